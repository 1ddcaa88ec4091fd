"""Over HTTP through Ray Serve (ingress → model deployment → simulated upstream): this batcher vs ``@serve.batch``.

The variants run side by side in one ``serve run`` (``serve.env``, as the README's run command
starts the service; the load comes from this process, which is not part of the Ray cluster), each with one model
replica of the ``openai`` backend pointed at the simulated upstream (its own process): ``adaptive``
(``AdaptiveBatcher``, max_batch 200, max_wait 25 ms, scale_factor 15), ``adaptive-limits`` (the same, with the
provider's quota in play but far from binding: the entry's ``limits:`` at 10^8 RPM and 10^9 TPM, and its own upstream
process reporting those limits in its ``x-ratelimit-*`` headers: what the quota costs while it does not bind),
``adaptive-tenants`` (the same behind a keys file of 1,000 tenants, the load one tenant's, limited far above it;
``adaptive-tenants-unlimited``: the same application, the load a tenant's with no limits),
``serve.batch`` (the same backend behind Ray Serve's ``@serve.batch``, 200 items or 25 ms), ``unbatched``
(``AdaptiveBatcher`` with max_batch 1 and no wait: the service path with nothing added by batching), and two floors
of Ray Serve's own cost, with none of this project's code (``serve_floor``: the ingress answering by itself, and
through a handle call a request). Single-text requests, closed loop at concurrency 1, 16, 64,
interleaved and repeated; every vector is checked against its text's hash. The upstream's own latency is measured
by calling it directly, one text at a time.

The same texts are also sent straight to the upstream, one per call, by as many clients (``direct``): what those
clients get without the service. And the ceiling: what as many clients could get through a gateway that added no
time to the upstream's, from the time a text spent in adaptive's upstream calls (timed by the upstream).

Targets: at concurrency 1, adaptive adds ≤ 2 ms over the unbatched service path (which itself adds Ray Serve's two
hops over the upstream's own latency; ``@serve.batch`` adds its 25 ms timeout); at the highest concurrency the
service (adaptive) serves ≥ 5× the texts/s of the direct clients.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import signal
import statistics
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path
from typing import Any, AsyncIterator, Callable, ContextManager, Sequence

import numpy as np
from ray import serve

from deployments.app import bind_ingress, build_app
from deployments.config import ModelConfig, parse_app_config
from deployments.model.backends import make_backend
from deployments.sizing import model_deployment_options
from load.loadgen import check, closed_loop
from load.peers.launch import DEFAULT_PEERS_DIR, Server, running
from load.stats import median_of
from load.upstream import UpstreamConfig
from load.upstream_client import UpstreamClient
from load.workload import pseudo_sentences

from .harness import add_common_arguments
from .options import chosen_settings
from .report import markdown_table, write_report
from .serve_floor import FloorIngress, floor_app
from .serving import SIM_BATCHING, SIM_MODEL, UNBATCHED, Target, compare_over_http, sim_model_entry, upstream_totals
from .shipped_service import (SERVICE_ENV, TENANT_KEY, TENANTS, UNLIMITED_TENANT_KEY, packaged_model_path, serve_run,
                              write_many_tenants)
from .upstream_process import upstream_config_from, upstream_process

TARGET_ADDED_MS = 2.0
TARGET_GAIN_OVER_DIRECT = 5.0
TARGET_LIMITS_COST = 0.03  # adaptive-limits within this share of adaptive's texts/s
FAR_LIMITS = {"rpm": 10**8, "tpm": 10**9}  # far above any load here: the quota never binds
TENANTS_VARIANT = "adaptive-tenants"
# The load of each tenants' variant: the key it sends, to the one application behind the keys file
TENANT_LOADS = {TENANTS_VARIANT: TENANT_KEY, f"{TENANTS_VARIANT}-unlimited": UNLIMITED_TENANT_KEY}
CPU_PARTS = ("ingress", "model replica", "the rest")
INGRESSES = ("EmbeddingsIngress", FloorIngress.name)  # an application's ingress deployment
FLOORS = {"serve-floor-http": False, "serve-floor-call": True}  # Serve's own path: with a handle call a request?


@serve.deployment
class ServeBatchedModel:
    """The ``openai`` backend behind Ray Serve's own ``@serve.batch``, answering like ``EmbeddingModel.embed``."""

    def __init__(self, model: ModelConfig) -> None:
        self._backend = make_backend(model)

    @serve.batch(max_batch_size=SIM_BATCHING["max_batch_size"], batch_wait_timeout_s=SIM_BATCHING["max_wait_ms"] / 1000,
                 max_concurrent_batches=SIM_BATCHING["max_concurrent_batches"])
    async def _embed_batch(self, texts: list[str]) -> Sequence[Any]:
        return await self._backend.embed(texts)

    async def embed(self, texts: Sequence[str], priority: str = "high", timeout_s: float | None = None,
                    dimensions: int | None = None) -> tuple[np.ndarray, list[int]]:
        vectors = await asyncio.gather(*(self._embed_batch(text) for text in texts))
        prepared = await self._backend.prepare_many(texts)
        return np.stack(vectors).astype(np.float32), [item.tokens for item in prepared]

    async def embed_many(self, requests: Sequence[Any]) -> AsyncIterator[list[tuple[int, Any]]]:
        """What the ingress calls: ``EmbeddingModel.embed_many``'s contract (all answers in one message here)."""
        outcomes = await asyncio.gather(*(self.embed(r.inputs) for r in requests), return_exceptions=True)
        yield list(enumerate(outcomes))

    async def stats(self) -> dict[str, Any]:
        return {}


@dataclass(frozen=True)
class Settings:
    # (concurrency, requests); 300 at c1, whose P50 the upstream's jitter would move too much over fewer, against
    # the few milliseconds the target allows
    levels: tuple[tuple[int, int], ...] = ((1, 300), (16, 800), (64, 1600))
    repeats: int = 2
    mean_chars: int = 120

    def __post_init__(self) -> None:
        if self.repeats < 1:
            raise ValueError("e2e: --repeats must be >= 1")


QUICK = Settings(levels=((1, 4), (4, 16)), repeats=1)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_common_arguments(parser, repeats=Settings.repeats, strategies=False, disturbance=False)


def run(args: argparse.Namespace) -> dict[str, Any]:
    settings = chosen_settings(args, Settings(), QUICK)
    upstream = upstream_config_from(args)
    with upstream_process(upstream) as root_url, limited_upstream(upstream) as limited_url, \
            running(gateway(root_url, limited_url), DEFAULT_PEERS_DIR, packaged_model_path()) as started:
        return measure(started.url, root_url, limited_url, upstream, settings, getattr(args, "results_dir", None),
                       started.pids, tenants=True)


def limited_upstream(upstream: UpstreamConfig) -> ContextManager[str]:
    """A second simulated upstream like ``upstream``, reporting ``FAR_LIMITS`` in its headers (adaptive-limits')."""
    return upstream_process(dataclasses.replace(upstream, **FAR_LIMITS))


def applications(root_url: str, limited_url: str,
                 tenants_keys: Path | None = None) -> dict[str, tuple[Callable[[dict[str, Any]], Any], dict[str, Any]]]:
    """Each variant, by route prefix: its application builder and the builder's args (every model on the upstream at
    ``root_url``, but adaptive-limits', on the one at ``limited_url``); with ``tenants_keys`` (a keys file of
    ``write_many_tenants``), adaptive-tenants too: adaptive behind that keys file."""
    base_url = f"{root_url}/v1"
    variants = {
        "adaptive": (build_app, {"models": [sim_model_entry(base_url)]}),
        "adaptive-limits": (build_app, {"models": [{**sim_model_entry(f"{limited_url}/v1"), "limits": FAR_LIMITS}]}),
        "serve-batch": (serve_batch_app, {"models": [sim_model_entry(base_url)]}),
        "unbatched": (build_app, {"models": [sim_model_entry(base_url, **UNBATCHED)]}),
        **{label: (floor_app, {"dim": UpstreamConfig().dim, "call": call}) for label, call in FLOORS.items()},
    }
    if tenants_keys is not None:
        variants[TENANTS_VARIANT] = (build_app, {"models": [sim_model_entry(base_url)], "ingress": {
            "env_vars": {"EMBEDDINGS_API_KEYS_FILE": str(tenants_keys)}}})
    return variants


def built_applications(root_url: str, limited_url: str) -> dict[str, Any]:
    """The variants built in this process (to deploy them on a running Serve instance, as the tests do)."""
    return {label: builder(args) for label, (builder, args) in applications(root_url, limited_url).items()}


def serve_batch_app(args: dict[str, Any]) -> Any:
    """The application with its model behind ``@serve.batch`` (``ServeBatchedModel``); ``args`` as ``build_app``'s."""
    config = parse_app_config(args)
    (model,) = config.models
    return bind_ingress(config, {model.name: ServeBatchedModel.options(**model_deployment_options(model)).bind(model)})


def gateway(root_url: str, limited_url: str) -> Server:
    """The variants in one ``serve run``, their model on the upstreams at ``root_url`` and ``limited_url``, and a
    keys file of ``TENANTS`` tenants in the service's temp dir for adaptive-tenants."""
    keys = write_many_tenants(Path(SERVICE_ENV["RAY_TMPDIR"]) / "e2e-tenants.yaml")
    config = {"proxy_location": "HeadOnly", "http_options": {"host": "127.0.0.1", "port": 8000},
              "applications": [{"name": label, "route_prefix": f"/{label}",
                                "import_path": f"{builder.__module__}:{builder.__name__}", "args": args}
                               for label, (builder, args) in applications(root_url, limited_url, keys).items()]}
    return Server("e2e-service", serve_run(config, "e2e"), SIM_BATCHING, route="/adaptive/v1/embeddings",
                  health="/adaptive/healthz", stop_signal=signal.SIGINT, model=SIM_MODEL)


def measure(url: str, root_url: str, limited_url: str, upstream: UpstreamConfig, settings: Settings,
            results_dir: Any = None, pids: Callable[[], list[int]] | None = None,
            tenants: bool = False) -> dict[str, Any]:
    """The scenario on the variants served under ``url`` (``/<label>`` each; adaptive-tenants too with ``tenants``)
    and the upstreams at ``root_url`` and ``limited_url`` (``limited_upstream``'s). A
    variant's mean batch is the texts per upstream call during its runs (the variants take turns); with the
    service's ``pids()``, its processes' CPU a request."""
    texts = pseudo_sentences(max(count for _, count in settings.levels), settings.mean_chars)
    direct = {concurrency: asyncio.run(upstream_direct(root_url, texts[:count], concurrency, upstream.dim))
              for concurrency, count in settings.levels}
    served = {label: label for label in applications(root_url, limited_url)}  # variant -> its application
    served.update({label: TENANTS_VARIANT for label in TENANT_LOADS} if tenants else {})
    targets = [Target(label, f"{url}/{app}",
                      partial(upstream_totals, limited_url if label == "adaptive-limits" else root_url),
                      {"Authorization": f"Bearer {TENANT_LOADS[label]}"} if label in TENANT_LOADS else {})
               for label, app in served.items()]
    runs = asyncio.run(compare_over_http(targets, SIM_MODEL, texts, settings.levels, settings.repeats, upstream.dim,
                                         pids))
    rows = summarise(runs, served)
    for concurrency, summary in direct.items():
        rows[str(concurrency)]["direct"] = {"items_per_s": summary["items_per_s"], "p50_ms": summary["p50_ms"],
                                            "p99_ms": summary["p99_ms"], "mean_batch_size": 1.0,
                                            "errors": summary["errors"], "mismatches": summary["mismatches"]}
    one = rows[str(settings.levels[0][0])]
    added = {label: one[label]["p50_ms"] - one["unbatched"]["p50_ms"] for label in ("adaptive", "serve-batch")}
    top = rows[str(settings.levels[-1][0])]
    gain = top["adaptive"]["items_per_s"] / top["direct"]["items_per_s"]
    limits_cost = 1 - top["adaptive-limits"]["items_per_s"] / top["adaptive"]["items_per_s"]
    tenants_cost = {label: 1 - top[label]["items_per_s"] / top["adaptive"]["items_per_s"]
                    for label in TENANT_LOADS} if tenants else None
    ceiling = gateway_ceiling(settings.levels[-1][0], top["adaptive"], top["direct"]["items_per_s"])
    data = {
        "settings": asdict(settings),
        "upstream": asdict(upstream),
        "upstream_alone_p50_ms": direct[settings.levels[0][0]]["p50_ms"],
        "rows": rows,
        "added_p50_ms_at_lowest_concurrency": added,
        "gain_over_direct_at_highest_concurrency": gain,
        "target": {"adaptive_added_ms": added["adaptive"], "needed_ms": TARGET_ADDED_MS,
                   "met": added["adaptive"] <= TARGET_ADDED_MS},
        "target_gain": {"gain": gain, "needed": TARGET_GAIN_OVER_DIRECT, "met": gain >= TARGET_GAIN_OVER_DIRECT},
        "target_limits_cost": {"cost": limits_cost, "allowed": TARGET_LIMITS_COST,
                               "met": limits_cost <= TARGET_LIMITS_COST},
        "tenants_cost": tenants_cost,
        "gateway_ceiling": ceiling,
        "runs": runs,
    }
    return write_report("e2e", "End to end through Ray Serve: adaptive vs @serve.batch",
                        render(settings, upstream, direct, rows, data), data, results_dir)


def gateway_ceiling(concurrency: int, adaptive: dict[str, Any], direct_per_s: float) -> dict[str, float] | None:
    """The most ``concurrency`` closed-loop clients can get through any gateway to this upstream: each text waits at
    least for the upstream call it rides in, so they get at most ``concurrency`` / (a text's mean time in a call) texts
    a second, with adaptive's calls (their sizes, the upstream's latency as it was during adaptive's runs) and a
    gateway that adds no time of its own. ``adaptive``: its summary row (None: its upstream calls were not timed)."""
    call_ms = adaptive.get("upstream_call_ms")
    if not call_ms:
        return None
    texts_per_s = concurrency / (call_ms / 1000)
    return {"upstream_call_ms": call_ms, "texts_per_s": texts_per_s,
            "gain_over_direct": texts_per_s / direct_per_s,
            "adaptive_share": adaptive["items_per_s"] / texts_per_s,
            "target_share": TARGET_GAIN_OVER_DIRECT * direct_per_s / texts_per_s}


async def upstream_direct(root_url: str, texts: Sequence[str], concurrency: int, dim: int) -> dict[str, Any]:
    """One text per call straight to the upstream from ``concurrency`` callers: what they get without the service."""
    async with UpstreamClient(root_url, model=SIM_MODEL) as client:
        return check(await closed_loop(client.embed_one, texts, concurrency), texts, dim).summary()


def summarise(runs: dict[str, dict[int, list[dict[str, Any]]]], served: dict[str, str]) -> dict[str, dict[str, Any]]:
    """Medians by concurrency and variant; ``served``: each variant's application (whose processes' CPU is its)."""
    rows = {}
    for concurrency in runs["adaptive"]:
        rows[str(concurrency)] = {
            label: {
                **{key: median_of(runs[label][concurrency], key)
                   for key in ("items_per_s", "p50_ms", "p99_ms", "mean_batch_size", "upstream_call_ms")},
                "errors": sum(r["errors"] for r in runs[label][concurrency]),
                "mismatches": sum(r["mismatches"] for r in runs[label][concurrency]),
                "cpu_ms_per_request": service_cpu(served[label], runs[label][concurrency]),
            }
            for label in runs
        }
    return rows


def service_cpu(app: str, runs: Sequence[dict[str, Any]]) -> dict[str, float]:
    """The service's CPU ms a request over a variant's runs (medians): its application ``app``'s ingress and model
    replica, and the rest of the service (HAProxy, Ray's own processes, the idle variants)."""
    def part(run: dict[str, Any]) -> dict[str, float]:
        cpu = run.get("cpu_ms_per_request", {})
        replicas = [(group.rsplit(":", 1)[-1], ms) for group, ms in cpu.items() if f"ServeReplica:{app}:" in group]
        ingress = sum(ms for deployment, ms in replicas if deployment in INGRESSES)
        model = sum(ms for _, ms in replicas) - ingress
        return {"ingress": ingress, "model replica": model, "the rest": sum(cpu.values()) - ingress - model}

    parts = [part(run) for run in runs if run.get("cpu_ms_per_request")]
    return {key: statistics.median(p[key] for p in parts) for key in parts[0]} if parts else {}


def _tenants_line(cost: dict[str, float] | None) -> str:
    if cost is None:
        return ""
    return (f" A keys file of {TENANTS:,} tenants costs {100 * cost[TENANTS_VARIANT]:.1f}% of adaptive's texts/s there "
            f"with the load one tenant's limited far above it (adaptive-tenants), "
            f"{100 * cost[f'{TENANTS_VARIANT}-unlimited']:.1f}% with the load an unlimited tenant's.")


def render(settings: Settings, upstream: UpstreamConfig, direct: dict[str, Any], rows: dict[str, Any],
           data: dict[str, Any]) -> str:
    def fmt(value: float | None, digits: int = 1) -> str:
        return "—" if value is None else f"{value:.{digits}f}"

    table = markdown_table(
        ["concurrency", "variant", "texts/s", "P50 ms", "P99 ms", "mean batch", "errors", "mismatches"],
        [[c, label, fmt(cell["items_per_s"]), fmt(cell["p50_ms"]), fmt(cell["p99_ms"]),
          fmt(cell["mean_batch_size"]), cell["errors"], cell["mismatches"]]
         for c, row in rows.items() for label, cell in row.items()],
    )
    added = data["added_p50_ms_at_lowest_concurrency"]
    verdict = "met" if data["target"]["met"] else "**not met**"
    gain = data["target_gain"]
    top = settings.levels[-1][0]
    cpu = markdown_table(
        ["concurrency", "variant", *CPU_PARTS, "all of the service"],
        [[c, label, *(fmt(cell["cpu_ms_per_request"].get(part), 2) for part in CPU_PARTS),
          fmt(sum(cell["cpu_ms_per_request"].values()), 2)]
         for c, row in rows.items() for label, cell in row.items() if cell.get("cpu_ms_per_request")],
    )
    ceiling = data["gateway_ceiling"]
    ceiling_line = "" if ceiling is None else f"""
The ceiling at concurrency {top}: a text spent {ceiling['upstream_call_ms']:.1f} ms in adaptive's upstream calls \
(timed by the upstream), so {top} closed-loop clients get at most {ceiling['texts_per_s']:.0f} texts/s through any \
gateway that adds no time of its own ({ceiling['gain_over_direct']:.2f}× the direct clients). Adaptive reaches \
{ceiling['adaptive_share']:.2f} of it; {TARGET_GAIN_OVER_DIRECT:g}× the direct clients is \
{ceiling['target_share']:.2f} of it.
"""
    return f"""\
Single-text `POST /v1/embeddings` requests (base64), closed loop; requests per level: \
{", ".join(f"{n} at concurrency {c}" for c, n in settings.levels)}; {settings.repeats} interleaved repeat(s), medians.
Upstream in its own process: base {upstream.base_latency_ms:g} ms + {upstream.per_token_ms:g} ms/token, jitter \
{upstream.jitter:g}, provider concurrency {upstream.max_concurrency}. The upstream alone (one caller, one text per \
call): P50 {fmt(direct[settings.levels[0][0]]['p50_ms'])} ms. `direct`: as many clients calling the upstream \
themselves, one text per call. `mean batch`: texts per upstream call during the variant's runs. \
The variants run in one `serve run` with `serve.env` (HAProxy in front), the load from a separate process.

{table}

At concurrency {settings.levels[0][0]}, over the unbatched service path (P50): adaptive adds \
{fmt(added['adaptive'])} ms, `@serve.batch` adds {fmt(added['serve-batch'])} ms. Target (adaptive adds ≤ \
{TARGET_ADDED_MS:g} ms): {verdict}. At concurrency {top}, the service serves {gain['gain']:.2f}× the texts/s of the \
direct clients (target ≥ {TARGET_GAIN_OVER_DIRECT:g}×): {"met" if gain["met"] else "**not met**"}. The quota far \
from binding (adaptive-limits) costs {100 * data['target_limits_cost']['cost']:.1f}% of adaptive's texts/s there \
(target ≤ {100 * TARGET_LIMITS_COST:g}%): {"met" if data['target_limits_cost']['met'] else "**not met**"}.\
{_tenants_line(data["tenants_cost"])}
{ceiling_line}
The service's CPU ms a request (each process's CPU time over a variant's runs, from /proc, by the texts it served;
medians): its ingress replica, its model replica, and the rest (HAProxy, Ray's own processes, the idle variants). \
The two `serve-floor` variants hold none of this project's code (`load/bench/serve_floor.py`): a bare ASGI ingress \
that answers each request itself (`-http`), or through one handle call a request to a second deployment (`-call`, \
its CPU under "model replica"); they answer at once, so their texts/s is Serve's path's own, not a gateway's, and \
their CPU is what Ray Serve costs a request by itself.

{cpu}
"""

"""The nightly job run twice with the embedding cache: night 1 cold, night 2 after 5% edited and 2% added.

One Ray cluster runs one copy of the application per store (``none``: no cache, ``disk``: the embedded store in a
temporary directory, ``redis``: a throwaway ``redis-server`` on a free loopback port, its URL read from a file as
the service reads secrets), each with one replica of the ``openai`` backend pointed at the simulated upstream (its
own process), batched as in ``bulk``. For each store, one after another: night 1 embeds every document with
``python -m embed_bulk`` (``embed-bulk``, unchanged, at LOW priority) into a fresh ``.npy``; night 2 embeds the next
night's corpus — the same documents with ``--edited-share`` of them edited (one word changed) and
``--added-share`` more appended — into another fresh file. Each night reports its wall time (launch to exit), the
upstream calls and the tokens the upstream billed; every output row is checked against its document's hash. The
nights are a day apart: night 2 starts once night 1's write-backs, which land after their requests were answered,
are in the store (``EmbeddingModel.cache_written``), and how long after the job's exit that was is reported too.
Targets: night 2 bills ≤ 8% of night 1's tokens and takes ≤ 25% of its wall time.

With ``--high-rate R`` a HIGH stream of single-text requests (Poisson, R a second, texts no night contains) runs
from each night's first upstream call to its end, and its P50/P99 are reported beside each night: the cache's cost
to interactive latency is the disk and redis rows against the control's. Upstream calls and tokens then include
the stream's, so the token target is read from a run without it.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import tempfile
import time
from contextlib import ExitStack
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Sequence

from embed_bulk.settings import BulkSettings
from load.redis_process import RedisServer
from load.upstream import UpstreamConfig
from load.upstream_client import UpstreamClient
from load.workload import pseudo_sentences

from .bulk_job import bulk_job, write_documents
from .options import add_settings_arguments, chosen_settings
from .report import markdown_table, write_report
from .serving import SIM_MODEL, deployed, run_with_upstream_and_service, sim_model_entry
from .upstream_process import add_upstream_arguments

TARGET_TOKEN_SHARE = 0.08
TARGET_WALL_SHARE = 0.25
STORES = ("none", "disk", "redis")
REDIS_URL_ENV = "BENCH_CACHE_REDIS_URL"  # the service reads it from the file $BENCH_CACHE_REDIS_URL_FILE names


@dataclass(frozen=True)
class Settings:
    documents: int = 100_000
    mean_chars: int = 120
    stores: str = ",".join(STORES)
    # night 2: the share of night 1's documents edited, and the share added
    edited_share: float = 0.05
    added_share: float = 0.02
    # embed-bulk's defaults
    job_concurrency: int = BulkSettings.concurrency
    job_batch_size: int = BulkSettings.batch_size
    high_rate_per_s: float = 0.0  # a HIGH stream beside each night; 0: none

    def __post_init__(self) -> None:
        unknown = set(self.store_names) - set(STORES)
        if unknown or not self.store_names:
            raise ValueError(f"--stores: choose from {', '.join(STORES)}, not {self.stores!r}")
        if not (0 <= self.edited_share <= 1 and 0 <= self.added_share):
            raise ValueError("--edited-share must be in [0, 1] and --added-share >= 0")

    @property
    def store_names(self) -> list[str]:
        return [name.strip() for name in self.stores.split(",") if name.strip()]


QUICK = Settings(documents=400)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_settings_arguments(parser, Settings(), QUICK)
    add_upstream_arguments(parser)


def run(args: argparse.Namespace) -> dict[str, Any]:
    return run_with_upstream_and_service(args, measure, chosen_settings(args, Settings(), QUICK))


def measure(proxy: str, root_url: str, upstream: UpstreamConfig, settings: Settings,
            results_dir: Any = None) -> dict[str, Any]:
    """The scenario on a running Serve instance (HTTP proxy at ``proxy``) and upstream (at ``root_url``)."""
    from ray import serve

    from deployments.app import build_app

    night_1 = pseudo_sentences(settings.documents, settings.mean_chars, seed=0)
    night_2 = next_night(night_1, settings)
    stream_texts = pseudo_sentences(int(settings.high_rate_per_s * 1800), settings.mean_chars, seed=1)
    with tempfile.TemporaryDirectory(prefix="bench-bulk-rerun-") as work, ExitStack() as servers:
        entries = {name: cached_entry(name, f"{root_url}/v1", Path(work), servers) for name in settings.store_names}
        apps = {name: build_app({"models": [entry]}) for name, entry in entries.items()}
        with deployed(proxy, apps, SIM_MODEL) as targets:
            models = {label: serve.get_deployment_handle(f"embed-{SIM_MODEL}", app_name=label) for label in apps}
            nights = asyncio.run(_both_nights({t.label: (t.url, models[t.label]) for t in targets}, root_url,
                                              night_1, night_2, stream_texts, Path(work), settings, upstream.dim))
    data = summarise(nights, settings, upstream)
    return write_report("bulk_rerun", "The nightly job re-run with the embedding cache", render(data), data,
                        results_dir)


def next_night(documents: Sequence[str], settings: Settings, seed: int = 3) -> list[str]:
    """``documents`` with ``edited_share`` of them edited (one word replaced: about as many tokens, a new text) and
    ``added_share`` new ones appended."""
    rng = random.Random(seed)
    edited = set(rng.sample(range(len(documents)), round(len(documents) * settings.edited_share)))
    known = set(documents)
    added = [text for text in pseudo_sentences(round(len(documents) * settings.added_share) * 2 + 1,
                                               settings.mean_chars, seed=seed + 1) if text not in known]
    words = " ".join(added).split()
    following = [_edit(text, rng, words) if index in edited else text for index, text in enumerate(documents)]
    return following + added[: round(len(documents) * settings.added_share)]


def _edit(text: str, rng: random.Random, words: Sequence[str]) -> str:
    tokens = text.split()
    position = rng.randrange(len(tokens))
    replacement = rng.choice(words)
    while replacement == tokens[position]:
        replacement = rng.choice(words)
    tokens[position] = replacement
    return " ".join(tokens)


def cached_entry(store: str, base_url: str, work: Path, servers: ExitStack) -> dict[str, Any]:
    """The simulated upstream's model entry (as ``bulk`` deploys it) with the cache ``store`` names (``none``: without
    a cache)."""
    entry = sim_model_entry(base_url)
    if store == "disk":
        entry["cache"] = {"store": "disk", "directory": str(work / "vectors"), "max_bytes": 4 * 1024**3}
    elif store == "redis":
        server = servers.enter_context(RedisServer(maxmemory="1gb"))
        url_file = work / "redis-url"
        url_file.write_text(server.url, encoding="utf-8")
        entry["cache"] = {"store": "redis", "url_env": REDIS_URL_ENV}
        entry["ray_actor_options"] = {**entry["ray_actor_options"],
                                      "runtime_env": {"env_vars": {f"{REDIS_URL_ENV}_FILE": str(url_file)}}}
    return entry


async def _both_nights(services: dict[str, tuple[str, Any]], root_url: str, night_1: Sequence[str], night_2: Sequence[str],
                       stream_texts: Sequence[str], work: Path, settings: Settings,
                       dim: int) -> dict[str, dict[str, Any]]:
    inputs = [write_documents(night_1, work / "night-1.jsonl"), write_documents(night_2, work / "night-2.jsonl")]
    nights: dict[str, dict[str, Any]] = {}
    async with UpstreamClient(root_url) as upstream:
        for store, (url, model) in services.items():
            nights[store] = {}
            for night, (documents, input_path) in enumerate(zip((night_1, night_2), inputs), start=1):
                job = await bulk_job(url, upstream, documents, input_path, dim,  # resets the counters
                                     concurrency=settings.job_concurrency, batch_size=settings.job_batch_size,
                                     stream_texts=stream_texts or None, stream_rate_per_s=settings.high_rate_per_s)
                job["tokens_billed"] = (await upstream.stats())["tokens_billed"]
                exited = time.perf_counter()
                await model.cache_written.remote()  # the nights are a day apart: yesterday's vectors are stored
                job["written_back_s"] = time.perf_counter() - exited
                nights[store][f"night_{night}"] = job
    return nights


def summarise(nights: dict[str, dict[str, Any]], settings: Settings, upstream: UpstreamConfig) -> dict[str, Any]:
    targets = {}
    for store, pair in nights.items():
        if store == "none":  # the control: what night 2 costs without a cache
            continue
        first, second = pair["night_1"], pair["night_2"]
        tokens = second["tokens_billed"] / first["tokens_billed"] if first["tokens_billed"] else None
        wall = second["wall_s"] / first["wall_s"]
        targets[store] = {
            "token_share": {"value": tokens, "needed": TARGET_TOKEN_SHARE,
                            "met": tokens is not None and tokens <= TARGET_TOKEN_SHARE},
            "wall_share": {"value": wall, "needed": TARGET_WALL_SHARE, "met": wall <= TARGET_WALL_SHARE},
        }
    return {"settings": asdict(settings), "upstream": asdict(upstream),
            "nights": nights, "targets": targets}


def render(data: dict[str, Any]) -> str:
    settings, upstream = data["settings"], data["upstream"]
    verdict = {True: "met", False: "**not met**"}
    rows = []
    for store, pair in data["nights"].items():
        for night in ("night_1", "night_2"):
            job = pair[night]
            wrong = job["mismatches"] + job["misplaced_ids"] + (job["documents"] - job["rows"])
            high = job.get("high_stream") or {}
            rows.append([store if store != "none" else "none (control)", night.replace("_", " "),
                         f"{job['documents']:,}", f"{job['wall_s']:,.1f}", f"{job['written_back_s']:,.1f}",
                         f"{job['upstream_calls']:,}",
                         f"{job['tokens_billed']:,}", wrong, high.get("submitted", "—"), _ms(high.get("p50_ms")),
                         _ms(high.get("p99_ms"))])
    shares = [f"`{store}`: tokens {_percent(t['token_share']['value'])} ({verdict[t['token_share']['met']]}), "
              f"wall time {_percent(t['wall_share']['value'])} ({verdict[t['wall_share']['met']]})"
              for store, t in data["targets"].items()]
    table = markdown_table(["store", "night", "documents", "wall s", "written back s", "upstream calls",
                            "tokens billed", "wrong rows", "HIGH requests", "HIGH P50 ms", "HIGH P99 ms"], rows)
    stream = (f"A HIGH stream of single texts, Poisson at {settings['high_rate_per_s']:g}/s, ran beside each night "
              "(its calls and tokens are in the counts)." if settings["high_rate_per_s"] else
              "No HIGH stream ran (`--high-rate` adds one).")
    return f"""\
{settings['documents']:,} generated documents (~{settings['mean_chars']} characters); night 2: \
{settings['edited_share']:.0%} edited (one word changed), {settings['added_share']:.0%} added. Upstream in its own \
process: base {upstream['base_latency_ms']:g} ms + {upstream['per_token_ms']:g} ms/token, provider concurrency \
{upstream['max_concurrency']}. Each night is `python -m embed_bulk` (`embed-bulk`, unchanged) with \
`--concurrency {settings['job_concurrency']} --batch-size {settings['job_batch_size']}` into a fresh `.npy`; wall \
time from launch to exit; `written back s`: from the exit until the cache's last write-back landed (night 2 \
starts after it). `wrong rows`: rows missing, out of place or not matching their document's hash. \
{stream}

{table}

Night 2 / night 1 (targets: tokens ≤ {TARGET_TOKEN_SHARE:.0%}, wall time ≤ {TARGET_WALL_SHARE:.0%}): \
{"; ".join(shares)}.
"""


def _ms(value: float | None) -> str:
    return "—" if value is None else f"{value:,.1f}"


def _percent(value: float | None) -> str:
    return "—" if value is None else f"{value:.1%}"

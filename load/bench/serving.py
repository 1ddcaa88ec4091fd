"""What the full-service benchmarks share: a Ray cluster with Serve on a free loopback port, the model entries they
deploy (``serve_config.yaml``'s, or one on the simulated upstream), variants of the application deployed side by
side under route prefixes, and closed-loop runs of single-text HTTP requests against each, interleaved."""

from __future__ import annotations

import argparse
import copy
import os
import sys
import tempfile
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Awaitable, Callable, Iterator, Mapping, NamedTuple, Sequence

import yaml

from load.loadgen import check, closed_loop
from load.proc_cpu import CpuMeter
from load.upstream import UpstreamConfig
from load.upstream_client import UpstreamClient

from .harness import rotated
from .upstream_process import free_port, upstream_config_from, upstream_process

SERVE_CONFIG = Path(__file__).resolve().parents[2] / "serve_config.yaml"
SERVE_ENV = SERVE_CONFIG.with_name("serve.env")


def serve_env(path: Path = SERVE_ENV) -> dict[str, str]:
    """The variables of ``serve.env`` (or of the file at ``path``, another checkout's): the environment the README's
    run command gives Ray (HAProxy in front)."""
    lines = (line.strip() for line in path.read_text().splitlines())
    return dict(line.split("=", 1) for line in lines if line and not line.startswith("#"))


def use_serve_env(blocking_handles: bool = False) -> None:
    """Put ``serve.env`` into this process's environment, for the Ray it starts and for Ray Serve itself: Serve reads
    it once, when it is imported, and a handle made in this process (every application deployed from it) is bound
    then to the transport it names (gRPC between replicas, with the preset), so it must come before that import.

    ``blocking_handles``: this process calls handles outside an event loop (``.result()``), or from loops that end
    before Serve shuts down (a scenario's ``asyncio.run``, after which ``serve.shutdown`` found its handles' router
    on a closed loop and raised), which the preset's router on the caller's loop cannot serve, so here (only: not in
    the replicas) the router gets a loop of its own."""
    env = serve_env()
    if "ray.serve" in sys.modules:
        if all(os.environ.get(key) == value for key, value in env.items()):
            return  # applied before that import (a test session running a scenario in-process)
        raise RuntimeError("serve.env must be applied before ray.serve is imported")
    os.environ.update(env)
    if blocking_handles:
        os.environ[_SEPARATE_ROUTER_LOOP] = "1"
        import ray.serve  # noqa: F401  (reads its settings now)

        del os.environ[_SEPARATE_ROUTER_LOOP]  # the Ray this process starts, and its replicas, run as serve.env says


_SEPARATE_ROUTER_LOOP = "RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP"


def without_serve_env() -> dict[str, str]:
    """This process's environment without ``serve.env``'s Serve settings: how a cluster's nodes start (docs/cluster.md:
    Serve's own proxy on every node), for a process that starts one."""
    return {key: value for key, value in os.environ.items() if key not in serve_env()}


def default_models(path: Path = SERVE_CONFIG) -> list[dict[str, Any]]:
    """The model entries of ``serve_config.yaml``'s application (or of the config file at ``path``, another
    checkout's), as its builder receives them."""
    config = yaml.safe_load(path.read_text())
    (application,) = config["applications"]
    return copy.deepcopy(application["args"]["models"])


def one_replica(model: Mapping[str, Any], **batching: Any) -> dict[str, Any]:
    """``model`` held at one replica (so variants compare on equal hardware) that reserves no CPU (so variants fit
    beside each other on a small cluster), with batching settings changed."""
    entry = {key: value for key, value in model.items() if key != "autoscaling"}
    entry["num_replicas"] = 1
    entry["ray_actor_options"] = {"num_cpus": 0}
    entry["batching"] = {**model.get("batching", {}), **batching}
    return entry


UNBATCHED = {"max_batch_size": 1, "max_wait_ms": 0.0, "max_batch_tokens": None}

SIM_MODEL = "sim-embed"  # the model the benchmarks on the simulated upstream serve
# As many batches in flight as the simulated upstream serves at once (its provider concurrency): with fewer, the
# service leaves slots of the upstream unused while its batches wait for one of its own.
SIM_BATCHING = {"max_batch_size": 200, "max_wait_ms": 25.0, "scale_factor": 15.0,
                "max_concurrent_batches": UpstreamConfig().max_concurrency}


def sim_model_entry(base_url: str, **batching: Any) -> dict[str, Any]:
    """One replica of the ``openai`` backend pointed at the simulated upstream at ``base_url``, reserving no CPU,
    batched as ``SIM_BATCHING`` with ``batching`` changed."""
    return {
        "name": SIM_MODEL, "backend": "openai", "base_url": base_url, "upstream_model": SIM_MODEL, "num_replicas": 1,
        "ray_actor_options": {"num_cpus": 0}, "batching": {**SIM_BATCHING, **batching},
    }


@contextmanager
def serve_cluster(num_cpus: int = 4, *, checkout_first: bool = True) -> Iterator[str]:
    """A fresh local Ray cluster started as ``serve run`` starts it (``serve.env``: HAProxy in front), with Serve's
    HTTP port a free loopback one; yields its URL. The process must have called ``use_serve_env`` first.

    Ray puts the directory its driver starts from first on every worker's ``sys.path``: this checkout, from which the
    benchmarks run, so the workers import this checkout's code before any other. ``checkout_first=False`` starts Ray
    from outside it, so an application may run another checkout's code (``deployed_as_configured``); the others then
    import this checkout's installed packages (and nothing of ``load/``)."""
    import ray
    from ray import serve

    here = os.getcwd()
    if not checkout_first:
        os.chdir(tempfile.gettempdir())
    try:
        ray.init(num_cpus=num_cpus, include_dashboard=False, logging_level="ERROR", log_to_driver=False)
    finally:
        os.chdir(here)
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        serve.shutdown()
        ray.shutdown()


def run_with_upstream_and_service(args: argparse.Namespace, measure: Callable[..., dict[str, Any]],
                                  settings: Any) -> dict[str, Any]:
    """``measure(proxy_url, upstream_root_url, upstream_config, settings, results_dir)`` on a fresh cluster, with the
    simulated upstream the command line describes in its own process."""
    upstream = upstream_config_from(args)
    with upstream_process(upstream) as root_url, serve_cluster() as proxy:
        return measure(proxy, root_url, upstream, settings, getattr(args, "results_dir", None))


@contextmanager
def deployed(proxy_url: str, apps: Mapping[str, Any], model: str) -> Iterator[list[Target]]:
    """Run each app under the route prefix ``/<label>``; delete them on exit."""
    from ray import serve

    try:
        for label, app in apps.items():
            serve.run(app, name=label, route_prefix=f"/{label}")
        yield [Target(label, f"{proxy_url}/{label}", _batch_totals(f"embed-{model}", label)) for label in apps]
    finally:
        for label in apps:
            serve.delete(label)


@contextmanager
def deployed_as_configured(proxy_url: str, apps: Mapping[str, tuple[Mapping[str, Any], Path | None]],
                           model: str) -> Iterator[list[Target]]:
    """Each app (label -> (its builder's args, a checkout or None)) deployed as ``serve run`` deploys a config's
    application: ``deployments.app:build_app`` builds it, in Serve's controller, under the route prefix ``/<label>``.
    An app given a checkout runs that checkout's code (first on ``PYTHONPATH`` for its build and its replicas, this
    machine's Ray only); the others this one's. Deleted on exit."""
    from ray import serve
    from ray.serve.context import _get_global_client
    from ray.serve.schema import ServeDeploySchema

    runtime_envs = {label: {"env_vars": {"PYTHONPATH": str(tree)}} for label, (_, tree) in apps.items()
                    if tree is not None}
    for label, runtime_env in runtime_envs.items():
        _check_code_first(runtime_env, apps[label][1])
    config = ServeDeploySchema.model_validate({"applications": [
        {"name": label, "route_prefix": f"/{label}", "import_path": "deployments.app:build_app", "args": dict(args),
         **({"runtime_env": runtime_envs[label]} if label in runtime_envs else {})}
        for label, (args, _) in apps.items()]})
    try:
        _get_global_client().deploy_apps(config)
        _wait_running(list(apps))
        yield [Target(label, f"{proxy_url}/{label}", _batch_totals(f"embed-{model}", label)) for label in apps]
    finally:
        for label in apps:
            serve.delete(label)


def _check_code_first(runtime_env: Mapping[str, Any], tree: Path) -> None:
    """``RuntimeError`` unless a worker of ``runtime_env`` imports ``deployments`` from the checkout at ``tree``:
    never measure a checkout's code against itself unawares."""
    import ray

    @ray.remote(num_cpus=0, runtime_env=dict(runtime_env))
    def deployments_path() -> str:
        import deployments

        return deployments.__file__

    found = Path(ray.get(deployments_path.remote()))
    if not found.resolve().is_relative_to(tree.resolve()):
        raise RuntimeError(f"this Ray's workers import {found.parent}, not the checkout at {tree}: start it with "
                           "serve_cluster(checkout_first=False)")


def _wait_running(labels: Sequence[str], timeout_s: float = 300.0) -> None:
    """Until every app of ``labels`` runs; ``RuntimeError`` with Serve's message if one fails to deploy."""
    from ray import serve
    from ray.serve.schema import ApplicationStatus

    give_up = time.monotonic() + timeout_s
    while time.monotonic() < give_up:
        apps = serve.status().applications
        failed = {label: apps[label].message for label in labels
                  if label in apps and apps[label].status == ApplicationStatus.DEPLOY_FAILED}
        if failed:
            raise RuntimeError(f"an application failed to deploy: {failed}")
        if all(label in apps and apps[label].status == ApplicationStatus.RUNNING for label in labels):
            return
        time.sleep(0.5)
    raise TimeoutError(f"{', '.join(labels)} not running after {timeout_s:g} s")


class SentTotals(NamedTuple):
    """What a variant's model has sent so far: its batches and their items, and, where its upstream times its calls
    (the simulated one does), each item's call time summed (ms)."""

    batches: int
    items: int
    item_call_ms: float | None = None


@dataclass(frozen=True)
class Target:
    """One deployed variant of the service: its URL prefix, and what its model has sent so far."""

    label: str
    url: str
    batch_totals: Callable[[], Awaitable[SentTotals]]
    headers: Mapping[str, str] = field(default_factory=dict)  # sent with every request (an API key)


async def compare_over_http(
    targets: Sequence[Target], model: str, texts: Sequence[str], levels: Sequence[tuple[int, int]], repeats: int,
    check_dim: int | None = None, pids: Callable[[], list[int]] | None = None,
) -> dict[str, dict[int, list[dict[str, Any]]]]:
    """Closed-loop runs of single-text requests at each (concurrency, request count), every target side by side:
    per repeat and level the targets run one after another in a rotating order. Returns label -> concurrency ->
    one summary per repeat, with the mean batch size the model deployment formed during the run (and, where its
    upstream times its calls, the mean time a text spent in one: ``upstream_call_ms``) and, given the
    service's ``pids()``, each process group's CPU ms a request (the targets take turns, so what the processes spent
    during a run is that target's, with the idle others' background)."""
    meter = CpuMeter(pids)
    runs: dict[str, dict[int, list[dict[str, Any]]]] = {t.label: {c: [] for c, _ in levels} for t in targets}
    clients = {t.label: UpstreamClient(t.url, model=model, headers=t.headers) for t in targets}
    for client in clients.values():
        await client.__aenter__()
    try:
        for repeat in range(repeats):
            for concurrency, count in levels:
                for target in rotated(list(targets), repeat + concurrency):
                    client = clients[target.label]

                    before = await target.batch_totals()
                    cpu_before = meter.start()
                    result = await closed_loop(client.embed_one, texts[:count], concurrency)
                    cpu_ms = meter.ms_each(cpu_before, result.completed)
                    after = await target.batch_totals()
                    if check_dim is not None:
                        check(result, texts[:count], check_dim)
                    batches, items = after.batches - before.batches, after.items - before.items
                    timed = items > 0 and after.item_call_ms is not None and before.item_call_ms is not None
                    runs[target.label][concurrency].append(
                        {**result.summary(), "mean_batch_size": items / batches if batches else None,
                         "upstream_call_ms": (after.item_call_ms - before.item_call_ms) / items if timed else None,
                         "cpu_ms_per_request": cpu_ms}
                    )
    finally:
        for client in clients.values():
            await client.__aexit__(None, None, None)
    return runs


def _batch_totals(deployment: str, app: str) -> Callable[[], Awaitable[SentTotals]]:
    """The batches and items ``app``'s ``deployment`` has sent so far; its handle is made when first asked for (an
    app may have no such deployment, and then nothing asks)."""
    from ray import serve

    handle = None

    async def totals() -> SentTotals:
        nonlocal handle
        handle = handle or serve.get_deployment_handle(deployment, app_name=app)
        stats = await handle.stats.remote()
        return SentTotals(sum(s.batches for s in stats.values()), sum(s.dispatched_items for s in stats.values()))

    return totals


async def upstream_totals(root_url: str) -> SentTotals:
    """The calls and items the simulated upstream at ``root_url`` has served, and their texts' time in calls: a
    variant's batches as seen from outside it, when the variants take turns."""
    async with UpstreamClient(root_url) as client:
        stats = await client.stats()
    return SentTotals(stats["calls"], stats["items_billed"], stats["text_call_ms"])

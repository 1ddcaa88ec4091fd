"""One node vs a cluster of several: the same application over HTTP on 1, 2, ... N Ray nodes, on the simulated upstream.

For each node count a fresh Ray cluster (``load.multinode``: nodes of one CPU each on this machine, a Serve proxy on
every node) runs ``e2e``'s adaptive application with one model replica per node (``num_cpus: 1``, so they spread)
and as many ingress replicas as nodes; the simulated upstream runs in its own process, shared by every cluster.
Single-text requests, closed loop, each request sent to the next node's proxy in turn (a load balancer in front);
every vector is checked against its text's hash. Reported: texts/s, P50 and P99 per node count and concurrency,
and each count's throughput as a multiple of one node's.

On one machine the nodes share its cores, so the ratio says how far more proxies, ingresses and replicas turn the
cores into throughput, which is the part of scaling out that Ray Serve's per-request cost decides; on separate
machines each node brings its own cores too.
"""

from __future__ import annotations

import argparse
import asyncio
from dataclasses import asdict, dataclass
from typing import Any, Sequence

from load.loadgen import check, closed_loop
from load.multinode import LocalCluster, local_cluster, spread, wait_for_proxies
from load.stats import median_of
from load.upstream import UpstreamConfig
from load.upstream_client import UpstreamClient
from load.workload import pseudo_sentences

from .harness import add_common_arguments, rotated
from .options import chosen_settings
from .report import markdown_table, write_report
from .serving import SIM_MODEL, sim_model_entry
from .upstream_process import upstream_config_from, upstream_process

APP_NAME = "cluster-bench"


@dataclass(frozen=True)
class Settings:
    nodes: int = 2  # node counts 1..nodes are compared
    levels: tuple[tuple[int, int], ...] = ((16, 1600), (64, 3200), (256, 6400))  # (concurrency, requests)
    repeats: int = 2
    mean_chars: int = 120

    def __post_init__(self) -> None:
        if self.nodes < 2:
            raise ValueError("--nodes must be at least 2 (one node is the baseline)")
        if self.repeats < 1:
            raise ValueError("cluster: --repeats must be >= 1")


QUICK = Settings(levels=((4, 16),), repeats=1)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_common_arguments(parser, repeats=Settings.repeats, strategies=False, disturbance=False)
    parser.add_argument("--nodes", type=int, default=Settings.nodes,
                        help=f"compare 1..NODES nodes of one CPU each (default {Settings.nodes})")


def run(args: argparse.Namespace) -> dict[str, Any]:
    settings = chosen_settings(args, Settings(), QUICK)
    upstream = upstream_config_from(args)
    with upstream_process(upstream) as root_url:
        return measure(root_url, upstream, settings, getattr(args, "results_dir", None))


def app_args(base_url: str, nodes: int) -> dict[str, Any]:
    """The adaptive application on the simulated upstream with one model replica per node and as many ingress
    replicas as nodes."""
    model = {**sim_model_entry(base_url), "num_replicas": nodes, "ray_actor_options": {"num_cpus": 1}}
    return {"models": [model], "ingress": {"num_replicas": nodes}}


def measure(root_url: str, upstream: UpstreamConfig, settings: Settings, results_dir: Any = None) -> dict[str, Any]:
    """Every node count once per repeat (in a rotating order), each on a cluster of its own."""
    texts = pseudo_sentences(max(count for _, count in settings.levels), settings.mean_chars)
    counts = list(range(1, settings.nodes + 1))
    runs: dict[int, dict[int, list[dict[str, Any]]]] = {n: {c: [] for c, _ in settings.levels} for n in counts}
    for repeat in range(settings.repeats):
        for nodes in rotated(counts, repeat):
            with local_cluster(nodes) as cluster:
                deploy(cluster, f"{root_url}/v1", nodes)
                for concurrency, results in asyncio.run(drive(cluster, texts, settings.levels, upstream.dim)):
                    runs[nodes][concurrency].append(results)
    rows = summarise(runs)
    data = {"settings": asdict(settings), "upstream": asdict(upstream), "rows": rows, "runs": runs}
    return write_report("cluster", "One node vs a cluster", render(settings, upstream, rows), data, results_dir)


def deploy(cluster: LocalCluster, base_url: str, nodes: int) -> None:
    from ray import serve

    from deployments.app import build_app

    serve.run(build_app(app_args(base_url, nodes)), name=APP_NAME, route_prefix="/")
    wait_for_proxies(cluster.nodes)  # each node holds a model replica, so each has a proxy


async def drive(cluster: LocalCluster, texts: Sequence[str], levels: Sequence[tuple[int, int]],
                dim: int) -> list[tuple[int, dict[str, Any]]]:
    """Each level once, requests spread over every node's proxy; one checked summary per level."""
    clients = [UpstreamClient(node.proxy_url, model=SIM_MODEL, connections=1024) for node in cluster.nodes]
    for client in clients:
        await client.__aenter__()
    try:
        embed_one = spread([client.embed_one for client in clients])
        await closed_loop(embed_one, texts[:4 * len(clients)], len(clients))  # every path warm before timing
        results = []
        for concurrency, count in levels:
            result = check(await closed_loop(embed_one, texts[:count], concurrency), texts[:count], dim)
            results.append((concurrency, result.summary()))
        return results
    finally:
        for client in clients:
            await client.__aexit__(None, None, None)


def summarise(runs: dict[int, dict[int, list[dict[str, Any]]]]) -> dict[str, dict[str, Any]]:
    """concurrency -> node count -> medians over repeats, with texts/s as a multiple of one node's."""
    rows: dict[str, dict[str, Any]] = {}
    for concurrency in runs[1]:
        one_node = median_of(runs[1][concurrency], "items_per_s")
        rows[str(concurrency)] = {}
        for nodes, levels in runs.items():
            records = levels[concurrency]
            texts_per_s = median_of(records, "items_per_s")
            rows[str(concurrency)][str(nodes)] = {
                "items_per_s": texts_per_s,
                "p50_ms": median_of(records, "p50_ms"),
                "p99_ms": median_of(records, "p99_ms"),
                "vs_one_node": texts_per_s / one_node if texts_per_s and one_node else None,
                "errors": sum(r["errors"] for r in records),
                "mismatches": sum(r["mismatches"] for r in records),
            }
    return rows


def render(settings: Settings, upstream: UpstreamConfig, rows: dict[str, dict[str, Any]]) -> str:
    def fmt(value: float | None, digits: int = 1) -> str:
        return "—" if value is None else f"{value:.{digits}f}"

    table = markdown_table(
        ["concurrency", "nodes", "texts/s", "× one node", "P50 ms", "P99 ms", "errors", "mismatches"],
        [[c, nodes, fmt(cell["items_per_s"]), fmt(cell["vs_one_node"], 2), fmt(cell["p50_ms"]),
          fmt(cell["p99_ms"]), cell["errors"], cell["mismatches"]]
         for c, row in rows.items() for nodes, cell in row.items()],
    )
    return f"""\
Single-text `POST /v1/embeddings` requests (base64), closed loop, each to the next node's proxy in turn; requests per \
level: {", ".join(f"{n} at concurrency {c}" for c, n in settings.levels)}; {settings.repeats} repeat(s), the node \
counts in rotating order, each on a fresh cluster (nodes of one CPU, one model replica per node, as many ingress \
replicas as nodes), medians. Upstream in its own process: base {upstream.base_latency_ms:g} ms + \
{upstream.per_token_ms:g} ms/token, provider concurrency {upstream.max_concurrency}. All nodes run on this one machine \
and share its cores.

{table}
"""

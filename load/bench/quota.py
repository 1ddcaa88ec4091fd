"""The provider's quota: the nightly bulk job (LOW) beside a HIGH stream, on an upstream limited in RPM and TPM.

One Ray cluster runs the application with two replicas of the ``openai`` backend, pointed at the simulated upstream
(its own process) with ``--rpm``/``--tpm`` limits, and the model entry's ``limits:`` set to the same (with
``--headroom``): both replicas claim from one budget. With ``--nodes 1`` (the default) the cluster is one Ray node
started as ``serve run`` starts it (``serve.env``); with ``--nodes N`` it is ``load.bench cluster``'s: N nodes of one
CPU each (``load.multinode``), a replica and an ingress on each, Serve's proxy on every node, the job sent to the
head's proxy and the HIGH stream to the last node's. Two measured runs, one after the other:

1. the HIGH stream alone (single texts, Poisson arrivals, ``X-Priority: high``);
2. ``embed-bulk`` (``python -m embed_bulk``, LOW) over every document, with the same stream running from the job's
   first upstream call to its exit; the upstream's counters are read every second.

Reported: upstream 429s as a share of upstream calls, tokens sent a minute against the TPM limit (over the job, and
after its first minute, when the bucket it started with is spent), the job's wall time against its tokens / TPM,
HIGH P99 with and without the job, and every request's outcome (the job's rows are checked against their hashes).
Targets (issue 31): 429s <= 0.5% of calls; tokens/min >= 90% of TPM; the job within 1.15x its tokens / TPM; HIGH
P99 during the job <= 1.5x alone.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import tempfile
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any, Iterator

from deployments.model import tokens
from load.multinode import local_cluster, wait_for_proxies
from load.upstream import UpstreamConfig
from load.upstream_client import UpstreamClient
from load.workload import pseudo_sentences

from .bulk_job import bulk_job, high_stream, write_documents
from .options import chosen_settings
from .report import markdown_table, write_report
from .serving import SIM_MODEL, deployed, serve_cluster, sim_model_entry
from .upstream_process import add_upstream_arguments, upstream_config_from, upstream_process

TARGET_429_SHARE = 0.005
TARGET_TPM_SHARE = 0.90
TARGET_JOB_WALL_RATIO = 1.15
TARGET_HIGH_P99_RATIO = 1.5
SAMPLE_S = 1.0


@dataclass(frozen=True)
class Settings:
    documents: int = 9_000  # ~3 minutes at 60,000 TPM: most of the job after the first minute's full bucket
    mean_chars: int = 120
    rpm: int = 1_200
    tpm: int = 60_000
    headroom: float = 0.95
    replicas: int = 2
    nodes: int = 1
    high_rate_per_s: float = 5.0
    baseline_s: float = 30.0
    # Requests in flight wait their turn for the quota: 16 of 256 documents (embed-bulk's default) is ~1.6 minutes of
    # this TPM, past embed-bulk's 120 s timeout, and every request it gave up on and sent again was billed again.
    job_concurrency: int = 4
    job_batch_size: int = 256

    def __post_init__(self) -> None:
        if self.nodes < 1:
            raise ValueError("quota: --nodes must be >= 1")


QUICK = Settings(documents=300, rpm=600, tpm=20_000, high_rate_per_s=2.0, baseline_s=3.0)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    for setting in fields(Settings):
        quick = getattr(QUICK, setting.name)
        kind = int if setting.type == "int" else float
        parser.add_argument(f"--{setting.name.replace('_', '-')}", type=kind,
                            help=f"(default {setting.default}; --quick {quick})")
    add_upstream_arguments(parser)


def run(args: argparse.Namespace) -> dict[str, Any]:
    settings = chosen_settings(args, Settings(), QUICK)
    upstream = dataclasses.replace(upstream_config_from(args), rpm=settings.rpm, tpm=settings.tpm)
    with upstream_process(upstream) as root_url, _service(settings, root_url) as (job_url, stream_url):
        return measure(job_url, stream_url, root_url, upstream, settings, getattr(args, "results_dir", None))


@contextmanager
def _service(settings: Settings, root_url: str) -> Iterator[tuple[str, str]]:
    """The application on a fresh cluster of ``settings.nodes`` nodes; yields the URLs the job and the HIGH stream
    are sent to."""
    from ray import serve

    from deployments.app import build_app

    entry = {**sim_model_entry(f"{root_url}/v1"), "num_replicas": settings.replicas,
             "limits": {"rpm": settings.rpm, "tpm": settings.tpm, "headroom": settings.headroom}}
    if settings.nodes == 1:
        with serve_cluster() as proxy, deployed(proxy, {"quota": build_app({"models": [entry]})}, SIM_MODEL) \
                as (target,):
            yield target.url, target.url
        return
    entry["ray_actor_options"] = {"num_cpus": 1}  # one CPU per node: the replicas spread over the nodes
    ingress = {"num_replicas": settings.nodes, "max_replicas_per_node": 1}
    with local_cluster(settings.nodes) as cluster:
        serve.run(build_app({"models": [entry], "ingress": ingress}), name="quota", route_prefix="/")
        wait_for_proxies(cluster.nodes)
        yield cluster.head.proxy_url, cluster.nodes[-1].proxy_url


def measure(job_url: str, stream_url: str, root_url: str, upstream: UpstreamConfig, settings: Settings,
            results_dir: Any = None) -> dict[str, Any]:
    documents = pseudo_sentences(settings.documents, settings.mean_chars, seed=0)
    stream_texts = pseudo_sentences(int(settings.high_rate_per_s * 1800), settings.mean_chars, seed=1)
    job_tokens = sum(tokens.count(text) for text in documents)
    with tempfile.TemporaryDirectory(prefix="bench-quota-") as work:
        input_path = write_documents(documents, Path(work) / "documents.jsonl")
        runs = asyncio.run(_runs(job_url, stream_url, root_url, documents, stream_texts, input_path, settings,
                                 upstream.dim))
    data = summarise(runs, settings, upstream, job_tokens)
    name = "quota" if settings.nodes == 1 else f"quota_{settings.nodes}_nodes"
    return write_report(name, "One provider quota, shared: bulk beside interactive traffic", render(data), data,
                        results_dir)


async def _runs(job_url: str, stream_url: str, root_url: str, documents: list[str], stream_texts: list[str],
                input_path: Path, settings: Settings, dim: int) -> dict[str, Any]:
    async with UpstreamClient(root_url) as upstream:
        await upstream.wait_idle()
        alone = await high_stream(stream_url, stream_texts, settings.high_rate_per_s, settings.baseline_s, dim)
        alone_upstream = await upstream.stats()
        samples: list[tuple[float, dict[str, Any]]] = []
        sampling = asyncio.ensure_future(_sample(upstream, samples))
        try:
            job = await bulk_job(job_url, upstream, documents, input_path, dim, concurrency=settings.job_concurrency,
                                 batch_size=settings.job_batch_size, stream_texts=stream_texts,
                                 stream_rate_per_s=settings.high_rate_per_s, stream_url=stream_url)
        finally:
            sampling.cancel()
        job_upstream = await upstream.stats()
    return {"high_alone": {**alone.summary(), "upstream": alone_upstream},
            "job_with_high": {**job, "upstream": job_upstream, "samples": _since_reset(samples)}}


async def _sample(upstream: UpstreamClient, samples: list[tuple[float, dict[str, Any]]]) -> None:
    while True:
        samples.append((time.monotonic(), await upstream.stats()))
        await asyncio.sleep(SAMPLE_S)


def _since_reset(samples: list[tuple[float, dict[str, Any]]]) -> list[dict[str, float]]:
    """The samples after the job's start reset the counters: seconds since its first call, tokens, calls, 429s."""
    start = max((i for i in range(1, len(samples)) if samples[i][1]["calls"] < samples[i - 1][1]["calls"]),
                default=0)
    kept = [(t, stats) for t, stats in samples[start:] if stats["calls"]]
    if not kept:
        return []
    first = kept[0][0]
    return [{"t_s": round(t - first, 1), "tokens": stats["tokens_billed"], "calls": stats["calls"],
             "rejected_429": stats["rejected_429"]} for t, stats in kept]


def summarise(runs: dict[str, Any], settings: Settings, upstream: UpstreamConfig, job_tokens: int) -> dict[str, Any]:
    job, alone = runs["job_with_high"], runs["high_alone"]
    calls = job["upstream"]["calls"] + alone["upstream"]["calls"]
    refused = job["upstream"]["rejected_429"] + alone["upstream"]["rejected_429"]
    per_min = job["upstream"]["tokens_billed"] / (job["wall_s"] / 60.0)
    samples = job["samples"]
    after_first = [s for s in samples if s["t_s"] >= 60.0]
    steady = None
    if len(after_first) >= 2:
        first, last = after_first[0], after_first[-1]
        steady = (last["tokens"] - first["tokens"]) / ((last["t_s"] - first["t_s"]) / 60.0)
    ideal_s = job_tokens / settings.tpm * 60.0
    alone_p99, during_p99 = alone["p99_ms"], job["high_stream"]["p99_ms"]
    p99_ratio = during_p99 / alone_p99 if alone_p99 and during_p99 else None

    def target(value: float | None, needed: float, at_most: bool) -> dict[str, Any]:
        met = value is not None and (value <= needed if at_most else value >= needed)
        return {"value": value, "needed": needed, "met": met}

    return {
        "settings": asdict(settings),
        "upstream": asdict(upstream),
        "job_tokens": job_tokens,
        "runs": runs,
        "tokens_per_min": per_min,
        "steady_tokens_per_min": steady,
        "ideal_job_s": ideal_s,
        "targets": {
            "upstream_429_share": target(refused / calls if calls else None, TARGET_429_SHARE, at_most=True),
            "tpm_share_over_job": target(per_min / settings.tpm, TARGET_TPM_SHARE, at_most=False),
            "tpm_share_after_first_minute": target(steady / settings.tpm if steady else None, TARGET_TPM_SHARE,
                                                   at_most=False),
            "job_wall_ratio": target(job["wall_s"] / ideal_s, TARGET_JOB_WALL_RATIO, at_most=True),
            "high_p99_ratio": target(p99_ratio, TARGET_HIGH_P99_RATIO, at_most=True),
        },
    }


def render(data: dict[str, Any]) -> str:
    settings, runs, targets = data["settings"], data["runs"], data["targets"]
    job, alone = runs["job_with_high"], runs["high_alone"]

    def fmt(value: float | None, digits: int = 1) -> str:
        return "—" if value is None else f"{value:,.{digits}f}"

    def percent(value: float | None, digits: int = 1) -> str:
        return "—" if value is None else f"{100 * value:,.{digits}f}%"

    verdict = {True: "met", False: "**not met**"}
    rows = [
        ["upstream 429s / upstream calls", percent(targets["upstream_429_share"]["value"], 2),
         f"≤ {100 * TARGET_429_SHARE:g}%", verdict[targets["upstream_429_share"]["met"]]],
        ["tokens/min over the job / TPM", percent(targets["tpm_share_over_job"]["value"]),
         f"≥ {100 * TARGET_TPM_SHARE:g}%", verdict[targets["tpm_share_over_job"]["met"]]],
        ["tokens/min after the job's first minute / TPM", percent(targets["tpm_share_after_first_minute"]["value"]),
         f"≥ {100 * TARGET_TPM_SHARE:g}%", verdict[targets["tpm_share_after_first_minute"]["met"]]],
        ["job wall / (job tokens / TPM)", f"{fmt(targets['job_wall_ratio']['value'], 2)}×",
         f"≤ {TARGET_JOB_WALL_RATIO:g}×", verdict[targets["job_wall_ratio"]["met"]]],
        ["HIGH P99 during the job / alone", f"{fmt(targets['high_p99_ratio']['value'], 2)}×",
         f"≤ {TARGET_HIGH_P99_RATIO:g}×", verdict[targets["high_p99_ratio"]["met"]]],
    ]
    stream_rows = [
        [label, run["submitted"], fmt(run["p50_ms"]), fmt(run["p99_ms"]), run["errors"] + run["mismatches"],
         run.get("error_sample") or ""]
        for label, run in (("alone", alone), ("during the job", job["high_stream"]))
    ]
    return f"""\
Upstream (its own process): {settings['rpm']:,} requests/min and {settings['tpm']:,} tokens/min, OpenAI's \
`x-ratelimit-*` headers on every answer. Service: {settings['replicas']} replicas of the `openai` backend on \
{settings['nodes']} Ray node(s) with \
`limits: {{rpm: {settings['rpm']}, tpm: {settings['tpm']}, headroom: {settings['headroom']}}}`. HIGH stream: single \
texts, Poisson at {settings['high_rate_per_s']:g}/s ({settings['baseline_s']:g} s alone). Job: `embed-bulk` at LOW, \
{settings['documents']:,} documents (~{settings['mean_chars']} characters, {data['job_tokens']:,} tokens), \
`--concurrency {settings['job_concurrency']} --batch-size {settings['job_batch_size']}`.

{markdown_table(["figure", "measured", "target", ""], rows)}

The job took {fmt(job['wall_s'])} s for {data['job_tokens']:,} tokens: {fmt(data['ideal_job_s'])} s at the TPM limit. \
The upstream billed {job['upstream']['tokens_billed']:,} tokens in {job['upstream']['calls']:,} calls while it ran \
({fmt(data['tokens_per_min'], 0)} a minute; after its first minute {fmt(data['steady_tokens_per_min'], 0)}). \
The bucket starts full (a minute of tokens), so the first minute may send more than the TPM, as the provider's own \
bucket allows. Job rows wrong or missing: {job['mismatches'] + job['misplaced_ids'] + job['documents'] - job['rows']}.

{markdown_table(["HIGH stream", "requests", "P50 ms", "P99 ms", "errors", "first error"], stream_rows)}
"""

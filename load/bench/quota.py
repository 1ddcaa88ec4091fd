"""The provider's quota: the nightly bulk job (LOW) beside a HIGH stream, on an upstream limited in RPM and TPM.

One Ray cluster runs the application with two replicas of the ``openai`` backend, pointed at the simulated upstream
(its own process) with ``--rpm``/``--tpm`` limits, and the model entry's ``limits:`` set to the same (with
``--headroom``): both replicas claim from one budget. With ``--nodes 1`` (the default) the cluster is one Ray node
started as ``serve run`` starts it (``serve.env``); with ``--nodes N`` it is ``load.bench cluster``'s: N nodes of one
CPU each (``load.multinode``), a replica and an ingress on each, Serve's proxy on every node, the job sent to the
head's proxy and the HIGH stream to the last node's. Three measured runs, one after the other:

1. the HIGH stream alone (single texts, Poisson arrivals, ``X-Priority: high``);
2. ``embed-bulk`` (``python -m embed_bulk``, LOW) over every document, with the same stream running from the job's
   first upstream call to its exit; the upstream's counters are read every second;
3. LOW of another shape: many clients (``--clients``), each sending requests of ``--client-texts`` texts back to back
   for ``--clients-s`` seconds (sleeping a 429's ``Retry-After``), with the same stream beside them.

Reported: upstream 429s as a share of upstream calls, tokens sent a minute against the TPM limit (over the job, and
after its first minute, when the bucket it started with is spent), the job's wall time against its tokens / TPM,
HIGH P99 beside each LOW shape against alone, the LOW clients' requests answered, and every request's outcome (the
job's rows are checked against their hashes). Targets: 429s <= 0.5% of calls; tokens/min >= 90% of TPM (85% beside
the clients, whose shape leaves gaps); the job within 1.15x its tokens / TPM; HIGH P99 beside each LOW shape <= 1.5x
alone; the clients' requests >= 90% answered.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import tempfile
import time
from collections import Counter
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Iterator

import aiohttp

from deployments.model import tokens
from load.multinode import local_cluster, wait_for_proxies
from load.upstream import UpstreamConfig
from load.upstream_client import UpstreamClient
from load.workload import pseudo_sentences

from .bulk_job import bulk_job, high_stream, write_documents
from .options import add_settings_arguments, chosen_settings
from .report import markdown_table, write_report
from .serving import SIM_MODEL, deployed, serve_cluster, sim_model_entry
from .upstream_process import add_upstream_arguments, upstream_config_from, upstream_process

TARGET_429_SHARE = 0.005
TARGET_TPM_SHARE = 0.90
TARGET_JOB_WALL_RATIO = 1.15
TARGET_HIGH_P99_RATIO = 1.5
TARGET_CLIENTS_TPM_SHARE = 0.85
TARGET_LOW_ANSWERED = 0.90
CLIENT_TIMEOUT_S = 120.0  # a LOW client's request waits for the quota at most this long (embed-bulk's own timeout)
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
    # the other LOW shape: many clients, multi-text requests back to back
    clients: int = 12
    client_texts: int = 64
    clients_s: float = 60.0

    def __post_init__(self) -> None:
        if self.nodes < 1:
            raise ValueError("quota: --nodes must be >= 1")


QUICK = Settings(documents=300, rpm=600, tpm=20_000, high_rate_per_s=2.0, baseline_s=3.0, clients=3, client_texts=8,
                 clients_s=3.0)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_settings_arguments(parser, Settings(), QUICK)
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
        clients = await low_clients(job_url, stream_url, upstream, stream_texts, settings, dim)
    return {"high_alone": {**alone.summary(), "upstream": alone_upstream},
            "job_with_high": {**job, "upstream": job_upstream, "samples": _since_reset(samples)},
            "clients_with_high": clients}


async def low_clients(url: str, stream_url: str, upstream: UpstreamClient, stream_texts: list[str],
                      settings: Settings, dim: int) -> dict[str, Any]:
    """``settings.clients`` LOW clients sending ``settings.client_texts`` texts a request back to back (sleeping a
    429's Retry-After) for ``settings.clients_s``, beside the HIGH stream; each request's status, and what the
    upstream billed meanwhile."""
    await upstream.wait_idle()
    before = await upstream.stats()
    texts = iter(pseudo_sentences(settings.clients * settings.client_texts * 400, settings.mean_chars, seed=3))
    statuses: Counter[int] = Counter()
    stop = asyncio.Event()
    body = {"model": SIM_MODEL, "encoding_format": "base64"}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=CLIENT_TIMEOUT_S)) as session:
        async def client() -> None:
            while not stop.is_set():
                inputs = [next(texts) for _ in range(settings.client_texts)]
                try:
                    async with session.post(f"{url}/v1/embeddings", json={**body, "input": inputs},
                                            headers={"X-Priority": "low"}) as response:
                        await response.read()
                        status, retry_after = response.status, response.headers.get("retry-after")
                except (aiohttp.ClientError, TimeoutError):
                    status, retry_after = 0, None
                statuses[status] += 1
                if status == 429:
                    await asyncio.sleep(float(retry_after or 1.0))

        started = time.monotonic()
        sending = asyncio.gather(*(client() for _ in range(settings.clients)))
        stream = await high_stream(stream_url, stream_texts, settings.high_rate_per_s, settings.clients_s, dim)
        stop.set()
        await sending  # what each client has in flight is answered (or times out)
        wall_s = time.monotonic() - started
    after = await upstream.stats()
    return {"high_stream": stream.summary(), "statuses": {str(status): count for status, count in statuses.items()},
            "wall_s": wall_s, "upstream": {key: after[key] - before[key]
                                           for key in ("calls", "tokens_billed", "rejected_429")}}


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
    clients = runs["clients_with_high"]
    sent = sum(clients["statuses"].values())
    clients_calls = clients["upstream"]["calls"]

    def p99_ratio(stream: dict[str, Any]) -> float | None:
        alone_p99, during_p99 = alone["p99_ms"], stream["p99_ms"]
        return during_p99 / alone_p99 if alone_p99 and during_p99 else None

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
            "high_p99_ratio": target(p99_ratio(job["high_stream"]), TARGET_HIGH_P99_RATIO, at_most=True),
            "clients_upstream_429_share": target(clients["upstream"]["rejected_429"] / clients_calls
                                                 if clients_calls else None, TARGET_429_SHARE, at_most=True),
            "clients_tpm_share": target(clients["upstream"]["tokens_billed"] / (clients["wall_s"] / 60.0)
                                        / settings.tpm, TARGET_CLIENTS_TPM_SHARE, at_most=False),
            "clients_high_p99_ratio": target(p99_ratio(clients["high_stream"]), TARGET_HIGH_P99_RATIO,
                                             at_most=True),
            "clients_low_answered": target(clients["statuses"].get("200", 0) / sent if sent else None,
                                           TARGET_LOW_ANSWERED, at_most=False),
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
        ["beside the LOW clients: upstream 429s / upstream calls",
         percent(targets["clients_upstream_429_share"]["value"], 2), f"≤ {100 * TARGET_429_SHARE:g}%",
         verdict[targets["clients_upstream_429_share"]["met"]]],
        ["beside the LOW clients: tokens/min / TPM", percent(targets["clients_tpm_share"]["value"]),
         f"≥ {100 * TARGET_CLIENTS_TPM_SHARE:g}%", verdict[targets["clients_tpm_share"]["met"]]],
        ["HIGH P99 beside the LOW clients / alone", f"{fmt(targets['clients_high_p99_ratio']['value'], 2)}×",
         f"≤ {TARGET_HIGH_P99_RATIO:g}×", verdict[targets["clients_high_p99_ratio"]["met"]]],
        ["the LOW clients' requests answered", percent(targets["clients_low_answered"]["value"]),
         f"≥ {100 * TARGET_LOW_ANSWERED:g}%", verdict[targets["clients_low_answered"]["met"]]],
    ]
    clients = runs["clients_with_high"]
    stream_rows = [
        [label, run["submitted"], fmt(run["p50_ms"]), fmt(run["p99_ms"]), run["errors"] + run["mismatches"],
         run.get("error_sample") or ""]
        for label, run in (("alone", alone), ("during the job", job["high_stream"]),
                           ("beside the LOW clients", clients["high_stream"]))
    ]
    statuses = ", ".join(f"{count:,}× {status}" for status, count in sorted(clients["statuses"].items()))
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

LOW clients: {settings['clients']} sending {settings['client_texts']} texts a request back to back for {settings['clients_s']:g} s (a 429's `Retry-After` slept): {statuses} (status 0: no answer within {CLIENT_TIMEOUT_S:g} s); the upstream billed {clients['upstream']['tokens_billed']:,} tokens in {clients['upstream']['calls']:,} calls ({clients['upstream']['rejected_429']} refused) over {fmt(clients['wall_s'])} s.

{markdown_table(["HIGH stream", "requests", "P50 ms", "P99 ms", "errors", "first error"], stream_rows)}
"""

"""The nightly job: 100,000 documents through the full service, one request each vs the bulk client at LOW priority.

One Ray cluster runs two copies of the application, each with one replica of the ``openai`` backend pointed at the
simulated upstream (its own process): ``adaptive`` (max_batch 200, max_wait 25 ms, 4 batches in flight, as in
``e2e``) and ``unbatched`` (max_batch 1, no wait). Four measured runs, one after another:

1. one request per document: single-text requests to ``unbatched`` from 50 closed-loop callers, over the first
   ``--unbatched-documents`` documents (all 100,000 take over 8 minutes: the time for all is projected from the
   measured rate and said to be a projection);
2. a HIGH stream alone: single-text requests with ``X-Priority: high``, Poisson arrivals, to ``adaptive``;
3. the bulk job alone: ``python -m embed_bulk`` (the ``embed-bulk`` a user runs, in its own process) over all the
   documents, ``X-Priority: low``, to ``adaptive``; wall time from launch to exit, upstream calls from the
   upstream's counters;
4. the bulk job again with the same HIGH stream running from its first upstream call to its exit;
5. (``throttled_rate``) the same with ``embed-bulk --max-rate``: a job that leaves the machine headroom;
6. (``fifo_control``) the job sent at HIGH priority with the stream: one FIFO lane, what the priority buys;
7. (``contention_control``) the job at LOW with the stream sent to a third copy of the application (its own
   replica and batcher): what sharing the machine's two cores and the upstream costs HIGH by itself.

Every vector is checked against its text's hash: the job's ``.npy`` row by row against its ids.
Targets: the job's upstream calls ≤ 1% of documents; HIGH P99 during the job ≤ 1.5× without it.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Sequence

from embed_bulk.settings import BulkSettings
from load.loadgen import check, closed_loop
from load.upstream import UpstreamConfig
from load.upstream_client import UpstreamClient
from load.workload import pseudo_sentences

from .bulk_job import bulk_job, high_stream, write_documents
from .options import add_settings_arguments, chosen_settings
from .report import markdown_table, write_report
from .serving import SIM_MODEL, UNBATCHED, deployed, run_with_upstream_and_service, sim_model_entry
from .upstream_process import add_upstream_arguments

TARGET_CALLS_PER_DOCUMENT = 0.01
TARGET_HIGH_P99_RATIO = 1.5


@dataclass(frozen=True)
class Settings:
    documents: int = 100_000
    unbatched_documents: int = 5_000
    unbatched_callers: int = 50
    job_concurrency: int = BulkSettings.concurrency  # embed-bulk's defaults
    job_batch_size: int = BulkSettings.batch_size
    high_rate_per_s: float = 20.0
    baseline_s: float = 60.0
    mean_chars: int = 120
    throttled_rate: float = 800.0  # documents/s for the polite run (embed-bulk --max-rate); 0 skips that run
    fifo_control: bool = True
    contention_control: bool = True


QUICK = Settings(documents=400, unbatched_documents=40, unbatched_callers=8, high_rate_per_s=10.0, baseline_s=2.0)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_settings_arguments(parser, Settings(), QUICK)
    add_upstream_arguments(parser)


def run(args: argparse.Namespace) -> dict[str, Any]:
    return run_with_upstream_and_service(args, measure, chosen_settings(args, Settings(), QUICK))


def measure(proxy: str, root_url: str, upstream: UpstreamConfig, settings: Settings,
            results_dir: Any = None) -> dict[str, Any]:
    """The scenario on a running Serve instance (HTTP proxy at ``proxy``) and upstream (at ``root_url``)."""
    from deployments.app import build_app

    base_url = f"{root_url}/v1"
    apps = {"adaptive": build_app({"models": [sim_model_entry(base_url)]}),
            "unbatched": build_app({"models": [sim_model_entry(base_url, **UNBATCHED)]})}
    if settings.contention_control:
        apps["interactive"] = build_app({"models": [sim_model_entry(base_url)]})
    documents = pseudo_sentences(settings.documents, settings.mean_chars, seed=0)
    stream_texts = pseudo_sentences(int(settings.high_rate_per_s * 1800), settings.mean_chars, seed=1)
    with deployed(proxy, apps, SIM_MODEL) as targets, tempfile.TemporaryDirectory(prefix="bench-bulk-") as work:
        urls = {target.label: target.url for target in targets}
        input_path = write_documents(documents, Path(work) / "documents.jsonl")
        runs = asyncio.run(_all_runs(urls, root_url, documents, stream_texts, input_path, settings, upstream.dim))
    data = summarise(runs, settings, upstream)
    return write_report("bulk", "The nightly bulk job through the full service", render(data), data, results_dir)


async def _all_runs(urls: dict[str, str], root_url: str, documents: Sequence[str], stream_texts: Sequence[str],
                    input_path: Path, settings: Settings, dim: int) -> dict[str, Any]:
    async with UpstreamClient(root_url) as upstream:
        job = functools.partial(bulk_job, urls["adaptive"], upstream, documents, input_path, dim,
                                concurrency=settings.job_concurrency, batch_size=settings.job_batch_size,
                                stream_rate_per_s=settings.high_rate_per_s)
        runs: dict[str, Any] = {
            "one_request_per_document": await one_request_per_document(
                urls["unbatched"], upstream, documents[: settings.unbatched_documents], settings, dim),
            "high_alone": (await high_stream(urls["adaptive"], stream_texts, settings.high_rate_per_s,
                                             settings.baseline_s, dim)).summary(),
            "job_alone": await job(),
            "job_with_high": await job(stream_texts=stream_texts),
        }
        if settings.throttled_rate:
            runs["job_throttled_with_high"] = await job(stream_texts=stream_texts, max_rate=settings.throttled_rate)
        if settings.fifo_control:
            runs["job_at_high_with_high"] = await job(stream_texts=stream_texts, priority="high")
        if settings.contention_control:
            runs["job_with_high_elsewhere"] = await job(stream_texts=stream_texts, stream_url=urls["interactive"])
    return runs


async def one_request_per_document(url: str, upstream: UpstreamClient, documents: Sequence[str],
                                   settings: Settings, dim: int) -> dict[str, Any]:
    await upstream.wait_idle()
    before = (await upstream.stats())["calls"]
    async with UpstreamClient(url, model=SIM_MODEL) as client:
        result = check(await closed_loop(client.embed_one, documents, settings.unbatched_callers), documents, dim)
    calls = (await upstream.stats())["calls"] - before
    return {**result.summary(), "documents": len(documents), "upstream_calls": calls}


def summarise(runs: dict[str, Any], settings: Settings, upstream: UpstreamConfig) -> dict[str, Any]:
    unbatched = runs["one_request_per_document"]
    job = runs["job_alone"]
    calls_per_document = job["upstream_calls"] / job["documents"]
    projected_s = settings.documents / unbatched["items_per_s"] if unbatched["items_per_s"] else None
    return {
        "settings": asdict(settings),
        "upstream": asdict(upstream),
        "runs": runs,
        "one_request_per_document_projected": {"documents": settings.documents, "wall_s": projected_s,
                                               "upstream_calls": settings.documents},
        "speedup": projected_s / job["wall_s"] if projected_s else None,
        "targets": {
            "calls_per_document": {"value": calls_per_document, "needed": TARGET_CALLS_PER_DOCUMENT,
                                   "met": calls_per_document <= TARGET_CALLS_PER_DOCUMENT},
            **{f"high_p99_ratio_{key}": _p99_target(runs, job_key)
               for key, job_key in P99_TARGET_RUNS.items() if job_key in runs},
        },
    }


P99_TARGET_RUNS = {"full_speed": "job_with_high", "throttled": "job_throttled_with_high"}


def _p99_target(runs: dict[str, Any], job_key: str) -> dict[str, Any]:
    alone, during = runs["high_alone"]["p99_ms"], runs[job_key]["high_stream"]["p99_ms"]
    ratio = during / alone if alone and during else None
    met = ratio is not None and ratio <= TARGET_HIGH_P99_RATIO
    return {"value": ratio, "needed": TARGET_HIGH_P99_RATIO, "met": met}


def render(data: dict[str, Any]) -> str:
    settings, runs, upstream = data["settings"], data["runs"], data["upstream"]

    def fmt(value: float | None, digits: int = 1) -> str:
        return "—" if value is None else f"{value:,.{digits}f}"

    unbatched, projected = runs["one_request_per_document"], data["one_request_per_document_projected"]
    job_rows = [
        [f"one request per document, measured ({settings['unbatched_callers']} callers)", unbatched["documents"],
         fmt(unbatched["elapsed_s"]), fmt(unbatched["items_per_s"]), unbatched["upstream_calls"],
         unbatched["errors"] + unbatched["mismatches"]],
        ["one request per document, projected from that rate", projected["documents"], fmt(projected["wall_s"]),
         fmt(unbatched["items_per_s"]), f"{projected['upstream_calls']} (1 a document)", "—"],
    ]
    alone_p99 = runs["high_alone"]["p99_ms"]
    stream_rows = [["none (the stream alone)", *_stream_cells(runs["high_alone"], alone_p99, fmt)]]
    for key, label in (("job_alone", "embed-bulk, LOW, alone"), ("job_with_high", "embed-bulk, LOW, + HIGH stream"),
                       ("job_throttled_with_high", "embed-bulk, LOW, --max-rate "
                                                   f"{settings['throttled_rate']:g}, + HIGH stream"),
                       ("job_at_high_with_high", "embed-bulk sent at HIGH (one FIFO lane), + HIGH stream"),
                       ("job_with_high_elsewhere", "embed-bulk, LOW, + HIGH stream to another copy of the service")):
        if key not in runs:
            continue
        job = runs[key]
        job_rows.append([label, job["documents"], fmt(job["wall_s"]), fmt(job["documents_per_s"]),
                         job["upstream_calls"] if not job["upstream_calls_include_stream"]
                         else f"{job['upstream_calls']} (incl. the stream's)",
                         job["mismatches"] + job["misplaced_ids"] + (job["documents"] - job["rows"])])
        if "high_stream" in job:
            stream_rows.append([label, *_stream_cells(job["high_stream"], alone_p99, fmt)])
    targets = data["targets"]
    calls = targets["calls_per_document"]
    verdict = {True: "met", False: "**not met**"}
    ratios = [f"{label}: {fmt(targets[key]['value'], 2)}× ({verdict[targets[key]['met']]})"
              for key, label in (("high_p99_ratio_full_speed", "the job at full speed"),
                                 ("high_p99_ratio_throttled", f"with `--max-rate {settings['throttled_rate']:g}`"))
              if key in targets]
    jobs_table = markdown_table(["run", "documents", "wall s", "documents/s", "upstream calls", "wrong rows"],
                                job_rows)
    stream_table = markdown_table(["bulk job running", "HIGH requests", "P50 ms", "P99 ms", "P99 / alone", "errors"],
                                  stream_rows)
    return f"""\
{settings['documents']:,} generated documents (~{settings['mean_chars']} characters). Upstream in its own process: \
base {upstream['base_latency_ms']:g} ms + {upstream['per_token_ms']:g} ms/token, jitter {upstream['jitter']:g}, \
provider concurrency {upstream['max_concurrency']}. The bulk job is `python -m embed_bulk` (`embed-bulk`) with \
`--concurrency {settings['job_concurrency']} --batch-size {settings['job_batch_size']}`, writing `.npy`; its wall \
time runs from launch to exit. `wrong rows`: rows missing, out of place or not matching their document's hash.

{jobs_table}

The bulk job is {fmt(data['speedup'])}× faster than one request per document would be (projected). Its upstream \
calls: {calls['value']:.2%} of documents (target ≤ {calls['needed']:.0%}): {verdict[calls['met']]}.

A HIGH stream of single-text requests, Poisson at {settings['high_rate_per_s']:g}/s (alone for \
{settings['baseline_s']:g} s; with a job, from its first upstream call to its exit):

{stream_table}

HIGH P99 during the job / alone (target ≤ {TARGET_HIGH_P99_RATIO:g}×): {"; ".join(ratios)}.
Controls (P99 / alone): the job sent at HIGH, one FIFO lane: \
{fmt(_control_ratio(runs, "job_at_high_with_high"), 2)}×; the job at LOW with the stream sent to another copy of \
the service (its own replica and batcher; only the two cores and the upstream are shared): \
{fmt(_control_ratio(runs, "job_with_high_elsewhere"), 2)}×.
"""


def _control_ratio(runs: dict[str, Any], job_key: str) -> float | None:
    return _p99_target(runs, job_key)["value"] if job_key in runs else None


def _stream_cells(summary: dict[str, Any], alone_p99: float | None, fmt: Any) -> list[Any]:
    p99 = summary["p99_ms"]
    ratio = p99 / alone_p99 if p99 and alone_p99 else None
    return [summary["submitted"], fmt(summary["p50_ms"]), fmt(p99), fmt(ratio, 2),
            summary["errors"] + summary["mismatches"] + summary["backlog"]]

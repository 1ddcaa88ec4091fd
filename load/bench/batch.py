"""The Batch API as a user runs it: a corpus through ``/v1/files`` and ``/v1/batches`` beside interactive traffic.

The service as shipped (``serve run serve_config.yaml`` with ``serve.env``, the local all-MiniLM-L6-v2), the load
from this process with the official ``openai`` client: the corpus (``--documents`` ~120-character texts) is cut into
input files of at most ``--lines-per-batch`` lines (OpenAI's 50,000), uploaded, and submitted as batches at once. A
HIGH stream of single texts (Poisson, ``--high-rate-per-s``) runs alone for ``--calm-s`` first, then beside the
batches until they finish, with a LOW one (``X-Priority: low``) beside it. Every output line is checked: one per
document, in order, and a sample's vectors equal (cosine) to ``/v1/embeddings`` for the same text.

Targets: HIGH P99 while the batches run ≤ 1.5× calm; every LOW request answered; no line lost, failed or repeated.
"""

from __future__ import annotations

import argparse
import asyncio
import io
import time
from dataclasses import asdict, dataclass
from typing import Any, Sequence

import aiohttp
import numpy as np
import openai
import orjson

from embeddings_wire import decode_embeddings
from load.loadgen import send_open_loop
from load.peers.launch import DEFAULT_PEERS_DIR, running
from load.workload import poisson_arrivals, pseudo_sentences

from .backlog import Answer, post, summary
from .options import add_settings_arguments, chosen_settings
from .report import markdown_table, write_report
from .shipped_service import MODEL, SERVICE, packaged_model_path

TARGET_HIGH_P99_RATIO = 1.5
SAMPLE = 500  # output lines compared with /v1/embeddings
POLL_S = 0.5


@dataclass(frozen=True)
class Settings:
    documents: int = 100_000
    lines_per_batch: int = 50_000
    mean_chars: int = 120
    high_rate_per_s: float = 5.0
    low_rate_per_s: float = 2.0
    calm_s: float = 30.0

    def __post_init__(self) -> None:
        if min(self.documents, self.lines_per_batch) < 1:
            raise ValueError("batch: --documents and --lines-per-batch must be >= 1")


QUICK = Settings(documents=2_000, lines_per_batch=1_000, calm_s=3.0)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_settings_arguments(parser, Settings(), QUICK)


def run(args: argparse.Namespace) -> dict[str, Any]:
    settings = chosen_settings(args, Settings(), QUICK)
    with running(SERVICE, DEFAULT_PEERS_DIR, packaged_model_path()) as started:
        return measure(started.url, settings, getattr(args, "results_dir", None))


def measure(url: str, settings: Settings, results_dir: Any = None, api_key: str = "unused") -> dict[str, Any]:
    """The scenario against the service at ``url`` (``api_key`` sent where it asks for one)."""
    documents = pseudo_sentences(settings.documents, settings.mean_chars, seed=7)
    stream_texts = pseudo_sentences(int(max(settings.high_rate_per_s, settings.low_rate_per_s) * 7200) + 100,
                                    settings.mean_chars, seed=8)
    data = asyncio.run(_runs(url, documents, stream_texts, settings, api_key))
    data["settings"] = asdict(settings)
    return write_report("batch", "The Batch API beside interactive traffic", render(data), data, results_dir)


async def _runs(url: str, documents: list[str], stream_texts: list[str], settings: Settings,
                api_key: str) -> dict[str, Any]:
    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=api_key, max_retries=0, timeout=600)
    async with aiohttp.ClientSession(url, headers={"Authorization": f"Bearer {api_key}"}) as session:
        calm = await _stream(session, stream_texts, "high", settings.high_rate_per_s, settings.calm_s, None)
        started = time.perf_counter()
        batch_ids, uploaded = [], []
        for first in range(0, len(documents), settings.lines_per_batch):
            lines = b"".join(orjson.dumps({"custom_id": f"doc-{i}", "method": "POST", "url": "/v1/embeddings",
                                           "body": {"model": MODEL, "input": documents[i]}}) + b"\n"
                             for i in range(first, min(first + settings.lines_per_batch, len(documents))))
            file = await client.files.create(file=(f"part-{first}.jsonl", io.BytesIO(lines)), purpose="batch")
            uploaded.append(file.id)
            batch = await client.batches.create(input_file_id=file.id, endpoint="/v1/embeddings",
                                                completion_window="24h")
            batch_ids.append(batch.id)
        submitted_s = time.perf_counter() - started
        done = asyncio.Event()
        streams = asyncio.gather(
            _stream(session, stream_texts, "high", settings.high_rate_per_s, 7200.0, done),
            _stream(session, stream_texts[::-1], "low", settings.low_rate_per_s, 7200.0, done))
        batches = await _wait(client, batch_ids)
        done.set()
        wall_s = time.perf_counter() - started
        high, low = await streams
    check = await _check(client, documents, batches)
    for file_id in uploaded + [b.output_file_id for b in batches] + [b.error_file_id for b in batches]:
        if file_id:
            await client.files.delete(file_id)
    return {"calm_high": calm, "high": high, "low": low, "wall_s": wall_s, "submitted_s": submitted_s,
            "batches": [{"id": b.id, "status": b.status, "request_counts": b.request_counts.model_dump()}
                        for b in batches], "check": check,
            "high_p99_ratio": high["p99_ms"] / calm["p99_ms"] if calm["p99_ms"] and high["p99_ms"] else None}


async def _wait(client: openai.AsyncOpenAI, batch_ids: Sequence[str]) -> list[Any]:
    while True:
        batches = [await client.batches.retrieve(batch_id) for batch_id in batch_ids]
        if all(b.status in ("completed", "failed", "expired", "cancelled") for b in batches):
            return batches
        await asyncio.sleep(POLL_S)


async def _stream(session: aiohttp.ClientSession, texts: Sequence[str], priority: str, rate_per_s: float,
                  duration_s: float, done: asyncio.Event | None) -> dict[str, Any]:
    """Single texts at Poisson arrivals (backlog's requests), each answer's status and latency at this client."""
    answers: list[Answer] = []
    offsets = poisson_arrivals(rate_per_s, 10**6, duration_s, seed=3 if priority == "high" else 4)
    await send_open_loop(lambda index, _: post(session, MODEL, priority, [texts[index % len(texts)]], answers,
                                                priority),
                         offsets, duration_s + 120.0, until=done.is_set if done is not None else None)
    return summary(answers)


async def _check(client: openai.AsyncOpenAI, documents: list[str], batches: list[Any]) -> dict[str, Any]:
    """Every document's line once and in order in the outputs; a sample's vectors against /v1/embeddings."""
    outputs: list[dict[str, Any]] = []
    failed = 0
    for batch in batches:
        if batch.output_file_id:
            content = (await client.files.content(batch.output_file_id)).content
            outputs += [orjson.loads(raw) for raw in content.splitlines()]
        if batch.error_file_id:
            failed += len((await client.files.content(batch.error_file_id)).content.splitlines())
    in_order = [line["custom_id"] for line in outputs] == [f"doc-{i}" for i in range(len(documents))]
    sample = list(range(0, len(outputs), max(1, len(outputs) // SAMPLE)))[:SAMPLE]
    direct = await client.embeddings.create(model=MODEL, input=[documents[i] for i in sample])
    direct_vectors = np.array([entry.embedding for entry in direct.data], dtype=np.float32)
    batched = np.array([decode_embeddings(outputs[i]["response"]["body"], 1)[0] for i in sample], dtype=np.float32)
    cosines = (batched * direct_vectors).sum(axis=1) if len(sample) else np.array([])
    return {"lines": len(outputs), "in_order_once_each": in_order, "error_lines": failed,
            "min_cosine": float(cosines.min()) if len(cosines) else None, "sampled": len(sample)}


def render(data: dict[str, Any]) -> str:
    settings, check = data["settings"], data["check"]

    def fmt(value: float | None, digits: int = 1) -> str:
        return "—" if value is None else f"{value:,.{digits}f}"

    ratio = data["high_p99_ratio"]
    met = ratio is not None and ratio <= TARGET_HIGH_P99_RATIO
    streams = markdown_table(
        ["stream", "requests", "statuses", "P50 ms", "P99 ms"],
        [[label, run["requests"], ", ".join(f"{n}× {s}" for s, n in sorted(run["statuses"].items())),
          fmt(run["p50_ms"]), fmt(run["p99_ms"])]
         for label, run in (("HIGH alone", data["calm_high"]), ("HIGH beside the batches", data["high"]),
                            ("LOW beside the batches", data["low"]))])
    batches = ", ".join(f"{b['status']} ({b['request_counts']['completed']:,} of {b['request_counts']['total']:,})"
                        for b in data["batches"])
    return f"""\
The service as shipped (`serve run serve_config.yaml`, `serve.env`), the local all-MiniLM-L6-v2 on this machine's
CPUs. {settings['documents']:,} documents (~{settings['mean_chars']} characters) in input files of at most \
{settings['lines_per_batch']:,} lines, uploaded and submitted with the `openai` client ({fmt(data['submitted_s'])} s), \
all at once; HIGH single texts at {settings['high_rate_per_s']:g}/s ({settings['calm_s']:g} s alone first) and LOW \
ones at {settings['low_rate_per_s']:g}/s beside them.

Batches: {batches}. Wall time from the first upload to the last batch's end: {fmt(data['wall_s'])} s, \
{settings['documents'] / data['wall_s']:,.0f} documents/s. Output: {check['lines']:,} lines, each document once and \
in order: {check['in_order_once_each']}; error lines {check['error_lines']}; min cosine to `/v1/embeddings` over \
{check['sampled']} sampled documents {fmt(check['min_cosine'], 6)}.

{streams}

HIGH P99 beside the batches / alone: {fmt(ratio, 2)}× (target ≤ {TARGET_HIGH_P99_RATIO:g}×): \
{"met" if met else "**not met**"}.
"""

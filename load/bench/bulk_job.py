"""What the bulk benchmarks share: ``embed-bulk`` run as a user runs it against a deployed copy of the service, with
a HIGH stream of single texts beside it, and its output checked row by row."""

from __future__ import annotations

import asyncio
import json
import sys
import time
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from load.loadgen import RunResult, check, count_mismatches, open_loop
from load.upstream_client import UpstreamClient
from load.workload import poisson_arrivals

from .serving import SIM_MODEL

STREAM_CAP_S = 3600.0  # a stream during a job ends with the job; this only bounds a job that never ends


def write_documents(documents: Sequence[str], path: Path) -> Path:
    with path.open("w", encoding="utf-8") as file:
        for index, text in enumerate(documents):
            file.write(json.dumps({"id": document_id(index), "text": text}) + "\n")
    return path


def document_id(index: int) -> str:
    return f"doc-{index:06d}"


async def high_stream(url: str, texts: Sequence[str], rate_per_s: float, duration_s: float, dim: int,
                      stop: asyncio.Event | None = None) -> RunResult:
    """Single HIGH texts at Poisson arrivals (``rate_per_s``) for ``duration_s``, or until ``stop`` is set."""
    offsets = poisson_arrivals(rate_per_s, len(texts), duration_s, seed=2)
    texts = texts[: len(offsets)]
    async with UpstreamClient(url, model=SIM_MODEL, priority="high") as client:
        result = await open_loop(client.embed_one, texts, offsets, duration_s + 60.0,
                                 until=stop.is_set if stop is not None else None)
    return check(result, texts, dim)


async def bulk_job(url: str, upstream: UpstreamClient, documents: Sequence[str], input_path: Path, dim: int, *,
                   concurrency: int, batch_size: int, stream_texts: Sequence[str] | None = None,
                   stream_rate_per_s: float = 0.0, stream_url: str | None = None, priority: str = "low",
                   max_rate: float | None = None) -> dict[str, Any]:
    """``python -m embed_bulk`` over every document into a fresh ``.npy``; with ``stream_texts``, a HIGH stream
    (``stream_rate_per_s``, to ``stream_url``, by default the job's own ``url``) runs from the job's first upstream
    call until it exits."""
    await upstream.wait_idle()
    output_path = input_path.with_name(f"vectors-{time.monotonic_ns()}.npy")
    before = (await upstream.stats())["calls"]
    command = [sys.executable, "-m", "embed_bulk", str(input_path), str(output_path), "--base-url", f"{url}/v1",
               "--model", SIM_MODEL, "--priority", priority, "--concurrency", str(concurrency),
               "--batch-size", str(batch_size), "--progress", "never"]
    if max_rate is not None:
        command += ["--max-rate", str(max_rate)]
    started = time.perf_counter()
    process = await asyncio.create_subprocess_exec(*command, stdout=asyncio.subprocess.PIPE,
                                                   stderr=asyncio.subprocess.PIPE)
    finished = asyncio.ensure_future(process.communicate())
    stream: RunResult | None = None
    if stream_texts is not None:
        stop = asyncio.Event()
        finished.add_done_callback(lambda _: stop.set())
        while not finished.done() and (await upstream.stats())["calls"] == before:
            await asyncio.sleep(0.02)
        stream = await high_stream(stream_url or url, stream_texts, stream_rate_per_s, STREAM_CAP_S, dim, stop)
    _, stderr = await finished
    wall_s = time.perf_counter() - started
    calls = (await upstream.stats())["calls"] - before
    report = stderr.decode("utf-8", "replace").strip()
    if process.returncode != 0:
        raise RuntimeError(f"embed-bulk exited with {process.returncode}:\n{report[-3000:]}")
    job = {"documents": len(documents), "priority": priority, "max_rate": max_rate, "wall_s": wall_s,
           "documents_per_s": len(documents) / wall_s, "upstream_calls": calls,
           "upstream_calls_include_stream": stream is not None, "embed_bulk_report": report.splitlines(),
           **check_output(output_path, documents, dim)}
    if stream is not None:
        job["high_stream"] = stream.summary()
    return job


def check_output(output_path: Path, documents: Sequence[str], dim: int) -> dict[str, int]:
    """Rows, misplaced ids and vectors not matching their document's hash in the job's ``.npy`` output."""
    matrix = np.load(output_path)
    ids_path = output_path.with_name(output_path.name + ".ids.jsonl")
    ids = [json.loads(line) for line in ids_path.read_text(encoding="utf-8").splitlines()]
    expected = [document_id(index) for index in range(len(documents))]
    misplaced = sum(found != wanted for found, wanted in zip(ids, expected)) + abs(len(ids) - len(expected))
    mismatches = count_mismatches(documents, list(matrix), dim)
    return {"rows": len(matrix), "misplaced_ids": misplaced, "mismatches": mismatches}

"""A bulk run: hold the output's lock, read the input, skip what the output already holds, embed the rest with
bounded concurrency, save every finished batch before taking the next, and account for every row. `stop()` (a
signal) ends it early: no new batch is taken, the batches in flight finish."""

from __future__ import annotations

import asyncio
import contextlib
import json
import sys
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import IO

import httpx2
import openai
from tqdm import tqdm

from embed_bulk.api import BatchOutcome, CallCounters, EmbeddingsClient, Failure, make_openai_client
from embed_bulk.documents import DocId, Document, read_documents, unique_ids
from embed_bulk.lock import output_lock
from embed_bulk.settings import BulkSettings
from embed_bulk.store import EmbeddingStore, open_store
from embed_bulk.via_batch import embed_via_batches

CLIENT_CLOSE_S = 1.0


@dataclass
class Summary:
    """What a run did; `embedded` and `failures` count this run only, `skipped` the rows done by earlier runs."""

    total: int = 0
    skipped: int = 0
    embedded: int = 0
    failures: list[Failure] = field(default_factory=list)
    wall_s: float = 0.0
    calls: CallCounters = field(default_factory=CallCounters)
    upstream_calls: int | None = None
    interrupted: bool = False  # rows were left undone because the run was stopped

    @property
    def rows_per_s(self) -> float:
        return self.embedded / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def exit_code(self) -> int:
        if self.interrupted:
            return 130
        return 1 if self.failures else 0


class Recorder:
    """Saves each finished batch durably, lists failures in `<out>.failures.jsonl`, and moves the progress bar.
    Saving runs on `saving`, one thread: its writes and fsyncs block, and on a cached re-run they held the event loop
    a tenth of the time; one thread keeps the batches in the order they finished."""

    def __init__(self, store: EmbeddingStore, saving: ThreadPoolExecutor, settings: BulkSettings, summary: Summary,
                 progress: tqdm) -> None:
        self._store = store
        self._saving = saving
        self._failures_path = settings.failures_path
        self._summary = summary
        self._progress = progress

    async def record(self, outcome: BatchOutcome) -> None:
        if outcome.embedded:
            await asyncio.get_running_loop().run_in_executor(self._saving, self._store.append, outcome.embedded)
            self._summary.embedded += len(outcome.embedded)
        if outcome.failed:
            self._write_failures(outcome.failed)
            self._summary.failures.extend(outcome.failed)
            self._progress.set_postfix(failed=len(self._summary.failures), refresh=False)
        self._progress.update(len(outcome.embedded) + len(outcome.failed))

    def _write_failures(self, failures: Sequence[Failure]) -> None:
        with self._failures_path.open("a", encoding="utf-8") as file:
            for failure in failures:
                row = {"id": failure.id, "line": failure.line, "error": failure.message, "status": failure.status}
                file.write(json.dumps(row, ensure_ascii=False) + "\n")


@dataclass
class Stop:
    """Set by `BulkJob.stop` (from a signal handler: it only flips a flag); `cut_short` once a worker left a batch."""

    requested: bool = False
    cut_short: bool = False


class BulkJob:
    """Runs once: `await job.run()`; `job.summary` stays readable if the run is interrupted. `OutputBusy` if another
    run holds the output."""

    def __init__(
        self,
        settings: BulkSettings,
        *,
        transport: httpx2.AsyncBaseTransport | None = None,
        stderr: IO[str] | None = None,
    ) -> None:
        self.settings = settings
        self.summary = Summary()
        self._transport = transport
        self._stderr = stderr if stderr is not None else sys.stderr
        self._started = time.monotonic()
        self._stop = Stop()

    def stop(self) -> None:
        """Take no new batch; those in flight finish and are saved, and the run ends interrupted."""
        self._stop.requested = True

    async def run(self) -> Summary:
        with output_lock(self.settings.output_path):
            return await self._run()

    async def _run(self) -> Summary:
        settings, summary = self.settings, self.summary
        self._started = time.monotonic()
        input_ids, malformed = unique_ids(self._documents())
        store = open_store(settings, input_ids)
        done = store.recover()
        if store.dropped_bytes:
            print(
                f"embed-bulk: cut an incomplete last write ({store.dropped_bytes} bytes) off the output; "
                "its rows are embedded again",
                file=self._stderr,
            )
        summary.total = len(input_ids) + malformed
        summary.skipped = sum(1 for doc_id in input_ids if doc_id in done)
        settings.failures_path.unlink(missing_ok=True)  # failed rows are not done: this run tries them again
        try:
            upstream_before = await self._upstream_calls()
            client = make_openai_client(settings, summary.calls, self._transport)
            try:
                with self._progress_bar(summary) as progress, ThreadPoolExecutor(1, "embed-bulk-save") as saving:
                    await self._embed_all(client, Recorder(store, saving, settings, summary, progress), done)
            finally:
                await _close(client)
            summary.interrupted = self._stop.cut_short
            if not summary.interrupted:
                summary.upstream_calls = _difference(await self._upstream_calls(), upstream_before)
                store.finish()
        except (asyncio.CancelledError, KeyboardInterrupt):
            summary.interrupted = True
            raise
        finally:
            store.close()
            summary.wall_s = time.monotonic() - self._started
        return summary

    async def _embed_all(self, client: openai.AsyncOpenAI, recorder: Recorder, done: set[DocId]) -> None:
        if self.settings.via == "batch":
            finished = await embed_via_batches(
                client, self.settings, recorder.record,
                lambda saved: pending_batches(self._documents(), done | saved, self.settings.batch_lines),
                lambda: self._stop.requested)
            self._stop.cut_short = not finished
            return
        embeddings = EmbeddingsClient(self.settings, client, self.summary.calls)
        batches = pending_batches(self._documents(), done, self.settings.batch_size)
        pacer = Pacer(self.settings.max_rate)
        try:
            async with asyncio.TaskGroup() as workers:
                for _ in range(self.settings.concurrency):
                    workers.create_task(_work(batches, pacer, embeddings, recorder, self._stop))
        except ExceptionGroup as group:
            raise group.exceptions[0] from None

    def _documents(self) -> Iterator[Document]:
        settings = self.settings
        return read_documents(
            settings.input_path, jsonl=settings.reads_jsonl, id_field=settings.id_field,
            text_field=settings.text_field, strict=settings.strict,
        )

    def _progress_bar(self, summary: Summary) -> tqdm:
        mode = self.settings.progress
        shown = mode == "always" or (mode == "auto" and self._stderr.isatty())
        return tqdm(
            total=summary.total,
            initial=summary.skipped,
            unit="row",
            desc="embedding",
            file=self._stderr,
            disable=not shown,
            dynamic_ncols=True,
            smoothing=0.1,
        )

    async def _upstream_calls(self) -> int | None:
        """The `calls` counter of `--stats-url`, if one was given and answers."""
        if not self.settings.stats_url:
            return None
        try:
            async with httpx2.AsyncClient(transport=self._transport, timeout=self.settings.connect_timeout_s) as http:
                response = await http.get(self.settings.stats_url)
            return int(response.json()["calls"])
        except (httpx2.HTTPError, ValueError, KeyError, TypeError):
            return None


def pending_batches(documents: Iterator[Document], done: set[DocId], size: int) -> Iterator[list[Document]]:
    """Batches of up to `size` documents in input order, leaving out those already done."""
    batch: list[Document] = []
    for document in documents:
        if document.id in done:
            continue
        batch.append(document)
        if len(batch) == size:
            yield batch
            batch = []
    if batch:
        yield batch


class Pacer:
    """Spaces the batches the workers send so that at most `rate_per_s` documents a second go out (None: no limit).
    A nightly job that shares the service with interactive users sets it to leave them the machine's headroom."""

    def __init__(self, rate_per_s: float | None) -> None:
        self._rate_per_s = rate_per_s
        self._next_at: float | None = None

    async def wait_turn(self, documents: int) -> None:
        if self._rate_per_s is None:
            return
        now = asyncio.get_running_loop().time()
        turn = now if self._next_at is None else max(now, self._next_at)
        self._next_at = turn + documents / self._rate_per_s
        if turn > now:
            await asyncio.sleep(turn - now)


async def _work(
    batches: Iterator[list[Document]], pacer: Pacer, client: EmbeddingsClient, recorder: Recorder, stop: Stop
) -> None:
    """One of `concurrency` workers sharing the batch iterator: embed a batch, save it, take the next; after a stop,
    no next (nor one taken while waiting for its turn)."""
    for batch in batches:
        sendable = [document for document in batch if document.problem is None]
        if sendable and not stop.requested:
            await pacer.wait_turn(len(sendable))
        if stop.requested:
            stop.cut_short = True
            return
        outcome = await client.embed(sendable) if sendable else BatchOutcome()
        outcome.failed.extend(Failure(doc.id, doc.problem, line=doc.line) for doc in batch if doc.problem is not None)
        await recorder.record(outcome)


async def _close(client: openai.AsyncOpenAI) -> None:
    """Closes the client's connections, waiting `CLIENT_CLOSE_S` at most: aiohttp waits for each to close, and one
    still holding bytes for a peer that stopped reading them (a stalled service) never does."""
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(CLIENT_CLOSE_S):
            await client.close()


def _difference(after: int | None, before: int | None) -> int | None:
    return after - before if after is not None and before is not None else None

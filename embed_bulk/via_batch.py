"""`--via batch`: the run through the service's Batch API (OpenAI's `/v1/files` and `/v1/batches`) instead of
`/v1/embeddings` requests: the same input, output and resuming.

The pending documents go in input files of at most `--batch-lines` lines (OpenAI's 50,000), each submitted as a
batch. Each batch's id is written to `<out>.batches.json` as soon as the service accepts it, so a rerun after a kill
(or after SIGINT, which leaves the batches running on the service) first waits for those batches instead of sending
their documents again. A finished batch's rows are saved from its output file, its failed lines listed as failures,
and then it is forgotten from `<out>.batches.json`; its files are deleted from the service.
"""

from __future__ import annotations

import asyncio
import io
import json
import os
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, Awaitable, Callable

import openai
import orjson

from embed_bulk.api import BatchOutcome, Failure
from embed_bulk.documents import DocId, Document
from embed_bulk.settings import BulkSettings, sidecar
from embeddings_wire import decode_embeddings

POLL_S = 2.0  # how often the batches in flight are asked for their status
FINISHED = ("completed", "failed", "expired", "cancelled")

Record = Callable[[BatchOutcome], Awaitable[None]]


class Submitted:
    """`<out>.batches.json`: the batches submitted and not yet saved, written whole and renamed over the old one."""

    def __init__(self, output_path: Path) -> None:
        self.path = sidecar(output_path, "batches.json")
        self.ids: list[str] = json.loads(self.path.read_text()) if self.path.exists() else []

    def add(self, batch_id: str) -> None:
        self.ids.append(batch_id)
        self._write()

    def forget(self, batch_id: str) -> None:
        self.ids.remove(batch_id)
        self._write()

    def _write(self) -> None:
        if not self.ids:
            self.path.unlink(missing_ok=True)
            return
        temporary = self.path.with_name(self.path.name + ".tmp")
        temporary.write_text(json.dumps(self.ids))
        os.replace(temporary, self.path)


async def embed_via_batches(client: openai.AsyncOpenAI, settings: BulkSettings, record: Record,
                            pending: Callable[[set[DocId]], Iterator[list[Document]]],
                            stopped: Callable[[], bool]) -> bool:
    """Wait for the batches an earlier run left, then submit ``pending(saved)``'s documents, ``saved`` being the rows
    those batches gave (in files of lines), and wait for those. False if ``stopped()`` ended it first."""
    submitted = Submitted(settings.output_path)
    saved: set[DocId] = set()

    async def record_earlier(outcome: BatchOutcome) -> None:
        saved.update(doc_id for doc_id, _ in outcome.embedded)
        saved.update(failure.id for failure in outcome.failed)
        await record(outcome)

    if not await _collect(client, submitted, record_earlier, stopped):
        return False
    for documents in pending(saved):
        sendable = [document for document in documents if document.problem is None]
        problems = [Failure(doc.id, doc.problem, line=doc.line) for doc in documents if doc.problem is not None]
        if problems:
            await record(BatchOutcome(failed=problems))
        if sendable:
            submitted.add(await _submit(client, settings, sendable))
        if stopped():
            return False
    return await _collect(client, submitted, record, stopped)


async def _submit(client: openai.AsyncOpenAI, settings: BulkSettings, documents: Sequence[Document]) -> str:
    body: dict[str, Any] = {"model": settings.model, "encoding_format": settings.encoding_format}
    if settings.dimensions is not None:
        body["dimensions"] = settings.dimensions
    lines = b"".join(orjson.dumps({"custom_id": json.dumps(doc.id), "method": "POST", "url": "/v1/embeddings",
                                   "body": {**body, "input": doc.text}}) + b"\n" for doc in documents)
    file = await client.files.create(file=(f"{settings.output_path.name}.jsonl", io.BytesIO(lines)), purpose="batch")
    batch = await client.batches.create(input_file_id=file.id, endpoint="/v1/embeddings", completion_window="24h")
    return batch.id


async def _collect(client: openai.AsyncOpenAI, submitted: Submitted, record: Record,
                   stopped: Callable[[], bool]) -> bool:
    """Save each submitted batch's rows once it has finished; False if ``stopped()`` first."""
    while submitted.ids:
        for batch_id in list(submitted.ids):
            batch = await client.batches.retrieve(batch_id)
            if batch.status in FINISHED:
                await record(await _outcome(client, batch))
                submitted.forget(batch_id)
                for file_id in (batch.input_file_id, batch.output_file_id, batch.error_file_id):
                    if file_id:
                        await client.files.delete(file_id)
        if stopped():
            return False
        if submitted.ids:
            await asyncio.sleep(POLL_S)
    return True


async def _outcome(client: openai.AsyncOpenAI, batch: Any) -> BatchOutcome:
    outcome = BatchOutcome()
    if batch.output_file_id:
        for raw in (await client.files.content(batch.output_file_id)).content.splitlines():
            line = orjson.loads(raw)
            (vector,) = decode_embeddings(line["response"]["body"], 1)
            outcome.embedded.append((_doc_id(line["custom_id"]), vector))
    if batch.error_file_id:
        for raw in (await client.files.content(batch.error_file_id)).content.splitlines():
            line = orjson.loads(raw)
            response, error = line.get("response"), line.get("error")
            status = response["status_code"] if response else None
            message = response["body"]["error"]["message"] if response else error["message"]
            outcome.failed.append(Failure(_doc_id(line["custom_id"]), message, status))
    if batch.status != "completed":
        done = {doc_id for doc_id, _ in outcome.embedded} | {failure.id for failure in outcome.failed}
        message = f"the batch ended {batch.status} before this row was embedded"
        outcome.failed += [Failure(doc_id, message) for doc_id in await _input_ids(client, batch) if doc_id not in done]
    return outcome


async def _input_ids(client: openai.AsyncOpenAI, batch: Any) -> list[DocId]:
    content = (await client.files.content(batch.input_file_id)).content
    return [_doc_id(orjson.loads(raw)["custom_id"]) for raw in content.splitlines() if raw.strip()]


def _doc_id(custom_id: str) -> DocId:
    return json.loads(custom_id)

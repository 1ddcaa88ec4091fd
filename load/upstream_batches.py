"""The simulated provider's Batch API: ``/v1/files`` (upload, content) and ``/v1/batches`` (create, retrieve, list,
cancel) in OpenAI's shapes, for ``/v1/embeddings`` lines.

A batch completes ``batch_delay_s`` after it was created (on the provider's clock), when it is next looked at: it is
``finalizing`` while each line is answered as the real-time route would answer its body, without latency or rate
limits, a few hundred lines a turn of the event loop (the real-time route keeps answering meanwhile, as a provider's
does), and billed apart from real-time calls (``GET /stats``: ``batch``). ``batch_error_rate`` of the lines, spread evenly, fail with a 500
in the error file, as a provider's batch sometimes does; a line whose body is invalid fails with its 400.
"""

from __future__ import annotations

import asyncio
import math
import uuid
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import orjson

if TYPE_CHECKING:
    from load.upstream import SimulatedProvider

ENDPOINT = "/v1/embeddings"
FINAL = ("completed", "failed", "expired", "cancelled")
LINES_PER_TURN = 256
SERVER_ERROR = {"error": {"message": "The server had an error processing this request.", "type": "server_error",
                          "param": None, "code": None}}


@dataclass
class BatchStats:
    """What the provider's Batch API took and billed: every input of a succeeded line is billed once."""

    files: int = 0
    batches: int = 0
    lines: int = 0
    lines_failed: int = 0
    items_billed: int = 0
    tokens_billed: int = 0

    def as_json(self) -> dict[str, int]:
        return dict(self.__dict__)


class BatchNotFound(Exception):
    pass


class SimulatedBatches:
    def __init__(self, provider: SimulatedProvider) -> None:
        self._provider = provider
        self.stats = BatchStats()
        self._files: dict[str, tuple[dict[str, Any], bytes]] = {}
        self._batches: dict[str, dict[str, Any]] = {}
        self._lines_seen = 0  # for spreading batch_error_rate evenly

    def reset_stats(self) -> None:
        self.stats = BatchStats()

    def add_file(self, filename: str, purpose: str, data: bytes) -> dict[str, Any]:
        self.stats.files += 1
        return self._add_file(filename, purpose, data)

    def file(self, file_id: str) -> dict[str, Any]:
        return self._file(file_id)[0]

    def content(self, file_id: str) -> bytes:
        return self._file(file_id)[1]

    def create(self, input_file_id: str, endpoint: str, window: str, metadata: dict[str, str] | None,
               now: float) -> dict[str, Any]:
        self._file(input_file_id)
        self.stats.batches += 1
        batch_id = f"batch_{uuid.uuid4().hex}"
        self._batches[batch_id] = {
            "id": batch_id, "object": "batch", "endpoint": endpoint, "errors": None, "input_file_id": input_file_id,
            "completion_window": window, "status": "in_progress", "output_file_id": None, "error_file_id": None,
            "created_at": int(now), "in_progress_at": int(now), "expires_at": int(now) + 86_400,
            "completed_at": None, "cancelled_at": None, "request_counts": {"total": 0, "completed": 0, "failed": 0},
            "metadata": metadata, "_created": now}
        return self._shown(self._batches[batch_id])

    async def retrieve(self, batch_id: str, now: float) -> dict[str, Any]:
        batch = self._batch(batch_id)
        if batch["status"] == "in_progress" and now - batch["_created"] >= self._provider.config.batch_delay_s:
            batch["status"] = "finalizing"  # whoever looks meanwhile sees it so
            await self._run(batch, now)
        return self._shown(batch)

    def list(self, limit: int) -> list[dict[str, Any]]:
        newest = sorted(self._batches.values(), key=lambda batch: batch["_created"], reverse=True)
        return [self._shown(batch) for batch in newest[:limit]]

    def cancel(self, batch_id: str, now: float) -> dict[str, Any]:
        batch = self._batch(batch_id)
        if batch["status"] not in FINAL:
            batch.update(status="cancelled", cancelled_at=int(now))
        return self._shown(batch)

    async def _run(self, batch: dict[str, Any], now: float) -> None:
        """Answer every line of the batch's input file, into its output and error files (unless it was cancelled
        meanwhile)."""
        output, errors = [], []
        for number, raw in enumerate(self.content(batch["input_file_id"]).splitlines()):
            if number % LINES_PER_TURN == 0:
                await asyncio.sleep(0)
            if not raw.strip():
                continue
            line = orjson.loads(raw)
            self.stats.lines += 1
            request_id = f"req_{uuid.uuid4().hex}"
            if self._fails_this_line():
                status, body, items, tokens = 500, SERVER_ERROR, 0, 0
            else:
                status, body, items, tokens = self._provider.answer_offline(orjson.dumps(line.get("body")))
            if status != 200:
                self.stats.lines_failed += 1
                response = {"status_code": status, "request_id": request_id, "body": body}
                errors.append({"id": f"batch_req_{uuid.uuid4().hex}", "custom_id": line.get("custom_id"),
                               "response": response, "error": None})
                continue
            self.stats.items_billed += items
            self.stats.tokens_billed += tokens
            output.append({"id": f"batch_req_{uuid.uuid4().hex}", "custom_id": line.get("custom_id"),
                           "response": {"status_code": 200, "request_id": request_id, "body": body}, "error": None})
        if batch["status"] != "finalizing":
            return  # cancelled meanwhile
        files = {}
        for kind, written in (("output", output), ("error", errors)):
            if written:
                data = b"".join(orjson.dumps(line) + b"\n" for line in written)
                files[kind] = self._add_file(f"{batch['id']}_{kind}.jsonl", "batch_output", data)["id"]
        batch.update(status="completed", completed_at=int(now), output_file_id=files.get("output"),
                     error_file_id=files.get("error"),
                     request_counts={"total": len(output) + len(errors), "completed": len(output),
                                     "failed": len(errors)})

    def _fails_this_line(self) -> bool:
        k, rate = self._lines_seen, self._provider.config.batch_error_rate
        self._lines_seen += 1
        return rate > 0 and math.floor(k * rate) != math.floor((k - 1) * rate)

    def _add_file(self, filename: str, purpose: str, data: bytes) -> dict[str, Any]:
        file_id = f"file-{uuid.uuid4().hex}"
        record = {"id": file_id, "object": "file", "bytes": len(data), "created_at": 0, "filename": filename,
                  "purpose": purpose, "status": "processed", "status_details": None}
        self._files[file_id] = (record, data)
        return record

    def _file(self, file_id: str) -> tuple[dict[str, Any], bytes]:
        if file_id not in self._files:
            raise BatchNotFound(f"No such File object: {file_id}")
        return self._files[file_id]

    def _batch(self, batch_id: str) -> dict[str, Any]:
        if batch_id not in self._batches:
            raise BatchNotFound(f"No such Batch object: {batch_id}")
        return self._batches[batch_id]

    @staticmethod
    def _shown(batch: dict[str, Any]) -> dict[str, Any]:
        return {key: value for key, value in batch.items() if not key.startswith("_")}

"""``/v1/files`` and ``/v1/batches`` in OpenAI's shapes: what the ``openai`` client's ``files.create``, ``files.list``,
``files.retrieve``, ``files.delete``, ``files.content``, ``batches.create``, ``batches.retrieve``, ``batches.list`` and
``batches.cancel`` send and read. API keys apply as on ``/v1/embeddings``; every refusal is a 4xx in OpenAI's error
shape.

Files and batches are their tenant's, as OpenAI's are their project's: a key sees, reads, deletes and cancels only its
own tenant's (another's is "not found", so not even its id is confirmed), a batch takes only its tenant's files, and
its lines run as that tenant (``runner.py``)."""

from __future__ import annotations

import asyncio
from typing import Any, Callable

import orjson
from fastapi import FastAPI, Request
from fastapi.responses import FileResponse
from starlette.datastructures import UploadFile

from deployments.config import BatchConfig
from deployments.errors import InvalidRequest, PayloadTooLarge, ResourceNotFound
from deployments.ingress.auth import ApiKeys, Tenant
from deployments.ingress.batch.lines import ENDPOINT
from deployments.ingress.batch.runner import ACTIVE, WINDOW_S
from deployments.ingress.batch.store import OWNER, BatchStore, TooLarge, new_id, owner_of

PURPOSE = "batch"  # the one purpose of an uploaded file this service has a use for
MULTIPART_SLACK_BYTES = 64 * 1024  # a multipart body's own bytes beside the file's
MAX_METADATA_PAIRS = 16  # OpenAI's, and its 64-character keys and 512-character values
LIST_LIMIT = 10_000


class BatchRoutes:
    def __init__(self, store: BatchStore, config: BatchConfig, api_keys: ApiKeys, wake: Callable[[], None]) -> None:
        self._store = store
        self._config = config
        self._api_keys = api_keys
        self._wake = wake

    def add_to(self, app: FastAPI) -> None:
        app.add_api_route("/v1/files", self.upload, methods=["POST"])
        app.add_api_route("/v1/files", self.list_files, methods=["GET"])
        app.add_api_route("/v1/files/{file_id}", self.retrieve_file, methods=["GET"])
        app.add_api_route("/v1/files/{file_id}", self.delete_file, methods=["DELETE"])
        app.add_api_route("/v1/files/{file_id}/content", self.file_content, methods=["GET"])
        app.add_api_route("/v1/batches", self.create_batch, methods=["POST"])
        app.add_api_route("/v1/batches", self.list_batches, methods=["GET"])
        app.add_api_route("/v1/batches/{batch_id}", self.retrieve_batch, methods=["GET"])
        app.add_api_route("/v1/batches/{batch_id}/cancel", self.cancel_batch, methods=["POST"])

    # ---- files --------------------------------------------------------------------------------------------------

    async def upload(self, request: Request) -> dict[str, Any]:
        tenant = self._tenant(request)
        limit = self._config.max_file_bytes
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > limit + MULTIPART_SLACK_BYTES:
            raise PayloadTooLarge(f"the file exceeds the {limit}-byte limit", param="file")
        if not request.headers.get("content-type", "").startswith("multipart/form-data"):
            raise InvalidRequest("send the file as multipart/form-data with the fields 'file' and 'purpose'")
        async with request.form(max_files=1, max_fields=8) as form:
            purpose, upload = form.get("purpose"), form.get("file")
            if purpose != PURPOSE:
                raise InvalidRequest(f"'purpose' must be {PURPOSE!r}: this service runs batches only", param="purpose")
            if not isinstance(upload, UploadFile):
                raise InvalidRequest("'file' must be an uploaded file", param="file")
            try:
                # copied and synced to the disk on a thread: a file of many megabytes would hold the event loop
                return _shown(await asyncio.to_thread(self._store.add_file, upload.filename or "upload.jsonl",
                                                      purpose, upload.file, limit, tenant.name))
            except TooLarge:
                raise PayloadTooLarge(f"the file exceeds the {limit}-byte limit", param="file") from None

    async def list_files(self, request: Request) -> dict[str, Any]:
        tenant = self._tenant(request)
        query = request.query_params
        records = [f for f in self._store.files() if query.get("purpose") in (None, f["purpose"]) and _owns(tenant, f)]
        if query.get("order") == "asc":
            records.reverse()
        return _page(records, query.get("after"), _limit(query.get("limit")))

    async def retrieve_file(self, file_id: str, request: Request) -> dict[str, Any]:
        return _shown(self._file(file_id, self._tenant(request)))

    async def delete_file(self, file_id: str, request: Request) -> dict[str, Any]:
        self._file(file_id, self._tenant(request))
        if not await asyncio.to_thread(self._store.delete_file, file_id):  # a batch's output is large to free
            raise _no_file(file_id)
        return {"id": file_id, "object": "file", "deleted": True}

    async def file_content(self, file_id: str, request: Request) -> FileResponse:
        record = self._file(file_id, self._tenant(request))
        path = self._store.file_path(file_id)
        if not path.exists():
            raise _no_file(file_id)
        return FileResponse(path, media_type="application/jsonl", filename=record["filename"])

    def _file(self, file_id: str, tenant: Tenant) -> dict[str, Any]:
        record = self._store.file(file_id)
        if record is None or not _owns(tenant, record):
            raise _no_file(file_id)
        return record

    def _tenant(self, request: Request) -> Tenant:
        return self._api_keys.check(request.headers.get("authorization"))

    # ---- batches ------------------------------------------------------------------------------------------------

    async def create_batch(self, request: Request) -> dict[str, Any]:
        tenant = self._tenant(request)
        try:
            body = orjson.loads(await request.body())
        except orjson.JSONDecodeError:
            raise InvalidRequest("the body is not valid JSON") from None
        if not isinstance(body, dict):
            raise InvalidRequest("the body must be a JSON object")
        if body.get("endpoint") != ENDPOINT:
            raise InvalidRequest(f"'endpoint' must be {ENDPOINT!r}: the one endpoint this service batches",
                                 param="endpoint")
        window = body.get("completion_window")
        if window not in WINDOW_S:
            raise InvalidRequest(f"'completion_window' must be one of {sorted(WINDOW_S)}", param="completion_window")
        input_file = self._store.file(str(body.get("input_file_id")))
        if input_file is None or input_file["purpose"] != PURPOSE or not _owns(tenant, input_file):
            raise InvalidRequest(f"'input_file_id' must name a file uploaded with purpose {PURPOSE!r}",
                                 param="input_file_id")
        now = self._store.now()
        batch = {"id": new_id("batch_"), "object": "batch", "endpoint": ENDPOINT, "errors": None,
                 "input_file_id": input_file["id"], "completion_window": window, "status": "validating",
                 "output_file_id": None, "error_file_id": None, "created_at": now, "in_progress_at": None,
                 "expires_at": now + WINDOW_S[window], "finalizing_at": None, "completed_at": None,
                 "failed_at": None, "expired_at": None, "cancelling_at": None, "cancelled_at": None,
                 "request_counts": {"total": 0, "completed": 0, "failed": 0},
                 "metadata": _metadata(body.get("metadata")), OWNER: tenant.name}
        self._store.save_batch(batch)
        self._wake()
        return _shown(batch)

    async def list_batches(self, request: Request) -> dict[str, Any]:
        tenant = self._tenant(request)
        query = request.query_params
        return _page([batch for batch in self._store.batches() if _owns(tenant, batch)], query.get("after"),
                     _limit(query.get("limit"), default=20))

    async def retrieve_batch(self, batch_id: str, request: Request) -> dict[str, Any]:
        batch = self._store.batch(batch_id)
        if batch is None or not _owns(self._tenant(request), batch):
            raise _no_batch(batch_id)
        return _shown(batch)

    async def cancel_batch(self, batch_id: str, request: Request) -> dict[str, Any]:
        tenant = self._tenant(request)
        batch = self._store.batch(batch_id)
        if batch is None or not _owns(tenant, batch):
            raise _no_batch(batch_id)
        refused: list[str] = []
        now = self._store.now()

        def cancel(batch: dict[str, Any]) -> None:
            if batch["status"] in ("validating", "in_progress"):
                batch.update(status="cancelling", cancelling_at=now)
            elif batch["status"] not in ACTIVE:
                refused.append(batch["status"])

        batch = self._store.update_batch(batch_id, cancel)
        if batch is None:
            raise _no_batch(batch_id)
        if refused:
            raise InvalidRequest(f"the batch is {refused[0]}: only a batch that is running can be cancelled")
        self._wake()
        return _shown(batch)


def _owns(tenant: Tenant, record: dict[str, Any]) -> bool:
    return owner_of(record) == tenant.name


def _shown(record: dict[str, Any]) -> dict[str, Any]:
    """The object as OpenAI shows it: its tenant left out."""
    return {field: value for field, value in record.items() if field != OWNER}


def _page(records: list[dict[str, Any]], after: str | None, limit: int) -> dict[str, Any]:
    """OpenAI's cursor page: the ``limit`` records after the one named ``after``."""
    start = next((i + 1 for i, record in enumerate(records) if record["id"] == after), 0) if after else 0
    page = [_shown(record) for record in records[start:start + limit]]
    return {"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
            "last_id": page[-1]["id"] if page else None, "has_more": start + limit < len(records)}


def _limit(text: str | None, default: int = LIST_LIMIT) -> int:
    if text is None:
        return default
    if not text.isdigit() or not 1 <= int(text) <= LIST_LIMIT:
        raise InvalidRequest(f"'limit' must be a whole number from 1 to {LIST_LIMIT}", param="limit")
    return int(text)


def _metadata(metadata: Any) -> dict[str, str] | None:
    if metadata is None:
        return None
    if not (isinstance(metadata, dict) and len(metadata) <= MAX_METADATA_PAIRS and all(
            isinstance(k, str) and isinstance(v, str) and len(k) <= 64 and len(v) <= 512
            for k, v in metadata.items())):
        raise InvalidRequest(f"'metadata' must map at most {MAX_METADATA_PAIRS} keys (≤ 64 characters) to strings "
                             "(≤ 512 characters)", param="metadata")
    return metadata


def _no_file(file_id: str) -> ResourceNotFound:
    return ResourceNotFound(f"no file {file_id!r}", param="file_id")


def _no_batch(batch_id: str) -> ResourceNotFound:
    return ResourceNotFound(f"no batch {batch_id!r}", param="batch_id")

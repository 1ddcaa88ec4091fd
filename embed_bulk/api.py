"""One batch through the embeddings API with `openai.AsyncOpenAI`, whose own retries (`max_retries`) make it a polite
background client: it waits out 429 (`Retry-After`, `retry-after-ms`) and backs off exponentially, with jitter,
after connection errors, timeouts, 408, 409 and 5xx. What is left when it gives up:

- 400 naming `input[i]` in its `param`: row i fails with the server's message; the other rows are sent again.
- any other 4xx: every row of the batch fails with the server's message.
- retries used up: every row of the batch fails; a rerun tries them again.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx2
import numpy as np
import openai
import orjson

from embed_bulk.documents import DocId, Document
from embed_bulk.settings import BulkSettings
from embeddings_wire import decode_embeddings

_RETRIED_STATUSES = frozenset({408, 409, 429})  # and 5xx: what the SDK retries
_RETRY_COUNT_HEADER = "x-stainless-retry-count"  # the SDK numbers each attempt of a call: 0 first, then 1, 2, ...


@dataclass(frozen=True)
class Failure:
    """A row that failed; `id` None and its input `line` for a line that held no document."""

    id: DocId | None
    message: str
    status: int | None = None
    line: int | None = None


@dataclass
class BatchOutcome:
    embedded: list[tuple[DocId, np.ndarray]] = field(default_factory=list)
    failed: list[Failure] = field(default_factory=list)


@dataclass
class CallCounters:
    """HTTP requests sent (every attempt), the 429 answers among their replies, the attempts that were retries."""

    requests: int = 0
    rate_limited: int = 0
    retries: int = 0
    tokens: int = 0

    async def count_request(self, request: httpx2.Request) -> None:
        self.requests += 1
        if request.headers.get(_RETRY_COUNT_HEADER, "0") != "0":
            self.retries += 1

    async def count_response(self, response: httpx2.Response) -> None:
        if response.status_code == 429:
            self.rate_limited += 1


def make_openai_client(
    settings: BulkSettings, counters: CallCounters, transport: httpx2.AsyncBaseTransport | None = None
) -> openai.AsyncOpenAI:
    timeout = httpx2.Timeout(settings.timeout_s, connect=settings.connect_timeout_s)
    # The SDK's aiohttp transport (unless one is given: tests pass theirs), as the openai backend sends on it.
    http = openai.DefaultAioHttpClient(
        timeout=timeout,
        limits=httpx2.Limits(max_connections=settings.concurrency, max_keepalive_connections=settings.concurrency),
        transport=transport,
        event_hooks={"request": [counters.count_request], "response": [counters.count_response]},
    )
    return openai.AsyncOpenAI(
        base_url=settings.base_url,
        api_key=settings.api_key or "unused",
        default_headers={"X-Priority": settings.priority},
        max_retries=settings.max_retries,
        timeout=timeout,
        http_client=http,
    )


class EmbeddingsClient:
    """Embeds one batch of documents at a time, as the module docstring says."""

    def __init__(self, settings: BulkSettings, client: openai.AsyncOpenAI, counters: CallCounters) -> None:
        self.settings = settings
        self.counters = counters
        self._client = client
        self._options: dict[str, Any] = {"model": settings.model, "encoding_format": settings.encoding_format}
        if settings.dimensions is not None:
            self._options["dimensions"] = settings.dimensions

    async def embed(self, documents: Sequence[Document]) -> BatchOutcome:
        pending, outcome = list(documents), BatchOutcome()
        while pending:
            try:
                body = await self._create(pending)
                vectors = decode_embeddings(body, len(pending))
            except openai.BadRequestError as error:
                if (index := failing_index(error.param, len(pending))) is not None:
                    outcome.failed.append(Failure(pending.pop(index).id, error_message(error), 400))
                    continue
                outcome.failed.extend(_failures(pending, error))
            except (openai.APIStatusError, openai.APIConnectionError) as error:
                outcome.failed.extend(_failures(pending, error))
            except (ValueError, KeyError, TypeError, AttributeError) as error:
                outcome.failed.extend(Failure(doc.id, f"malformed response: {error}") for doc in pending)
            else:
                self.counters.tokens += _tokens(body)
                outcome.embedded.extend((doc.id, vector) for doc, vector in zip(pending, vectors, strict=True))
            pending = []
        return outcome

    async def _create(self, documents: Sequence[Document]) -> Any:
        """The decoded JSON body of one embeddings call: sent with the SDK's retries and errors, read by hand. The
        SDK's `embeddings.create` builds a model object per embedding and walks the input list to transform it,
        which on a cached re-run, where the service answers quickly, makes the client's own CPU the bottleneck.
        orjson reads a body of base64 rows faster than json. The request goes as orjson's bytes too, which the SDK
        sends as they are, cheaper than a body the SDK encodes itself."""
        request = orjson.dumps({"input": [doc.text for doc in documents], **self._options})
        response = await self._client.post("/embeddings", content=request, cast_to=httpx2.Response)
        return orjson.loads(await response.aread())


def _failures(pending: list[Document], error: openai.APIStatusError | openai.APIConnectionError) -> list[Failure]:
    """Every row of a batch the client gave up on: a refusal keeps its status; retries used up say how many."""
    if isinstance(error, openai.APITimeoutError):
        message, status = "timed out", None
    elif isinstance(error, openai.APIConnectionError):
        message, status = f"connection failed ({_cause(error)})", None
    else:
        message, status = f"HTTP {error.status_code}: {error_message(error)}", error.status_code
    if status is None or status in _RETRIED_STATUSES or status >= 500:
        attempts = int(error.request.headers.get(_RETRY_COUNT_HEADER, "0")) + 1
        message, status = f"gave up after {attempts} attempts: {message}", None
    return [Failure(doc.id, message, status) for doc in pending]


def failing_index(param: str | None, count: int) -> int | None:
    """The input an error's `param` names (`"input[3]"`), if it is one of the `count` sent."""
    if param is None or not (param.startswith("input[") and param.endswith("]")):
        return None
    digits = param.removeprefix("input[").removesuffix("]")
    return int(digits) if digits.isdigit() and int(digits) < count else None


def error_message(error: openai.APIError) -> str:
    """The server's own message (`{"error": {"message": ...}}`), not the SDK's wrapping of it."""
    body = error.body
    if isinstance(body, dict) and "message" in body:
        return str(body["message"])
    if isinstance(body, str) and body:
        return body[:500]
    return error.message


def _tokens(body: Any) -> int:
    usage = body.get("usage") or {}
    return int(usage.get("total_tokens") or usage.get("prompt_tokens") or 0)


def _cause(error: openai.APIConnectionError) -> str:
    cause = error.__cause__
    return f"{type(cause).__name__}: {cause}" if cause is not None else error.message

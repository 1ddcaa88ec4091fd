"""One batch through `POST {base_url}/embeddings`, with the retry rules of a polite background client:

- 429: wait `Retry-After` (or a backoff when absent) and send the same batch again; not counted as a failure.
- connection errors, timeouts, 408, 409 and 5xx: exponential backoff with jitter, up to `max_retries` retries.
- 400 naming `input[i]`: row i fails with the server's message; the other rows are sent again.
- any other 4xx: every row of the batch fails with the server's message.
"""

from __future__ import annotations

import base64
import email.utils
import random
import re
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx
import numpy as np

from load.bulk.documents import DocId, Document
from load.bulk.settings import BulkSettings

Sleep = Callable[[float], Awaitable[None]]

# "Invalid 'input[3]': ..." (OpenAI, load.upstream), "input[3]: ..." (this service), "'input.3': ..." (validation)
_FAILING_INDEX = re.compile(r"\binput\[(\d+)\]|\binput(?:\.[^\s'\".]+)*\.(\d+)\b")
_TRANSIENT_STATUSES = frozenset({408, 409})
MIN_RATE_LIMIT_WAIT_S = 0.05  # a 429 with "Retry-After: 0" still does not turn into a busy loop


@dataclass(frozen=True)
class Failure:
    id: DocId
    message: str
    status: int | None = None


@dataclass
class BatchOutcome:
    embedded: list[tuple[DocId, np.ndarray]] = field(default_factory=list)
    failed: list[Failure] = field(default_factory=list)


@dataclass
class CallCounters:
    requests: int = 0
    rate_limited: int = 0
    retries: int = 0
    tokens: int = 0


@dataclass(frozen=True)
class Embedded:
    vectors: np.ndarray
    tokens: int


@dataclass(frozen=True)
class RateLimited:
    wait_s: float | None


@dataclass(frozen=True)
class BadInput:
    index: int
    message: str


@dataclass(frozen=True)
class Transient:
    message: str


@dataclass(frozen=True)
class Rejected:
    status: int
    message: str


Reply = Embedded | RateLimited | BadInput | Transient | Rejected


def make_http_client(settings: BulkSettings, transport: httpx.AsyncBaseTransport | None = None) -> httpx.AsyncClient:
    headers = {"X-Priority": settings.priority}
    if settings.api_key:
        headers["Authorization"] = f"Bearer {settings.api_key}"
    return httpx.AsyncClient(
        base_url=settings.base_url,
        headers=headers,
        timeout=httpx.Timeout(settings.timeout_s, connect=settings.connect_timeout_s),
        limits=httpx.Limits(max_connections=settings.concurrency, max_keepalive_connections=settings.concurrency),
        transport=transport,
    )


class EmbeddingsClient:
    """Embeds one batch of documents at a time, retrying as the module docstring says."""

    def __init__(
        self,
        settings: BulkSettings,
        http: httpx.AsyncClient,
        *,
        sleep: Sleep,
        jitter: Callable[[], float] = random.random,
    ) -> None:
        self.settings = settings
        self.counters = CallCounters()
        self._http = http
        self._sleep = sleep
        self._jitter = jitter

    async def embed(self, documents: Sequence[Document]) -> BatchOutcome:
        pending, outcome, failed_attempts = list(documents), BatchOutcome(), 0
        while pending:
            reply = await self._call([document.text for document in pending])
            match reply:
                case Embedded(vectors, tokens):
                    self.counters.tokens += tokens
                    outcome.embedded.extend((doc.id, vector) for doc, vector in zip(pending, vectors, strict=True))
                    pending = []
                case RateLimited(wait_s):
                    self.counters.rate_limited += 1
                    wait_s = self._backoff_s(failed_attempts + 1) if wait_s is None else wait_s
                    await self._sleep(max(MIN_RATE_LIMIT_WAIT_S, wait_s))
                case BadInput(index, message):
                    outcome.failed.append(Failure(pending.pop(index).id, message, 400))
                case Transient(message) if failed_attempts < self.settings.max_retries:
                    failed_attempts += 1
                    self.counters.retries += 1
                    await self._sleep(self._backoff_s(failed_attempts))
                case Transient(message):
                    gave_up = f"gave up after {failed_attempts + 1} attempts: {message}"
                    outcome.failed.extend(Failure(doc.id, gave_up) for doc in pending)
                    pending = []
                case Rejected(status, message):
                    outcome.failed.extend(Failure(doc.id, message, status) for doc in pending)
                    pending = []
        return outcome

    async def _call(self, texts: list[str]) -> Reply:
        self.counters.requests += 1
        settings = self.settings
        body: dict[str, Any] = {"model": settings.model, "input": texts, "encoding_format": settings.encoding_format}
        if settings.dimensions is not None:
            body["dimensions"] = settings.dimensions
        try:
            response = await self._http.post("embeddings", json=body)
        except httpx.TimeoutException as error:
            return Transient(f"timed out ({type(error).__name__})")
        except httpx.TransportError as error:
            return Transient(f"connection failed ({type(error).__name__}: {error})")
        return classify(response, len(texts))

    def _backoff_s(self, attempt: int) -> float:
        ceiling = min(self.settings.backoff_max_s, self.settings.backoff_base_s * 2 ** (attempt - 1))
        return ceiling * (0.5 + 0.5 * self._jitter())


def classify(response: httpx.Response, count: int) -> Reply:
    """What a response means for a batch of `count` inputs."""
    status = response.status_code
    if status == 200:
        try:
            body = response.json()
            return Embedded(decode_embeddings(body, count), _tokens(body))
        except (ValueError, KeyError, TypeError) as error:
            return Transient(f"malformed response: {error}")
    message = error_message(response)
    if status == 429:
        return RateLimited(retry_after_s(response.headers))
    if status == 400 and (index := failing_index(message, count)) is not None:
        return BadInput(index, message)
    if status in _TRANSIENT_STATUSES or status >= 500:
        return Transient(f"HTTP {status}: {message}")
    return Rejected(status, f"HTTP {status}: {message}")


def decode_embeddings(body: dict[str, Any], count: int) -> np.ndarray:
    """The `[count, d]` float32 matrix of an embeddings response, rows in input order."""
    data = sorted(body["data"], key=lambda item: item["index"])
    if [item["index"] for item in data] != list(range(count)):
        raise ValueError(f"expected embeddings for indexes 0..{count - 1}, got {len(data)} items")
    vectors = [_vector(item["embedding"]) for item in data]
    if len({vector.shape for vector in vectors}) != 1:
        raise ValueError("embeddings of different widths in one response")
    return np.stack(vectors)


def failing_index(message: str, count: int) -> int | None:
    """The input a 400 message names (`input[3]`, `input.3`), if it is one of the `count` sent."""
    match = _FAILING_INDEX.search(message)
    if match is None:
        return None
    index = int(match.group(1) or match.group(2))
    return index if index < count else None


def error_message(response: httpx.Response) -> str:
    try:
        error = response.json()["error"]
        return str(error["message"]) if isinstance(error, dict) else str(error)
    except (ValueError, KeyError, TypeError):
        return response.text[:500] or response.reason_phrase


def retry_after_s(headers: httpx.Headers) -> float | None:
    """Seconds to wait from `retry-after-ms`, or `Retry-After` (seconds or an HTTP date); None when absent."""
    if (milliseconds := _number(headers.get("retry-after-ms"))) is not None:
        return max(0.0, milliseconds / 1000)
    value = headers.get("retry-after")
    if value is None:
        return None
    if (seconds := _number(value)) is not None:
        return max(0.0, seconds)
    try:
        return max(0.0, email.utils.parsedate_to_datetime(value).timestamp() - time.time())
    except (TypeError, ValueError):
        return None


def _vector(embedding: str | list[float]) -> np.ndarray:
    if isinstance(embedding, str):
        return np.frombuffer(base64.b64decode(embedding), dtype="<f4")
    return np.asarray(embedding, dtype=np.float32)


def _tokens(body: dict[str, Any]) -> int:
    usage = body.get("usage") or {}
    return int(usage.get("total_tokens") or usage.get("prompt_tokens") or 0)


def _number(value: str | None) -> float | None:
    try:
        return float(value) if value is not None else None
    except ValueError:
        return None

"""An OpenAI-compatible provider's Batch API, for embeddings: inputs go up as one JSONL file and one batch
(``/v1/files`` with ``purpose=batch``, then ``/v1/batches`` for ``/v1/embeddings`` in the ``24h`` window), and once
the provider says the batch is done its output file gives each input's vector.

Each request line carries up to ``per_line`` inputs, in order; its ``custom_id`` is the line's number. A line the
provider failed (its error file, or a status other than 200) leaves its inputs without a vector: the caller sends
them again. A batch is created under a ``tag`` in its metadata, and ``submit`` first looks for a batch with that tag:
a caller that crashed after the provider took a batch but before it learnt its id gets the same batch, not a second
one billed again.
"""

from __future__ import annotations

import asyncio
import functools
from typing import Any, Awaitable, Callable, Iterable, Iterator, NamedTuple, ParamSpec, Sequence, TypeVar

import numpy as np
import openai
import orjson

from embeddings_wire import decode_embeddings

from deployments.model.backends.base import UpstreamError

TAG_KEY = "relay_tag"
ENDPOINT = "/v1/embeddings"
WINDOW = "24h"
FINAL = ("completed", "failed", "expired", "cancelled")
RECENT_BATCHES = 100  # how far back ``submit`` looks for a batch it created before (the newest come first)


P = ParamSpec("P")
R = TypeVar("R")


def _provider_errors(call: Callable[P, Awaitable[R]]) -> Callable[P, Awaitable[R]]:
    """The provider's failure as an ``UpstreamError`` naming its kind only (OpenAI's messages may quote the key)."""

    @functools.wraps(call)
    async def calling(*args: P.args, **kwargs: P.kwargs) -> R:
        try:
            return await call(*args, **kwargs)
        except openai.APIStatusError as exc:
            raise UpstreamError(f"the provider's Batch API answered {exc.status_code}", status=exc.status_code,
                                retryable=exc.status_code == 429 or exc.status_code >= 500) from None
        except openai.OpenAIError as exc:
            raise UpstreamError(f"the provider's Batch API failed ({type(exc).__name__})", retryable=True) from None

    return calling


class Polled(NamedTuple):
    """A provider batch's status; once it is final (``done``), each input's vector, or None where it has none."""

    status: str
    done: bool
    vectors: list[np.ndarray | None]


class ProviderBatches:
    def __init__(self, client: openai.AsyncOpenAI, upstream_model: str) -> None:
        self._client = client
        self._model = upstream_model

    @_provider_errors
    async def submit(self, tag: str, inputs: Sequence[Any], dimensions: int | None, per_line: int) -> str:
        """The id of the provider batch embedding ``inputs`` (texts or token-id lists), created unless one with this
        ``tag`` exists already."""
        existing = await self._find(tag)
        if existing is not None:
            return existing
        uploaded = await self._client.files.create(
            file=(f"{tag}.jsonl", self._input_file(inputs, dimensions, per_line), "application/jsonl"),
            purpose="batch")
        batch = await self._client.batches.create(input_file_id=uploaded.id, endpoint=ENDPOINT,
                                                  completion_window=WINDOW, metadata={TAG_KEY: tag})
        return batch.id

    @_provider_errors
    async def poll(self, batch_id: str, count: int, per_line: int) -> Polled:
        """The batch's status, with the vectors of its ``count`` inputs once it is final (what an expired or
        cancelled batch finished is kept too)."""
        batch = await self._client.batches.retrieve(batch_id)
        if batch.status not in FINAL:
            return Polled(batch.status, False, [])
        vectors: list[np.ndarray | None] = [None] * count
        if batch.output_file_id:
            # a provider batch's output runs to hundreds of megabytes: it is downloaded a chunk a turn and never joined
            # (a join holds the loop while it copies them all), and read on a thread, the replica's loop serving on
            async with self._client.files.with_streaming_response.content(batch.output_file_id) as response:
                chunks = [chunk async for chunk in response.iter_bytes()]
            await asyncio.to_thread(self._read_output, chunks, vectors, per_line)
        return Polled(batch.status, True, vectors)

    @_provider_errors
    async def cancel(self, batch_id: str) -> None:
        try:
            await self._client.batches.cancel(batch_id)
        except openai.ConflictError:  # finished meanwhile: nothing left to cancel
            pass

    async def _find(self, tag: str) -> str | None:
        page = await self._client.batches.list(limit=RECENT_BATCHES)
        for batch in page.data:
            if (batch.metadata or {}).get(TAG_KEY) == tag and batch.status not in ("failed", "cancelled", "expired"):
                return batch.id
        return None

    def _input_file(self, inputs: Sequence[Any], dimensions: int | None, per_line: int) -> bytes:
        lines = []
        for number, start in enumerate(range(0, len(inputs), per_line)):
            body: dict[str, Any] = {"model": self._model, "input": list(inputs[start:start + per_line]),
                                    "encoding_format": "base64"}
            if dimensions is not None:
                body["dimensions"] = dimensions
            lines.append(orjson.dumps({"custom_id": str(number), "method": "POST", "url": ENDPOINT, "body": body}))
        return b"\n".join(lines) + b"\n"

    @staticmethod
    def _read_output(chunks: Iterable[bytes], vectors: list[np.ndarray | None], per_line: int) -> None:
        """Each output line's vectors (the file in ``chunks``) into their inputs' places; a line that is not a
        success leaves them None."""
        for raw in _lines(chunks):
            if raw.strip():
                ProviderBatches._read_line(raw, vectors, per_line)

    @staticmethod
    def _read_line(raw: bytes, vectors: list[np.ndarray | None], per_line: int) -> None:
        try:
            line = orjson.loads(raw)
            start = int(line["custom_id"]) * per_line
            response = line["response"]
            if response is None or response["status_code"] != 200:
                return
            expected = min(per_line, len(vectors) - start)
            matrix = decode_embeddings(response["body"], expected)
        except (ValueError, KeyError, TypeError, IndexError):  # a line not in the provider's shape embeds nothing
            return
        vectors[start:start + expected] = list(matrix)


def _lines(chunks: Iterable[bytes]) -> Iterator[bytes]:
    """The lines of the file whose content is ``chunks`` in order (a line may span several), without their ends."""
    pending = bytearray()
    for chunk in chunks:
        pending += chunk
        end = pending.rfind(b"\n")
        if end >= 0:
            yield from bytes(pending[:end]).split(b"\n")
            del pending[:end + 1]
    if pending:
        yield bytes(pending)

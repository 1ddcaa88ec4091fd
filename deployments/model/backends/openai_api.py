"""Any OpenAI-compatible embeddings API, through ``openai.AsyncOpenAI`` with the SDK's own retries off.

The batcher retries per item, so this backend only classifies what went wrong:
- a 400/413/422 that fails the call is raised: the batcher splits the batch until the input at fault fails alone;
- a 429 fails every item in place as retryable, with the upstream's ``retry-after-ms`` / ``Retry-After`` delay;
- a 5xx, timeout or connection error fails every item in place as retryable;
- anything else (401, 403, 404, a malformed response) fails every item in place for good.
The upstream key never appears in an error: a 401/403 is reported without the upstream's message (OpenAI's echoes
part of the key), and the key is masked in every other message.
Token ids are passed on as they are; token counts come from the upstream model's encoding (cl100k_base or o200k_base).

Calls go through the SDK (its errors, timeouts and headers) on its aiohttp transport, and the answer is read as JSON:
``embeddings.create`` on the default httpx transport builds a model object per embedding and does its I/O through
httpcore, CPU the replica's event loop spends on every call for nothing it needs.
"""

from __future__ import annotations

import asyncio
import email.utils
import os
import time
from typing import Any, Callable, Hashable, Mapping, Sequence

import httpx
import httpx2
import numpy as np
import openai
import orjson

from embeddings_wire import decode_embeddings

from deployments.model import tokens
from deployments.model.backends.base import EmbeddingBackend, Item, ItemRejected, Prepared, UpstreamError
from deployments.model.backends.provider_batches import ProviderBatches
from deployments.secrets import read_secret

DEFAULT_RETRY_AFTER_S = 1.0  # a 429 that does not say how long to wait
# Inputs of a request longer than this in all (characters, or ids) are counted on a worker thread. Counting up to it
# inline holds the event loop only briefly, while on a thread each of a bulk request's 256 counts gives the GIL up and
# must win it back from the busy loop, so a bulk request's many short inputs are cheaper inline and only a long input,
# which would hold the loop for long, goes to a thread.
INLINE_PREPARE_SIZE = 64_000
_REJECTING_STATUSES = frozenset({400, 413, 422})
_CREDENTIAL_STATUSES = frozenset({401, 403})


class OpenAIBackend(EmbeddingBackend):
    def __init__(
        self,
        *,
        base_url: str,
        upstream_model: str,
        api_key_env: str | None = None,
        timeout_s: float = 30.0,
        http_client: httpx.AsyncClient | None = None,
    ) -> None:
        """``http_client``: what the ``openai`` client sends its requests through (by default the SDK's aiohttp one)."""
        api_key = read_secret(api_key_env, os.environ) if api_key_env else ""
        self._api_key = api_key
        self._client = openai.AsyncOpenAI(
            base_url=base_url, api_key=api_key or "unused", max_retries=0, timeout=timeout_s,
            http_client=http_client or openai.DefaultAioHttpClient(),
        )
        self._model = upstream_model
        self._encoding = tokens.encoding_name_for_model(upstream_model)
        tokens.get_encoding(self._encoding)  # load the table now, not on the first request
        self._dimension: int | None = None
        # Calls the service gave up on (timed out, cancelled, connection lost) once sent, or maybe sent: the upstream
        # may still have embedded, and billed, their items. Items retried after that may be billed twice.
        self.abandoned_calls = 0
        self.abandoned_items = 0
        # Told of every answer the upstream gave: its headers, and a 429's delay (None for other answers), so the
        # quota (deployments/model/quota/) follows the provider's account.
        self.on_response: Callable[[Mapping[str, str], float | None], None] | None = None

    @property
    def dimension(self) -> int | None:
        return self._dimension

    def supports_dimensions(self, dimensions: int) -> bool:
        return dimensions > 0  # the upstream decides; a refusal comes back as a 400 for the input

    async def prepare_many(self, items: Sequence[Item], prompt: str = "",
                           background: bool = False) -> list[Prepared | BaseException]:
        """The text as it is, or the ids as a tuple, each costing its tokens in the upstream model's encoding. An
        upstream API has no prompts here (``prompts`` names none), so ``prompt`` is always empty."""
        if sum(len(item) for item in items) <= INLINE_PREPARE_SIZE:
            return self._prepare_all(items)
        return await asyncio.to_thread(self._prepare_all, items)

    def _prepare_all(self, items: Sequence[Item]) -> list[Prepared | BaseException]:
        prepared: list[Prepared | BaseException] = []
        for item in items:
            try:
                prepared.append(self._prepare(item))
            except ItemRejected as exc:
                prepared.append(exc)
        return prepared

    def _prepare(self, item: Item) -> Prepared:
        if isinstance(item, str):
            return Prepared(item, tokens.count(item, self._encoding))
        # Ids outside the vocabulary are the caller's error: refuse them here, alone, rather than send them and
        # have the upstream fail (or crash on) the whole call, and with it every other input of the batch.
        largest = tokens.get_encoding(self._encoding).max_token_value
        for position, token in enumerate(item):
            if not 0 <= token <= largest:
                raise ItemRejected(f"token {position} ({token}) is not a {self._encoding} token id")
        return Prepared(tuple(item), len(item))

    async def embed(
        self, contents: Sequence[Hashable], dimensions: int | None = None, background: bool = False
    ) -> Sequence[np.ndarray | BaseException]:
        items = [content if isinstance(content, str) else list(content) for content in contents]  # type: ignore
        request: dict[str, Any] = {
            "model": self._model,
            "input": items,
            "encoding_format": "base64",
        }
        if dimensions is not None:
            request["dimensions"] = dimensions
        try:
            response = await self._client.post("/embeddings", body=request, cast_to=httpx2.Response)
        except openai.APIStatusError as exc:
            error = _status_error(exc, self._mask)
            self._answered(exc.response.headers, error.retry_after_s if exc.status_code == 429 else None)
            if exc.status_code in _REJECTING_STATUSES:
                raise ItemRejected(f"the upstream refused the input: {self._mask(_upstream_message(exc))}") from None
            return [error for _ in items]
        except openai.APIConnectionError as exc:  # includes APITimeoutError
            self._abandoned(len(items))
            return [UpstreamError(f"upstream unreachable: {self._mask(str(exc))}", retryable=True) for _ in items]
        except asyncio.CancelledError:  # the batch timed out, or every caller gave up
            self._abandoned(len(items))
            raise
        self._answered(response.headers, None)
        return self._vectors(response.content, len(items))

    def provider_batches(self) -> ProviderBatches:
        """The upstream's Batch API, through this backend's client (its URL, key and transport)."""
        return ProviderBatches(self._client, self._model)

    def _answered(self, headers: Mapping[str, str], refused_for_s: float | None) -> None:
        if self.on_response is not None:
            self.on_response(headers, refused_for_s)

    def _abandoned(self, items: int) -> None:
        self.abandoned_calls += 1
        self.abandoned_items += items

    def _mask(self, message: str) -> str:
        return message.replace(self._api_key, "***") if self._api_key else message

    def stats(self) -> dict[str, int]:
        return {"abandoned_calls": self.abandoned_calls, "abandoned_items": self.abandoned_items}

    def _vectors(self, body: bytes, expected: int) -> list[np.ndarray | BaseException]:
        try:
            matrix = decode_embeddings(orjson.loads(body), expected)
        except (ValueError, KeyError, TypeError) as exc:  # orjson's JSONDecodeError is a ValueError
            error = f"the upstream's answer is not one embedding per input: {exc}"
            return [UpstreamError(error) for _ in range(expected)]
        if self._dimension is None:
            self._dimension = int(matrix.shape[1])
        return list(matrix)

    async def aclose(self) -> None:
        await self._client.close()


def _status_error(exc: openai.APIStatusError, mask: Callable[[str], str]) -> UpstreamError:
    status = exc.status_code
    if status in _CREDENTIAL_STATUSES:  # OpenAI's message quotes part of the key: say what happened, not that
        return UpstreamError(f"upstream answered {status}: it refused the service's upstream API key", status=status)
    message = f"upstream answered {status}: {mask(_upstream_message(exc))}"
    if status == 429:
        delay = retry_after_s(exc.response.headers) or DEFAULT_RETRY_AFTER_S
        return UpstreamError(message, status=status, retryable=True, retry_after_s=delay)
    if status >= 500 or status == 408:
        return UpstreamError(message, status=status, retryable=True, retry_after_s=retry_after_s(exc.response.headers))
    return UpstreamError(message, status=status)


def _upstream_message(exc: openai.APIStatusError) -> str:
    body = exc.body
    if isinstance(body, Mapping):
        error = body.get("error", body)
        if isinstance(error, Mapping) and error.get("message"):
            return str(error["message"])
    return exc.message


def retry_after_s(headers: Mapping[str, str]) -> float | None:
    """The delay an upstream asked for: ``retry-after-ms`` (OpenAI's), else ``Retry-After`` in seconds or as a date."""
    millis = headers.get("retry-after-ms")
    if millis is not None:
        try:
            return max(0.0, float(millis) / 1000.0)
        except ValueError:
            pass
    value = headers.get("retry-after")
    if value is None:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    return max(0.0, when.timestamp() - time.time())

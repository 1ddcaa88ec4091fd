"""``EmbeddingModel``: one model behind one ``AdaptiveBatcher`` per output size, what each replica of the model's
Ray Serve deployment runs (``deployments.app`` makes the class a deployment; tests build it as it is).

Every input of a request is one item in the shared queue, so a request's inputs ride with other requests' inputs,
and a failing input fails alone. Handle callers get ``(vectors float32 [n, d], token_counts)`` or a
``deployments.errors.ServiceError`` naming the input at fault.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, AsyncIterator, Awaitable, Callable, Sequence

import numpy as np

from batching import BatcherClosed, BatcherMetrics, BatcherStats, DeadlineExceeded, NeverFits, Overloaded, Priority

from deployments.autoscaling import QUEUE_DEPTH_METRIC
from deployments.config import ModelConfig
from deployments.errors import (InvalidRequest, ModelOverloaded, RequestTimedOut, ServiceError, ServiceUnavailable,
                                UpstreamFailed, UpstreamRateLimited)
from deployments.garbage_collection import collect_less_often
from deployments.model.backends import EmbeddingBackend, ItemRejected, Prepared, UpstreamError, make_backend
from deployments.model.backends.prompts import UnknownPrompt
from deployments.model.batched import BatchedBackend
from deployments.model.cache import CacheMetrics, make_cache
from deployments.model.metrics import RayServeMetrics
from deployments.model.quota import make_pacer
from deployments.model.quota.metrics import RayQuotaMetrics
from deployments.model.relay import ProviderRelay
from deployments.model.stage import EmbeddingStage
from deployments.usage import ModelUsage, RayTenantUsage, RayUsageLedger, TenantUsage
from deployments.wire import Deadline, EmbedRequest

logger = logging.getLogger("ray.serve")

UPSTREAM_RETRY_AFTER_S = 1.0  # for an upstream 429 that does not say when to come back


Embeddings = tuple[np.ndarray, list[int]]  # float32 vectors [n, d] and each input's token count


class EmbeddingModel:
    def __init__(
        self, model: ModelConfig, *, backend: EmbeddingBackend | None = None, metrics: BatcherMetrics | None = None,
        cache_metrics: CacheMetrics | None = None, clock: Callable[[], float] = time.monotonic,
        usage: TenantUsage | None = None,
    ) -> None:
        """``backend``, ``metrics`` and ``cache_metrics`` default to what the model entry names and Ray Serve sinks;
        ``clock`` is the quota's, the event loop's (``time.monotonic``, or a test's controlled clock). ``usage``
        counts each tenant's tokens answered from the cache and billed upstream (default: to Ray Serve's metrics and
        the application's ledger where ``metrics`` is, else nowhere)."""
        collect_less_often()
        self._model = model
        self._backend = backend if backend is not None else make_backend(model)
        # an upstream model's calls claim the provider's quota first (deployments/model/quota/); its answers update it
        pacer = make_pacer(model, RayQuotaMetrics() if metrics is None else None, clock)
        if pacer is not None:
            self._backend.on_response = pacer.observe
        self._costs = costs = ModelUsage(model.name, _usage_maker(usage, in_serve=metrics is None))
        # the path runs one way: the cache (if any) answers what it holds and passes the rest to the batchers
        self._batched = BatchedBackend(model.name, self._backend, model.batcher,
                                       metrics if metrics is not None else RayServeMetrics(), pacer, costs)
        self._cache = make_cache(model, self._batched, cache_metrics, costs)
        self._first_stage: EmbeddingStage = self._cache if self._cache is not None else self._batched
        self._relay = self._provider_relay(costs)
        self._closing = False

    async def embed(
        self,
        texts: Sequence[str] | Sequence[Sequence[int]],
        priority: Priority | str = Priority.HIGH,
        timeout_s: float | None = None,
        dimensions: int | None = None,
        prompt_name: str | None = None,
        input_type: str | None = None,
    ) -> Embeddings:
        """The vectors of ``texts`` in order, or a ``ServiceError`` naming the input at fault. ``prompt_name`` or
        ``input_type`` choose the model's prompt (neither: its default)."""
        return await self._embed(EmbedRequest(texts, priority, timeout_s, dimensions, prompt_name, input_type))

    async def embed_many(
        self, requests: Sequence[EmbedRequest]
    ) -> AsyncIterator[list[tuple[int, Embeddings | BaseException]]]:
        """Several requests in one call (the ingress forwards those that reach it together), streamed back: each is
        served as if it came alone, with its own priority and deadline, and its ``(index, outcome)`` is yielded as
        soon as it is done (those done together in one list), so a quick answer never waits for a slow neighbour.
        Failures are yielded, not raised, so one bad request neither fails the others nor fills the replica's log."""
        tasks = [asyncio.ensure_future(self._embed(request)) for request in requests]
        index = {task: i for i, task in enumerate(tasks)}
        pending = set(tasks)
        try:
            while pending:
                done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                yield [(index[task], task.exception() or task.result()) for task in done]
        finally:
            for task in pending:
                task.cancel()

    # ---- a Batch API batch relayed to the provider's (deployments/model/relay.py; the ingress's runner calls) ---------

    async def relay_uncached(self, inputs: Sequence[Any], dimensions: int | None = None) -> list[int]:
        """The indexes of ``inputs`` the cache lacks and the provider can embed."""
        try:
            key = self._output_size(dimensions)
        except InvalidRequest:
            return []  # every line asking for this size fails as its request would
        return await self._relaying().uncached(inputs, dimensions, key)

    async def relay_submit(self, tag: str, inputs: Sequence[Any], dimensions: int | None, per_line: int) -> str:
        """The id of the provider batch embedding ``inputs`` (the one already made under ``tag``, if any)."""
        return await self._relaying().submit(tag, inputs, dimensions, per_line)

    async def relay_collect(self, batch_id: str, inputs: Sequence[Any], dimensions: int | None,
                            per_line: int, tenant: str | None = None) -> tuple[str, bool, int]:
        """The provider batch's status, whether it is final, and how many of ``inputs`` it embedded (then cached,
        and billed to ``tenant``)."""
        return await self._relaying().collect(batch_id, inputs, dimensions, self._output_size(dimensions), per_line,
                                              tenant)

    async def relay_cancel(self, batch_id: str) -> None:
        await self._relaying().cancel(batch_id)

    async def stats(self) -> dict[str, BatcherStats]:
        """Each batcher's counters, by batcher name."""
        return self._batched.stats()

    async def backend_stats(self) -> dict[str, int]:
        """The backend's own counters (the ``openai`` backend: calls it gave up on, which may still be billed)."""
        stats = getattr(self._backend, "stats", None)
        return dict(stats()) if callable(stats) else {}

    async def cache_written(self) -> None:
        """Return once every vector this replica computed so far is in its cache's store (or its write was given
        up): a write-back lands after its request was answered."""
        if self._cache is not None:
            await self._cache.written()

    async def record_autoscaling_stats(self) -> dict[str, float]:
        """Read by Serve every few seconds and handed to the autoscaling policy."""
        snapshots = self._batched.stats().values()
        return {
            QUEUE_DEPTH_METRIC: float(sum(s.queue_depth + s.delayed for s in snapshots)),
            "in_flight_batches": float(sum(s.in_flight_batches for s in snapshots)),
        }

    async def aclose(self) -> None:
        """Stop taking inputs, send every queued one and wait for it, then release the backend."""
        if self._closing:
            return
        self._closing = True
        await self._batched.aclose()
        if self._cache is not None:
            await self._cache.aclose()
        await self._backend.aclose()
        await self._costs.aclose()

    def __del__(self) -> Awaitable[None] | None:
        """Serve calls ``__del__`` on replica shutdown (after it stopped routing requests here) and awaits the
        coroutine it returns: the queued inputs are drained. The garbage collector calls it too, with no running
        event loop; there is then nothing to drain into, and nothing is returned."""
        if getattr(self, "_closing", True):  # closed already, or __init__ never finished
            return None
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            return None
        return self.aclose()

    # ---- internals ----------------------------------------------------------------------------------------

    async def _embed(self, request: EmbedRequest) -> Embeddings:
        texts, timeout_s = request.inputs, request.timeout_s
        try:
            level = Priority.parse(request.priority)
        except ValueError as exc:
            raise InvalidRequest(str(exc), param="priority") from None
        if timeout_s is not None and not timeout_s > 0:
            raise InvalidRequest("the timeout must be a positive number of seconds", param="timeout_s")
        deadline = Deadline.of(timeout_s)  # on arrival: preparing the inputs takes part of it
        if not texts:
            raise InvalidRequest("there is nothing to embed", param="input")
        dimensions = self._output_size(request.dimensions)
        prompt = self._prompt(request)
        prepared = self._within_token_limit(await self._backend.prepare_many(texts, prompt, level is Priority.LOW))
        self._raise_first_failure(prepared)
        if deadline is not None and deadline.remaining() <= 0:
            raise RequestTimedOut("the request timed out before it was embedded")
        try:
            if request.cached_only:
                outcomes = await self._cached(prepared, dimensions)
            else:
                outcomes = await self._first_stage.embed(prepared, dimensions=dimensions, priority=level,
                                                         deadline=deadline, share=request.share)
        except Overloaded as exc:
            raise ModelOverloaded(f"model {self._model.name!r} is overloaded; retry later",
                                  retry_after_s=exc.retry_after_s) from None
        except BatcherClosed:
            raise ServiceUnavailable(f"model {self._model.name!r} is shutting down; retry") from None
        except NeverFits as exc:
            raise InvalidRequest(str(exc), param="input") from None
        self._raise_first_failure(outcomes)
        return np.stack(outcomes).astype(np.float32, copy=False), [item.tokens for item in prepared]

    async def _cached(self, prepared: Sequence[Prepared], dimensions: int | None) -> list[Any]:
        if self._cache is None:
            raise InvalidRequest(f"model {self._model.name!r} has no cache to answer from", param="model")
        return await self._cache.cached(prepared, dimensions=dimensions)

    def _provider_relay(self, usage: ModelUsage) -> ProviderRelay | None:
        """What relays Batch API work to the provider's Batch API, if the entry says so."""
        provider_batches = getattr(self._backend, "provider_batches", None)
        if self._model.provider_batches is None or self._cache is None or provider_batches is None:
            return None
        return ProviderRelay(provider_batches(), self._cache, self._prepare_to_relay, usage)

    def _relaying(self) -> ProviderRelay:
        if self._relay is None:
            raise InvalidRequest(f"model {self._model.name!r} does not relay batches to its provider", param="model")
        return self._relay

    async def _prepare_to_relay(self, inputs: Sequence[Any]) -> list[Prepared | BaseException]:
        return self._within_token_limit(await self._backend.prepare_many(inputs, "", True))

    def _output_size(self, dimensions: int | None) -> int | None:
        """The batcher key: None for the model's own size, so asking for it explicitly shares that batcher."""
        if dimensions is None or dimensions == self._backend.dimension:
            return None
        valid = isinstance(dimensions, int) and not isinstance(dimensions, bool) and dimensions >= 1
        if not valid or not self._backend.supports_dimensions(dimensions):
            native = self._backend.dimension
            hint = f"omit it or send {native}" if native else "send a positive integer"
            raise InvalidRequest(
                f"model {self._model.name!r} cannot return {dimensions!r}-dimensional embeddings; {hint}",
                param="dimensions",
            )
        return dimensions

    def _prompt(self, request: EmbedRequest) -> str:
        """The prompt's text, the same for every input of the request; applied before batching, so inputs of any
        prompts share batches (and the cache keys each by its ids, the prompt's included)."""
        try:
            return self._backend.prompts.choose(request.prompt_name, request.input_type)
        except UnknownPrompt as exc:
            param = "prompt_name" if request.prompt_name is not None else "input_type"
            raise InvalidRequest(f"model {self._model.name!r}: {exc}", param=param) from None

    def _within_token_limit(self, prepared: Sequence[Prepared | BaseException]) -> list[Prepared | BaseException]:
        """An input longer than ``max_input_tokens`` fails alone, before it costs an upstream call."""
        limit = self._model.max_input_tokens
        if limit is None:
            return list(prepared)
        return [
            ItemRejected(f"the input holds {item.tokens} tokens; this model takes at most {limit}")
            if isinstance(item, Prepared) and item.tokens > limit else item
            for item in prepared
        ]

    def _raise_first_failure(self, outcomes: Sequence[Any]) -> None:
        failures = [(i, outcome) for i, outcome in enumerate(outcomes) if isinstance(outcome, BaseException)]
        if not failures:
            return
        index, error = failures[0]
        more = f" ({len(failures) - 1} more input(s) failed too)" if len(failures) > 1 else ""
        raise _service_error(error, index, more, self._model.name) from None


def _usage_maker(usage: TenantUsage | None, in_serve: bool) -> Callable[[], TenantUsage]:
    """What makes the replica's tenants' usage: ``usage``; else Ray Serve's metrics and the application's ledger where
    the other sinks are Ray Serve's, or a count that goes nowhere."""
    if usage is not None:
        return lambda: usage
    return (lambda: RayTenantUsage(RayUsageLedger())) if in_serve else TenantUsage


def _service_error(error: BaseException, index: int, more: str, model: str) -> ServiceError:
    where = f"input[{index}]"
    if isinstance(error, ServiceError):
        return error
    if isinstance(error, ItemRejected):
        return InvalidRequest(f"{where}: {error}{more}", param="input", index=index)
    if isinstance(error, DeadlineExceeded):
        return RequestTimedOut(f"{where}: the request timed out before it was embedded{more}", index=index)
    if isinstance(error, BatcherClosed):
        return ServiceUnavailable(f"model {model!r} is shutting down; retry{more}", index=index)
    if isinstance(error, UpstreamError) and error.status == 429:
        return UpstreamRateLimited(f"{where}: the upstream is rate-limiting this service: {error}{more}", index=index,
                                   retry_after_s=error.retry_after_s or UPSTREAM_RETRY_AFTER_S)
    if isinstance(error, (UpstreamError, ConnectionError, TimeoutError)):
        return UpstreamFailed(f"{where}: the upstream model failed: {error}{more}", index=index)
    logger.error("model %r failed on %s", model, where, exc_info=error)
    return ServiceError(f"{where}: the model failed ({type(error).__name__}){more}", index=index)



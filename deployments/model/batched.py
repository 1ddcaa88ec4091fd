"""The last stage of a model's path: its inputs batched into the backend's calls, one ``AdaptiveBatcher`` per
output size, each call paced by the provider's quota for an upstream model (``deployments.model.quota``), and what
the provider was paid for each tenant's inputs counted from the calls that succeeded."""

from __future__ import annotations

import asyncio
from typing import Awaitable, Sequence

import numpy as np

from batching import (AdaptiveBatcher, BatcherClosed, BatcherConfig, BatcherMetrics, BatcherStats, Priority,
                      batch_priority)
from deployments.model.backends import EmbeddingBackend, Prepared
from deployments.model.quota import PacedInput, QuotaPacer
from deployments.model.stage import Outcome
from deployments.usage import ModelUsage
from deployments.wire import Deadline, Share


def _token_cost(payload: Prepared) -> float:
    return payload.tokens


def _bill(usage: ModelUsage, payloads: Sequence[PacedInput], outcomes: Sequence[Outcome]) -> None:
    """Each tenant's tokens of the call's inputs that came back (the provider bills a call that succeeded)."""
    billed: dict[str, int] = {}
    for payload, outcome in zip(payloads, outcomes):
        if payload.tenant is not None and isinstance(outcome, np.ndarray):
            billed[payload.tenant] = billed.get(payload.tenant, 0) + payload.tokens
    for tenant, tokens in billed.items():
        usage.billed(tenant, tokens)


class BatchedBackend:
    def __init__(self, name: str, backend: EmbeddingBackend, config: BatcherConfig, metrics: BatcherMetrics,
                 pacer: QuotaPacer | None = None, usage: ModelUsage | None = None) -> None:
        """``usage``: where a tenant's billed tokens are counted (an upstream model's: those of its paced calls)."""
        self._name = name
        self._backend = backend
        self._config = config
        self._metrics = metrics
        self._pacer = pacer
        self._usage = usage
        self._batchers: dict[int | None, AdaptiveBatcher[Prepared, np.ndarray]] = {}
        self._closed = False

    async def embed(self, prepared: Sequence[Prepared], *, dimensions: int | None, priority: Priority,
                    deadline: Deadline | None, share: Share | None = None) -> list[Outcome]:
        batcher = self._batcher(dimensions)
        items: Sequence[Prepared] = prepared
        if self._pacer is not None:  # its batch's claim needs the priority and deadlines
            tenant = None if share is None else share.key
            items = [PacedInput(item.content, item.tokens, priority, deadline, tenant) for item in prepared]
        key, weight = share if share is not None else (None, 1.0)
        return await batcher.submit_many(items, priority=priority, timeout_s=Deadline.seconds_left(deadline),
                                         return_exceptions=True, key=key, weight=weight)

    def stats(self) -> dict[str, BatcherStats]:
        """Each batcher's counters, by batcher name."""
        return {batcher.name: batcher.stats() for batcher in self._batchers.values()}

    async def aclose(self) -> None:
        """Take no more inputs; send every queued one and wait for it."""
        self._closed = True
        await asyncio.gather(*(batcher.aclose(drain=True) for batcher in self._batchers.values()))

    def _batcher(self, dimensions: int | None) -> AdaptiveBatcher[Prepared, np.ndarray]:
        """The batcher of one output size (None: the model's own), made on its first request."""
        if self._closed:
            raise BatcherClosed(f"model {self._name!r} is shutting down")
        batcher = self._batchers.get(dimensions)
        if batcher is None:
            backend, pacer, usage = self._backend, self._pacer, self._usage

            async def process(payloads: list[Prepared]) -> Sequence[np.ndarray | BaseException]:
                def send() -> Awaitable[Sequence[np.ndarray | BaseException]]:
                    return backend.embed([payload.content for payload in payloads], dimensions,
                                         background=batch_priority() is Priority.LOW)

                if pacer is None:
                    return await send()
                outcomes = await pacer.paced(payloads, send)
                if usage is not None:
                    _bill(usage, payloads, outcomes)
                return outcomes

            size = dimensions or backend.dimension or "default"
            batcher = AdaptiveBatcher(process, self._config, cost_fn=_token_cost, metrics=self._metrics,
                                      name=f"{self._name}/d={size}")
            self._batchers[dimensions] = batcher
        return batcher

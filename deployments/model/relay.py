"""A model replica's side of a Batch API batch relayed to the provider's own Batch API (the ingress's
``deployments/ingress/batch/relay.py`` drives it, and keeps its state): which inputs the cache lacks, a provider
batch for them, and once the provider is done, its vectors into the cache, from which the batch's lines are then
answered. Nothing here sends a real-time call.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Awaitable, Callable, Sequence

import numpy as np

from deployments.errors import UpstreamFailed
from deployments.model.backends import Prepared, UpstreamError
from deployments.model.cache.front import EmbeddingCache
from deployments.usage import ModelUsage

if TYPE_CHECKING:  # the openai backend's, imported only where it is used
    from deployments.model.backends.provider_batches import ProviderBatches

Prepare = Callable[[Sequence[Any]], Awaitable[list[Prepared | BaseException]]]


class ProviderRelay:
    def __init__(self, batches: ProviderBatches, cache: EmbeddingCache, prepare: Prepare,
                 usage: ModelUsage | None = None) -> None:
        """``prepare``: the model's inputs made ready as a request's are (token limit included), a failure in place
        of each input that cannot be embedded. ``usage``: where the tokens a provider batch embedded are billed to
        its tenant."""
        self._batches = batches
        self._cache = cache
        self._prepare = prepare
        self._usage = usage

    async def uncached(self, inputs: Sequence[Any], dimensions: int | None, key: int | None) -> list[int]:
        """The indexes of the inputs the cache lacks and the provider can embed (one that fails as a request's input
        would is left to fail so, from its line). ``key``: the cache's name for ``dimensions``."""
        prepared = await self._prepare(inputs)
        valid = [(index, item) for index, item in enumerate(prepared) if isinstance(item, Prepared)]
        held = await self._cache.cached([item for _, item in valid], dimensions=key)
        return [index for (index, _), outcome in zip(valid, held) if not isinstance(outcome, np.ndarray)]

    async def submit(self, tag: str, inputs: Sequence[Any], dimensions: int | None, per_line: int) -> str:
        return await _provider_call(self._batches.submit(tag, inputs, dimensions, per_line))

    async def collect(self, batch_id: str, inputs: Sequence[Any], dimensions: int | None, key: int | None,
                      per_line: int, tenant: str | None = None) -> tuple[str, bool, int]:
        """The provider batch's status, whether it is final, and how many inputs it embedded: once it is final
        their vectors are in the cache (written before this returns), and their tokens billed to ``tenant``."""
        polled = await _provider_call(self._batches.poll(batch_id, len(inputs), per_line))
        if not polled.done:
            return polled.status, False, 0
        prepared = await self._prepare(inputs)
        vectors = {item: vector for item, vector in zip(prepared, polled.vectors)
                   if isinstance(item, Prepared) and vector is not None}
        await self._cache.put(vectors, dimensions=key)
        if tenant is not None and self._usage is not None:
            self._usage.billed(tenant, sum(item.tokens for item in vectors))
        return polled.status, True, len(vectors)

    async def cancel(self, batch_id: str) -> None:
        await _provider_call(self._batches.cancel(batch_id))


async def _provider_call(call: Awaitable[Any]) -> Any:
    try:
        return await call
    except UpstreamError as exc:
        raise UpstreamFailed(str(exc)) from None

"""Batching strategies compared by the benchmarks, each an "embed one text" call over one shared batch function.

A strategy is built over ``embed_batch(texts) -> vectors`` (one upstream call) and turns it into
``embed(text) -> vector``: no batching, static batching (the article's N items or T ms), Ray Serve's
``@serve.batch``, the article's batcher (``load.article_batcher``) and our ``AdaptiveBatcher`` with its variants.
Every batching strategy gets the same ``max_concurrent_batches``, except the article's, which has no such limit.
"""

from __future__ import annotations

import dataclasses
from contextlib import ExitStack
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable, Protocol

from batching import AdaptiveBatcher, BatcherConfig, FixedWait, WaitPolicy
from load.article_batcher import ArticleBatcher
from load.serve_batch import close_serve_batched, serve_batch_outside_replica, serve_batched

EmbedBatch = Callable[[list[str]], Awaitable[list[Any]]]
EmbedOne = Callable[[str], Awaitable[Any]]


class RunningStrategy(Protocol):
    embed: EmbedOne

    def stats(self) -> dict[str, Any]: ...

    async def aclose(self) -> None: ...


@dataclass(frozen=True)
class Strategy:
    """A named recipe; ``build(embed_batch)`` makes a fresh running instance for one run."""

    name: str
    description: str
    build: Callable[[EmbedBatch], RunningStrategy] = field(repr=False, compare=False)


class Unbatched:
    """One upstream call per text."""

    def __init__(self, embed_batch: EmbedBatch) -> None:
        self._embed_batch = embed_batch

    async def embed(self, text: str) -> Any:
        (vector,) = await self._embed_batch([text])
        return vector

    def stats(self) -> dict[str, Any]:
        return {}

    async def aclose(self) -> None:
        return None


class Batched:
    """Our ``AdaptiveBatcher`` over the batch function; ``batcher`` is exposed for ``submit_many`` and priorities."""

    def __init__(self, embed_batch: EmbedBatch, config: BatcherConfig, wait_policy: WaitPolicy | None = None):
        self.embed_batch = embed_batch
        self.batcher: AdaptiveBatcher[str, Any] = AdaptiveBatcher(
            embed_batch, config, wait_policy=wait_policy, name="bench"
        )
        self.embed = self.batcher.submit

    def stats(self) -> dict[str, Any]:
        stats = self.batcher.stats()
        return {**dataclasses.asdict(stats), "mean_batch_size": stats.mean_batch_size}

    async def aclose(self) -> None:
        await self.batcher.aclose(drain=False)


class ServeBatched:
    """Ray Serve's ``@serve.batch`` (fixed wait from the first item of a batch)."""

    def __init__(self, embed_batch: EmbedBatch, max_batch_size: int, wait_s: float, max_concurrent_batches: int):
        self._stub = ExitStack()
        self._stub.enter_context(serve_batch_outside_replica())
        self.embed = serve_batched(
            embed_batch,
            max_batch_size=max_batch_size,
            batch_wait_timeout_s=wait_s,
            max_concurrent_batches=max_concurrent_batches,
        )

    def stats(self) -> dict[str, Any]:
        return {}

    async def aclose(self) -> None:
        try:
            await close_serve_batched(self.embed)
        finally:
            self._stub.close()


class ArticleBatched:
    """The article's batcher, re-implemented with its flaws (``load.article_batcher``)."""

    def __init__(self, embed_batch: EmbedBatch, max_batch_size: int, max_wait_ms: float, scale_factor: float):
        self._batcher = ArticleBatcher(
            embed_batch, max_batch_size=max_batch_size, max_wait_ms=max_wait_ms, scale_factor=scale_factor
        )
        self.embed = self._batcher.add

    def stats(self) -> dict[str, Any]:
        return self._batcher.get_stats()

    async def aclose(self) -> None:
        return None


# ---- the strategies the benchmarks compare ------------------------------------------------------------------------

MAX_BATCH = 200
MAX_WAIT_MS = 25.0
SCALE_FACTOR = 15.0
MAX_CONCURRENT_BATCHES = 4
STALL_FACTORS = (2.0, 4.0, 8.0)


def unbatched() -> Strategy:
    return Strategy("none", "one upstream call per text", Unbatched)


def fixed(max_batch_size: int, wait_ms: float, concurrent: int = MAX_CONCURRENT_BATCHES) -> Strategy:
    config = BatcherConfig(max_batch_size=max_batch_size, max_concurrent_batches=concurrent, stall_factor=None)
    return Strategy(
        f"fixed-{max_batch_size}/{wait_ms:g}ms",
        f"AdaptiveBatcher, FixedWait({wait_ms / 1000:g} s): {max_batch_size} items or {wait_ms:g} ms from the oldest",
        lambda embed_batch: Batched(embed_batch, config, FixedWait(wait_ms / 1000)),
    )


def serve_batch(max_batch_size: int = MAX_BATCH, wait_ms: float = MAX_WAIT_MS,
                concurrent: int = MAX_CONCURRENT_BATCHES) -> Strategy:
    return Strategy(
        f"serve.batch-{max_batch_size}/{wait_ms:g}ms",
        f"ray.serve @serve.batch(max_batch_size={max_batch_size}, batch_wait_timeout_s={wait_ms / 1000:g}, "
        f"max_concurrent_batches={concurrent})",
        lambda embed_batch: ServeBatched(embed_batch, max_batch_size, wait_ms / 1000, concurrent),
    )


def article(max_batch_size: int = MAX_BATCH, wait_ms: float = MAX_WAIT_MS, scale: float = SCALE_FACTOR) -> Strategy:
    return Strategy(
        "article",
        f"load.article_batcher.ArticleBatcher(max_batch_size={max_batch_size}, max_wait_ms={wait_ms:g}, "
        f"scale_factor={scale:g}); no concurrency limit",
        lambda embed_batch: ArticleBatched(embed_batch, max_batch_size, wait_ms, scale),
    )


def adaptive(
    name: str = "adaptive",
    *,
    wait_policy: Callable[[], WaitPolicy] | None = None,
    policy_text: str = "",
    **config_changes: Any,
) -> Strategy:
    """``AdaptiveBatcher`` with the benchmark's shared settings; ``config_changes`` override ``BatcherConfig``."""
    settings: dict[str, Any] = dict(
        max_batch_size=MAX_BATCH, max_wait_ms=MAX_WAIT_MS, scale_factor=SCALE_FACTOR,
        max_concurrent_batches=MAX_CONCURRENT_BATCHES, stall_factor=None,  # the formula alone unless asked
    )
    settings.update(config_changes)
    config = BatcherConfig(**settings)
    shown = ", ".join(f"{key}={value:g}" if isinstance(value, float) else f"{key}={value}"
                      for key, value in settings.items())
    description = f"AdaptiveBatcher(BatcherConfig({shown}))" + (f", {policy_text}" if policy_text else "")
    return Strategy(
        name,
        description,
        lambda embed_batch: Batched(embed_batch, config, wait_policy() if wait_policy is not None else None),
    )


def adaptive_with_stall(factor: float) -> Strategy:
    return adaptive(f"adaptive+stall({factor:g})", stall_factor=factor)


def standard_strategies(stall_factors: tuple[float, ...] = STALL_FACTORS) -> list[Strategy]:
    """Every strategy of the seed table and the sweep, in report order."""
    return [
        unbatched(),
        fixed(50, 50),
        fixed(100, 100),
        serve_batch(),
        article(),
        adaptive(),
        *(adaptive_with_stall(factor) for factor in stall_factors),
    ]


def select(strategies: list[Strategy], names: str | None) -> list[Strategy]:
    """The strategies named in a comma-separated list (all when ``names`` is empty), in report order."""
    if not names:
        return strategies
    wanted = [name.strip() for name in names.split(",") if name.strip()]
    known = {strategy.name: strategy for strategy in strategies}
    unknown = [name for name in wanted if name not in known]
    if unknown:
        raise SystemExit(f"unknown strategies {unknown}; known: {', '.join(known)}")
    return [strategy for strategy in strategies if strategy.name in wanted]

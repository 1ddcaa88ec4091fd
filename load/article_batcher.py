"""The seed article's §4.1 asyncio batcher, re-implemented from its described behaviour as a benchmark baseline.

This is a re-implementation for comparison only, not a copy of the article's code and not something to deploy.
Its flaws are kept on purpose, because the benchmarks measure what they cost:

- The wait is computed once, when the flush timer task starts, from the queue depth at that moment
  (``max_wait_ms * (1 - 1/(1 + depth/scale_factor))``, 0 at depth 0); later arrivals never shorten or lengthen it.
- One ``asyncio.Lock`` guards the queue, and the time-triggered flush awaits ``process_fn`` while holding it:
  every ``add`` stalls behind a time-triggered batch in flight.
- The size trigger fires on every ``add`` that finds ``max_batch_size`` or more items queued, and each time it
  starts a fire-and-forget flush task (nothing owns or awaits it; many of them find the queue already empty).
  Size-triggered batches run outside the lock and without any limit on how many run at once.
- A flush takes at most ``max_batch_size`` items; whatever is left has no timer until the next ``add``.
- A raised error (or a result list of the wrong length) fails every item of the batch; an exception *returned*
  in the result list is handed to its caller as a plain result.
- No priorities, no backpressure (the queue grows without bound), no per-item deadlines, no retries, no close
  or drain; a cancelled caller's item is still sent. ``min_batch_size`` is accepted and ignored, as in the article.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable, Sequence

ProcessFn = Callable[[list[Any]], Awaitable[Sequence[Any]]]


@dataclass
class _Entry:
    payload: Any
    future: asyncio.Future
    enqueued_at: float = field(default_factory=time.monotonic)


class ArticleBatcher:
    """Size-or-time batching with a depth-scaled wait, behaving like the article's ``AdaptiveBatcher``."""

    def __init__(
        self,
        process_fn: ProcessFn,
        max_batch_size: int = 100,
        max_wait_ms: float = 30.0,
        min_batch_size: int = 1,
        scale_factor: float = 10,
    ) -> None:
        self.process_fn = process_fn
        self.max_batch_size = max_batch_size
        self.max_wait_ms = max_wait_ms
        self.min_batch_size = min_batch_size
        self.scale_factor = scale_factor
        self._queue: deque[_Entry] = deque()
        self._lock = asyncio.Lock()
        self._timer_task: asyncio.Task | None = None
        self._counts = {"total_items": 0, "total_batches": 0, "size_triggered": 0, "time_triggered": 0}

    def adaptive_wait_ms(self) -> float:
        depth = len(self._queue)
        if depth == 0:
            return 0.0
        return self.max_wait_ms * (1 - 1 / (1 + depth / self.scale_factor))

    async def add(self, payload: Any) -> Any:
        entry = _Entry(payload, asyncio.get_running_loop().create_future())
        async with self._lock:
            self._queue.append(entry)
            self._counts["total_items"] += 1
            if len(self._queue) >= self.max_batch_size:
                if self._timer_task is not None and not self._timer_task.done():
                    self._timer_task.cancel()
                self._timer_task = None
                asyncio.create_task(self._flush("size"))
            elif self._timer_task is None or self._timer_task.done():
                self._timer_task = asyncio.create_task(self._flush_after_wait())
        return await entry.future

    async def _flush_after_wait(self) -> None:
        wait_ms = self.adaptive_wait_ms()
        if wait_ms > 0:
            await asyncio.sleep(wait_ms / 1000)
        async with self._lock:
            if self._queue:
                await self._flush("time")
            self._timer_task = None

    async def _flush(self, reason: str) -> None:
        if not self._queue:
            return
        batch = [self._queue.popleft() for _ in range(min(self.max_batch_size, len(self._queue)))]
        self._counts["total_batches"] += 1
        self._counts[f"{reason}_triggered"] += 1
        try:
            results = await self.process_fn([entry.payload for entry in batch])
            if len(results) != len(batch):
                raise ValueError(f"process_fn returned {len(results)} results for {len(batch)} items")
            for entry, result in zip(batch, results):
                if not entry.future.done():
                    entry.future.set_result(result)
        except Exception as exc:
            for entry in batch:
                if not entry.future.done():
                    entry.future.set_exception(exc)

    def get_stats(self) -> dict[str, float]:
        counts = self._counts
        return {
            **counts,
            "queue_depth": len(self._queue),
            "avg_batch_size": counts["total_items"] / counts["total_batches"] if counts["total_batches"] else 0,
        }

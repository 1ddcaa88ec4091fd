"""The sink the batcher reports to: it counts each event, for ``stats()``, and passes it on to the user's sink."""

from __future__ import annotations

from collections import Counter
from typing import Sequence

from .metrics import BatcherMetrics


class CountingMetrics(BatcherMetrics):
    """Totals of what the hooks were told, so the batcher tells each event once and keeps no counters of its own."""

    def __init__(self, sink: BatcherMetrics) -> None:
        self.sink = sink
        self.items = self.dispatched_items = self.batches = self.retried = self.splits = 0
        self.flushes: Counter[str] = Counter()
        self.rejections: Counter[str] = Counter()  # items ended without a result, by reason
        # Hooks with nothing to count are the sink's own: on the hot path a call in between would cost time.
        self.queue_depth = sink.queue_depth  # type: ignore[method-assign]
        self.batch_completed = sink.batch_completed  # type: ignore[method-assign]

    def items_admitted(self, batcher: str, count: int) -> None:
        self.items += count
        self.sink.items_admitted(batcher, count)

    def batch_flushed(self, batcher: str, reason: str, size: int, waits_s: Sequence[float]) -> None:
        self.batches += 1
        self.dispatched_items += size
        self.flushes[reason] += 1
        self.sink.batch_flushed(batcher, reason, size, waits_s)

    def item_rejected(self, batcher: str, reason: str, count: int) -> None:
        self.rejections[reason] += count
        self.sink.item_rejected(batcher, reason, count)

    def item_retried(self, batcher: str, count: int) -> None:
        self.retried += count
        self.sink.item_retried(batcher, count)

    def batch_split(self, batcher: str) -> None:
        self.splits += 1
        self.sink.batch_split(batcher)

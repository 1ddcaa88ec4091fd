"""Metrics hooks the batcher calls, and the standard metric names every sink keeps."""

from __future__ import annotations

from typing import Sequence

from .config import Priority

QUEUE_DEPTH = "batcher_queue_depth"
BATCH_SIZE = "batcher_batch_size"
ITEM_WAIT_MS = "batcher_item_wait_ms"
FLUSH_TOTAL = "batcher_flush_total"
REJECTED_TOTAL = "batcher_rejected_total"
RETRIES_TOTAL = "batcher_retries_total"
SPLITS_TOTAL = "batcher_splits_total"
BATCH_LATENCY_MS = "batcher_batch_latency_ms"

BATCH_SIZE_BUCKETS = (1, 5, 10, 25, 50, 100, 200)
ITEM_WAIT_MS_BUCKETS = (1, 5, 10, 25, 50, 100, 200, 500)
BATCH_LATENCY_MS_BUCKETS = (1, 5, 10, 25, 50, 100, 200, 500, 1000, 2500, 5000, 10000)

FLUSH_REASONS = ("size", "cost", "time", "stall", "drain")
REJECT_REASONS = ("overload", "deadline", "cancelled")


class BatcherMetrics:
    """Hooks with no effect; a sink overrides the ones it records.

    ``batcher`` is the batcher's name, the tag that tells batchers apart in one process.
    """

    def items_admitted(self, batcher: str, count: int) -> None:
        """One call queued ``count`` items."""

    def queue_depth(self, batcher: str, priority: Priority, depth: int) -> None:
        """Queued (not yet dispatched) items of one priority, after it changed."""

    def batch_flushed(self, batcher: str, reason: str, size: int, waits_s: Sequence[float]) -> None:
        """A batch left the queue; ``waits_s`` is how long each of its items queued."""

    def batch_completed(self, batcher: str, latency_s: float) -> None:
        """One call of the process function returned or failed after ``latency_s``."""

    def item_rejected(self, batcher: str, reason: str, count: int) -> None:
        """``count`` items ended without a result: ``overload``, ``deadline`` or ``cancelled``."""

    def item_retried(self, batcher: str, count: int) -> None:
        """``count`` failed items were queued again."""

    def batch_split(self, batcher: str) -> None:
        """A failed batch was split in halves."""

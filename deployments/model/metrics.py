"""A ``batching.BatcherMetrics`` sink on ``ray.serve.metrics``, with the standard names and buckets.

Ray exports them with the ``ray_`` prefix (``ray_batcher_queue_depth``, ``ray_batcher_item_wait_ms_bucket``, ...)
and adds the Serve tags (deployment, replica, application) itself. Create one per replica.
"""

from __future__ import annotations

from typing import Sequence

from ray.serve import metrics as serve_metrics

from batching import Priority
from batching import metrics as names
from batching.metrics import BatcherMetrics


class RayServeMetrics(BatcherMetrics):
    def __init__(self) -> None:
        self._depth = serve_metrics.Gauge(
            names.QUEUE_DEPTH, "Queued items not yet dispatched", tag_keys=("batcher", "priority")
        )
        self._size = serve_metrics.Histogram(
            names.BATCH_SIZE, "Items per dispatched batch",
            boundaries=list(names.BATCH_SIZE_BUCKETS), tag_keys=("batcher",),
        )
        self._wait = serve_metrics.Histogram(
            names.ITEM_WAIT_MS, "Time an item queued before dispatch (ms)",
            boundaries=list(names.ITEM_WAIT_MS_BUCKETS), tag_keys=("batcher",),
        )
        self._flush = serve_metrics.Counter(names.FLUSH_TOTAL, "Dispatched batches by trigger", tag_keys=("batcher", "reason"))
        self._rejected = serve_metrics.Counter(
            names.REJECTED_TOTAL, "Items ended without a result", tag_keys=("batcher", "reason")
        )
        self._retries = serve_metrics.Counter(
            names.RETRIES_TOTAL, "Items queued again after a retryable failure", tag_keys=("batcher",)
        )
        self._splits = serve_metrics.Counter(names.SPLITS_TOTAL, "Failed batches split in halves", tag_keys=("batcher",))
        self._latency = serve_metrics.Histogram(
            names.BATCH_LATENCY_MS, "Duration of one process call (ms)",
            boundaries=list(names.BATCH_LATENCY_MS_BUCKETS), tag_keys=("batcher",),
        )

    def queue_depth(self, batcher: str, priority: Priority, depth: int) -> None:
        self._depth.set(depth, tags={"batcher": batcher, "priority": priority.name.lower()})

    def batch_flushed(self, batcher: str, reason: str, size: int, waits_s: Sequence[float]) -> None:
        tags = {"batcher": batcher}
        self._flush.inc(tags={"batcher": batcher, "reason": reason})
        self._size.observe(size, tags=tags)
        for waited in waits_s:
            self._wait.observe(waited * 1000.0, tags=tags)

    def batch_completed(self, batcher: str, latency_s: float) -> None:
        self._latency.observe(latency_s * 1000.0, tags={"batcher": batcher})

    def item_rejected(self, batcher: str, reason: str, count: int) -> None:
        self._rejected.inc(count, tags={"batcher": batcher, "reason": reason})

    def item_retried(self, batcher: str, count: int) -> None:
        self._retries.inc(count, tags={"batcher": batcher})

    def batch_split(self, batcher: str) -> None:
        self._splits.inc(tags={"batcher": batcher})

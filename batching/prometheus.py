"""A ``prometheus_client`` sink for the batcher's metrics, for use outside Ray."""

from __future__ import annotations

from typing import Sequence

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge, Histogram

from . import metrics as names
from .config import Priority
from .metrics import BatcherMetrics


class PrometheusMetrics(BatcherMetrics):
    def __init__(self, registry: CollectorRegistry = REGISTRY) -> None:
        self._depth = Gauge(names.QUEUE_DEPTH, "Queued items not yet dispatched", ["batcher", "priority"], registry=registry)
        self._size = Histogram(
            names.BATCH_SIZE, "Items per dispatched batch", ["batcher"], buckets=names.BATCH_SIZE_BUCKETS, registry=registry
        )
        self._wait = Histogram(
            names.ITEM_WAIT_MS, "Time an item queued before dispatch (ms)", ["batcher"],
            buckets=names.ITEM_WAIT_MS_BUCKETS, registry=registry,
        )
        self._flush = Counter(names.FLUSH_TOTAL, "Dispatched batches by trigger", ["batcher", "reason"], registry=registry)
        self._rejected = Counter(names.REJECTED_TOTAL, "Items ended without a result", ["batcher", "reason"], registry=registry)
        self._retries = Counter(names.RETRIES_TOTAL, "Items queued again after a retryable failure", ["batcher"], registry=registry)
        self._splits = Counter(names.SPLITS_TOTAL, "Failed batches split in halves", ["batcher"], registry=registry)
        self._latency = Histogram(
            names.BATCH_LATENCY_MS, "Duration of one process call (ms)", ["batcher"],
            buckets=names.BATCH_LATENCY_MS_BUCKETS, registry=registry,
        )

    def queue_depth(self, batcher: str, priority: Priority, depth: int) -> None:
        self._depth.labels(batcher, priority.name.lower()).set(depth)

    def batch_flushed(self, batcher: str, reason: str, size: int, waits_s: Sequence[float]) -> None:
        self._flush.labels(batcher, reason).inc()
        self._size.labels(batcher).observe(size)
        wait = self._wait.labels(batcher)
        for waited in waits_s:
            wait.observe(waited * 1000.0)

    def batch_completed(self, batcher: str, latency_s: float) -> None:
        self._latency.labels(batcher).observe(latency_s * 1000.0)

    def item_rejected(self, batcher: str, reason: str, count: int) -> None:
        self._rejected.labels(batcher, reason).inc(count)

    def item_retried(self, batcher: str, count: int) -> None:
        self._retries.labels(batcher).inc(count)

    def batch_split(self, batcher: str) -> None:
        self._splits.labels(batcher).inc()

"""Whether a call's items may join the queue, and when to come back if not: every admission rule in one place.

- A call of more items than ``max_queue_depth`` can never fit, however empty the queue: ``NeverFits`` (no retry
  helps; a service answers it as a bad request).
- The items waiting (queued, or waiting out a Retry-After, since those queue again) stay within ``max_queue_depth``;
  LOW is refused once they reach ``LOW_SHARE_OF_QUEUE`` of it, so a LOW flood always leaves HIGH room to queue.
- With a deadline, once the drain rate is known (``HISTORY_BATCHES`` batches sent), a call that the work queued
  ahead of it would keep past its deadline is refused now, rather than failed with ``DeadlineExceeded`` later.

A refused call is told to come back once the queue ahead of it has drained, within ``RETRY_AFTER_BOUNDS_S``.
"""

from __future__ import annotations

from typing import NamedTuple

from .config import HIGH, BatcherConfig, Priority
from .errors import NeverFits

LOW_SHARE_OF_QUEUE = 0.8
HISTORY_BATCHES = 8
RETRY_AFTER_BOUNDS_S = (0.05, 60.0)
# The weight of the latest batch in the drain rate's running means (of latency and of size).
_EWMA = 1 / 8


def low_admission_limit(max_queue_depth: int) -> int:
    """LOW items are refused once this many items wait."""
    return max(1, int(max_queue_depth * LOW_SHARE_OF_QUEUE))


class Refusal(NamedTuple):
    reason: str
    retry_after_s: float


class DrainRate:
    """How fast the batcher has been getting through its queue lately: running means of batch latency and size."""

    __slots__ = ("mean_latency_s", "mean_batch", "batches")

    def __init__(self) -> None:
        self.mean_latency_s = 0.0
        self.mean_batch = 0.0
        self.batches = 0

    def batch_sent(self, size: int) -> None:
        self.mean_batch += (size - self.mean_batch) * _EWMA
        self.batches += 1

    def batch_done(self, latency_s: float) -> None:
        self.mean_latency_s += (latency_s - self.mean_latency_s) * _EWMA

    def items_per_s(self, config: BatcherConfig) -> float:
        """Mean batch size x slots over mean batch latency (``max_wait_ms`` stands in for a latency not yet seen)."""
        batch_s = self.mean_latency_s or config.max_wait_ms / 1000.0 or 1e-3
        return max(1.0, self.mean_batch * config.max_concurrent_batches) / batch_s


class Admission:
    def __init__(self, config: BatcherConfig) -> None:
        self.config = config

    def limit(self, priority: Priority) -> int:
        """Items that may be waiting once this priority's items are admitted."""
        depth = self.config.max_queue_depth
        return depth if priority is HIGH else low_admission_limit(depth)

    def refusal(self, name: str, count: int, priority: Priority, timeout_s: float | None, *, queued: int,
                delayed: int, ahead: int, rate: DrainRate) -> Refusal | None:
        """Why a call of ``count`` items is refused now, or None when it is admitted: ``queued`` items are in the
        queue (``ahead`` of them would be served before this call) and ``delayed`` wait out a Retry-After. Raises
        ``NeverFits`` for a call no queue could hold."""
        config = self.config
        if count > config.max_queue_depth:
            raise NeverFits(f"{count} items can never fit a queue of max_queue_depth={config.max_queue_depth}")
        waiting = queued + delayed
        if waiting + count > self.limit(priority):
            return self._refuse(f"batcher {name!r} queue is full ({waiting} waiting)", queued, rate)
        if timeout_s is not None and rate.batches >= HISTORY_BATCHES:
            expected_s = (ahead + count) / rate.items_per_s(config) + rate.mean_latency_s
            if expected_s > timeout_s:
                return self._refuse(f"batcher {name!r} would take about {expected_s:.3f}s to serve what is queued "
                                    f"ahead, past the {timeout_s:.3f}s allowed", queued, rate)
        return None

    def _refuse(self, reason: str, queued: int, rate: DrainRate) -> Refusal:
        """Come back once the queue has drained."""
        low, high = RETRY_AFTER_BOUNDS_S
        return Refusal(reason, min(high, max(low, queued / rate.items_per_s(self.config))))

"""A snapshot of what a batcher has done and holds."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class BatcherStats:
    queued_high: int = 0
    queued_low: int = 0
    delayed: int = 0  # failed items waiting out a Retry-After before they queue again
    in_flight_batches: int = 0
    items: int = 0  # items admitted
    dispatched_items: int = 0
    batches: int = 0
    flushes: dict[str, int] = field(default_factory=dict)
    rejected: int = 0  # refused for overload
    expired: int = 0
    cancelled: int = 0
    retried: int = 0
    splits: int = 0

    @property
    def queue_depth(self) -> int:
        return self.queued_high + self.queued_low

    @property
    def mean_batch_size(self) -> float:
        return self.dispatched_items / self.batches if self.batches else 0.0

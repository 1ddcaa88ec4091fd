"""Configuration of an adaptive batcher and the priority of an item."""

from __future__ import annotations

from dataclasses import dataclass, fields
from enum import IntEnum


class Priority(IntEnum):
    HIGH = 0  # interactive callers
    LOW = 1  # background bulk work

    @classmethod
    def parse(cls, value: "Priority | str") -> "Priority":
        if isinstance(value, Priority):
            return value
        try:
            return cls[str(value).strip().upper()]
        except KeyError:
            raise ValueError(f"priority must be 'high' or 'low', not {value!r}") from None


# A member read through its enum class is a slow attribute lookup (EnumType's), next to a module global's; the
# batcher's per-item paths compare with these instead.
HIGH, LOW = Priority.HIGH, Priority.LOW


@dataclass(frozen=True)
class BatcherConfig:
    max_batch_size: int = 100
    max_batch_cost: float | None = None
    max_wait_ms: float = 25.0
    scale_factor: float = 10.0
    max_concurrent_batches: int = 4
    max_queue_depth: int = 10_000
    batch_timeout_s: float | None = None
    max_retries: int = 1
    dedupe: bool = True
    low_share: float = 0.1  # while HIGH keeps every slot busy, LOW still gets this fraction of the items sent
    stall_factor: float | None = 4.0  # the load sweep in load/ chose it (docs/batching.md "Choosing the default")
    # Where this batcher differs from @serve.batch on purpose, each switch gives Serve's behaviour when turned:
    split_on_failure: bool = True  # a raising call is bisected so a poisonous item fails alone (Serve: all fail)
    refuse_oversized: bool = False  # an item alone over max_batch_cost travels alone (Serve: ItemTooLarge)

    def __post_init__(self) -> None:
        problems = [
            message
            for failed, message in (
                (self.max_batch_size < 1, "max_batch_size must be >= 1"),
                (self.max_batch_cost is not None and self.max_batch_cost <= 0, "max_batch_cost must be > 0 or None"),
                (self.max_wait_ms < 0, "max_wait_ms must be >= 0"),
                (self.scale_factor <= 0, "scale_factor must be > 0"),
                (self.max_concurrent_batches < 1, "max_concurrent_batches must be >= 1"),
                (self.max_queue_depth < 1, "max_queue_depth must be >= 1"),
                (self.batch_timeout_s is not None and self.batch_timeout_s <= 0, "batch_timeout_s must be > 0 or None"),
                (self.max_retries < 0, "max_retries must be >= 0"),
                (not 0 <= self.low_share < 1, "low_share must be >= 0 and < 1"),
                (self.stall_factor is not None and self.stall_factor <= 0, "stall_factor must be > 0 or None"),
            )
            if failed
        ]
        if problems:
            raise ValueError("invalid BatcherConfig: " + "; ".join(problems))

    @classmethod
    def field_names(cls) -> frozenset[str]:
        return frozenset(f.name for f in fields(cls))

"""Wait policies: how long the oldest queued item may wait, given the queue depth now."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable


@runtime_checkable
class WaitPolicy(Protocol):
    def wait_s(self, depth: int) -> float: ...


@dataclass(frozen=True)
class DepthScaledWait:
    """Wait grows with depth: ``max_wait * (1 - 1 / (1 + depth / scale_factor))``.

    A lone item barely waits; a deep queue waits up to ``max_wait_ms`` to fill bigger batches.
    """

    max_wait_ms: float
    scale_factor: float

    def __post_init__(self) -> None:
        if self.max_wait_ms < 0 or self.scale_factor <= 0:
            raise ValueError("DepthScaledWait needs max_wait_ms >= 0 and scale_factor > 0")

    def wait_s(self, depth: int) -> float:
        if depth <= 0:
            return 0.0
        return self.max_wait_ms / 1000.0 * (1.0 - 1.0 / (1.0 + depth / self.scale_factor))


@dataclass(frozen=True)
class FixedWait:
    """A fixed wait from the oldest item, whatever the depth (what ``@serve.batch`` does)."""

    timeout_s: float

    def __post_init__(self) -> None:
        if self.timeout_s < 0:
            raise ValueError("FixedWait needs timeout_s >= 0")

    def wait_s(self, depth: int) -> float:
        return self.timeout_s

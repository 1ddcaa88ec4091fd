"""When a batch may leave, and from which lane: every dispatch rule of DESIGN §2 in one place.

The batcher (the mechanism) asks ``DispatchPolicy.choose`` whenever something changed; the answer names the lane to
take a batch from and why, or the moment to ask again.

- Each lane is judged on its own triggers (its depth, its oldest item, its cost, its pace), since a batch never
  mixes priorities: a lone HIGH item waits ``wait_s(1)``, not the window a deep LOW queue earns.
- HIGH goes first. A LOW batch takes a free slot only when no HIGH batch is ready and, with more than one slot,
  never the last one; except that while HIGH keeps the slots busy, LOW is owed ``low_share`` of the items
  dispatched, and a LOW batch that is owed goes ahead of HIGH or takes the last slot. LOW never turns into HIGH.
"""

from __future__ import annotations

import math
from typing import Any, Callable, NamedTuple

from .config import HIGH, LOW, BatcherConfig, Priority
from .policies import WaitPolicy
from .queue import Lane, Lanes

# A timer may run a hair before its time (asyncio runs handles due within the clock's resolution).
EPS = 1e-6
# The stall trigger's window is (stall_factor + ln depth) x the lane's mean arrival gap, and at least this long (s).
_STALL_MIN_S = 0.0005


class Decision(NamedTuple):
    lane: Priority | None  # take a batch from this lane now; None: nothing may leave yet
    reason: str  # the trigger that fired (size, cost, time, stall, drain)
    wake_at: float  # when lane is None: the earliest moment a time-based trigger could fire
    share: bool = False  # a LOW batch sent on the share it is owed, ahead of HIGH work or into the last slot


class DispatchPolicy:
    def __init__(self, config: BatcherConfig, wait_policy: WaitPolicy,
                 batch_cost_fn: Callable[[list[Any]], float] | None = None) -> None:
        self.config = config
        self.wait_policy = wait_policy
        self._batch_cost_fn = batch_cost_fn
        # Items LOW may still send ahead of ready HIGH work (or into the last slot); it grows by low_share/(1 -
        # low_share) for every HIGH item dispatched while LOW waits, and shrinks by what every LOW batch carries.
        self._low_credit = 0.0

    # ---- dispatch -----------------------------------------------------------------------------------------------

    def choose(self, lanes: Lanes, in_flight: int, closing: bool, now: float) -> Decision:
        """Which lane sends a batch into a free slot now (the caller checked that a slot is free)."""
        high, low = lanes[HIGH], lanes[LOW]
        if closing:
            return Decision(HIGH if high.depth else LOW, "drain", now)
        high_reason, high_at = self.lane_trigger(high, now)
        low_reason, low_at = self.lane_trigger(low, now)
        low_owed = self._low_credit >= 1.0
        if high_reason is not None:
            if low_reason is not None and low_owed:
                return Decision(LOW, low_reason, now, share=True)
            return Decision(HIGH, high_reason, now)
        if low_reason is not None:
            slots = self.config.max_concurrent_batches
            last_slot = slots > 1 and in_flight == slots - 1
            if not last_slot:
                return Decision(LOW, low_reason, now)
            if low_owed:
                return Decision(LOW, low_reason, now, share=True)
            return Decision(None, "", high_at)  # the last slot waits for HIGH work, or for a slot to free
        return Decision(None, "", min(high_at, low_at))

    def dispatched(self, lanes: Lanes, decision: Decision, size: int) -> None:
        """Account for a batch of ``size`` items sent as ``decision`` said."""
        share = self.config.low_share
        if decision.lane is HIGH:
            if lanes[LOW].depth and share > 0:
                self._low_credit = min(self._low_credit + size * share / (1.0 - share), self.config.max_batch_size)
        elif decision.share:
            self._low_credit -= size
        else:  # LOW into a slot nobody else wanted: what it sends counts toward its share, and no debt is carried
            self._low_credit = max(self._low_credit - size, 0.0)

    def lane_trigger(self, lane: Lane, now: float) -> tuple[str | None, float]:
        """The trigger that fires for this lane now, if any; otherwise (None, when the earliest one will)."""
        depth = lane.depth
        if not depth:
            return None, math.inf
        config = self.config
        if depth >= config.max_batch_size:
            return "size", now
        if config.max_batch_cost is not None and (
                lane.cost > config.max_batch_cost if self._batch_cost_fn is None
                else lane.head_full(self._batch_cost_fn, config.max_batch_cost)):
            return "cost", now
        head = lane.head()
        reason, wake_at = "time", head.enqueued_at + self.wait_policy.wait_s(depth)
        if config.stall_factor is not None and lane.mean_gap is not None and depth > 1:
            # Steady (Poisson) arrivals leave a gap over k mean gaps with probability e^-k; adding ln(depth) keeps the
            # chance that one of the `depth` gaps of a filling batch passes for a stall near e^-stall_factor. A pool
            # of callers that has all submitted goes quiet for good, and the trigger still ends that wait.
            window = (config.stall_factor + math.log(depth)) * lane.mean_gap
            stall_at = lane.last_arrival + max(_STALL_MIN_S, window)
            if stall_at < wake_at:
                reason, wake_at = "stall", stall_at
        return (reason if now >= wake_at - EPS else None), wake_at

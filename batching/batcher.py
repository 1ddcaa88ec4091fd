"""The adaptive batcher: items queue, batches leave on size, cost, time or stall, at most N at once.

Dispatch is event-driven: every change that can make a batch ready (an arrival, a freed slot, an item leaving,
a timer) runs ``_pump``, which sends every batch that is ready and arms one timer for the next moment a
time-based trigger could fire. There is no background loop to die; each batch runs in a task the batcher owns.
All times come from the event loop's monotonic clock.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import math
from collections import Counter
from typing import Any, Awaitable, Callable, Generic, Sequence, TypeVar

from .config import BatcherConfig, Priority
from .errors import BatcherClosed, BatchResultMismatch, DeadlineExceeded, Overloaded, is_retryable, retry_after_s
from .metrics import BatcherMetrics
from .policies import DepthScaledWait, WaitPolicy
from .queue import DELAYED, DONE, IN_FLIGHT, QUEUED, Item, PriorityQueue
from .stats import BatcherStats

P = TypeVar("P")
R = TypeVar("R")
ProcessFn = Callable[[list[P]], Awaitable[Sequence["R | BaseException"]]]

logger = logging.getLogger(__name__)

# A timer may run a hair before its time (asyncio runs handles due within the clock's resolution).
_EPS = 1e-6
# The stall trigger's window is (stall_factor + ln depth) x the mean gap between arrivals that join a non-empty queue
# (the pace at which a batch fills; the idle time before a batch's first item would stretch it), and at least this
# long (s).
_STALL_MIN_S = 0.0005
_GAP_EWMA = 1 / 16
_LATENCY_EWMA = 1 / 8


class AdaptiveBatcher(Generic[P, R]):
    def __init__(
        self,
        process_fn: ProcessFn,
        config: BatcherConfig = BatcherConfig(),
        *,
        wait_policy: WaitPolicy | None = None,
        cost_fn: Callable[[P], float] | None = None,
        metrics: BatcherMetrics | None = None,
        name: str = "default",
    ) -> None:
        self.name = name
        self._process = process_fn
        self._config = config
        self._custom_policy = wait_policy
        self._wait_policy: WaitPolicy = wait_policy or DepthScaledWait(config.max_wait_ms, config.scale_factor)
        self._cost_fn = cost_fn
        self._metrics = metrics
        self._queue = PriorityQueue()
        self._delayed: set[Item] = set()
        self._tasks: set[asyncio.Task] = set()
        self._in_flight = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at = math.inf
        self._closing = False
        self._drain = True
        self._settled: asyncio.Event | None = None
        self._last_arrival = -math.inf
        self._mean_gap: float | None = None
        self._mean_latency = 0.0
        self._items = self._dispatched = self._batches = 0
        self._rejected = self._expired = self._cancelled = self._retried = self._splits = 0
        self._flushes: Counter[str] = Counter()

    # ---- public API -------------------------------------------------------------------------------------------

    @property
    def config(self) -> BatcherConfig:
        return self._config

    def reconfigure(self, **changes: Any) -> None:
        """Change settings at run time (validated like the constructor); queued items keep their place."""
        self._config = dataclasses.replace(self._config, **changes)
        if self._custom_policy is None:
            self._wait_policy = DepthScaledWait(self._config.max_wait_ms, self._config.scale_factor)
        if self._loop is not None:
            self._pump()

    async def submit(self, payload: P, *, priority: Priority = Priority.HIGH, timeout_s: float | None = None) -> R:
        self._admit(1, priority)
        item = self._enqueue(payload, priority, timeout_s)
        self._pump()
        try:
            return await item.future
        except asyncio.CancelledError:
            self._abandon(item)
            raise

    async def submit_many(
        self,
        payloads: Sequence[P],
        *,
        priority: Priority = Priority.HIGH,
        timeout_s: float | None = None,
        return_exceptions: bool = False,
    ) -> list[R | BaseException]:
        if not payloads:
            return []
        self._admit(len(payloads), priority)
        items = [self._enqueue(payload, priority, timeout_s) for payload in payloads]
        self._pump()
        try:
            await asyncio.wait([item.future for item in items])
        except asyncio.CancelledError:
            for item in items:
                if not item.future.done():
                    item.future.cancel()
                    self._abandon(item)
            raise
        outcomes = [item.future.exception() or item.future.result() for item in items]
        if not return_exceptions:
            for outcome in outcomes:
                if isinstance(outcome, BaseException):
                    raise outcome
        return outcomes

    def stats(self) -> BatcherStats:
        return BatcherStats(
            queued_high=self._queue.depth(Priority.HIGH),
            queued_low=self._queue.depth(Priority.LOW),
            delayed=len(self._delayed),
            in_flight_batches=self._in_flight,
            items=self._items,
            dispatched_items=self._dispatched,
            batches=self._batches,
            flushes=dict(self._flushes),
            rejected=self._rejected,
            expired=self._expired,
            cancelled=self._cancelled,
            retried=self._retried,
            splits=self._splits,
        )

    async def aclose(self, drain: bool = True) -> None:
        """Stop taking items. ``drain`` sends what is queued and waits for it; otherwise queued items fail with
        ``BatcherClosed``. Either way, batches already in flight are awaited."""
        if self._settled is not None:
            await self._settled.wait()
            return
        self._closing, self._drain = True, drain
        self._settled = asyncio.Event()
        if not drain:
            for item in [*self._queue.drain(), *self._delayed]:
                self._finish(item, error=BatcherClosed("batcher closed before the item was sent"))
            self._delayed.clear()
            self._report_depths()
        if self._loop is not None:
            self._pump()
        self._check_settled()
        await self._settled.wait()
        if self._timer is not None:
            self._timer.cancel()

    async def __aenter__(self) -> "AdaptiveBatcher[P, R]":
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose(drain=True)

    # ---- admission ----------------------------------------------------------------------------------------------

    def _admit(self, count: int, priority: Priority) -> None:
        if self._closing:
            raise BatcherClosed("batcher is closed")
        if self._loop is None:
            self._loop = asyncio.get_running_loop()
        config = self._config
        if count > config.max_queue_depth:
            raise ValueError(f"{count} items can never fit a queue of max_queue_depth={config.max_queue_depth}")
        limit = config.max_queue_depth if priority == Priority.HIGH else config.low_admission_limit
        waiting = len(self._queue) + len(self._delayed)  # items waiting out a Retry-After will queue again
        if waiting + count > limit:
            self._rejected += count
            if self._metrics is not None:
                for _ in range(count):
                    self._metrics.item_rejected(self.name, "overload")
            raise Overloaded(self._retry_after_estimate(), f"batcher {self.name!r} queue is full ({waiting} waiting)")

    def _retry_after_estimate(self) -> float:
        """Roughly how long until the queue has room again: its depth over the recent drain rate."""
        config = self._config
        batch_s = self._mean_latency or config.max_wait_ms / 1000.0
        per_round = max(1.0, (self._dispatched / self._batches if self._batches else 1.0) * config.max_concurrent_batches)
        return min(60.0, max(0.05, len(self._queue) / per_round * batch_s))

    def _enqueue(self, payload: P, priority: Priority, timeout_s: float | None) -> Item:
        loop = self._loop
        now = loop.time()
        cost = self._cost_fn(payload) if self._cost_fn is not None else 1.0
        deadline = None if timeout_s is None else now + timeout_s
        item = Item(payload, loop.create_future(), priority, now, cost, deadline)
        if deadline is not None:
            item.add_timer(loop.call_at(deadline, self._on_deadline, item))
        if self._config.stall_factor is not None and len(self._queue):
            gap = min(now - self._last_arrival, self._config.max_wait_ms / 1000.0)
            self._mean_gap = gap if self._mean_gap is None else self._mean_gap + (gap - self._mean_gap) * _GAP_EWMA
        self._queue.push(item)
        self._items += 1
        self._last_arrival = now
        if self._metrics is not None:
            self._metrics.queue_depth(self.name, priority, self._queue.depth(priority))
        return item

    # ---- dispatch -----------------------------------------------------------------------------------------------

    def _pump(self) -> None:
        """Send every batch that is ready now; otherwise arm the timer for when one could be."""
        config, queue = self._config, self._queue
        now = self._loop.time()
        while len(queue) and self._in_flight < config.max_concurrent_batches:
            reason, wake_at = self._trigger(now)
            if reason is None:
                self._arm_timer(wake_at)
                return
            aged_before = now - config.low_aging_s + _EPS
            last_slot = config.max_concurrent_batches > 1 and self._in_flight == config.max_concurrent_batches - 1
            if last_slot and not self._closing and not queue.has_urgent(aged_before):
                self._arm_timer(queue.head(Priority.LOW).enqueued_at + config.low_aging_s)
                return
            batch = queue.take(config.max_batch_size, config.max_batch_cost, aged_before)
            self._dispatch(batch, reason, now)

    def _trigger(self, now: float) -> tuple[str | None, float]:
        """Which trigger, if any, fires now; if none, when the earliest time-based one will.

        Each priority lane is judged on its own (its depth, its oldest item, its cost), since a batch never mixes
        them: a lone HIGH item waits ``wait_s(1)``, not the wait a deep LOW queue would earn.
        """
        if self._closing:
            return "drain", now
        earliest = math.inf
        for priority in Priority:
            if self._queue.depth(priority):
                reason, wake_at = self._lane_trigger(priority, now)
                if reason is not None:
                    return reason, now
                earliest = min(earliest, wake_at)
        return None, earliest

    def _lane_trigger(self, priority: Priority, now: float) -> tuple[str | None, float]:
        config, queue = self._config, self._queue
        depth = queue.depth(priority)
        if depth >= config.max_batch_size:
            return "size", now
        if config.max_batch_cost is not None and queue.cost(priority) > config.max_batch_cost:
            return "cost", now
        reason, wake_at = "time", queue.head(priority).enqueued_at + self._wait_policy.wait_s(depth)
        if config.stall_factor is not None and self._mean_gap is not None and depth > 1:
            # Steady (Poisson) arrivals leave a gap over k mean gaps with probability e^-k; adding ln(depth) keeps the
            # chance that one of the `depth` gaps of a filling batch passes for a stall near e^-stall_factor. A pool
            # of callers that has all submitted goes quiet for good, and the trigger still ends that wait.
            window = (config.stall_factor + math.log(depth)) * self._mean_gap
            stall_at = self._last_arrival + max(_STALL_MIN_S, window)
            if stall_at < wake_at:
                reason, wake_at = "stall", stall_at
        return (reason if now >= wake_at - _EPS else None), wake_at

    def _arm_timer(self, when: float) -> None:
        # A timer that fires too early is harmless (the pump re-checks), so only an earlier moment re-arms it.
        if when < self._timer_at - _EPS:
            if self._timer is not None:
                self._timer.cancel()
            self._timer = self._loop.call_at(when, self._on_timer)
            self._timer_at = when

    def _on_timer(self) -> None:
        self._timer, self._timer_at = None, math.inf
        self._pump()

    def _dispatch(self, batch: list[Item], reason: str, now: float) -> None:
        live = []
        for item in batch:
            item.state = IN_FLIGHT
            if item.deadline is not None and item.deadline <= now:
                self._expire(item)
            else:
                live.append(item)
        if not live:
            return
        self._in_flight += 1
        self._batches += 1
        self._dispatched += len(live)
        self._flushes[reason] += 1
        if self._metrics is not None:
            self._metrics.batch_flushed(self.name, reason, len(live), [now - item.enqueued_at for item in live])
            self._report_depths()
        task = self._loop.create_task(self._run_batch(live))
        self._tasks.add(task)
        task.add_done_callback(self._batch_done)

    def _batch_done(self, task: asyncio.Task) -> None:
        self._tasks.discard(task)
        self._in_flight -= 1
        if not task.cancelled() and task.exception() is not None:
            logger.error("batcher %r: a batch failed unexpectedly", self.name, exc_info=task.exception())
        self._pump()
        self._check_settled()

    # ---- running a batch ----------------------------------------------------------------------------------------

    async def _run_batch(self, items: list[Item]) -> None:
        try:
            await self._attempt(items)
        except BaseException as exc:
            # Our own failure (or cancellation): no item may be left without an outcome.
            error = exc if isinstance(exc, Exception) else BatcherClosed("batch cancelled")
            for item in items:
                if item.state == IN_FLIGHT:
                    self._finish(item, error=error)
            raise

    async def _attempt(self, items: list[Item]) -> None:
        """Send the items once; on a raised error or timeout, bisect so a poisonous item fails alone."""
        live = [item for item in items if not item.future.done()]
        if not live:
            return
        payloads, slots = self._unique_payloads(live)
        timeout_s = self._config.batch_timeout_s
        started = self._loop.time()
        try:
            if timeout_s is None:
                results = await self._process(payloads)
            else:
                async with asyncio.timeout(timeout_s):
                    results = await self._process(payloads)
        except Exception as exc:
            self._record_latency(started)
            if len(payloads) > 1:
                self._splits += 1
                if self._metrics is not None:
                    self._metrics.batch_split(self.name)
                half = len(payloads) // 2
                await self._attempt([item for item, slot in zip(live, slots) if slot < half])
                await self._attempt([item for item, slot in zip(live, slots) if slot >= half])
                return
            for item in live:
                self._fail_or_retry(item, exc)
            return
        self._record_latency(started)
        if len(results) != len(payloads):
            for item in live:
                self._finish(item, error=BatchResultMismatch(
                    f"process function returned {len(results)} results for {len(payloads)} payloads"))
            return
        for item, slot in zip(live, slots):
            result = results[slot]
            if isinstance(result, BaseException):
                self._fail_or_retry(item, result)
            else:
                self._finish(item, result=result)

    def _unique_payloads(self, items: list[Item]) -> tuple[list[Any], list[int]]:
        """The payloads to send, and for each item the index of its payload among them."""
        if not self._config.dedupe:
            return [item.payload for item in items], list(range(len(items)))
        payloads: list[Any] = []
        slots: list[int] = []
        seen: dict[Any, int] = {}
        for item in items:
            payload = item.payload
            try:
                slot = seen.setdefault(payload, len(payloads))
            except TypeError:  # unhashable: never shared
                slot = len(payloads)
            if slot == len(payloads):
                payloads.append(payload)
            slots.append(slot)
        return payloads, slots

    def _record_latency(self, started: float) -> None:
        latency = self._loop.time() - started
        self._mean_latency += (latency - self._mean_latency) * _LATENCY_EWMA
        if self._metrics is not None:
            self._metrics.batch_completed(self.name, latency)

    def _fail_or_retry(self, item: Item, exc: BaseException) -> None:
        if item.future.done():
            return
        if item.attempts >= self._config.max_retries or not is_retryable(exc) or (self._closing and not self._drain):
            self._finish(item, error=exc)
            return
        item.attempts += 1
        self._retried += 1
        if self._metrics is not None:
            self._metrics.item_retried(self.name)
        delay = retry_after_s(exc)
        if delay > 0:
            item.state = DELAYED
            self._delayed.add(item)
            item.add_timer(self._loop.call_later(delay, self._requeue, item))
        else:
            self._requeue(item)

    def _requeue(self, item: Item) -> None:
        if item.future.done():
            return
        self._delayed.discard(item)
        if self._closing and not self._drain:
            self._finish(item, error=BatcherClosed("batcher closed before the item could be retried"))
            self._check_settled()
            return
        item.state = QUEUED
        self._queue.push_front(item)
        if self._metrics is not None:
            self._metrics.queue_depth(self.name, item.priority, self._queue.depth(item.priority))
        self._pump()

    # ---- items that leave early ---------------------------------------------------------------------------------

    def _finish(self, item: Item, *, result: Any = None, error: BaseException | None = None) -> None:
        if item.future.done():
            return
        item.finish()
        if error is None:
            item.future.set_result(result)
        else:
            item.future.set_exception(error)

    def _leave_queue(self, item: Item) -> None:
        if item.state == QUEUED:
            self._queue.discard(item)
            if self._metrics is not None:
                self._metrics.queue_depth(self.name, item.priority, self._queue.depth(item.priority))
        elif item.state == DELAYED:
            self._delayed.discard(item)

    def _expire(self, item: Item) -> None:
        self._leave_queue(item)
        self._expired += 1
        if self._metrics is not None:
            self._metrics.item_rejected(self.name, "deadline")
        waited = self._loop.time() - item.enqueued_at
        self._finish(item, error=DeadlineExceeded(f"no result within the deadline (waited {waited:.3f}s)"))

    def _on_deadline(self, item: Item) -> None:
        if item.future.done():
            return
        was_waiting = item.state in (QUEUED, DELAYED)
        self._expire(item)
        if was_waiting:
            self._pump()
            self._check_settled()

    def _abandon(self, item: Item) -> None:
        """The caller stopped waiting: the item never goes out, and a result already on its way is dropped."""
        if item.state == DONE:
            return
        was_waiting = item.state in (QUEUED, DELAYED)
        self._leave_queue(item)
        item.finish()
        self._cancelled += 1
        if self._metrics is not None:
            self._metrics.item_rejected(self.name, "cancelled")
        if was_waiting:
            self._pump()
            self._check_settled()

    def _report_depths(self) -> None:
        if self._metrics is not None:
            for priority in Priority:
                self._metrics.queue_depth(self.name, priority, self._queue.depth(priority))

    def _check_settled(self) -> None:
        if self._settled is not None and not (self._in_flight or len(self._queue) or self._delayed):
            self._settled.set()

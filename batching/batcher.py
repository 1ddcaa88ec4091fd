"""The adaptive batcher: items queue, batches leave on size, cost, time or stall, at most N at once.

Dispatch is event-driven: every change that can make a batch ready (an arrival, a freed slot, an item leaving,
a timer) runs ``_pump``, which sends every batch the ``DispatchPolicy`` allows now and arms one timer for the next
moment a time-based trigger could fire. There is no background loop to die; each batch runs in a task the batcher
owns. All times come from the event loop's monotonic clock.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import math
from contextvars import ContextVar
from typing import Any, Awaitable, Callable, Generic, Hashable, Sequence, TypeVar

from .admission import Admission, DrainRate
from .config import HIGH, LOW, BatcherConfig, Priority
from .counting import CountingMetrics
from .errors import (BatcherClosed, BatchResultMismatch, DeadlineExceeded, ItemTooLarge, Overloaded, Postponed,
                     is_retryable, retry_after_s)
from .metrics import BatcherMetrics
from .policies import DepthScaledWait, WaitPolicy
from .queue import DELAYED, DONE, IN_FLIGHT, QUEUED, Item, Lanes
from .scheduling import EPS, DispatchPolicy
from .stats import BatcherStats

P = TypeVar("P")
R = TypeVar("R")
T = TypeVar("T")
ProcessFn = Callable[[list[P]], Awaitable[Sequence["R | BaseException"]]]
BatchCostFn = Callable[[list[P]], float]

logger = logging.getLogger(__name__)

_NO_METRICS = BatcherMetrics()

_BATCH_PRIORITY: ContextVar[Priority | None] = ContextVar("batch_priority", default=None)


def batch_priority() -> Priority | None:
    """The priority of the batch whose process call is running here (in the process function and whatever it
    awaits); None outside one. A batch is taken from one priority's queue, so this is every item's priority: a
    process function may let a LOW batch's work yield to others' with it."""
    return _BATCH_PRIORITY.get()


class _BatchTimedOut(TimeoutError):
    """The process call ran past ``batch_timeout_s``: maybe one slow input's fault, so the batch is bisected."""


class AdaptiveBatcher(Generic[P, R]):
    def __init__(
        self,
        process_fn: ProcessFn,
        config: BatcherConfig = BatcherConfig(),
        *,
        wait_policy: WaitPolicy | None = None,
        cost_fn: Callable[[P], float] | None = None,
        batch_cost_fn: BatchCostFn | None = None,
        metrics: BatcherMetrics | None = None,
        name: str = "default",
    ) -> None:
        """``cost_fn`` measures one item and a batch costs the sum; ``batch_cost_fn`` measures a whole batch (e.g.
        its longest text times its length, what padding costs), asked again for each item that might join it."""
        if cost_fn is not None and batch_cost_fn is not None:
            raise ValueError("give cost_fn or batch_cost_fn, not both")
        self.name = name
        self._process = process_fn
        self._config = config
        self._custom_policy = wait_policy
        self._policy = DispatchPolicy(config, wait_policy or DepthScaledWait(config.max_wait_ms, config.scale_factor),
                                      batch_cost_fn)
        self._pending: tuple[BatcherConfig, WaitPolicy | None] | None = None  # settings for after the next batch
        self._cost_fn = cost_fn
        self._batch_cost_fn = batch_cost_fn
        self._metrics = CountingMetrics(metrics if metrics is not None else _NO_METRICS)
        self._lanes = Lanes()
        self._delayed: set[Item] = set()
        self._tasks: dict[asyncio.Task, list[Item]] = {}  # each batch in flight, and its items
        self._in_flight = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at = math.inf
        self._closing = False
        self._drain = True
        self._settled: asyncio.Event | None = None
        self._admission = Admission(config)
        self._rate = DrainRate()

    # ---- public API -------------------------------------------------------------------------------------------

    @property
    def config(self) -> BatcherConfig:
        return self._config

    @property
    def wait_policy(self) -> WaitPolicy:
        return self._policy.wait_policy

    def reconfigure(self, *, wait_policy: WaitPolicy | None = None, from_next_batch: bool = False,
                    **changes: Any) -> None:
        """Change settings at run time (validated like the constructor); queued items keep their place.

        ``wait_policy`` replaces the wait policy (without one ever given, a depth-scaled wait follows
        ``max_wait_ms`` and ``scale_factor``). With ``from_next_batch``, the batch filling now keeps the settings it
        started with and the new ones apply once it has left (what ``@serve.batch``'s setters do)."""
        config, policy = self._pending or (self._config, self._custom_policy)
        config = dataclasses.replace(config, **changes)
        policy = wait_policy or policy
        if from_next_batch and len(self._lanes):
            self._pending = (config, policy)
            return
        self._pending = None
        self._apply(config, policy)
        if self._loop is not None:
            self._pump()

    def _apply(self, config: BatcherConfig, wait_policy: WaitPolicy | None) -> None:
        self._config = self._policy.config = self._admission.config = config
        self._custom_policy = wait_policy
        self._policy.wait_policy = wait_policy or DepthScaledWait(config.max_wait_ms, config.scale_factor)

    async def submit(self, payload: P, *, priority: Priority = Priority.HIGH, timeout_s: float | None = None,
                     key: Hashable = None, weight: float = 1.0) -> R:
        """The payload's result. ``key``: whose it is (a tenant, a client): keys share each priority's batches by
        ``weight`` (see ``queue.py``); None: nobody's."""
        self._admit(1, priority, timeout_s)
        items, deadline_timer = self._enqueue((payload,), priority, timeout_s, key=key, weight=weight)
        self._pump()
        return await self._wait_for(items, deadline_timer, items[0].future)

    def submit_nowait(
        self, payload: P, on_end: Callable[[BaseException | None], None], *, priority: Priority = Priority.HIGH,
        timeout_s: float | None = None, key: Hashable = None, weight: float = 1.0,
    ) -> Callable[[], None]:
        """Queue one item for a caller that does not await it, e.g. one reading a stream the process function feeds.

        ``on_end(error)`` is called once, at the moment the item ends: with None after a result, else with the error
        ``submit`` would raise. Returns ``withdraw()``, for a caller that stops waiting: the item is never sent if
        still queued, and a result on its way is dropped (``on_end`` is not called then)."""
        self._admit(1, priority, timeout_s)
        items, deadline_timer = self._enqueue((payload,), priority, timeout_s, awaited=False, key=key,
                                              weight=weight)
        items[0].on_settle = on_end if deadline_timer is None else functools.partial(_end_in_time, deadline_timer,
                                                                                    on_end)
        self._pump()
        return functools.partial(self._withdraw, items, deadline_timer)

    async def submit_many(
        self,
        payloads: Sequence[P],
        *,
        priority: Priority = Priority.HIGH,
        timeout_s: float | None = None,
        return_exceptions: bool = False,
        key: Hashable = None,
        weight: float = 1.0,
    ) -> list[R | BaseException]:
        if not payloads:
            return []
        self._admit(len(payloads), priority, timeout_s)
        items, deadline_timer = self._enqueue(payloads, priority, timeout_s, key=key, weight=weight)
        self._pump()
        await self._wait_for(items, deadline_timer, asyncio.wait([item.future for item in items]))
        outcomes = [item.future.exception() or item.future.result() for item in items]
        if not return_exceptions:
            for outcome in outcomes:
                if isinstance(outcome, BaseException):
                    raise outcome
        return outcomes

    def stats(self) -> BatcherStats:
        counts = self._metrics
        return BatcherStats(
            queued_high=self._lanes[Priority.HIGH].depth,
            queued_low=self._lanes[Priority.LOW].depth,
            delayed=len(self._delayed),
            in_flight_batches=self._in_flight,
            items=counts.items,
            dispatched_items=counts.dispatched_items,
            batches=counts.batches,
            flushes=dict(counts.flushes),
            rejected=counts.rejections["overload"],
            expired=counts.rejections["deadline"],
            cancelled=counts.rejections["cancelled"],
            retried=counts.retried,
            splits=counts.splits,
        )

    async def aclose(self, drain: bool = True, timeout: float | None = None) -> None:
        """Stop taking items. ``drain`` sends what is queued and waits for it; otherwise queued items fail with
        ``BatcherClosed``. Either way, batches already in flight are awaited. After ``timeout`` seconds, whatever is
        still queued or in flight fails with ``BatcherClosed``, and the batches' tasks are cancelled and awaited."""
        if self._settled is None:
            self._closing, self._drain = True, drain
            self._settled = asyncio.Event()
            if not drain:
                self._fail_waiting()
            if self._loop is not None:
                self._pump()
            self._check_settled()
        try:
            async with asyncio.timeout(timeout):
                await self._settled.wait()
        except TimeoutError:
            self._give_up()
            await self._settled.wait()
        if self._timer is not None:
            self._timer.cancel()

    async def __aenter__(self) -> "AdaptiveBatcher[P, R]":
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose(drain=True)

    # ---- waiting ------------------------------------------------------------------------------------------------

    def _withdraw(self, items: list[Item], deadline_timer: asyncio.TimerHandle | None) -> None:
        if deadline_timer is not None:
            deadline_timer.cancel()
        self._abandon(items)

    async def _wait_for(self, items: list[Item], deadline_timer: asyncio.TimerHandle | None,
                        waiting: Awaitable[T]) -> T:
        """``waiting``, for the caller of ``items``: if it stops waiting, they are abandoned; either way its deadline
        timer goes. (A coroutine, not a context manager: this is on submit's path for every item, and a
        generator-based context manager adds a generator object and its frames to each call.)"""
        try:
            return await waiting
        except asyncio.CancelledError:
            self._abandon(items)
            raise
        finally:
            if deadline_timer is not None:
                deadline_timer.cancel()

    # ---- admission ----------------------------------------------------------------------------------------------

    def _admit(self, count: int, priority: Priority, timeout_s: float | None) -> None:
        if self._closing:
            raise BatcherClosed("batcher is closed")
        if self._loop is None:
            self._loop = asyncio.get_running_loop()
        lanes = self._lanes
        refusal = self._admission.refusal(
            self.name, count, priority, timeout_s, queued=len(lanes), delayed=len(self._delayed),
            ahead=lanes[HIGH].depth + (lanes[LOW].depth if priority is LOW else 0), rate=self._rate)
        if refusal is not None:
            self._metrics.item_rejected(self.name, "overload", count)
            raise Overloaded(refusal.retry_after_s, refusal.reason)

    def _enqueue(
        self, payloads: Sequence[P], priority: Priority, timeout_s: float | None, awaited: bool = True,
        key: Hashable = None, weight: float = 1.0,
    ) -> tuple[list[Item], asyncio.TimerHandle | None]:
        """Queue the items of one call; they share one deadline, so one timer expires them. Items nobody awaits get
        no future."""
        loop = self._loop
        now = loop.time()
        cost_fn = self._cost_fn
        deadline = None if timeout_s is None else now + timeout_s
        lane = self._lanes[priority]
        max_gap_s = self._config.max_wait_ms / 1000.0
        items = []
        metrics = self._metrics
        for seq, payload in enumerate(payloads, metrics.items):  # arrival order: the items admitted before it
            item = Item(seq, payload, loop.create_future() if awaited else None, priority, now,
                        cost_fn(payload) if cost_fn else 1.0, deadline, key)
            lane.push(item, max_gap_s, weight)
            items.append(item)
        metrics.items_admitted(self.name, len(items))
        metrics.queue_depth(self.name, priority, lane.depth)
        timer = None if deadline is None else loop.call_at(deadline, self._on_deadline, items)
        return items, timer

    # ---- dispatch -----------------------------------------------------------------------------------------------

    def _pump(self) -> None:
        """Send every batch the policy allows now; otherwise arm the timer for when one could be ready."""
        lanes, policy = self._lanes, self._policy
        if self._pending is not None and not len(lanes):
            self._apply(*self._pending)
            self._pending = None
        if self._in_flight >= self._config.max_concurrent_batches:  # every arrival while the slots are busy
            return
        now = self._loop.time()
        while len(lanes) and self._in_flight < self._config.max_concurrent_batches:
            config = self._config
            decision = policy.choose(lanes, self._in_flight, self._closing, now)
            if decision.lane is None:
                self._arm_timer(decision.wake_at)
                return
            batch = lanes[decision.lane].take(config.max_batch_size, config.max_batch_cost, self._batch_cost_fn)
            policy.dispatched(lanes, decision, len(batch))
            if self._pending is not None:  # the batch that was filling has left
                self._apply(*self._pending)
                self._pending = None
            self._dispatch(batch, decision.reason, now)

    def _arm_timer(self, when: float) -> None:
        # A timer that fires too early is harmless (the pump re-checks), so only an earlier moment re-arms it.
        if when < self._timer_at - EPS:
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
            if item.deadline is not None and item.deadline <= now:
                self._expire(item)
            else:
                live.append(item)
        if not live or (len(live) == 1 and self._refused_as_oversized(live[0])):
            return
        self._in_flight += 1
        self._rate.batch_sent(len(live))
        self._metrics.batch_flushed(self.name, reason, len(live), [now - item.enqueued_at for item in live])
        self._metrics.queue_depth(self.name, live[0].priority, self._lanes[live[0].priority].depth)
        task = self._loop.create_task(self._run_batch(live))
        self._tasks[task] = live
        task.add_done_callback(self._batch_done)

    def _refused_as_oversized(self, item: Item) -> bool:
        """With ``refuse_oversized``, an item that alone costs more than the budget fails instead of travelling."""
        budget = self._config.max_batch_cost
        if not self._config.refuse_oversized or budget is None:
            return False
        cost = self._batch_cost_fn([item.payload]) if self._batch_cost_fn is not None else item.cost
        if cost <= budget:
            return False
        item.settle(error=ItemTooLarge(f"an item of cost {cost} is over the batch budget of {budget}"))
        return True

    def _batch_done(self, task: asyncio.Task) -> None:
        del self._tasks[task]
        self._in_flight -= 1
        if not task.cancelled() and task.exception() is not None:
            logger.error("batcher %r: a batch failed unexpectedly", self.name, exc_info=task.exception())
        self._pump()
        self._check_settled()

    # ---- running a batch ----------------------------------------------------------------------------------------

    async def _run_batch(self, items: list[Item]) -> None:
        _BATCH_PRIORITY.set(items[0].priority)  # this task's own context: no other batch sees it
        try:
            retries = await self._attempt(items)
        except BaseException as exc:
            # Our own failure (or cancellation): no item may be left without an outcome.
            error = exc if isinstance(exc, Exception) else BatcherClosed("batch cancelled")
            for item in items:
                if item.state is IN_FLIGHT:
                    item.settle(error=error)
            raise
        if retries:
            self._retry(retries)

    async def _attempt(self, items: list[Item]) -> list[tuple[Item, BaseException]]:
        """Send the items once and settle them; return those that failed retryably (to be queued again together).

        A raised error that is retryable (the call failed, not an input) fails every item in place; any other raised
        error, or running past ``batch_timeout_s``, bisects the batch so a poisonous item fails alone."""
        live = [item for item in items if not item.done]
        if not live:
            return []
        payloads, slots = self._unique_payloads(live)
        started = self._loop.time()
        try:
            results = await self._call(payloads)
        except Exception as exc:
            self._record_latency(started)
            if len(payloads) > 1 and self._config.split_on_failure and (
                    isinstance(exc, _BatchTimedOut) or not is_retryable(exc)):
                self._metrics.batch_split(self.name)
                half = len(payloads) // 2
                first = await self._attempt([item for item, slot in zip(live, slots) if slot < half])
                return first + await self._attempt([item for item, slot in zip(live, slots) if slot >= half])
            return self._settle_failures([(item, exc) for item in live])
        self._record_latency(started)
        if len(results) != len(payloads):
            error = BatchResultMismatch(f"process function returned {len(results)} results for {len(payloads)} payloads")
            for item in live:
                item.settle(error=error)
            return []
        failures = []
        for item, slot in zip(live, slots):
            result = results[slot]
            if isinstance(result, BaseException):
                failures.append((item, result))
            else:
                item.settle(result)
        return self._settle_failures(failures)

    async def _call(self, payloads: list[Any]) -> Sequence[Any]:
        timeout_s = self._config.batch_timeout_s
        if timeout_s is None:
            return await self._process(payloads)
        try:
            async with asyncio.timeout(timeout_s):
                return await self._process(payloads)
        except TimeoutError as exc:
            raise _BatchTimedOut(f"the process call ran past batch_timeout_s={timeout_s}s") from exc

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
        self._rate.batch_done(latency)
        self._metrics.batch_completed(self.name, latency)

    def _settle_failures(self, failures: list[tuple[Item, BaseException]]) -> list[tuple[Item, BaseException]]:
        """Fail the items that get no other attempt; return the rest."""
        retries = []
        may_retry = not (self._closing and not self._drain)
        for item, exc in failures:
            if item.done:
                continue
            if may_retry and (isinstance(exc, Postponed) or
                              item.attempts < self._config.max_retries and is_retryable(exc)):
                retries.append((item, exc))
            else:
                item.settle(error=exc)
        return retries

    def _retry(self, retries: list[tuple[Item, BaseException]]) -> None:
        """Queue failed items again, together, after the delay their errors ask for (the longest of them). A
        postponed item was not sent: that is no attempt."""
        attempted = [item for item, exc in retries if not isinstance(exc, Postponed)]
        for item in attempted:
            item.attempts += 1
        if attempted:
            self._metrics.item_retried(self.name, len(attempted))
        items = [item for item, _ in retries]
        delay = max(retry_after_s(exc) for _, exc in retries)
        if delay > 0:
            for item in items:
                item.delay()
            self._delayed.update(items)
            self._loop.call_later(delay, self._requeue, items)
        else:
            self._requeue(items)

    def _requeue(self, items: list[Item]) -> None:
        self._delayed.difference_update(items)
        waiting = [item for item in items if not item.done]
        if self._closing and not self._drain:
            for item in waiting:
                item.settle(error=BatcherClosed("batcher closed before the item could be retried"))
            self._check_settled()
            return
        for item in waiting:
            self._lanes[item.priority].put_back(item)
        self._report_depths()
        self._pump()
        self._check_settled()

    # ---- items that leave early ---------------------------------------------------------------------------------

    def _leave_queue(self, item: Item) -> None:
        if item.state is QUEUED:
            self._lanes[item.priority].discard(item)
        elif item.state is DELAYED:
            self._delayed.discard(item)

    def _expire(self, item: Item) -> None:
        self._leave_queue(item)
        waited = self._loop.time() - item.enqueued_at
        if item.settle(error=DeadlineExceeded(f"no result within the deadline (waited {waited:.3f}s)")):
            self._metrics.item_rejected(self.name, "deadline", 1)

    def _on_deadline(self, items: list[Item]) -> None:
        pending = [item for item in items if not item.done]
        was_waiting = any(item.waiting for item in pending)
        for item in pending:
            self._expire(item)
        if was_waiting:
            self._report_depths()
            self._pump()
            self._check_settled()

    def _abandon(self, items: list[Item]) -> None:
        """The caller stopped waiting: its items never go out, and results already on their way are dropped."""
        pending = [item for item in items if item.state is not DONE]
        was_waiting = any(item.waiting for item in pending)
        for item in pending:
            self._leave_queue(item)
            item.abandon()
        if pending:
            self._metrics.item_rejected(self.name, "cancelled", len(pending))
        if was_waiting:
            self._report_depths()
            self._pump()
            self._check_settled()

    def _fail_waiting(self) -> None:
        """Closing without draining: the queued items, and those waiting out a Retry-After, are never sent."""
        for item in [*self._lanes.drain(), *self._delayed]:
            item.settle(error=BatcherClosed("batcher closed before the item was sent"))
        self._delayed.clear()
        self._report_depths()

    def _give_up(self) -> None:
        """The close timed out: nothing more is sent or retried, and the batches in flight are cancelled. Their items
        fail here rather than in ``_run_batch``, which a task cancelled before it started never runs."""
        self._drain = False
        self._fail_waiting()
        closed = BatcherClosed("batcher closed while the item's batch was in flight")
        for task, items in self._tasks.items():
            for item in items:
                if item.state is IN_FLIGHT:
                    item.settle(error=closed)
            task.cancel()

    def _report_depths(self) -> None:
        for lane in self._lanes:
            self._metrics.queue_depth(self.name, lane.priority, lane.depth)

    def _check_settled(self) -> None:
        if self._settled is not None and not (self._in_flight or len(self._lanes) or self._delayed):
            self._settled.set()


def _end_in_time(deadline_timer: asyncio.TimerHandle, on_end: Callable[[BaseException | None], None],
                 error: BaseException | None) -> None:
    deadline_timer.cancel()
    on_end(error)

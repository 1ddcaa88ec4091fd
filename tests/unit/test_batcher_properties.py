"""Random mixes of submissions, priorities, deadlines, cancellations, failures and closes keep the invariants:
every item ends exactly once with its own result or an allowed error; submit_many keeps order; batches respect
size and cost; in-flight batches respect the cap; a success is never sent again; expired or cancelled items
are not sent after they left."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import looptime
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from batching import (
    AdaptiveBatcher,
    BatcherClosed,
    BatcherConfig,
    DeadlineExceeded,
    Overloaded,
    Priority,
)

BEHAVIOURS = ("ok", "ok", "ok", "fail", "transient", "poison", "slow")


class ItemFailed(Exception):
    pass


class Poisoned(Exception):
    pass


@dataclass(frozen=True)
class Payload:
    ident: int
    behaviour: str
    cost: int


@dataclass(frozen=True)
class Op:
    gap_s: float
    payloads: tuple[Payload, ...]
    many: bool
    priority: Priority
    timeout_s: float | None
    cancel_after_s: float | None


def payloads(start: int):
    return st.lists(
        st.tuples(st.sampled_from(BEHAVIOURS), st.integers(1, 6)), min_size=1, max_size=5
    ).map(lambda specs: tuple(Payload(start + i, b, c) for i, (b, c) in enumerate(specs)))


@st.composite
def scenarios(draw):
    config = BatcherConfig(
        max_batch_size=draw(st.integers(1, 8)),
        max_batch_cost=draw(st.none() | st.integers(4, 20)),
        max_wait_ms=draw(st.sampled_from([0.0, 5.0, 25.0])),
        scale_factor=draw(st.sampled_from([1.0, 10.0])),
        max_concurrent_batches=draw(st.integers(1, 3)),
        max_queue_depth=draw(st.integers(5, 30)),  # a longer submit_many is a ValueError
        batch_timeout_s=draw(st.sampled_from([None, 0.2])),
        max_retries=draw(st.integers(0, 2)),
        low_share=draw(st.sampled_from([0.0, 0.1, 0.5])),
        stall_factor=draw(st.sampled_from([None, 3.0])),
    )
    ops = []
    next_id = 0
    for _ in range(draw(st.integers(1, 25))):
        batch = draw(payloads(next_id))
        next_id += len(batch)
        ops.append(Op(
            gap_s=draw(st.sampled_from([0.0, 0.0, 0.001, 0.01, 0.05])),
            payloads=batch,
            many=draw(st.booleans()),
            priority=draw(st.sampled_from(list(Priority))),
            timeout_s=draw(st.sampled_from([None, None, 0.03, 0.3])),
            cancel_after_s=draw(st.sampled_from([None, None, None, 0.0, 0.02])),
        ))
    close = draw(st.sampled_from([None, True, False]))
    close_after_op = draw(st.integers(0, len(ops)))
    close_timeout_s = draw(st.sampled_from([None, None, 0.0, 0.02, 0.3]))
    return config, ops, close, close_after_op, close_timeout_s


class RecordingProcess:
    def __init__(self, config: BatcherConfig) -> None:
        self.config = config
        self.calls: list[tuple[float, list[Payload]]] = []
        self.succeeded: list[tuple[int, int]] = []  # (call index, payload id) that got a result
        self.attempts: dict[int, int] = {}
        self.in_flight = 0
        self.max_in_flight = 0

    async def __call__(self, batch: list[Payload]):
        loop = asyncio.get_running_loop()
        call = len(self.calls)
        self.calls.append((loop.time(), list(batch)))
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            await asyncio.sleep(0.5 if any(p.behaviour == "slow" for p in batch) else 0.01 * (1 + len(batch) % 3))
            if any(p.behaviour == "poison" for p in batch):
                raise Poisoned("the batch holds a poisonous item")
            results = []
            for p in batch:
                self.attempts[p.ident] = self.attempts.get(p.ident, 0) + 1
                if p.behaviour == "fail":
                    results.append(ItemFailed(p.ident))
                elif p.behaviour == "transient" and self.attempts[p.ident] == 1:
                    results.append(ConnectionError(p.ident))
                else:
                    results.append(("ok", p.ident))
                    self.succeeded.append((call, p.ident))
            return results
        finally:
            self.in_flight -= 1


ALLOWED_ERRORS = (ItemFailed, ConnectionError, Poisoned, TimeoutError, DeadlineExceeded, BatcherClosed, Overloaded)


async def run_scenario(
    config: BatcherConfig, ops: list[Op], close: bool | None, close_after_op: int, close_timeout_s: float | None
) -> None:
    loop = asyncio.get_running_loop()
    process = RecordingProcess(config)
    batcher = AdaptiveBatcher(process, config, cost_fn=lambda p: p.cost)
    left_at: dict[int, float] = {}  # payload id -> when its caller stopped waiting (cancel)
    deadline_of: dict[int, float] = {}
    callers: list[tuple[Op, asyncio.Task]] = []
    closing = None

    for index, op in enumerate(ops):
        if index == close_after_op and close is not None:
            closing = asyncio.ensure_future(batcher.aclose(drain=close, timeout=close_timeout_s))
        if op.gap_s:
            await asyncio.sleep(op.gap_s)
        if op.many:
            call = batcher.submit_many(list(op.payloads), priority=op.priority, timeout_s=op.timeout_s,
                                       return_exceptions=True)
        else:
            call = batcher.submit(op.payloads[0], priority=op.priority, timeout_s=op.timeout_s)
        task = asyncio.ensure_future(call)
        callers.append((op, task))
        if op.timeout_s is not None:
            for p in op.payloads:
                deadline_of[p.ident] = loop.time() + op.timeout_s
        if op.cancel_after_s is not None:
            def cancel(task=task, op=op):
                if not task.done():
                    task.cancel()
                    for p in (op.payloads if op.many else op.payloads[:1]):
                        left_at[p.ident] = loop.time()
            loop.call_later(op.cancel_after_s, cancel)

    await asyncio.wait_for(asyncio.gather(*(t for _, t in callers), return_exceptions=True), timeout=120)
    if closing is not None:
        await asyncio.wait_for(closing, timeout=120)
    else:
        await asyncio.wait_for(batcher.aclose(), timeout=120)

    # Every caller ended, with its own results in order, or an allowed error.
    for op, task in callers:
        assert task.done()
        if task.cancelled():
            continue
        outcome = task.exception() or task.result()
        sent = op.payloads if op.many else op.payloads[:1]
        outcomes = outcome if op.many and not isinstance(outcome, BaseException) else [outcome] * len(sent)
        assert len(outcomes) == len(sent)
        for payload, result in zip(sent, outcomes):
            if isinstance(result, BaseException):
                assert isinstance(result, ALLOWED_ERRORS), repr(result)
            else:
                assert result == ("ok", payload.ident)
                assert payload.behaviour in ("ok", "transient", "slow")

    # Batches respect size and cost; in-flight batches respect the cap.
    for _, batch in process.calls:
        assert len(batch) <= config.max_batch_size
        if config.max_batch_cost is not None and len(batch) > 1:
            assert sum(p.cost for p in batch) <= config.max_batch_cost
    assert process.max_in_flight <= config.max_concurrent_batches

    # A success is never sent again.
    succeeded_ids = [ident for _, ident in process.succeeded]
    assert len(succeeded_ids) == len(set(succeeded_ids))
    first_success = {ident: call for call, ident in process.succeeded}
    for call_index, (_, batch) in enumerate(process.calls):
        for p in batch:
            assert first_success.get(p.ident, call_index) >= call_index

    # Items that left (deadline passed or caller cancelled) are not sent afterwards.
    for started, batch in process.calls:
        for p in batch:
            assert started < deadline_of.get(p.ident, float("inf")) + 1e-9
            assert started <= left_at.get(p.ident, float("inf")) + 1e-9

    stats = batcher.stats()
    assert stats.queue_depth == 0 and stats.in_flight_batches == 0 and stats.delayed == 0
    assert asyncio.all_tasks() == {asyncio.current_task()}  # no batch task outlives aclose


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenarios())
def test_batcher_invariants_hold_under_random_mixes(scenario):
    loop = looptime.new_event_loop()
    try:
        loop.run_until_complete(run_scenario(*scenario))
    finally:
        loop.close()

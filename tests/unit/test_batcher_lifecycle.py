"""Every submitted item ends in exactly one result or one exception, on every path."""

import asyncio

import pytest

from batching import (
    AdaptiveBatcher,
    BatcherClosed,
    BatcherConfig,
    BatchResultMismatch,
    DeadlineExceeded,
    NeverFits,
    Overloaded,
    Postponed,
    Priority,
)

from .fake_process import FakeProcess

pytestmark = pytest.mark.looptime


class Poisoned(Exception):
    pass


class RateLimited(Exception):
    retryable = True

    def __init__(self, retry_after_s: float) -> None:
        super().__init__("429")
        self.retry_after_s = retry_after_s


def now() -> float:
    return asyncio.get_running_loop().time()


async def test_an_error_entry_fails_that_item_alone():
    process = FakeProcess(answer=lambda p: ValueError(f"bad {p}") if p == "bad" else p.upper())
    batcher = AdaptiveBatcher(process)
    results = await batcher.submit_many(["a", "bad", "c"], return_exceptions=True)
    assert results[0] == "A" and results[2] == "C"
    assert isinstance(results[1], ValueError) and str(results[1]) == "bad bad"
    assert len(process.calls) == 1  # a non-retryable error is not sent again


async def test_retryable_items_ride_a_later_batch_and_successes_are_never_sent_again():
    failures = {"flaky": 1}

    def answer(p):
        if failures.get(p):
            failures[p] -= 1
            return ConnectionError("reset")
        return p

    process = FakeProcess(answer=answer)
    batcher = AdaptiveBatcher(process, BatcherConfig(max_retries=1))
    assert await batcher.submit_many(["a", "flaky", "b"]) == ["a", "flaky", "b"]
    assert process.calls == [["a", "flaky", "b"], ["flaky"]]
    assert batcher.stats().retried == 1


async def test_retries_stop_at_max_retries():
    process = FakeProcess(answer=lambda p: TimeoutError("upstream timed out"))
    batcher = AdaptiveBatcher(process, BatcherConfig(max_retries=2))
    with pytest.raises(TimeoutError, match="upstream timed out"):
        await batcher.submit("x")
    assert process.calls == [["x"], ["x"], ["x"]]


async def test_retry_after_delays_the_retry_instead_of_failing():
    attempts = []

    def answer(p):
        attempts.append(now())
        return RateLimited(retry_after_s=2.0) if len(attempts) == 1 else p

    batcher = AdaptiveBatcher(FakeProcess(answer=answer), BatcherConfig(max_retries=1))
    assert await batcher.submit("x") == "x"
    assert attempts[1] - attempts[0] >= 2.0


async def test_a_postponed_item_waits_out_of_its_slot_and_uses_no_retry_and_its_deadline_still_ends_it():
    attempts = []

    def answer(p):
        attempts.append((p, now()))
        return Postponed(1.0) if p != "other" and now() < 3.0 else p

    config = BatcherConfig(max_retries=0, max_concurrent_batches=1, max_wait_ms=0.0)
    batcher = AdaptiveBatcher(FakeProcess(answer=answer), config)
    later = asyncio.ensure_future(batcher.submit("later"))
    gone = asyncio.ensure_future(batcher.submit("gone", timeout_s=1.5))
    await asyncio.sleep(0.1)
    assert await batcher.submit("other") == "other"  # the only slot was free while the others waited
    assert now() == pytest.approx(0.1)
    assert await later == "later" and now() == pytest.approx(3.0)  # postponed three times: no retry used
    with pytest.raises(DeadlineExceeded):
        await gone
    assert [p for p, _ in attempts].count("gone") == 2  # not sent again once its deadline passed
    assert batcher.stats().retried == 0


async def test_wrong_number_of_results_fails_every_item_of_the_batch():
    async def process(payloads):
        return payloads[:-1]

    batcher = AdaptiveBatcher(process)
    results = await batcher.submit_many([1, 2, 3], return_exceptions=True)
    assert all(isinstance(r, BatchResultMismatch) for r in results)


async def test_a_raising_batch_is_bisected_so_the_poisonous_item_fails_alone():
    calls = []

    async def process(payloads):
        calls.append(list(payloads))
        if "poison" in payloads:
            raise Poisoned("cannot embed")
        return [p * 2 for p in payloads]

    batcher = AdaptiveBatcher(process, BatcherConfig(max_batch_size=8))
    items = ["a", "b", "c", "poison", "e", "f", "g", "h"]
    results = await batcher.submit_many(items, return_exceptions=True)
    assert [r for r in results if not isinstance(r, Exception)] == [p * 2 for p in items if p != "poison"]
    assert isinstance(results[3], Poisoned)
    assert calls[0] == items and ["poison"] in calls
    sent_ok = [p for call in calls if "poison" not in call for p in call]
    assert sorted(sent_ok) == sorted(p for p in items if p != "poison")  # successes sent exactly once
    assert batcher.stats().splits == 3


async def test_a_retryable_raise_retries_the_batch_whole_instead_of_bisecting_it():
    calls = []

    async def process(payloads):
        calls.append(list(payloads))
        raise ConnectionError("upstream unreachable")

    batcher = AdaptiveBatcher(process, BatcherConfig(max_batch_size=64, max_retries=1, max_wait_ms=0))
    results = await batcher.submit_many(list(range(64)), return_exceptions=True)
    assert all(isinstance(r, ConnectionError) for r in results)
    assert calls == [list(range(64))] * 2  # max_retries + 1 calls, never a split
    assert batcher.stats().splits == 0


async def test_retried_items_keep_their_place_ahead_of_younger_items():
    failed_once = set()

    def answer(p):
        if p in ("a", "c") and p not in failed_once:
            failed_once.add(p)
            return ConnectionError("reset")
        return p

    process = FakeProcess(delay_s=0.1, answer=answer)
    batcher = AdaptiveBatcher(process, BatcherConfig(max_batch_size=3, max_concurrent_batches=1, max_wait_ms=0,
                                                    max_retries=1))
    first = asyncio.ensure_future(batcher.submit_many(["a", "b", "c"]))
    await process.started.wait()
    later = asyncio.ensure_future(batcher.submit_many(["d", "e"]))
    assert await first == ["a", "b", "c"] and await later == ["d", "e"]
    assert process.calls == [["a", "b", "c"], ["a", "c", "d"], ["e"]]


async def test_an_item_whose_deadline_cannot_be_met_is_refused_at_once_not_timed_out_later():
    process = FakeProcess(delay_s=0.1)
    batcher = AdaptiveBatcher(process, BatcherConfig(max_batch_size=1, max_concurrent_batches=1, max_wait_ms=0))
    await asyncio.gather(*(batcher.submit(i) for i in range(8)))  # history: 10 items/s
    backlog = [asyncio.ensure_future(batcher.submit(f"q{i}")) for i in range(30)]  # ~3 s of work
    await asyncio.sleep(0)
    started = now()
    with pytest.raises(Overloaded) as refused:
        await batcher.submit("hurried", timeout_s=1.0)
    assert now() == started and refused.value.retry_after_s > 0
    assert await batcher.submit("patient", timeout_s=10.0) == ("ok", "patient")
    await asyncio.gather(*backlog)


async def test_batch_timeout_bisects_around_the_slow_item():
    async def process(payloads):
        await asyncio.sleep(10 if "slow" in payloads else 0.01)
        return payloads

    batcher = AdaptiveBatcher(process, BatcherConfig(batch_timeout_s=1.0, max_retries=0))
    results = await batcher.submit_many(["a", "slow", "c", "d"], return_exceptions=True)
    assert results[0] == "a" and results[2:] == ["c", "d"]
    assert isinstance(results[1], TimeoutError)


async def test_equal_payloads_in_one_batch_are_sent_once():
    process = FakeProcess()
    batcher = AdaptiveBatcher(process)
    results = await batcher.submit_many(["same", "other", "same", [1, 2], [1, 2]])
    assert results == [("ok", "same"), ("ok", "other"), ("ok", "same"), ("ok", [1, 2]), ("ok", [1, 2])]
    assert process.calls == [["same", "other", [1, 2], [1, 2]]]  # lists are unhashable: never merged


async def test_overloaded_when_queue_is_full_and_low_refused_from_80_percent():
    process = FakeProcess(delay_s=1.0)
    batcher = AdaptiveBatcher(process, BatcherConfig(max_queue_depth=10, max_batch_size=100, max_wait_ms=100))
    queued = [asyncio.ensure_future(batcher.submit(i)) for i in range(8)]
    await asyncio.sleep(0)
    with pytest.raises(Overloaded) as refused:
        await batcher.submit("low", priority=Priority.LOW)
    assert refused.value.retry_after_s > 0
    queued += [asyncio.ensure_future(batcher.submit(i)) for i in range(8, 10)]
    await asyncio.sleep(0)
    with pytest.raises(Overloaded):
        await batcher.submit("high")
    with pytest.raises(Overloaded):
        await batcher.submit_many(["x", "y"])
    assert batcher.stats().rejected == 4
    await asyncio.gather(*queued)
    assert len(process.sent) == 10


async def test_submit_many_admission_is_all_or_nothing():
    process = FakeProcess(delay_s=1.0)
    batcher = AdaptiveBatcher(process, BatcherConfig(max_queue_depth=5, max_wait_ms=100))
    queued = asyncio.ensure_future(batcher.submit_many([1, 2, 3]))
    await asyncio.sleep(0)
    with pytest.raises(Overloaded):
        await batcher.submit_many([4, 5, 6])
    assert batcher.stats().queue_depth == 3
    await queued
    assert process.sent == [1, 2, 3]


async def test_a_call_larger_than_the_queue_never_fits_even_when_it_is_empty():
    process = FakeProcess()
    batcher = AdaptiveBatcher(process, BatcherConfig(max_queue_depth=5, max_wait_ms=0))
    with pytest.raises(NeverFits, match="6 items can never fit a queue of max_queue_depth=5"):
        await batcher.submit_many(list(range(6)))
    assert batcher.stats().rejected == 0 and process.sent == []  # not an overload: no retry would help
    assert await batcher.submit_many(list(range(5))) == [("ok", i) for i in range(5)]


async def test_deadline_raises_when_it_passes_and_the_item_is_never_sent():
    process = FakeProcess(delay_s=1.0)
    batcher = AdaptiveBatcher(process, BatcherConfig(max_concurrent_batches=1, max_wait_ms=0))
    busy = asyncio.ensure_future(batcher.submit("busy"))
    await process.started.wait()
    start = now()
    with pytest.raises(DeadlineExceeded):
        await batcher.submit("late", timeout_s=0.3)
    assert now() - start == pytest.approx(0.3, abs=2e-6)
    await busy
    await asyncio.sleep(2)
    assert "late" not in process.sent
    assert batcher.stats().expired == 1


async def test_deadline_in_flight_returns_on_time_and_discards_the_late_result():
    process = FakeProcess(delay_s=5.0)
    batcher = AdaptiveBatcher(process, BatcherConfig(max_wait_ms=0))
    start = now()
    with pytest.raises(DeadlineExceeded):
        await batcher.submit("x", timeout_s=1.0)
    assert now() - start == pytest.approx(1.0, abs=2e-6)
    await batcher.aclose()
    assert process.sent == ["x"]


async def test_a_cancelled_caller_is_never_sent():
    process = FakeProcess()
    batcher = AdaptiveBatcher(process, BatcherConfig(max_wait_ms=100, scale_factor=0.001, stall_factor=None))
    gone = asyncio.ensure_future(batcher.submit("gone"))
    stays = asyncio.ensure_future(batcher.submit("stays"))
    await asyncio.sleep(0.01)
    gone.cancel()
    assert await stays == ("ok", "stays")
    assert process.sent == ["stays"]
    assert batcher.stats().cancelled == 1


async def test_cancelling_submit_many_withdraws_its_queued_items():
    process = FakeProcess()
    batcher = AdaptiveBatcher(process, BatcherConfig(max_wait_ms=100, scale_factor=0.001, stall_factor=None))
    many = asyncio.ensure_future(batcher.submit_many([1, 2, 3]))
    await asyncio.sleep(0.01)
    many.cancel()
    with pytest.raises(asyncio.CancelledError):
        await many
    await asyncio.sleep(1)
    assert process.calls == [] and batcher.stats().queue_depth == 0


async def test_submit_many_keeps_input_order_across_batches_and_raises_first_failure_in_order():
    process = FakeProcess(answer=lambda p: KeyError(p) if p in (7, 3) else p)
    batcher = AdaptiveBatcher(process, BatcherConfig(max_batch_size=4))
    with pytest.raises(KeyError) as first:
        await batcher.submit_many(list(range(10)))
    assert first.value.args == (3,)
    results = await batcher.submit_many(list(range(20, 30)))
    assert results == list(range(20, 30)) and len(process.calls) == 6


async def test_close_with_drain_sends_what_is_queued():
    process = FakeProcess(delay_s=0.5)
    batcher = AdaptiveBatcher(process, BatcherConfig(max_wait_ms=1000, scale_factor=0.001))
    pending = [asyncio.ensure_future(batcher.submit(i)) for i in range(5)]
    await asyncio.sleep(0)
    await batcher.aclose(drain=True)
    assert [p.result() for p in pending] == [("ok", i) for i in range(5)]
    assert batcher.stats().flushes == {"drain": 1}
    with pytest.raises(BatcherClosed):
        await batcher.submit("after")


async def test_close_without_drain_fails_queued_items_and_waits_for_batches_in_flight():
    process = FakeProcess(delay_s=0.5)
    batcher = AdaptiveBatcher(process, BatcherConfig(max_concurrent_batches=1, max_wait_ms=0))
    flying = asyncio.ensure_future(batcher.submit("flying"))
    await process.started.wait()
    queued = asyncio.ensure_future(batcher.submit("queued"))
    await asyncio.sleep(0)
    await batcher.aclose(drain=False)
    assert flying.result() == ("ok", "flying")
    with pytest.raises(BatcherClosed):
        queued.result()
    assert process.sent == ["flying"]


class Stubborn:
    """A process function that runs ``delay_s`` and, with ``swallow``, finishes its batch even when cancelled."""

    def __init__(self, delay_s: float, swallow: bool = False) -> None:
        self.delay_s, self.swallow = delay_s, swallow
        self.started = asyncio.Event()
        self.cancelled_at: list[float] = []

    async def __call__(self, payloads):
        self.started.set()
        try:
            await asyncio.sleep(self.delay_s)
        except asyncio.CancelledError:
            self.cancelled_at.append(now())
            if not self.swallow:
                raise
            await asyncio.sleep(self.delay_s)
        return payloads


async def one_in_flight_one_queued(process: Stubborn) -> tuple[AdaptiveBatcher, asyncio.Future, asyncio.Future]:
    batcher = AdaptiveBatcher(process, BatcherConfig(max_batch_size=1, max_concurrent_batches=1, max_wait_ms=0))
    flying = asyncio.ensure_future(batcher.submit("flying"))
    await process.started.wait()
    queued = asyncio.ensure_future(batcher.submit("queued"))
    await asyncio.sleep(0)
    return batcher, flying, queued


async def test_close_timeout_fails_what_is_queued_or_in_flight_and_cancels_the_batches():
    process = Stubborn(delay_s=10.0)
    batcher, flying, queued = await one_in_flight_one_queued(process)
    start = now()
    await batcher.aclose(drain=True, timeout=1.0)
    assert now() - start == pytest.approx(1.0, abs=2e-6)
    assert process.cancelled_at == [pytest.approx(start + 1.0, abs=2e-6)]
    for caller in (flying, queued):
        with pytest.raises(BatcherClosed):
            caller.result()
    assert batcher.stats().in_flight_batches == 0 and batcher.stats().queue_depth == 0
    assert asyncio.all_tasks() == {asyncio.current_task()}  # no batch task outlives aclose


async def test_close_timeout_fails_the_items_of_a_batch_cancelled_before_it_started():
    process = Stubborn(delay_s=10.0)
    batcher, flying, queued = await one_in_flight_one_queued(process)
    closing = asyncio.ensure_future(batcher.aclose(drain=True, timeout=1.0))
    await asyncio.sleep(0)
    # A slot frees at the moment the timeout passes, just after it: the batch sent then is cancelled unstarted.
    asyncio.get_running_loop().call_later(1.0, lambda: batcher.reconfigure(max_concurrent_batches=2))
    await closing
    for caller in (flying, queued):
        with pytest.raises(BatcherClosed):
            caller.result()
    assert len(process.cancelled_at) == 1  # "queued" was dispatched but never reached the process function


async def test_close_timeout_fails_items_waiting_out_a_retry_after():
    process = FakeProcess(answer=lambda p: RateLimited(retry_after_s=60.0))
    batcher = AdaptiveBatcher(process, BatcherConfig(max_wait_ms=0, max_retries=3))
    waiting = asyncio.ensure_future(batcher.submit("x"))
    await asyncio.sleep(0.1)
    assert batcher.stats().delayed == 1
    await batcher.aclose(drain=True, timeout=1.0)
    with pytest.raises(BatcherClosed):
        waiting.result()
    assert process.calls == [["x"]] and batcher.stats().delayed == 0


async def test_a_close_that_ends_before_its_timeout_drains_as_without_one():
    process = FakeProcess(delay_s=0.5)
    batcher = AdaptiveBatcher(process, BatcherConfig(max_wait_ms=1000, scale_factor=0.001))
    pending = [asyncio.ensure_future(batcher.submit(i)) for i in range(3)]
    await asyncio.sleep(0)
    start = now()
    await batcher.aclose(drain=True, timeout=5.0)
    assert now() - start == pytest.approx(0.5, abs=2e-6)
    assert [p.result() for p in pending] == [("ok", i) for i in range(3)]


async def test_a_batch_that_ignores_cancellation_is_awaited_but_its_callers_fail_at_the_timeout():
    process = Stubborn(delay_s=10.0, swallow=True)
    batcher = AdaptiveBatcher(process, BatcherConfig(max_wait_ms=0))
    caller = asyncio.ensure_future(batcher.submit("x"))
    await process.started.wait()
    start = now()
    closing = asyncio.ensure_future(batcher.aclose(drain=False, timeout=1.0))
    with pytest.raises(BatcherClosed):
        await caller  # one outcome: the result the batch returns later is dropped
    assert now() - start == pytest.approx(1.0, abs=2e-6)
    await closing
    assert now() - start == pytest.approx(11.0, abs=2e-6)
    assert asyncio.all_tasks() == {asyncio.current_task()}


async def test_context_manager_drains_on_exit():
    process = FakeProcess()
    async with AdaptiveBatcher(process, BatcherConfig(max_wait_ms=1000, scale_factor=0.001)) as batcher:
        pending = asyncio.ensure_future(batcher.submit("x"))
        await asyncio.sleep(0)
    assert pending.result() == ("ok", "x")


async def test_a_crashing_process_function_fails_its_items_and_the_batcher_keeps_serving():
    crashes = [RuntimeError("process crashed")]

    async def process(payloads):
        if crashes:
            raise crashes.pop()
        return payloads

    batcher = AdaptiveBatcher(process, BatcherConfig(max_retries=0))
    with pytest.raises(RuntimeError, match="process crashed"):
        await batcher.submit("a")
    assert await batcher.submit("b") == "b"


async def test_items_waiting_out_a_retry_after_count_against_the_queue_limit():
    answers = iter([RateLimited(retry_after_s=5.0)] * 3)
    process = FakeProcess(answer=lambda p: next(answers, p))
    batcher = AdaptiveBatcher(process, BatcherConfig(max_queue_depth=4, max_wait_ms=0, stall_factor=None))
    delayed = asyncio.ensure_future(batcher.submit_many(["a", "b", "c"]))
    await asyncio.sleep(0.1)
    assert batcher.stats().delayed == 3 and batcher.stats().queue_depth == 0
    with pytest.raises(Overloaded):
        await batcher.submit_many(["d", "e"])
    assert await delayed == ["a", "b", "c"]


# ---- submit_nowait: a caller that does not await its item ---------------------------------------------------------


async def test_submit_nowait_reports_the_end_of_an_item_once_when_it_happens():
    process = FakeProcess()
    batcher = AdaptiveBatcher(process, BatcherConfig(max_wait_ms=100, stall_factor=None))
    ends: list = []
    batcher.submit_nowait("a", ends.append)
    batcher.submit_nowait("b", ends.append, timeout_s=0.001)  # expires before a batch leaves
    await asyncio.sleep(0.1)
    assert process.sent == ["a"]
    assert ends[0].__class__ is DeadlineExceeded and ends[1] is None
    await batcher.aclose()


async def test_a_withdrawn_item_is_never_sent_and_its_end_not_reported():
    process = FakeProcess()
    batcher = AdaptiveBatcher(process, BatcherConfig(max_wait_ms=10))
    ends: list = []
    withdraw = batcher.submit_nowait("a", ends.append)
    batcher.submit_nowait("b", ends.append)
    withdraw()
    await asyncio.sleep(0.1)
    assert process.sent == ["b"] and ends == [None]
    assert batcher.stats().cancelled == 1
    await batcher.aclose()

"""When batches leave: size, cost, time (re-evaluated as depth changes), stall; the concurrency cap."""

import asyncio
import math

import pytest

from batching import AdaptiveBatcher, BatcherConfig, DepthScaledWait, FixedWait

from .fake_process import FakeProcess

pytestmark = pytest.mark.looptime

WAIT = DepthScaledWait(max_wait_ms=25, scale_factor=10)
FORMULA_ONLY = {"stall_factor": None}  # these tests pin the depth-scaled formula itself


def now() -> float:
    return asyncio.get_running_loop().time()


async def test_lone_item_leaves_after_wait_of_depth_one_not_max_wait():
    process = FakeProcess()
    batcher = AdaptiveBatcher(process, BatcherConfig(max_wait_ms=25, scale_factor=10))
    start = now()
    assert await batcher.submit("a") == ("ok", "a")
    assert process.started_at[0] - start == pytest.approx(WAIT.wait_s(1), abs=2e-6)
    assert batcher.stats().flushes == {"time": 1}


async def test_wait_lengthens_as_depth_grows():
    process = FakeProcess()
    batcher = AdaptiveBatcher(process, BatcherConfig(max_wait_ms=25, scale_factor=10, **FORMULA_ONLY))
    start = now()
    first = asyncio.ensure_future(batcher.submit("a"))
    await asyncio.sleep(0.001)  # before wait_s(1) = 2.27 ms passes, depth grows to 5
    rest = [asyncio.ensure_future(batcher.submit(x)) for x in "bcde"]
    await asyncio.gather(first, *rest)
    assert process.calls == [["a", "b", "c", "d", "e"]]
    assert process.started_at[0] - start == pytest.approx(WAIT.wait_s(5), abs=2e-6)


async def test_wait_shortens_when_queued_items_leave():
    process = FakeProcess()
    batcher = AdaptiveBatcher(process, BatcherConfig(max_wait_ms=25, scale_factor=10, **FORMULA_ONLY))
    start = now()
    keep = asyncio.ensure_future(batcher.submit("keep"))
    leaving = [asyncio.ensure_future(batcher.submit(i)) for i in range(9)]
    await asyncio.sleep(0.004)  # depth 10 → wait 12.5 ms; now cancel nine: depth 1 → wait 2.27 ms, already passed
    for task in leaving:
        task.cancel()
    await keep
    assert process.calls == [["keep"]]
    assert process.started_at[0] - start == pytest.approx(0.004, abs=2e-6)
    assert batcher.stats().cancelled == 9


async def test_size_trigger_sends_full_batches_at_once():
    process = FakeProcess()
    batcher = AdaptiveBatcher(process, BatcherConfig(max_batch_size=4, max_wait_ms=1000))
    start = now()
    results = await asyncio.gather(*(batcher.submit(i) for i in range(8)))
    assert results == [("ok", i) for i in range(8)]
    assert process.calls == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert process.started_at == [start, start]
    assert batcher.stats().flushes == {"size": 2}


async def test_cost_budget_closes_a_batch_before_it_overflows():
    process = FakeProcess()
    config = BatcherConfig(max_batch_size=100, max_batch_cost=10, max_wait_ms=50, max_concurrent_batches=1)
    batcher = AdaptiveBatcher(process, config, cost_fn=len)
    await asyncio.gather(*(batcher.submit(word) for word in ["aaaa", "bbbb", "cccc", "dd"]))
    assert process.calls == [["aaaa", "bbbb"], ["cccc", "dd"]]
    assert batcher.stats().flushes["cost"] == 1


async def test_item_costlier_than_the_budget_travels_alone():
    process = FakeProcess()
    batcher = AdaptiveBatcher(process, BatcherConfig(max_batch_cost=5, max_wait_ms=50), cost_fn=len)
    await asyncio.gather(batcher.submit("x" * 12), batcher.submit("y"))
    assert process.calls == [["x" * 12], ["y"]]
    assert batcher.stats().flushes == {"cost": 1, "time": 1}


async def test_at_most_max_concurrent_batches_in_flight_and_batches_grow_while_waiting_for_a_slot():
    process = FakeProcess(delay_s=0.1)
    batcher = AdaptiveBatcher(process, BatcherConfig(max_batch_size=50, max_concurrent_batches=2, max_wait_ms=5))
    first = [asyncio.ensure_future(batcher.submit(i)) for i in range(2)]
    await asyncio.sleep(0.001)
    await asyncio.sleep(0.01)  # first batch in flight
    second = [asyncio.ensure_future(batcher.submit(i)) for i in range(2, 4)]
    await asyncio.sleep(0.01)  # second batch in flight: both slots busy
    third = [asyncio.ensure_future(batcher.submit(i)) for i in range(4, 30)]
    await asyncio.sleep(0.02)
    assert len(process.calls) == 2 and batcher.stats().queue_depth == 26
    await asyncio.gather(*first, *second, *third)
    assert process.max_in_flight == 2
    assert process.calls[2] == list(range(4, 30))  # not sealed early: one batch of everything queued


async def test_submitting_never_waits_for_a_batch_in_flight():
    process = FakeProcess(delay_s=0.1)
    batcher = AdaptiveBatcher(process, BatcherConfig(max_batch_size=1000, max_concurrent_batches=1))
    inflight = asyncio.ensure_future(batcher.submit("slow"))
    await process.started.wait()
    accepted_at = now()
    waiting = [asyncio.ensure_future(batcher.submit(i)) for i in range(1000)]
    await asyncio.sleep(0)
    assert batcher.stats().queue_depth == 1000 and now() == accepted_at
    await asyncio.gather(inflight, *waiting)


async def test_fixed_wait_policy_waits_the_same_whatever_the_depth():
    process = FakeProcess()
    batcher = AdaptiveBatcher(process, BatcherConfig(max_batch_size=100), wait_policy=FixedWait(0.05))
    start = now()
    await batcher.submit("one")
    assert process.started_at[0] - start == pytest.approx(0.05, abs=2e-6)


async def test_stall_trigger_ends_the_wait_when_arrivals_stop():
    process = FakeProcess()
    config = BatcherConfig(max_batch_size=100, max_wait_ms=25, scale_factor=10, stall_factor=4)
    batcher = AdaptiveBatcher(process, config)
    start = now()
    await asyncio.gather(*(batcher.submit(i) for i in range(50)))  # a burst: nothing more will come
    assert process.calls == [list(range(50))]
    assert process.started_at[0] - start < WAIT.wait_s(50) / 4
    assert batcher.stats().flushes == {"stall": 1}


async def test_stall_trigger_waits_while_items_keep_arriving():
    process = FakeProcess()
    config = BatcherConfig(max_batch_size=100, max_wait_ms=25, scale_factor=10, stall_factor=4)
    batcher = AdaptiveBatcher(process, config)
    start = now()
    tasks = []
    for i in range(12):  # one item every 0.2 ms: the stall window never opens before the time trigger
        tasks.append(asyncio.ensure_future(batcher.submit(i)))
        await asyncio.sleep(0.0002)
    await asyncio.gather(*tasks)
    assert process.calls == [list(range(12))]  # not cut while arrivals kept coming...
    assert process.started_at[0] - start > 11 * 0.0002  # ... and it left only after the last one


async def test_reconfigure_applies_to_queued_items():
    process = FakeProcess()
    config = BatcherConfig(max_batch_size=10, max_wait_ms=1000, scale_factor=1, **FORMULA_ONLY)
    batcher = AdaptiveBatcher(process, config)
    start = now()
    pending = [asyncio.ensure_future(batcher.submit(i)) for i in range(3)]
    await asyncio.sleep(0.001)
    batcher.reconfigure(max_batch_size=3)  # the three queued items now fill a batch: it leaves at once, on size
    await asyncio.gather(*pending)
    assert process.calls == [[0, 1, 2]]
    assert process.started_at[0] - start == pytest.approx(0.001, abs=2e-6)
    assert batcher.stats().flushes == {"size": 1}
    with pytest.raises(ValueError):
        batcher.reconfigure(max_batch_size=0)


async def test_stall_window_learns_from_arrivals_that_join_a_queue_not_from_idle_time():
    process = FakeProcess()
    config = BatcherConfig(max_batch_size=100, max_wait_ms=25, scale_factor=10, stall_factor=4)
    batcher = AdaptiveBatcher(process, config)
    for burst in range(3):  # bursts of 20 arrivals 0.1 ms apart, separated by a second of idle time
        burst_start = now()
        tasks = []
        for i in range(20):
            tasks.append(asyncio.ensure_future(batcher.submit((burst, i))))
            await asyncio.sleep(0.0001)
        await asyncio.gather(*tasks)
        last_arrival = burst_start + 19 * 0.0001
        # (4 + ln 20) x the 0.1 ms gap; the idle second between bursts is not learnt
        assert process.started_at[-1] - last_arrival == pytest.approx((4 + math.log(20)) * 0.0001, abs=5e-6)
        await asyncio.sleep(1.0)
    assert batcher.stats().flushes == {"stall": 3}


async def test_stall_trigger_never_cuts_a_lone_items_wait():
    process = FakeProcess()
    batcher = AdaptiveBatcher(process, BatcherConfig(max_wait_ms=25, scale_factor=10, stall_factor=1))
    await asyncio.gather(batcher.submit("a"), batcher.submit("b"))  # teaches a near-zero gap
    start = now()
    await batcher.submit("lone")
    assert process.started_at[-1] - start == pytest.approx(WAIT.wait_s(1), abs=2e-6)


async def test_stall_window_widens_with_depth_so_steady_traffic_does_not_cut_a_filling_batch():
    process = FakeProcess()
    config = BatcherConfig(max_batch_size=100, max_wait_ms=25, scale_factor=10, stall_factor=4)
    batcher = AdaptiveBatcher(process, config)
    tasks = []
    for i in range(50):  # 0.1 ms apart, but one gap of 0.6 ms: 6 mean gaps, which steady traffic shows now and then
        tasks.append(asyncio.ensure_future(batcher.submit(i)))
        await asyncio.sleep(0.0006 if i == 39 else 0.0001)
    await asyncio.gather(*tasks)
    assert process.calls == [list(range(50))]  # 4 mean gaps alone would have cut it at item 40
    assert batcher.stats().flushes == {"stall": 1}


# ---- a whole-batch cost -------------------------------------------------------------------------------------------


def padded(texts: list[str]) -> int:
    """What a batch costs once padded to its longest text."""
    return max(map(len, texts)) * len(texts)


async def test_a_whole_batch_cost_fills_a_batch_until_the_next_item_would_pass_the_budget():
    process = FakeProcess(answer=len)
    batcher = AdaptiveBatcher(process, BatcherConfig(max_batch_cost=8, max_wait_ms=1000, **FORMULA_ONLY),
                              batch_cost_fn=padded)
    texts = ["aa", "bb", "c", "dddd", "e"]
    assert await asyncio.gather(*(batcher.submit(t) for t in texts)) == [2, 2, 1, 4, 1]
    # ["aa","bb","c"] costs 6; with "dddd" 16: it leaves at once on cost, then ["dddd","e"] (8, full) leaves too
    assert process.calls == [["aa", "bb", "c"], ["dddd", "e"]]
    assert process.started_at == [0.0, 0.0]
    assert batcher.stats().flushes == {"cost": 2}


async def test_a_whole_batch_cost_is_measured_again_when_an_item_leaves_the_head_batch():
    process = FakeProcess(answer=len)
    batcher = AdaptiveBatcher(process, BatcherConfig(max_batch_cost=8, max_wait_ms=1000, **FORMULA_ONLY),
                              wait_policy=FixedWait(1.0), batch_cost_fn=padded)
    kept = asyncio.ensure_future(batcher.submit("b"))
    gone = asyncio.ensure_future(batcher.submit("aaa"))
    await asyncio.sleep(0.1)  # ["b", "aaa"] costs 6: not full
    gone.cancel()
    await asyncio.sleep(0.1)
    last = asyncio.ensure_future(batcher.submit("ccc"))  # ["b", "ccc"] costs 6, not the 9 of a stale measure
    assert await asyncio.gather(kept, last) == [1, 3]
    assert process.calls == [["b", "ccc"]]
    assert process.started_at == [pytest.approx(1.0)]  # on time, not on cost


async def test_cost_fn_and_batch_cost_fn_together_are_refused():
    with pytest.raises(ValueError, match="not both"):
        AdaptiveBatcher(FakeProcess(), cost_fn=len, batch_cost_fn=padded)


async def test_a_new_wait_policy_replaces_the_wait():
    process = FakeProcess()
    batcher = AdaptiveBatcher(process, BatcherConfig(max_wait_ms=25), wait_policy=FixedWait(0.5))
    batcher.reconfigure(wait_policy=FixedWait(0.2))
    start = now()
    await batcher.submit("a")
    assert process.started_at[0] - start == pytest.approx(0.2)

"""HIGH never waits behind LOW nor rides with it; LOW-only batches never take the last slot; LOW is kept from
starving by its share of the items sent, never by turning into HIGH; each lane fires on its own triggers."""

import asyncio
import math

import pytest

from batching import AdaptiveBatcher, BatcherConfig, Priority, batch_priority

from .fake_process import FakeProcess

pytestmark = pytest.mark.looptime

LOW = Priority.LOW


async def settle() -> None:
    """Let submitted calls and the batches they start run up to their first real wait."""
    for _ in range(5):
        await asyncio.sleep(0)


async def test_high_items_leave_before_low_items_queued_earlier():
    process = FakeProcess(delay_s=0.1)
    batcher = AdaptiveBatcher(process, BatcherConfig(max_batch_size=3, max_concurrent_batches=1, max_wait_ms=0))
    busy = asyncio.ensure_future(batcher.submit("busy"))
    await process.started.wait()
    low = [asyncio.ensure_future(batcher.submit(f"low{i}", priority=LOW)) for i in range(4)]
    high = [asyncio.ensure_future(batcher.submit(f"high{i}")) for i in range(2)]
    await asyncio.gather(busy, *low, *high)
    assert process.calls[1:] == [["high0", "high1"], ["low0", "low1", "low2"], ["low3"]]


async def test_a_batch_never_mixes_high_items_with_low_filler():
    process = FakeProcess(delay_s=0.5)
    config = BatcherConfig(max_batch_size=10, max_concurrent_batches=4, max_wait_ms=10, low_share=0,
                           stall_factor=None)
    batcher = AdaptiveBatcher(process, config)
    low = [asyncio.ensure_future(batcher.submit(i, priority=LOW)) for i in range(5)]
    high = asyncio.ensure_future(batcher.submit("high"))
    await asyncio.gather(high, *low)
    assert process.calls == [["high"], [0, 1, 2, 3, 4]]  # both leave at once, in two calls, slots to spare
    assert process.max_in_flight == 2


async def test_low_only_batch_never_takes_the_last_free_slot():
    process = FakeProcess(delay_s=0.5)
    config = BatcherConfig(max_batch_size=2, max_concurrent_batches=2, max_wait_ms=0, low_share=0)
    batcher = AdaptiveBatcher(process, config)
    low = [asyncio.ensure_future(batcher.submit(i, priority=LOW)) for i in range(6)]
    await asyncio.sleep(0.1)
    assert process.in_flight == 1  # one LOW batch runs; the last slot stays free for HIGH
    high_start = asyncio.get_running_loop().time()
    high = asyncio.ensure_future(batcher.submit("high"))
    await settle()
    assert process.in_flight == 2 and process.calls[-1][0] == "high"
    await high
    assert asyncio.get_running_loop().time() - high_start == pytest.approx(0.5, abs=2e-6)
    await asyncio.gather(*low)
    assert process.max_in_flight == 2


async def test_batch_in_the_last_slot_carries_no_low_filler():
    process = FakeProcess(delay_s=0.5)
    config = BatcherConfig(max_batch_size=10, max_concurrent_batches=2, max_wait_ms=0, low_share=0)
    batcher = AdaptiveBatcher(process, config)
    low = [asyncio.ensure_future(batcher.submit(i, priority=LOW)) for i in range(30)]
    await asyncio.sleep(0.1)
    high = asyncio.ensure_future(batcher.submit("high"))
    await settle()
    assert process.calls[-1] == ["high"]
    await asyncio.gather(high, *low)


async def test_with_one_slot_low_uses_it_when_no_high_waits():
    process = FakeProcess()
    batcher = AdaptiveBatcher(process, BatcherConfig(max_concurrent_batches=1, low_share=0))
    assert await batcher.submit("bulk", priority=LOW) == ("ok", "bulk")


async def test_low_gets_its_share_while_high_keeps_every_slot_busy():
    process = FakeProcess(delay_s=0.4)
    config = BatcherConfig(max_batch_size=1, max_concurrent_batches=2, max_wait_ms=0, low_share=0.1)
    batcher = AdaptiveBatcher(process, config)
    high = []

    async def interactive_stream():
        for i in range(60):  # 10 HIGH items/s against 5/s of capacity: HIGH always waits
            high.append(asyncio.ensure_future(batcher.submit(f"h{i}")))
            await asyncio.sleep(0.1)

    stream = asyncio.ensure_future(interactive_stream())
    await asyncio.sleep(0.25)
    sent_before_low = len(process.calls)
    await batcher.submit("low", priority=LOW)
    # One item in ten: nine HIGH items went after LOW arrived, then LOW, long before the HIGH stream ended.
    assert process.calls.index(["low"]) - sent_before_low == 9
    await stream
    await asyncio.gather(*high)


async def test_an_old_low_backlog_never_stands_ahead_of_new_high_items():
    process = FakeProcess(delay_s=2.0)
    config = BatcherConfig(max_batch_size=2, max_concurrent_batches=1, max_wait_ms=0)
    batcher = AdaptiveBatcher(process, config)
    busy = asyncio.ensure_future(batcher.submit("busy"))
    await process.started.wait()
    low = [asyncio.ensure_future(batcher.submit(f"old-low{i}", priority=LOW)) for i in range(4)]
    await asyncio.sleep(1.5)
    high = [asyncio.ensure_future(batcher.submit(f"h{i}")) for i in range(2)]
    await asyncio.gather(busy, *low, *high)
    assert process.calls[1] == ["h0", "h1"]


async def test_the_lane_whose_trigger_fired_is_the_lane_that_is_sent():
    process = FakeProcess(delay_s=0.5)
    config = BatcherConfig(max_batch_size=4, max_concurrent_batches=4, max_wait_ms=1000, stall_factor=None)
    batcher = AdaptiveBatcher(process, config)
    high = asyncio.ensure_future(batcher.submit("high"))
    await settle()
    low = [asyncio.ensure_future(batcher.submit(i, priority=LOW)) for i in range(4)]
    await settle()
    assert process.calls == [[0, 1, 2, 3]]  # LOW reached its size; the lone HIGH item still waits its own time
    assert batcher.stats().flushes == {"size": 1}
    await asyncio.gather(high, *low)
    assert batcher.stats().flushes == {"size": 1, "time": 1}


async def test_each_lane_learns_its_own_arrival_pace_for_the_stall_trigger():
    process = FakeProcess()
    config = BatcherConfig(max_batch_size=500, max_concurrent_batches=4, max_wait_ms=1000, stall_factor=4)
    batcher = AdaptiveBatcher(process, config)
    loop = asyncio.get_running_loop()
    start = loop.time()

    async def arrivals(prefix, count, gap_s, priority):
        calls = []
        for i in range(count):
            calls.append(asyncio.ensure_future(batcher.submit(f"{prefix}{i}", priority=priority)))
            await asyncio.sleep(gap_s)
        return await asyncio.gather(*calls)

    await asyncio.gather(arrivals("h", 5, 0.02, Priority.HIGH), arrivals("l", 100, 0.001, LOW))
    high_call = next(i for i, call in enumerate(process.calls) if call[0] == "h0")
    assert process.calls[high_call] == [f"h{i}" for i in range(5)]
    # The HIGH lane stalls on its own pace (20 ms gaps), not on the LOW lane's 1 ms gaps.
    expected = 0.08 + (4 + math.log(5)) * 0.02
    assert process.started_at[high_call] - start == pytest.approx(expected, abs=1e-4)


async def test_a_lone_high_item_waits_for_its_own_depth_not_for_the_low_queue():
    process = FakeProcess(delay_s=0.5)
    config = BatcherConfig(max_batch_size=100, max_concurrent_batches=4, max_wait_ms=100, scale_factor=10,
                           low_share=0, stall_factor=None)
    batcher = AdaptiveBatcher(process, config)
    loop = asyncio.get_running_loop()
    start = loop.time()
    low = [asyncio.ensure_future(batcher.submit(i, priority=LOW)) for i in range(90)]
    await batcher.submit("high")
    lone_wait_s = 0.1 * (1 - 1 / (1 + 1 / 10))
    assert process.started_at[0] - start == pytest.approx(lone_wait_s, abs=2e-6)  # not wait_s(91) ≈ 90 ms
    assert process.calls[0] == ["high"]
    await asyncio.gather(*low)
    assert process.started_at[1] - start == pytest.approx(0.1 * (1 - 1 / (1 + 90 / 10)), abs=2e-6)


async def test_a_process_call_knows_its_batch_priority_and_nothing_outside_one_does():
    seen = []

    async def process(items):
        await asyncio.sleep(0.01)  # both batches in flight at once: each task keeps its own
        seen.append((items, batch_priority()))
        return items

    batcher = AdaptiveBatcher(process, BatcherConfig(max_batch_size=4, max_concurrent_batches=4, max_wait_ms=0,
                                                     low_share=0))
    await asyncio.gather(batcher.submit("high"), batcher.submit("low", priority=LOW))
    assert sorted(seen) == [(["high"], Priority.HIGH), (["low"], LOW)]
    assert batch_priority() is None

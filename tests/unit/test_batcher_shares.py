"""Keys share a priority's batches by weight (batching/queue.py): a batch is one key's, one key's flood lengthens its
own wait, not another key's; weights set the shares while both are busy; a key back from idle starts level; items
without a key are one more key; a batcher that is never given a key sends in arrival order, as before."""

import asyncio

import pytest

from batching import AdaptiveBatcher, BatcherConfig, Priority

from .fake_process import FakeProcess

pytestmark = pytest.mark.looptime


def busy_batcher(process: FakeProcess, size: int = 4) -> AdaptiveBatcher:
    return AdaptiveBatcher(process, BatcherConfig(max_batch_size=size, max_concurrent_batches=1, max_wait_ms=0))


@pytest.mark.parametrize("priority", [Priority.HIGH, Priority.LOW])
async def test_one_keys_flood_does_not_hold_another_keys_item(priority: Priority) -> None:
    process = FakeProcess(delay_s=0.1)
    batcher = busy_batcher(process)
    busy = asyncio.ensure_future(batcher.submit("busy"))
    await process.started.wait()
    flood = [asyncio.ensure_future(batcher.submit(f"a{i}", priority=priority, key="a")) for i in range(40)]
    late = asyncio.ensure_future(batcher.submit("b0", priority=priority, key="b"))
    await late
    assert process.calls[1:3] == [["a0", "a1", "a2", "a3"], ["b0"]]  # b's one item goes alone, next after it came
    await asyncio.gather(busy, *flood)


async def test_weights_set_the_shares_while_both_keys_are_busy() -> None:
    process = FakeProcess(delay_s=0.1)
    batcher = busy_batcher(process, size=8)
    busy = asyncio.ensure_future(batcher.submit("busy"))
    await process.started.wait()
    heavy = [asyncio.ensure_future(batcher.submit(f"h{i}", key="heavy", weight=3.0)) for i in range(60)]
    light = [asyncio.ensure_future(batcher.submit(f"l{i}", key="light")) for i in range(60)]
    await asyncio.gather(busy, *heavy[:30])
    sent = [item for call in process.calls[1:5] for item in call]
    assert sum(item.startswith("h") for item in sent) == 3 * sum(item.startswith("l") for item in sent)
    await asyncio.gather(*heavy, *light)


async def test_a_key_back_from_idle_starts_level_not_ahead() -> None:
    process = FakeProcess(delay_s=0.1)
    batcher = busy_batcher(process, size=2)
    first = [asyncio.ensure_future(batcher.submit(f"a{i}", key="a")) for i in range(12)]
    await asyncio.gather(*first)  # a alone: it is served a lot while b is idle
    sent_before = len(process.calls)
    busy = asyncio.ensure_future(batcher.submit("busy"))
    await process.started.wait()
    more = [asyncio.ensure_future(batcher.submit(f"b{i}", key="b")) for i in range(4)]
    more += [asyncio.ensure_future(batcher.submit(f"a{i}", key="a")) for i in range(12, 16)]
    await asyncio.gather(busy, *more)
    keys = [call[0][0] for call in process.calls[sent_before + 1:]]
    assert keys in (["a", "b", "a", "b"], ["b", "a", "b", "a"])  # turns, not b's to catch up first


async def test_items_without_a_key_share_with_keys_and_a_keyless_batcher_keeps_arrival_order() -> None:
    process = FakeProcess(delay_s=0.1)
    batcher = busy_batcher(process)
    busy = asyncio.ensure_future(batcher.submit("busy"))
    await process.started.wait()
    plain = [asyncio.ensure_future(batcher.submit(f"n{i}")) for i in range(6)]
    keyed = asyncio.ensure_future(batcher.submit("k0", key="k"))
    await asyncio.gather(busy, keyed, *plain)
    assert process.calls[1:4] == [["n0", "n1", "n2", "n3"], ["k0"], ["n4", "n5"]]
    keyless = FakeProcess(delay_s=0.1)
    ordered = busy_batcher(keyless)
    await asyncio.gather(*(ordered.submit(i) for i in range(9)))
    assert [item for call in keyless.calls for item in call] == list(range(9))

"""``batching.batch``'s waits, on a controlled clock: Serve's fixed ``batch_wait_timeout_s`` by default, the
depth-scaled wait one argument away, and the setters applying from the next batch."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from batching import DepthScaledWait, batch

pytestmark = pytest.mark.looptime


class Recorder:
    def __init__(self) -> None:
        self.batches: list[tuple[float, list[Any]]] = []

    def record(self, items: list) -> list:
        self.batches.append((asyncio.get_running_loop().time(), list(items)))
        return items


def recorded(**settings: Any) -> tuple[Any, Recorder]:
    """A plain function batched with ``settings`` that records when each batch left and what it held."""
    recorder = Recorder()

    @batch(**settings)
    async def handle(items):
        return recorder.record(items)

    return handle, recorder


async def test_a_lone_call_waits_the_whole_batch_wait_timeout():
    handle, recorder = recorded(max_batch_size=10, batch_wait_timeout_s=0.2)

    assert await handle(1) == 1
    assert recorder.batches == [(pytest.approx(0.2), [1])]
    await handle.aclose()


async def test_simultaneous_callers_short_of_a_full_batch_wait_the_timeout_too():
    # no stall trigger called the Serve way: nine callers and then silence still wait the timeout out
    handle, recorder = recorded(max_batch_size=10, batch_wait_timeout_s=0.1)

    assert await asyncio.gather(*(handle(i) for i in range(9))) == list(range(9))
    assert recorder.batches == [(pytest.approx(0.1), list(range(9)))]
    await handle.aclose()


async def test_a_full_batch_leaves_at_once():
    handle, recorder = recorded(max_batch_size=4, batch_wait_timeout_s=5.0)

    await asyncio.gather(*(handle(i) for i in range(4)))
    assert recorder.batches == [(0.0, [0, 1, 2, 3])]
    await handle.aclose()


async def test_the_wait_counts_from_the_oldest_call():
    handle, recorder = recorded(max_batch_size=10, batch_wait_timeout_s=0.1)

    first = asyncio.ensure_future(handle("first"))
    await asyncio.sleep(0.06)
    assert await asyncio.gather(first, handle("second")) == ["first", "second"]
    assert recorder.batches == [(pytest.approx(0.1), ["first", "second"])]
    await handle.aclose()


async def test_scale_factor_turns_on_the_depth_scaled_wait_with_the_timeout_as_its_longest():
    handle, recorder = recorded(max_batch_size=100, batch_wait_timeout_s=0.1, scale_factor=10)

    assert await handle(1) == 1
    assert recorder.batches[0][0] == pytest.approx(DepthScaledWait(100, 10).wait_s(1), abs=2e-6)
    assert handle.batcher().wait_policy == DepthScaledWait(100.0, 10)
    await handle.aclose()


async def test_a_new_timeout_applies_from_the_next_batch_not_the_one_filling():
    handle, recorder = recorded(max_batch_size=10, batch_wait_timeout_s=1.0)

    filling = asyncio.ensure_future(handle("filling"))
    await asyncio.sleep(0.1)
    handle.set_batch_wait_timeout_s(0.2)
    assert await filling == "filling"
    started = asyncio.get_running_loop().time()
    assert await handle("next") == "next"
    assert [at for at, _ in recorder.batches] == [pytest.approx(1.0), pytest.approx(started + 0.2)]
    await handle.aclose()


async def test_a_new_max_batch_size_applies_from_the_next_batch_not_the_one_filling():
    handle, recorder = recorded(max_batch_size=4, batch_wait_timeout_s=0.5)

    filling = [asyncio.ensure_future(handle(i)) for i in range(3)]
    await asyncio.sleep(0.1)
    handle.set_max_batch_size(2)  # the filling batch does not leave at once for being over the new size
    assert await asyncio.gather(*filling) == [0, 1, 2]
    assert recorder.batches == [(pytest.approx(0.5), [0, 1, 2])]
    await asyncio.gather(*(handle(i) for i in range(2)))
    assert recorder.batches[1] == (pytest.approx(0.5), [0, 1])
    await handle.aclose()


async def test_set_timeout_with_the_depth_scaled_wait_changes_its_longest_wait():
    @batch(max_batch_size=100, batch_wait_timeout_s=0.1, scale_factor=10)
    async def handle(items):
        return items

    await handle(0)
    handle.set_batch_wait_timeout_s(0.3)
    assert handle.batcher().wait_policy == DepthScaledWait(300.0, 10)
    assert handle._get_batch_wait_timeout_s() == pytest.approx(0.3)
    await handle.aclose()


async def test_a_batch_formed_while_the_slot_is_busy_leaves_when_it_frees_with_what_queued():
    # Serve seals a batch at its timeout and then waits for the slot; ours forms it when the slot frees, so calls
    # that arrived meanwhile ride along instead of waiting for a later batch.
    recorder = Recorder()

    @batch(max_batch_size=10, batch_wait_timeout_s=0.01)
    async def handle(items):
        recorder.record(items)
        await asyncio.sleep(1.0)
        return items

    first = asyncio.ensure_future(handle("busy"))
    await asyncio.sleep(0.1)
    later = [asyncio.ensure_future(handle(i)) for i in range(3)]
    await asyncio.sleep(0.5)
    later.append(asyncio.ensure_future(handle(3)))
    assert await asyncio.gather(first, *later) == ["busy", 0, 1, 2, 3]
    assert [items for _, items in recorder.batches] == [["busy"], [0, 1, 2, 3]]
    assert recorder.batches[1][0] == pytest.approx(1.01)
    await handle.aclose()

"""@adaptive_batch: one item in, one result out; one batcher per instance, closed through the decorated callable."""

import asyncio
import gc
import weakref

import pytest

from batching import BatcherClosed, DeadlineExceeded, Priority, adaptive_batch

pytestmark = pytest.mark.looptime


class Model:
    def __init__(self, scale: int) -> None:
        self.scale = scale
        self.calls: list[list[int]] = []

    @adaptive_batch(max_batch_size=8, max_wait_ms=10, max_concurrent_batches=2)
    async def embed(self, items: list[int]) -> list[int]:
        self.calls.append(list(items))
        return [item * self.scale for item in items]


async def test_decorated_method_takes_one_item_and_batches_concurrent_calls():
    model = Model(scale=10)
    results = await asyncio.gather(*(model.embed(i) for i in range(20)))
    assert results == [i * 10 for i in range(20)]
    assert [len(call) for call in model.calls] == [8, 8, 4]


async def test_each_instance_has_its_own_batcher():
    first, second = Model(scale=1), Model(scale=2)
    assert await asyncio.gather(first.embed(3), second.embed(3)) == [3, 6]
    assert first.calls == [[3]] and second.calls == [[3]]
    assert Model.embed.batcher(first) is not Model.embed.batcher(second)
    assert Model.embed.batcher(first).stats().batches == 1


async def test_callers_can_pass_priority_and_timeout():
    model = Model(scale=3)
    low = asyncio.ensure_future(model.embed(2, priority="low", timeout_s=5))
    high = asyncio.ensure_future(model.embed(4, priority=Priority.HIGH))
    await asyncio.sleep(0)
    stats = Model.embed.batcher(model).stats()
    assert (stats.queued_low, stats.queued_high) == (1, 1)  # each queued at the priority its caller passed
    assert await asyncio.gather(low, high) == [6, 12]

    @adaptive_batch(max_batch_size=8, max_wait_ms=10)
    async def slow(items: list[int]) -> list[int]:
        await asyncio.sleep(1.0)
        return items

    start = asyncio.get_running_loop().time()
    with pytest.raises(DeadlineExceeded):
        await slow(1, timeout_s=0.5)  # the caller's deadline ends the call, not the handler's second
    assert asyncio.get_running_loop().time() - start == pytest.approx(0.5, abs=2e-6)
    await slow.aclose()


async def test_plain_function_gets_one_batcher_per_loop():
    calls = []

    @adaptive_batch(max_batch_size=4, max_wait_ms=5)
    async def double(items):
        calls.append(items)
        return [item * 2 for item in items]

    assert await asyncio.gather(double(1), double(2)) == [2, 4]
    assert calls == [[1, 2]]


async def test_aclose_closes_the_batcher_of_every_instance_after_draining_it():
    first, second = Model(scale=1), Model(scale=2)
    pending = [asyncio.ensure_future(model.embed(5)) for model in (first, second)]
    await asyncio.sleep(0)
    await Model.embed.aclose()
    assert [p.result() for p in pending] == [5, 10]
    for model in (first, second):
        with pytest.raises(BatcherClosed):
            await model.embed(1)


async def test_aclose_passes_drain_and_timeout_to_each_batcher():
    class Slow:
        @adaptive_batch(max_wait_ms=0)
        async def embed(self, items):
            await asyncio.sleep(10)
            return items

    model = Slow()
    flying = asyncio.ensure_future(model.embed(1))
    await asyncio.sleep(0.1)
    await Slow.embed.aclose(drain=False, timeout=1.0)
    with pytest.raises(BatcherClosed):
        flying.result()
    assert asyncio.get_running_loop().time() == pytest.approx(1.1, abs=2e-6)


async def test_an_instance_is_freed_with_its_batcher_and_aclose_skips_it():
    model = Model(scale=1)
    assert await model.embed(1) == 1
    await asyncio.sleep(0)  # the finished batch's task lets go of the batcher a turn later
    model_ref, batcher_ref = weakref.ref(model), weakref.ref(Model.embed.batcher(model))
    gc.disable()  # freed by reference counting alone: no cycle through the batcher
    try:
        del model
        assert model_ref() is None and batcher_ref() is None
    finally:
        gc.enable()
    await Model.embed.aclose()


async def test_aclose_closes_a_plain_functions_batcher():
    @adaptive_batch(max_batch_size=4, max_wait_ms=5)
    async def double(items):
        return [item * 2 for item in items]

    assert await double(1) == 2
    await double.aclose()
    with pytest.raises(BatcherClosed):
        await double(2)


def test_unknown_settings_are_refused_at_decoration():
    with pytest.raises(TypeError, match="batch_wait_timeout_s"):
        adaptive_batch(batch_wait_timeout_s=0.1)


def test_bad_settings_are_refused_at_decoration():
    with pytest.raises(ValueError, match="max_batch_size"):
        adaptive_batch(max_batch_size=0)

"""@adaptive_batch: one item in, one result out; one batcher per instance."""

import asyncio

import pytest

from batching import Priority, adaptive_batch

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
    assert await model.embed(2, priority="low", timeout_s=5) == 6
    assert await model.embed(2, priority=Priority.HIGH) == 6


async def test_plain_function_gets_one_batcher_per_loop():
    calls = []

    @adaptive_batch(max_batch_size=4, max_wait_ms=5)
    async def double(items):
        calls.append(items)
        return [item * 2 for item in items]

    assert await asyncio.gather(double(1), double(2)) == [2, 4]
    assert calls == [[1, 2]]


def test_unknown_settings_are_refused_at_decoration():
    with pytest.raises(TypeError, match="batch_wait_timeout_s"):
        adaptive_batch(batch_wait_timeout_s=0.1)


def test_bad_settings_are_refused_at_decoration():
    with pytest.raises(ValueError, match="max_batch_size"):
        adaptive_batch(max_batch_size=0)

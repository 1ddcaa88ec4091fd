"""What ``batching.batch`` adds to ``@serve.batch``, and where it differs on purpose with a switch back to Serve's
behaviour: bisecting a failing batch, an over-budget call travelling alone, priorities, deadlines and backpressure
for unary and streaming handlers, one batcher per instance."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any, AsyncIterator

import pytest

from batching import (BatcherClosed, DeadlineExceeded, ItemTooLarge, Overloaded, Priority, adaptive_batch, batch,
                      batch_options)

pytestmark = pytest.mark.looptime


async def collect(stream: AsyncIterator[Any]) -> list[Any]:
    return [value async for value in stream]


# ---- by-design differences and their switches ---------------------------------------------------------------------


class Poisoned:
    def __init__(self) -> None:
        self.calls: list[list] = []

    async def __call__(self, items: list) -> list:
        self.calls.append(list(items))
        if "poison" in items:
            raise ValueError("cannot embed poison")
        return items


async def test_a_raising_batch_is_bisected_so_only_the_poisonous_call_fails():
    handler = Poisoned()

    @batch(max_batch_size=4)
    async def handle(items):
        return await handler(items)

    outcomes = await asyncio.gather(*(handle(i) for i in ["a", "poison", "c", "d"]), return_exceptions=True)
    assert outcomes[0] == "a" and outcomes[2:] == ["c", "d"] and isinstance(outcomes[1], ValueError)
    await handle.aclose()


async def test_split_on_failure_off_fails_every_caller_as_serve_does():
    handler = Poisoned()

    @batch(max_batch_size=4, split_on_failure=False)
    async def handle(items):
        return await handler(items)

    outcomes = await asyncio.gather(*(handle(i) for i in ["a", "poison", "c", "d"]), return_exceptions=True)
    assert all(isinstance(outcome, ValueError) for outcome in outcomes)
    assert handler.calls == [["a", "poison", "c", "d"]]
    await handle.aclose()


async def test_calls_of_different_shapes_in_one_batch_are_split_apart():
    @batch(max_batch_size=2)
    async def handle(items, *, scale=None):
        return items if scale is None else [i * s for i, s in zip(items, scale)]

    assert await asyncio.gather(handle(2), handle(3, scale=10)) == [2, 30]
    await handle.aclose()


async def test_an_over_budget_call_travels_alone():
    seen = []

    @batch(max_batch_size=5, batch_size_fn=lambda texts: sum(map(len, texts)))
    async def handle(texts):
        seen.append(list(texts))
        return texts

    assert await asyncio.gather(handle("ab"), handle("much too long"), handle("cd")) == ["ab", "much too long", "cd"]
    assert seen == [["ab"], ["much too long"], ["cd"]]
    await handle.aclose()


async def test_refuse_oversized_fails_an_over_budget_call_with_a_runtime_error_as_serve_does():
    @batch(max_batch_size=5, batch_size_fn=lambda texts: sum(map(len, texts)), refuse_oversized=True)
    async def handle(texts):
        return texts

    short, too_long = await asyncio.gather(handle("ab"), handle("much too long"), return_exceptions=True)
    assert short == "ab"
    assert isinstance(too_long, ItemTooLarge) and isinstance(too_long, RuntimeError)
    await handle.aclose()


async def test_a_set_max_batch_size_with_batch_size_fn_changes_the_cost_budget_not_the_count():
    seen = []

    @batch(max_batch_size=8, batch_size_fn=lambda texts: sum(map(len, texts)))
    async def handle(texts):
        seen.append(list(texts))
        return texts

    texts = ["aaaa", "bbbb", "cc", "dd"]
    assert await asyncio.gather(*(handle(t) for t in texts)) == texts
    handle.set_max_batch_size(4)
    assert handle._get_max_batch_size() == 4
    assert await asyncio.gather(*(handle(t) for t in texts)) == texts
    # 8 characters a batch, then 4: a batch of 4 items would be 12 characters
    assert seen == [["aaaa", "bbbb"], ["cc", "dd"], ["aaaa"], ["bbbb"], ["cc", "dd"]]
    await handle.aclose()


def test_batch_timeout_s_is_refused_for_a_streaming_handler():
    with pytest.raises(ValueError, match="streaming"):
        @batch(batch_timeout_s=1.0)
        async def generate(prompts):
            yield prompts


def test_unknown_settings_are_refused():
    with pytest.raises(TypeError, match="batch_timeout"):
        batch(batch_timeout=1)


# ---- priorities, deadlines and backpressure -----------------------------------------------------------------------


async def test_batch_options_choose_the_priority_high_goes_first():
    order = []
    release = asyncio.Event()

    @batch(max_batch_size=1, batch_wait_timeout_s=0)
    async def handle(items):
        order.append(items[0])
        await release.wait()
        return items

    busy = asyncio.ensure_future(handle("busy"))
    await asyncio.sleep(0.01)
    with batch_options(priority="low"):
        low = asyncio.ensure_future(handle("low"))
    await asyncio.sleep(0.01)
    high = asyncio.ensure_future(handle("high"))
    await asyncio.sleep(0.01)
    release.set()
    await asyncio.gather(busy, low, high)
    assert order == ["busy", "high", "low"]
    await handle.aclose()


async def test_a_deadline_ends_a_waiting_call_with_deadline_exceeded():
    @batch(max_batch_size=10, batch_wait_timeout_s=5.0)
    async def handle(items):
        return items

    with batch_options(timeout_s=0.5):
        with pytest.raises(DeadlineExceeded):
            await handle(1)
    assert asyncio.get_running_loop().time() == pytest.approx(0.5)
    assert handle.batcher().stats().dispatched_items == 0
    await handle.aclose()


async def test_a_deadline_ends_a_stream_mid_way_and_the_others_go_on():
    @batch(max_batch_size=2, batch_wait_timeout_s=0.01)
    async def generate(prompts):
        for step in range(4):
            await asyncio.sleep(1.0)
            yield [f"{p}{step}" for p in prompts]

    received = []
    with batch_options(timeout_s=2.5):
        first = generate("a")
    second = generate("b")  # both queued now: one batch

    async def read_with_deadline():
        async for value in first:
            received.append(value)

    outcomes = await asyncio.gather(read_with_deadline(), collect(second), return_exceptions=True)
    assert isinstance(outcomes[0], DeadlineExceeded) and received == ["a0", "a1"]
    assert outcomes[1] == ["b0", "b1", "b2", "b3"]
    await generate.aclose()


@pytest.mark.parametrize("leave", ["deadline", "cancel"])
async def test_a_stream_that_leaves_while_queued_is_never_sent(leave):
    seen = []

    @batch(max_batch_size=1, batch_wait_timeout_s=0)
    async def generate(prompts):
        seen.append(list(prompts))
        await asyncio.sleep(5.0)
        yield prompts

    busy = asyncio.ensure_future(collect(generate("busy")))
    await asyncio.sleep(0.1)
    with batch_options(timeout_s=1.0 if leave == "deadline" else None):
        reader = asyncio.ensure_future(collect(generate("gone")))
    await asyncio.sleep(0.1 if leave == "cancel" else 2.0)
    reader.cancel()
    with pytest.raises(DeadlineExceeded if leave == "deadline" else asyncio.CancelledError):
        await reader
    assert await busy == ["busy"]
    await asyncio.sleep(6.0)
    assert seen == [["busy"]]
    await generate.aclose()


async def test_once_every_caller_has_gone_the_handler_is_closed():
    steps_run = []

    @batch(max_batch_size=2, batch_wait_timeout_s=0.01)
    async def generate(prompts):
        for step in range(100):
            steps_run.append(step)
            await asyncio.sleep(0.1)
            yield prompts

    async def two_steps(prompt):
        stream = generate(prompt)
        values = [await stream.__anext__(), await stream.__anext__()]
        await stream.aclose()
        return values

    await asyncio.gather(two_steps("a"), two_steps("b"))
    await asyncio.sleep(1.0)
    assert steps_run == [0, 1, 2]  # the step after both left finds no one and ends the batch
    await generate.aclose()


async def test_a_streaming_error_before_the_first_step_is_retried_when_retryable():
    attempts = []

    @batch(max_batch_size=1, max_retries=1)
    async def generate(prompts):
        attempts.append(list(prompts))
        if len(attempts) == 1:
            raise ConnectionError("upstream reset")
        yield prompts

    assert await collect(generate("a")) == ["a"]
    assert attempts == [["a"], ["a"]]
    await generate.aclose()


async def test_a_bounded_queue_refuses_with_overloaded():
    @batch(max_batch_size=10, batch_wait_timeout_s=10.0, max_queue_depth=2)
    async def handle(items):
        return items

    waiting = [asyncio.ensure_future(handle(i)) for i in range(2)]
    await asyncio.sleep(0)
    with pytest.raises(Overloaded):
        await handle(3)
    for task in waiting:
        task.cancel()
    await handle.aclose()


async def test_a_closed_handler_refuses_new_streams():
    @batch(max_batch_size=1)
    async def generate(prompts):
        yield prompts

    assert await collect(generate("a")) == ["a"]
    await generate.aclose()
    with pytest.raises(BatcherClosed):
        generate("b")


# ---- @adaptive_batch on the same machinery ------------------------------------------------------------------------


async def test_adaptive_batch_streams_an_async_generator_handler_per_item():
    class Model:
        @adaptive_batch(max_batch_size=4, max_wait_ms=1)
        async def generate(self, prompts: list):
            for step in range(2):
                yield [f"{p}{step}" for p in prompts]

    model = Model()
    assert await asyncio.gather(collect(model.generate("a")), collect(model.generate("b", priority="low"))) == [
        ["a0", "a1"], ["b0", "b1"]]
    await Model.generate.aclose()


async def test_adaptive_batch_reads_batch_options_as_defaults():
    @adaptive_batch(max_batch_size=4, max_wait_ms=1)
    async def handle(items):
        await asyncio.sleep(1.0)
        return items

    with batch_options(priority=Priority.LOW, timeout_s=0.5):
        call = asyncio.ensure_future(handle(1))  # the task runs in a copy of this context
    await asyncio.sleep(0)
    stats = handle.batcher().stats()
    assert (stats.queued_low, stats.queued_high) == (1, 0)
    with pytest.raises(DeadlineExceeded):
        await call  # ended by the block's timeout_s, not by the handler's second
    assert await handle(2) == 2  # outside the block: no deadline
    await handle.aclose()


def test_the_documented_switching_example_is_the_file_the_integration_test_deploys():
    root = Path(__file__).resolve().parents[2]
    example = (root / "docs" / "examples" / "serve_batch_dropin.py").read_text()
    assert f"```python\n{example}```" in (root / "docs" / "batching.md").read_text()


async def test_in_a_replica_that_cannot_fill_a_batch_the_first_call_warns_as_serve_does(caplog):
    from types import SimpleNamespace
    from unittest import mock

    from ray import serve

    replica = SimpleNamespace(_deployment_config=SimpleNamespace(max_ongoing_requests=5))
    with mock.patch.object(serve, "get_replica_context", return_value=replica):
        @batch(max_batch_size=4, max_concurrent_batches=2)
        async def handle(items):
            return items

        assert await handle(1) == 1
        handle.set_max_batch_size(2)
    warnings = [record.getMessage() for record in caplog.records if "max_ongoing_requests" in record.getMessage()]
    assert len(warnings) == 1 and "(5)" in warnings[0] and ">= 8" in warnings[0]
    await handle.aclose()

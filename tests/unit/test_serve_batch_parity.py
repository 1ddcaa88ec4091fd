"""``batching.batch`` called the ``@serve.batch`` way behaves as Ray Serve 2.60's ``@serve.batch``: every test here
runs against both, Serve's own decorator (outside a replica) and ours, and pins what a Serve user relies on.

Batches here are formed by their size or by callers queued in the same turn of the loop, so no outcome depends on
how long a wait lasts; the waits themselves are pinned on a controlled clock in test_serve_batch_timing.py.
"""

from __future__ import annotations

import asyncio
from typing import Any, AsyncIterator, Callable

import pytest

import batching
from load.serve_batch import close_serve_batched, serve_batch_outside_replica


class Decorators:
    """One implementation's ``batch``, and every handler decorated with it in a test, to stop after the test."""

    def __init__(self, name: str, decorator: Callable) -> None:
        self.name = name
        self._decorator = decorator
        self.made: list[Any] = []

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        made = self._decorator(*args, **kwargs)
        if args and callable(args[0]):
            self.made.append(made)
            return made

        def decorate(fn: Callable) -> Any:
            handler = made(fn)
            self.made.append(handler)
            return handler
        return decorate

    async def close(self) -> None:
        for handler in self.made:
            if self.name == "serve":
                await close_serve_batched(handler)
            else:
                await handler.aclose()


@pytest.fixture(params=["serve", "ours"])
async def batch(request: pytest.FixtureRequest) -> AsyncIterator[Decorators]:
    if request.param == "serve":
        from ray import serve

        with serve_batch_outside_replica():
            decorators = Decorators("serve", serve.batch)
            yield decorators
            await decorators.close()
    else:
        decorators = Decorators("ours", batching.batch)
        yield decorators
        await decorators.close()


# ---- arguments ----------------------------------------------------------------------------------------------------


async def test_positional_and_keyword_arguments_are_batched_column_wise(batch):
    seen = []

    class Model:
        @batch(max_batch_size=3)
        async def combine(self, words: list, counts: list, *, sep: list) -> list:
            seen.append((list(words), list(counts), list(sep)))
            return [s.join([w] * c) for w, c, s in zip(words, counts, sep)]

    model = Model()
    results = await asyncio.gather(model.combine("a", 2, sep="-"), model.combine("b", 1, sep="+"),
                                   model.combine("c", 3, sep="."))
    assert results == ["a-a", "b", "c.c.c"]
    assert seen == [(["a", "b", "c"], [2, 1, 3], ["-", "+", "."])]


async def test_a_plain_function_batches_its_arguments_column_wise(batch):
    @batch(max_batch_size=2)
    async def add(left: list, right: list) -> list:
        return [a + b for a, b in zip(left, right)]

    assert await asyncio.gather(add(1, 10), add(2, 20)) == [11, 22]


async def test_keyword_arguments_may_be_given_for_positional_parameters(batch):
    class Model:
        @batch(max_batch_size=2)
        async def scale(self, values: list, factors: list) -> list:
            return [v * f for v, f in zip(values, factors)]

    model = Model()
    assert await asyncio.gather(model.scale(2, factors=3), model.scale(4, factors=5)) == [6, 20]


async def test_a_call_that_does_not_fit_the_signature_raises_type_error_at_once(batch):
    class Model:
        @batch(max_batch_size=2)
        async def handle(self, items: list) -> list:
            return items

    with pytest.raises(TypeError):
        await Model().handle(1, 2)
    with pytest.raises(TypeError):
        await Model().handle(missing=1)


async def test_one_item_handlers_still_take_one_list(batch):
    class Model:
        @batch(max_batch_size=4)
        async def double(self, items: list) -> list:
            return [i * 2 for i in items]

    model = Model()
    assert await asyncio.gather(*(model.double(i) for i in range(6))) == [0, 2, 4, 6, 8, 10]


# ---- results and failures -----------------------------------------------------------------------------------------


async def test_results_of_the_wrong_length_fail_every_caller_of_the_batch(batch):
    class Model:
        @batch(max_batch_size=2)
        async def handle(self, items: list) -> list:
            return items[:1]

    model = Model()
    outcomes = await asyncio.gather(model.handle(1), model.handle(2), return_exceptions=True)
    assert all(isinstance(outcome, Exception) for outcome in outcomes)
    assert all("length" in str(outcome) or "results" in str(outcome) for outcome in outcomes)


async def test_an_exception_in_a_result_slot_is_returned_to_that_caller_as_a_value(batch):
    class Model:
        @batch(max_batch_size=2)
        async def handle(self, items: list) -> list:
            return [ValueError("bad") if item == "bad" else item for item in items]

    model = Model()
    good, bad = await asyncio.gather(model.handle("good"), model.handle("bad"), return_exceptions=True)
    assert good == "good" and isinstance(bad, ValueError)


async def test_a_batch_runs_one_at_a_time_by_default(batch):
    running = []
    most = []

    class Model:
        @batch(max_batch_size=2)
        async def handle(self, items: list) -> list:
            running.append(1)
            most.append(len(running))
            await asyncio.sleep(0.001)
            running.pop()
            return items

    model = Model()
    assert await asyncio.gather(*(model.handle(i) for i in range(8))) == list(range(8))
    assert max(most) == 1


async def test_max_concurrent_batches_lets_that_many_run_at_once(batch):
    running = []
    most = []
    release = asyncio.Event()

    class Model:
        @batch(max_batch_size=1, max_concurrent_batches=3)
        async def handle(self, items: list) -> list:
            running.append(1)
            most.append(len(running))
            await release.wait()
            running.pop()
            return items

    model = Model()
    calls = asyncio.gather(*(model.handle(i) for i in range(5)))
    for _ in range(20):
        await asyncio.sleep(0)
    release.set()
    assert await calls == list(range(5))
    assert max(most) == 3


async def test_equal_calls_each_reach_the_handler(batch):
    seen = []

    class Model:
        @batch(max_batch_size=3)
        async def handle(self, items: list) -> list:
            seen.append(list(items))
            return items

    model = Model()
    assert await asyncio.gather(*(model.handle("same") for _ in range(3))) == ["same"] * 3
    assert seen == [["same", "same", "same"]]


async def test_a_retryable_error_is_not_retried(batch):
    calls = []

    class Model:
        @batch(max_batch_size=2)
        async def handle(self, items: list) -> list:
            calls.append(list(items))
            return [TimeoutError("upstream timed out") for _ in items]

    model = Model()
    outcomes = await asyncio.gather(model.handle(1), model.handle(2), return_exceptions=True)
    assert all(isinstance(outcome, TimeoutError) for outcome in outcomes)
    assert calls == [[1, 2]]


async def test_a_cancelled_caller_is_not_sent(batch):
    seen = []

    class Model:
        @batch(max_batch_size=3, batch_wait_timeout_s=0.05)
        async def handle(self, items: list) -> list:
            seen.append(list(items))
            return items

    model = Model()
    first = asyncio.ensure_future(model.handle(1))
    gone = asyncio.ensure_future(model.handle(2))
    await asyncio.sleep(0)
    gone.cancel()
    assert await asyncio.gather(first, model.handle(3)) == [1, 3]
    assert seen == [[1, 3]]


async def test_calls_for_different_multiplexed_models_never_share_a_batch(batch):
    from ray import serve
    from ray.serve import context

    seen = []

    class Model:
        @batch(max_batch_size=4)
        async def handle(self, items: list) -> list:
            seen.append((serve.get_multiplexed_model_id(), sorted(items)))
            return [item * 10 for item in items]

    model = Model()

    async def call(item: int, model_id: str) -> int:
        context._set_request_context(multiplexed_model_id=model_id)  # as a replica sets it for each request
        return await model.handle(item)

    assert await asyncio.gather(call(1, "a"), call(2, "b"), call(3, "a"), call(4, "b")) == [10, 20, 30, 40]
    assert sorted(seen) == [("a", [1, 3]), ("b", [2, 4])]


# ---- settings at run time -----------------------------------------------------------------------------------------


async def test_setters_change_the_settings_the_getters_read(batch):
    class Model:
        @batch(max_batch_size=4, batch_wait_timeout_s=0.5)
        async def handle(self, items: list) -> list:
            return items

    model = Model()
    assert model.handle._get_max_batch_size() == 4
    assert model.handle._get_batch_wait_timeout_s() == 0.5
    model.handle.set_max_batch_size(2)
    model.handle.set_batch_wait_timeout_s(0.01)
    assert model.handle._get_max_batch_size() == 2
    assert model.handle._get_batch_wait_timeout_s() == 0.01


async def test_a_smaller_max_batch_size_applies_to_the_next_batches(batch):
    seen = []

    class Model:
        @batch(max_batch_size=4)
        async def handle(self, items: list) -> list:
            seen.append(len(items))
            return items

    model = Model()
    assert await asyncio.gather(*(model.handle(i) for i in range(4))) == list(range(4))
    model.handle.set_max_batch_size(2)
    assert await asyncio.gather(*(model.handle(i) for i in range(4))) == list(range(4))
    assert seen == [4, 2, 2]


# ---- batch_size_fn ------------------------------------------------------------------------------------------------


async def test_batch_size_fn_measures_the_whole_batch(batch):
    seen = []

    class Model:
        @batch(max_batch_size=10, batch_size_fn=lambda texts: max(map(len, texts)) * len(texts))
        async def handle(self, texts: list) -> list:
            seen.append(list(texts))
            return [len(t) for t in texts]

    model = Model()
    texts = ["aa", "bb", "cccc", "d", "e"]
    assert await asyncio.gather(*(model.handle(t) for t in texts)) == [2, 2, 4, 1, 1]
    # padded cost: ["aa","bb"] = 4, adding "cccc" makes 12 > 10; ["cccc","d"] = 8, adding "e" makes 12
    assert seen[0] == ["aa", "bb"]
    assert sorted(t for call in seen for t in call) == sorted(texts)
    assert all(max(map(len, call)) * len(call) <= 10 for call in seen)


# ---- streaming ----------------------------------------------------------------------------------------------------


async def collect(stream: AsyncIterator[Any]) -> list[Any]:
    return [value async for value in stream]


async def test_a_streaming_handler_gives_each_caller_its_own_entries(batch):
    class Model:
        @batch(max_batch_size=3)
        async def generate(self, prompts: list) -> AsyncIterator[list]:
            for step in range(3):
                yield [f"{prompt}{step}" for prompt in prompts]

    model = Model()
    assert await asyncio.gather(*(collect(model.generate(p)) for p in "abc")) == [
        ["a0", "a1", "a2"], ["b0", "b1", "b2"], ["c0", "c1", "c2"]]


async def test_a_streaming_call_returns_an_async_iterator_not_a_coroutine(batch):
    class Model:
        @batch(max_batch_size=1)
        async def generate(self, prompts: list) -> AsyncIterator[list]:
            yield prompts

    stream = Model().generate("x")
    assert hasattr(stream, "__anext__") and not asyncio.iscoroutine(stream)
    assert await collect(stream) == ["x"]


async def test_stop_iteration_in_a_slot_ends_that_callers_stream_only(batch):
    class Model:
        @batch(max_batch_size=2)
        async def generate(self, lengths: list) -> AsyncIterator[list]:
            for step in range(max(lengths)):
                yield [step if step < length else StopIteration for length in lengths]

    model = Model()
    short, long = await asyncio.gather(collect(model.generate(1)), collect(model.generate(3)))
    assert short == [0] and long == [0, 1, 2]


async def test_stop_async_iteration_in_a_slot_ends_that_callers_stream(batch):
    class Model:
        @batch(max_batch_size=2)
        async def generate(self, lengths: list) -> AsyncIterator[list]:
            for step in range(max(lengths)):
                yield [step if step < length else StopAsyncIteration for length in lengths]

    model = Model()
    assert await asyncio.gather(collect(model.generate(2)), collect(model.generate(1))) == [[0, 1], [0]]


async def test_an_error_mid_stream_ends_every_stream_of_the_batch_with_it(batch):
    class Model:
        @batch(max_batch_size=2)
        async def generate(self, prompts: list) -> AsyncIterator[list]:
            yield prompts
            raise RuntimeError("model crashed")

    model = Model()
    received: dict[str, list] = {"a": [], "b": []}

    async def read(prompt: str) -> None:
        async for value in model.generate(prompt):
            received[prompt].append(value)

    outcomes = await asyncio.gather(read("a"), read("b"), return_exceptions=True)
    assert [type(o) for o in outcomes] == [RuntimeError, RuntimeError]
    assert received == {"a": ["a"], "b": ["b"]}


async def test_a_step_of_the_wrong_length_fails_the_streams(batch):
    class Model:
        @batch(max_batch_size=2)
        async def generate(self, prompts: list) -> AsyncIterator[list]:
            yield prompts[:1]

    model = Model()
    outcomes = await asyncio.gather(collect(model.generate("a")), collect(model.generate("b")),
                                    return_exceptions=True)
    assert all(isinstance(outcome, Exception) for outcome in outcomes)


async def test_a_caller_that_stops_reading_leaves_the_others_streaming(batch):
    class Model:
        @batch(max_batch_size=2)
        async def generate(self, prompts: list) -> AsyncIterator[list]:
            for step in range(4):
                await asyncio.sleep(0)
                yield [f"{p}{step}" for p in prompts]

    model = Model()

    async def first_only(prompt: str) -> list:
        stream = model.generate(prompt)
        value = await stream.__anext__()
        await stream.aclose()
        return [value]

    assert await asyncio.gather(first_only("a"), collect(model.generate("b"))) == [["a0"], ["b0", "b1", "b2", "b3"]]


async def test_streaming_handlers_batch_keyword_arguments_too(batch):
    class Model:
        @batch(max_batch_size=2)
        async def generate(self, prompts: list, *, steps: list) -> AsyncIterator[list]:
            for step in range(max(steps)):
                yield [p * (step + 1) if step < n else StopIteration for p, n in zip(prompts, steps)]

    model = Model()
    assert await asyncio.gather(collect(model.generate("a", steps=2)), collect(model.generate("b", steps=1))) == [
        ["a", "aa"], ["b"]]


# ---- checks at decoration -----------------------------------------------------------------------------------------


def test_a_function_that_is_not_async_is_refused_naming_async_def(batch):
    def sync(items):
        return items

    with pytest.raises(TypeError, match="async def"):
        batch(sync)


def test_decorating_something_not_callable_is_refused(batch):
    with pytest.raises(TypeError):
        batch(42)


@pytest.mark.parametrize("settings, error", [
    ({"max_batch_size": 1.1}, TypeError),
    ({"max_batch_size": "10"}, TypeError),
    ({"max_batch_size": 0}, ValueError),
    ({"batch_wait_timeout_s": "0.1"}, TypeError),
    ({"batch_wait_timeout_s": -1}, ValueError),
    ({"max_concurrent_batches": 0}, TypeError),
    ({"max_concurrent_batches": 1.5}, TypeError),
    ({"batch_size_fn": 3}, TypeError),
])
def test_bad_settings_are_refused_at_decoration(batch, settings, error):
    with pytest.raises(error):
        batch(**settings)


async def test_a_whole_number_float_batch_size_is_accepted_and_caps_the_batch(batch):
    seen = []

    @batch(max_batch_size=4.0)
    async def handle(items):
        seen.append(len(items))
        return items

    assert await asyncio.gather(*(handle(i) for i in range(6))) == list(range(6))
    assert seen == [4, 2]


def test_the_decorator_keeps_the_handlers_name_and_wrapped_function(batch):
    async def embed(items):
        return items

    handler = batch(embed)
    assert handler.__name__ == "embed" and handler.__wrapped__ is embed

"""``EmbeddingModel``'s own logic, run as a plain class on a fake backend (no Ray cluster)."""

from __future__ import annotations

import asyncio
import pickle
from typing import Sequence

import numpy as np
import pytest

from batching import BatcherConfig, BatcherMetrics, DeadlineExceeded, Overloaded
from deployments.config import ModelConfig
from deployments.errors import InvalidRequest, ModelOverloaded, RequestTimedOut, ServiceUnavailable, UpstreamFailed
from deployments.ingress.openai_errors import error_body, error_headers, http_error
from deployments.model.backends import ItemRejected, Prepared, UpstreamError
from deployments.model.backends.prompts import Prompts
from deployments.model.embedder import EmbeddingModel
from deployments.wire import EmbedRequest

DIM = 8


class FakeBackend:
    """Vectors derived from the input; ``gate`` (when set) holds every call until released."""

    def __init__(self) -> None:
        self.calls: list[tuple[list, int | None]] = []
        self.background_calls: list[bool] = []  # each call's ``background``
        self.gate: asyncio.Event | None = None
        self.rejected_text = "poison"
        self.failing_text = "upstream-down"
        self.closed = False

    prompts = Prompts((("query", "query: "), ("passage", "passage: ")))

    @property
    def dimension(self) -> int:
        return DIM

    def supports_dimensions(self, dimensions: int) -> bool:
        return dimensions <= DIM

    async def prepare_many(self, items, prompt: str = "", background: bool = False) -> list:
        return [Prepared(prompt + item, len((prompt + item).split())) if isinstance(item, str)
                else Prepared(tuple(item), len(item)) for item in items]

    async def embed(self, items: Sequence, dimensions: int | None = None, background: bool = False) -> list:
        self.calls.append((list(items), dimensions))
        self.background_calls.append(background)
        if self.gate is not None:
            await self.gate.wait()
        if any(item == self.rejected_text for item in items):
            raise ItemRejected("the upstream refused the input")
        return [UpstreamError("503 from upstream") if item == self.failing_text else vector(item, dimensions or DIM)
                for item in items]

    async def aclose(self) -> None:
        self.closed = True


def vector(item, dim: int) -> np.ndarray:
    seed = sum(map(ord, item)) if isinstance(item, str) else sum(item)
    return np.random.default_rng(seed).standard_normal(dim).astype(np.float32)


_open_models: list[EmbeddingModel] = []


def make_model(backend: FakeBackend, **batching) -> EmbeddingModel:
    settings = {"max_batch_size": 16, "max_wait_ms": 5.0, "max_concurrent_batches": 1, **batching}
    config = ModelConfig(name="fake", backend="local", batcher=BatcherConfig(**settings))
    model = EmbeddingModel(config, backend=backend, metrics=BatcherMetrics())
    _open_models.append(model)
    return model


@pytest.fixture(autouse=True)
async def close_models():
    yield
    while _open_models:
        model = _open_models.pop()
        if model._backend.gate is not None:
            model._backend.gate.set()
        await model.aclose()


async def test_vectors_and_token_counts_come_back_in_input_order() -> None:
    backend = FakeBackend()
    model = make_model(backend)
    texts = [f"text number {i}" for i in range(40)]
    vectors, counts = await model.embed(texts)
    assert vectors.dtype == np.float32 and vectors.shape == (40, DIM)
    for text, row in zip(texts, vectors):
        np.testing.assert_array_equal(row, vector(text, DIM))
    assert counts == [3] * 40


async def test_concurrent_single_text_requests_share_batches() -> None:
    backend = FakeBackend()
    model = make_model(backend, max_batch_size=64, max_wait_ms=20.0)
    results = await asyncio.gather(*(model.embed([f"request {i}"]) for i in range(64)))
    assert all(vectors.shape == (1, DIM) for vectors, _ in results)
    (stats,) = (await model.stats()).values()
    assert stats.items == 64
    assert stats.mean_batch_size > 1
    assert len(backend.calls) < 64


async def test_requests_forwarded_together_each_get_their_own_outcome() -> None:
    backend = FakeBackend()
    model = make_model(backend, max_wait_ms=0.0)
    streamed = [finished async for finished in model.embed_many([
        EmbedRequest(["one", "two"]),
        EmbedRequest(["fine", "poison"]),
        EmbedRequest(["low"], priority="low", dimensions=4),
        EmbedRequest(["late"], priority="urgent"),
    ])]
    assert [i for i, _ in streamed[0]] == [3]  # the bad priority is answered at once, before any batch ran
    outcomes = dict(pair for finished in streamed for pair in finished)
    assert sorted(outcomes) == [0, 1, 2, 3]
    vectors, counts = outcomes[0]
    np.testing.assert_array_equal(vectors[1], vector("two", DIM))
    assert counts == [1, 1]
    assert isinstance(outcomes[1], InvalidRequest) and outcomes[1].index == 1
    assert outcomes[2][0].shape == (1, 4)
    assert isinstance(outcomes[3], InvalidRequest) and outcomes[3].param == "priority"


async def test_a_low_batch_reaches_the_backend_as_background_work_and_a_high_one_does_not() -> None:
    backend = FakeBackend()
    model = make_model(backend, max_wait_ms=0.0)
    await model.embed(["interactive"])
    await model.embed(["bulk"], priority="low")
    assert backend.calls == [(["interactive"], None), (["bulk"], None)]
    assert backend.background_calls == [False, True]


async def test_token_ids_are_submitted_as_items_too() -> None:
    model = make_model(FakeBackend())
    vectors, counts = await model.embed([[1, 2, 3], [4, 5]])
    np.testing.assert_array_equal(vectors[1], vector([4, 5], DIM))
    assert counts == [3, 2]


async def test_a_rejected_input_fails_the_request_naming_its_index() -> None:
    model = make_model(FakeBackend())
    with pytest.raises(InvalidRequest) as caught:
        await model.embed(["fine", "also fine", "poison", "fine too"])
    assert caught.value.index == 2
    assert "input[2]" in caught.value.message and http_error(caught.value).status == 400
    assert error_body(caught.value)["error"]["param"] == "input[2]"


async def test_an_upstream_failure_is_a_502_naming_the_input() -> None:
    model = make_model(FakeBackend())
    with pytest.raises(UpstreamFailed) as caught:
        await model.embed(["ok", "upstream-down"])
    assert http_error(caught.value).status == 502 and caught.value.index == 1


async def test_each_output_size_gets_its_own_batcher() -> None:
    backend = FakeBackend()
    model = make_model(backend)
    full, _ = await model.embed(["a"])
    native, _ = await model.embed(["a"], dimensions=DIM)
    short, _ = await model.embed(["a"], dimensions=4)
    assert full.shape == native.shape == (1, DIM) and short.shape == (1, 4)
    assert sorted(await model.stats()) == ["fake/d=4", "fake/d=8"]
    assert {dims for _, dims in backend.calls} == {None, 4}


@pytest.mark.parametrize("dimensions", [0, -3, DIM + 1, "8", True])
async def test_an_unsupported_size_is_a_400_on_dimensions(dimensions) -> None:
    with pytest.raises(InvalidRequest) as caught:
        await make_model(FakeBackend()).embed(["a"], dimensions=dimensions)
    assert caught.value.param == "dimensions"


async def test_a_bad_priority_is_a_400() -> None:
    with pytest.raises(InvalidRequest):
        await make_model(FakeBackend()).embed(["a"], priority="urgent")


async def test_a_full_queue_is_a_429_with_retry_after() -> None:
    backend = FakeBackend()
    backend.gate = asyncio.Event()
    model = make_model(backend, max_queue_depth=4, max_batch_size=2, max_wait_ms=0.0)
    first = asyncio.create_task(model.embed(["a", "b"]))  # in flight, held by the gate
    await asyncio.sleep(0.01)
    queued = asyncio.create_task(model.embed(["c", "d", "e", "f"]))
    await asyncio.sleep(0.01)
    with pytest.raises(ModelOverloaded) as caught:
        await model.embed(["g"])
    assert isinstance(caught.value, Overloaded)  # handle callers may catch the batcher's own error
    assert caught.value.retry_after_s > 0 and "Retry-After" in error_headers(caught.value)
    backend.gate.set()
    await asyncio.gather(first, queued)


async def test_a_deadline_is_a_504() -> None:
    backend = FakeBackend()
    backend.gate = asyncio.Event()
    model = make_model(backend)
    with pytest.raises(RequestTimedOut) as caught:
        await model.embed(["slow"], timeout_s=0.05)
    assert isinstance(caught.value, DeadlineExceeded) and http_error(caught.value).status == 504
    backend.gate.set()


async def test_queue_depth_is_reported_for_autoscaling() -> None:
    backend = FakeBackend()
    backend.gate = asyncio.Event()
    model = make_model(backend, max_batch_size=2, max_wait_ms=0.0)
    assert await model.record_autoscaling_stats() == {"queue_depth": 0.0, "in_flight_batches": 0.0}
    task = asyncio.create_task(model.embed([f"t{i}" for i in range(7)]))
    await asyncio.sleep(0.01)
    assert await model.record_autoscaling_stats() == {"queue_depth": 5.0, "in_flight_batches": 1.0}
    backend.gate.set()
    await task


async def test_shutdown_drains_queued_inputs_then_refuses_new_ones() -> None:
    backend = FakeBackend()
    model = make_model(backend, max_batch_size=4, max_wait_ms=10_000.0)
    pending = asyncio.create_task(model.embed(["a", "b"]))  # would wait 10 s for more items
    await asyncio.sleep(0.01)
    await model.__del__()
    vectors, _ = await pending
    assert vectors.shape == (2, DIM)
    assert backend.closed
    with pytest.raises(ServiceUnavailable):
        await model.embed(["c"])


@pytest.mark.parametrize("error", [
    InvalidRequest("input[3]: bad", param="input", index=3),
    ModelOverloaded("busy", retry_after_s=2.5),
    RequestTimedOut("late", index=0),
    UpstreamFailed("input[1]: down", index=1),
])
def test_errors_keep_their_fields_across_a_process_boundary(error) -> None:
    copy = pickle.loads(pickle.dumps(error))
    assert type(copy) is type(error)
    assert error_body(copy) == error_body(error) and copy.index == error.index
    assert error_headers(copy) == error_headers(error) and str(copy) == str(error)


def test_upstream_errors_keep_retry_fields_across_a_process_boundary() -> None:
    copy = pickle.loads(pickle.dumps(UpstreamError("429", status=429, retryable=True, retry_after_s=1.5)))
    assert (copy.status, copy.retryable, copy.retry_after_s) == (429, True, 1.5)

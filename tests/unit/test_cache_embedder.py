"""The cache inside ``EmbeddingModel`` (a plain class on a fake backend, no Ray): hits skip the backend, ``usage``
still counts every input's tokens, and with the cache on every response equals the response with it off."""

from __future__ import annotations

import asyncio
import tempfile
from pathlib import Path

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from batching import BatcherConfig, BatcherMetrics
from deployments.config import CacheConfig, ModelConfig
from deployments.model.embedder import EmbeddingModel

from .cache_fakes import RecordingMetrics
from .test_deployments_embedder import DIM, FakeBackend, vector


def make_model(backend: FakeBackend, cache_dir: Path | None, metrics: RecordingMetrics | None = None
               ) -> EmbeddingModel:
    cache = CacheConfig(store="disk", directory=str(cache_dir)) if cache_dir is not None else None
    config = ModelConfig(name="fake", backend="openai", base_url="http://upstream/v1", upstream_model="fake-1",
                         batcher=BatcherConfig(max_batch_size=16, max_wait_ms=1.0, max_concurrent_batches=2),
                         cache=cache)
    return EmbeddingModel(config, backend=backend, metrics=BatcherMetrics(),
                                        cache_metrics=metrics or RecordingMetrics())


async def embed_then_close(model: EmbeddingModel, *requests: tuple[list, int | None]) -> list:
    """Each request's outcome, one after another; closing the model lets its cache writes land."""
    try:
        return [await model.embed(inputs, dimensions=dimensions) for inputs, dimensions in requests]
    finally:
        await model.aclose()


async def test_a_cached_text_costs_no_backend_call_and_still_reports_its_tokens(tmp_path: Path) -> None:
    backend, metrics = FakeBackend(), RecordingMetrics()
    [(first, first_counts)] = await embed_then_close(make_model(backend, tmp_path), (["one two three", "four"], None))
    [(again, counts)] = await embed_then_close(make_model(backend, tmp_path, metrics),
                                               (["four", "one two three"], None))
    assert len(backend.calls) == 1
    assert counts == [1, 3] and first_counts == [3, 1]
    assert again.tobytes() == first[::-1].tobytes()
    np.testing.assert_array_equal(again[1], vector("one two three", DIM))
    assert metrics.lookups == {"hit": 2} and metrics.saved_tokens == 4


async def test_dimensions_and_token_ids_are_keyed_apart(tmp_path: Path) -> None:
    backend = FakeBackend()
    await embed_then_close(make_model(backend, tmp_path), (["text"], None), ([[1, 2]], None))
    (short, _), (ids, counts), (native, _) = await embed_then_close(
        make_model(backend, tmp_path), (["text"], 4), ([[1, 2]], None),
        (["text"], DIM))  # the native size, asked for: the same entry as without dimensions
    assert backend.calls == [(["text"], None), ([(1, 2)], None), (["text"], 4)]
    assert short.shape == (1, 4) and counts == [2]
    np.testing.assert_array_equal(ids[0], vector([1, 2], DIM))
    np.testing.assert_array_equal(native[0], vector("text", DIM))


TEXTS = ["alpha", "beta gamma", "delta", "poison", "eps zeta eta"]
INPUTS = st.one_of(st.sampled_from(TEXTS), st.lists(st.integers(0, 50), min_size=1, max_size=3))
REQUESTS = st.lists(  # waves of concurrent requests: (inputs, dimensions, priority)
    st.lists(st.tuples(st.lists(INPUTS, min_size=1, max_size=4), st.sampled_from([None, 4, DIM]),
                       st.sampled_from(["high", "low"])), min_size=1, max_size=6),
    min_size=1, max_size=4)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(waves=REQUESTS)
def test_every_response_with_the_cache_on_equals_the_response_with_it_off(waves) -> None:
    async def responses(cache_dir: Path | None) -> list[object]:
        model = make_model(FakeBackend(), cache_dir)
        answers: list[object] = []
        try:
            for wave in waves:
                outcomes = await asyncio.gather(
                    *(model.embed(inputs, priority=priority, dimensions=dimensions)
                      for inputs, dimensions, priority in wave), return_exceptions=True)
                answers += [describe(outcome) for outcome in outcomes]
        finally:
            await model.aclose()
        return answers

    with tempfile.TemporaryDirectory() as cache_dir:
        assert asyncio.run(responses(Path(cache_dir))) == asyncio.run(responses(None))


def describe(outcome: object) -> object:
    """What the caller sees: the vectors' bytes and token counts, or the error's type, status and message."""
    if isinstance(outcome, BaseException):
        return type(outcome).__name__, getattr(outcome, "status", None), str(outcome)
    vectors, counts = outcome
    return vectors.dtype.str, vectors.shape, vectors.tobytes(), counts

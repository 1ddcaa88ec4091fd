"""The ``openai`` backend alone and behind an ``EmbeddingModel`` (a plain class, no Ray), against the simulated
upstream."""

from __future__ import annotations

import asyncio
import threading

import numpy as np
import pytest

from batching import BatcherConfig, BatcherMetrics
from deployments.config import ModelConfig
from deployments.errors import InvalidRequest, UpstreamFailed
from deployments.ingress.openai_errors import http_error
from deployments.model import tokens
from deployments.model.backends import ItemRejected, Prepared
from deployments.model.backends.openai_api import INLINE_PREPARE_SIZE, OpenAIBackend, retry_after_s
from deployments.model.embedder import EmbeddingModel
from load.hashvec import matches
from load.upstream import UpstreamConfig, run_upstream

DIM = 384
POISON = "<poison>"


@pytest.fixture(scope="module")
def upstream():
    config = UpstreamConfig(base_latency_ms=2.0, per_token_ms=0.0, jitter=0.0, fail_marker=POISON, max_concurrency=8)
    with run_upstream(config) as running:
        yield running


@pytest.fixture(autouse=True)
def fresh_upstream(upstream):
    upstream.set_faults(error_rate=0.0, rpm=None, tpm=None, down_for_s=0.0)
    upstream.reset()


@pytest.fixture
async def make_model(upstream):
    models: list[EmbeddingModel] = []

    def make(base_url: str | None = None, **batching) -> EmbeddingModel:
        settings = {"max_batch_size": 32, "max_wait_ms": 10.0, "max_concurrent_batches": 2, "max_retries": 2, **batching}
        config = ModelConfig(
            name="sim", backend="openai", base_url=base_url or upstream.base_url,
            upstream_model="text-embedding-3-small", upstream_timeout_s=5.0, batcher=BatcherConfig(**settings),
        )
        model = EmbeddingModel(config, metrics=BatcherMetrics())
        models.append(model)
        return model

    yield make
    for model in models:
        await model.aclose()


@pytest.fixture
async def backend(upstream):
    backend = OpenAIBackend(base_url=upstream.base_url, upstream_model="text-embedding-3-small", timeout_s=5.0)
    yield backend
    await backend.aclose()


async def test_prepare_keeps_the_text_or_the_ids_and_counts_cl100k_tokens(backend) -> None:
    ids = tokens.encode("already tokenized")
    text, from_ids = await backend.prepare_many(["count me in cl100k", ids])
    assert text == Prepared("count me in cl100k", tokens.count("count me in cl100k"))
    assert from_ids == Prepared(tuple(ids), len(ids))
    ((vector,), (vector_of_ids,)) = [await backend.embed([prepared.content]) for prepared in (text, from_ids)]
    assert matches(text.content, vector, DIM) and matches(ids, vector_of_ids, DIM)


async def test_ids_outside_the_encoding_are_rejected_in_place(backend) -> None:
    bad, good = await backend.prepare_many([[tokens.get_encoding().max_token_value + 1], "fine"])
    assert isinstance(bad, ItemRejected) and "cl100k_base" in str(bad) and isinstance(good, Prepared)


async def test_a_long_input_is_counted_off_the_event_loop(backend, monkeypatch) -> None:
    counted_on: list[str] = []
    count = tokens.count

    def recording_count(text: str, encoding: str = tokens.DEFAULT_ENCODING) -> int:
        counted_on.append(threading.current_thread().name)
        return count(text, encoding)

    monkeypatch.setattr(tokens, "count", recording_count)
    short, long = "short", "word " * INLINE_PREPARE_SIZE
    (prepared_short,) = await backend.prepare_many([short])
    (prepared_long,) = await backend.prepare_many([long])
    assert counted_on[0] == threading.current_thread().name != counted_on[1]
    assert prepared_long.tokens == tokens.count(long) and prepared_short.tokens == 1


async def test_vectors_belong_to_their_inputs_and_tokens_are_counted_in_cl100k(make_model) -> None:
    model = make_model()
    texts = [f"sentence {i} about the sea" for i in range(50)]
    vectors, counts = await model.embed(texts)
    assert vectors.shape == (50, DIM) and vectors.dtype == np.float32
    assert all(matches(text, row, DIM) for text, row in zip(texts, vectors))
    assert counts == [tokens.count(text) for text in texts]


async def test_token_ids_are_passed_on_as_they_are(make_model) -> None:
    ids = tokens.encode("pass me through")
    vectors, counts = await make_model().embed([ids])
    assert matches(ids, vectors[0], DIM) and counts == [len(ids)]


async def test_dimensions_are_passed_on(make_model) -> None:
    vectors, _ = await make_model().embed(["short please"], dimensions=16)
    assert vectors.shape == (1, 16) and matches("short please", vectors[0], DIM)


async def test_concurrent_requests_share_upstream_calls(make_model, upstream) -> None:
    model = make_model()
    await asyncio.gather(*(model.embed([f"single {i}"]) for i in range(64)))
    stats = upstream.stats()
    assert stats["items_billed"] == 64
    assert stats["calls"] < 64 and stats["batch_size"]["mean"] > 1


async def test_an_input_the_upstream_refuses_fails_alone(make_model) -> None:
    model = make_model(max_wait_ms=50.0)
    good = [model.embed([f"good {i}"]) for i in range(6)]
    outcomes = await asyncio.gather(model.embed(["fine", f"this one is {POISON}"]), *good, return_exceptions=True)
    refused, *served = outcomes
    assert isinstance(refused, InvalidRequest) and refused.index == 1 and "input[1]" in refused.message
    assert all(isinstance(result, tuple) for result in served)


async def test_a_429_is_retried_after_the_upstreams_retry_after(make_model, upstream) -> None:
    filler = "token " * 200
    budget = tokens.count(filler)
    upstream.set_faults(tpm=budget)  # one call of `budget` tokens empties the minute's budget
    await make_model(max_wait_ms=0.0).embed([filler])
    # Another replica, which has not yet seen the provider's rate-limit headers (deployments/model/quota/ would pace it)
    model = make_model(max_wait_ms=0.0, max_retries=3)
    vectors, _ = await model.embed(["and now a short one"])  # 429 first, then served after Retry-After
    assert matches("and now a short one", vectors[0], DIM)
    stats = upstream.stats()
    assert stats["rejected_429"] >= 1 and stats["items_billed"] == 2


async def test_server_errors_are_retried_then_reported_as_502(make_model, upstream) -> None:
    upstream.set_faults(error_rate=1.0)
    with pytest.raises(UpstreamFailed) as caught:
        await make_model(max_retries=2).embed(["doomed"])
    assert http_error(caught.value).status == 502 and caught.value.index == 0
    assert upstream.stats()["errors_500"] == 3  # the first try and two retries


async def test_an_unreachable_upstream_is_a_502(make_model) -> None:
    with pytest.raises(UpstreamFailed, match="input\\[0\\]"):
        await make_model(base_url="http://127.0.0.1:9/v1", max_retries=0).embed(["anyone there?"])


def test_retry_after_headers() -> None:
    assert retry_after_s({"retry-after-ms": "250"}) == 0.25
    assert retry_after_s({"retry-after": "3"}) == 3.0
    assert retry_after_s({"retry-after-ms": "x", "retry-after": "2"}) == 2.0
    assert retry_after_s({"retry-after": "Wed, 21 Oct 2015 07:28:00 GMT"}) == 0.0  # a date in the past
    assert retry_after_s({}) is None

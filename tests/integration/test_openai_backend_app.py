"""An application with the ``openai`` backend, over HTTP, against the simulated upstream (``load.upstream``)."""

from __future__ import annotations

import asyncio
from typing import Iterator

import numpy as np
import openai
import pytest
from ray import serve

from deployments.model import tokens
from load.hashvec import matches
from load.upstream import RunningUpstream, UpstreamConfig, run_upstream

from .helpers import API_KEYS, Service

pytestmark = pytest.mark.integration

APP = "simulated"
PREFIX = "/simulated"
MODEL = "sim-embedding-small"
DIM = 1536  # text-embedding-3-small's width: answers of a thousand inputs pass 4 MiB
POISON = "<refuse-me>"


@pytest.fixture(scope="module")
def upstream() -> Iterator[RunningUpstream]:
    config = UpstreamConfig(dim=DIM, base_latency_ms=5.0, per_token_ms=0.0, jitter=0.0, max_concurrency=8,
                            fail_marker=POISON)
    with run_upstream(config) as running:
        yield running


@pytest.fixture(scope="module")
def simulated_app(serve_instance: Service, upstream: RunningUpstream) -> Iterator[Service]:
    from deployments.app import build_app

    args = {
        "models": [{
            "name": MODEL,
            "backend": "openai",
            "base_url": upstream.base_url,
            "upstream_model": "text-embedding-3-small",
            "batching": {"max_batch_size": 64, "max_wait_ms": 25, "max_concurrent_batches": 2, "max_retries": 3},
            "num_replicas": 1,
        }],
        "ingress": {"env_vars": {"EMBEDDINGS_API_KEYS": API_KEYS[0]}},
    }
    serve.run(build_app(args), name=APP, route_prefix=PREFIX)
    try:
        yield serve_instance
    finally:
        serve.delete(APP)


@pytest.fixture(autouse=True)
def calm_upstream(upstream: RunningUpstream) -> None:
    upstream.set_faults(error_rate=0.0, rpm=None, tpm=None, down_for_s=0.0)
    upstream.reset()


def vectors(response) -> np.ndarray:
    return np.asarray([entry.embedding for entry in response.data], dtype=np.float32)


def test_every_vector_belongs_to_its_input(simulated_app: Service) -> None:
    texts = [f"document {i} about lighthouses" for i in range(100)]
    response = simulated_app.client(PREFIX).embeddings.create(model=MODEL, input=texts)
    assert all(matches(text, row, DIM) for text, row in zip(texts, vectors(response)))
    assert response.usage.prompt_tokens == sum(tokens.count(text) for text in texts)


def test_an_answer_larger_than_grpcs_default_message_limit_arrives(simulated_app: Service) -> None:
    # 1,024 vectors of 1,536 floats: 6.3 MB from the model replica to the ingress in one message, past the 4 MiB
    # gRPC allows between replicas by default (the call failed with RESOURCE_EXHAUSTED: a 503).
    texts = [f"page {i} of a long manual" for i in range(1024)]
    response = simulated_app.client(PREFIX).embeddings.create(model=MODEL, input=texts)
    assert all(matches(text, row, DIM) for text, row in zip(texts, vectors(response)))


def test_token_ids_and_dimensions_are_passed_through(simulated_app: Service) -> None:
    ids = tokens.encode("token ids go upstream untouched")
    response = simulated_app.client(PREFIX).embeddings.create(model=MODEL, input=[ids], dimensions=32)
    (row,) = vectors(response)
    assert row.shape == (32,) and matches(ids, row, DIM)


def test_concurrent_requests_share_upstream_calls(simulated_app: Service, upstream: RunningUpstream) -> None:
    async def fire() -> None:
        client = simulated_app.async_client(PREFIX)
        try:
            await asyncio.gather(*(client.embeddings.create(model=MODEL, input=f"one of many {i}") for i in range(64)))
        finally:
            await client.close()

    asyncio.run(fire())
    stats = upstream.stats()
    assert stats["items_billed"] == 64 and stats["calls"] < 64


def test_an_input_the_upstream_refuses_is_a_400_naming_it(simulated_app: Service, upstream: RunningUpstream) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        simulated_app.client(PREFIX).embeddings.create(model=MODEL, input=["fine", "fine too", f"please {POISON}"])
    assert "input[2]" in caught.value.body["message"] and caught.value.param == "input[2]"


def test_a_spent_upstream_quota_is_waited_for_not_sent_into(simulated_app: Service, upstream: RunningUpstream) -> None:
    """The provider's x-ratelimit-* headers say its budget is spent: the next call waits for it
    (deployments/model/quota/) instead of drawing a 429 (the openai backend's own 429 retry is tested in tests/unit)."""
    filler = "word " * 300
    upstream.set_faults(tpm=tokens.count(filler) + 5)  # one call of that size spends the minute's budget
    client = simulated_app.client(PREFIX)
    client.embeddings.create(model=MODEL, input=filler)
    response = client.embeddings.create(model=MODEL, input="a short text after the budget ran out")
    assert matches("a short text after the budget ran out", vectors(response)[0], DIM)
    stats = upstream.stats()
    assert (stats["rejected_429"], stats["items_billed"]) == (0, 2)


def test_an_upstream_that_keeps_failing_is_a_502(simulated_app: Service, upstream: RunningUpstream) -> None:
    upstream.set_faults(error_rate=1.0)
    with pytest.raises(openai.APIStatusError) as caught:
        simulated_app.client(PREFIX).embeddings.create(model=MODEL, input=["doomed"])
    assert caught.value.status_code == 502
    assert "input[0]" in caught.value.body["message"]

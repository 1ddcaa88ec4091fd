"""An ``openai`` model entry with ``limits:`` against the simulated upstream (no Ray: the replica paces alone on its
share, the whole limit for one replica): calls wait for the budget instead of drawing the provider's 429s, and a
request the budget cannot hold within its deadline ends in a 429 whose Retry-After says when it could."""

from __future__ import annotations

import pytest

from batching import BatcherConfig, BatcherMetrics
from deployments.config import ModelConfig, QuotaLimits
from deployments.errors import UpstreamRateLimited
from deployments.model.embedder import EmbeddingModel
from deployments.model.quota.budget import LEASE_SHARE
from load.upstream import UpstreamConfig, run_upstream


@pytest.fixture
def upstream():
    config = UpstreamConfig(base_latency_ms=1.0, per_token_ms=0.0, jitter=0.0, tpm=600)  # 10 tokens a second
    with run_upstream(config) as running:
        yield running


@pytest.fixture
async def model(upstream):
    config = ModelConfig(name="sim", backend="openai", base_url=upstream.base_url, upstream_model="m",
                         batcher=BatcherConfig(max_batch_size=8, max_wait_ms=1.0),
                         limits=QuotaLimits(tpm=600, headroom=1.0))
    model = EmbeddingModel(config, metrics=BatcherMetrics())
    yield model
    await model.aclose()


async def test_a_request_the_quota_cannot_hold_in_time_is_429_with_a_computed_retry_after(model, upstream) -> None:
    vectors, counts = await model.embed([[1] * 500])
    assert counts == [500]
    with pytest.raises(UpstreamRateLimited) as refused:
        await model.embed([[2] * 300], timeout_s=1.0)  # 200 short: 20 s of refill
    # ... and up to 1.2 s more when the replica holds a HIGH lease (LEASE_SHARE of the bucket), counted as spent
    assert 15.0 < refused.value.retry_after_s <= (300 - (100 - LEASE_SHARE * 600)) / 10
    assert upstream.stats()["calls"] == 1  # the provider never saw the call it would have refused


async def test_a_model_without_limits_paces_to_what_the_providers_headers_say(upstream) -> None:
    config = ModelConfig(name="sim", backend="openai", base_url=upstream.base_url, upstream_model="m",
                         batcher=BatcherConfig(max_batch_size=8, max_wait_ms=1.0, max_retries=3))
    model = EmbeddingModel(config, metrics=BatcherMetrics())
    try:
        await model.embed([[1] * 590])  # the headers say 10 of the 600 tokens a minute are left
        await model.embed([[2] * 15])  # waits for the budget instead of drawing a 429
        assert (upstream.stats()["calls"], upstream.stats()["rejected_429"]) == (2, 0)
    finally:
        await model.aclose()

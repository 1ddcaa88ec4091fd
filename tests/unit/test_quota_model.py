"""An ``openai`` model entry with ``limits:`` against the simulated upstream (no shared budget: the replica paces
alone on its share, the whole limit for one replica): calls wait for the budget instead of drawing the provider's 429s, and a
request the budget cannot hold within its deadline ends in a 429 whose Retry-After says when it could.

The upstream is served in process (its ASGI app on this test's loop) and the quota runs on the loop's clock, so
looptime's clock is every clock here: refills and waits are exact."""

from __future__ import annotations

import asyncio
from typing import AsyncIterator

import httpx
import pytest

from batching import BatcherConfig, BatcherMetrics
from deployments.config import ModelConfig, QuotaLimits
from deployments.errors import UpstreamRateLimited
from deployments.model.backends import make_backend
from deployments.model import quota
from deployments.model.embedder import EmbeddingModel
from load.upstream import UpstreamConfig, create_app

pytestmark = pytest.mark.looptime

UPSTREAM = UpstreamConfig(base_latency_ms=1.0, per_token_ms=0.0, jitter=0.0, tpm=600)  # 10 tokens a second


class NoSharedBudget:
    """The limiter actor as a replica finds it when it cannot be reached: at once, whether or not this test process
    runs Ray (the suite's integration tests start it in the same process)."""

    def __init__(self, *_: object) -> None:
        pass

    async def _unreachable(self, *_: object) -> None:
        raise ConnectionError("no shared budget in this test")

    claim = renew = report = release = _unreachable


@pytest.fixture(autouse=True)
def alone(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(quota, "RemoteLedger", NoSharedBudget)


async def served(config: ModelConfig) -> tuple[EmbeddingModel, httpx.AsyncClient]:
    """The model on a fresh in-process upstream, and a client of that upstream (its /stats)."""
    upstream = httpx.AsyncClient(transport=httpx.ASGITransport(app=create_app(UPSTREAM)), base_url="http://upstream")
    model = EmbeddingModel(config, backend=make_backend(config, http_client=upstream), metrics=BatcherMetrics(),
                           clock=asyncio.get_running_loop().time)
    return model, upstream


@pytest.fixture
async def limited() -> AsyncIterator[tuple[EmbeddingModel, httpx.AsyncClient]]:
    config = ModelConfig(name="sim", backend="openai", base_url="http://upstream/v1", upstream_model="m",
                         batcher=BatcherConfig(max_batch_size=8, max_wait_ms=1.0),
                         limits=QuotaLimits(tpm=600, headroom=1.0))
    model, upstream = await served(config)
    yield model, upstream
    await model.aclose()
    await upstream.aclose()


async def test_a_request_the_quota_cannot_hold_in_time_is_429_with_a_computed_retry_after(limited) -> None:
    model, upstream = limited
    vectors, counts = await model.embed([[1] * 500])
    assert counts == [500]
    with pytest.raises(UpstreamRateLimited) as refused:
        await model.embed([[2] * 300], timeout_s=1.0)
    # 100 left (alone, a replica takes no lease): 300 wait for 200 more, at 10 tokens a second, from when it asked
    assert refused.value.retry_after_s == pytest.approx(20.0, abs=0.01)
    stats = (await upstream.get("/stats")).json()
    assert stats["calls"] == 1  # the provider never saw the call it would have refused


async def test_a_model_without_limits_paces_to_what_the_providers_headers_say() -> None:
    config = ModelConfig(name="sim", backend="openai", base_url="http://upstream/v1", upstream_model="m",
                         batcher=BatcherConfig(max_batch_size=8, max_wait_ms=1.0, max_retries=3))
    model, upstream = await served(config)
    loop = asyncio.get_running_loop()
    try:
        await model.embed([[1] * 590])  # the headers say 10 of the 600 tokens a minute are left
        started = loop.time()
        await model.embed([[2] * 15])  # waits for the budget instead of drawing a 429
        # the default headroom (0.9) of what is left: 9 tokens; the other 6 at 9 a second
        assert loop.time() - started == pytest.approx(6 / 9, abs=0.01)
        stats = (await upstream.get("/stats")).json()
        assert (stats["calls"], stats["rejected_429"]) == (2, 0)
    finally:
        await model.aclose()
        await upstream.aclose()

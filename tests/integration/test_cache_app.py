"""The cache in the full service, over HTTP: an ``openai`` model entry against the simulated upstream with a Redis
cache (a real ``redis-server`` on a free loopback port, its URL read from a file): a repeated text costs the
upstream nothing, and Redis killed while requests are in flight costs no request."""

from __future__ import annotations

import asyncio
import shutil
from typing import Iterator

import numpy as np
import pytest

from deployments.model import tokens
from load.bench.serving import deployed
from load.hashvec import matches
from load.redis_process import RedisServer
from load.upstream import RunningUpstream, UpstreamConfig, run_upstream

from .helpers import API_KEYS, Service

pytestmark = [pytest.mark.integration,
              pytest.mark.skipif(shutil.which("redis-server") is None, reason="redis-server is not installed")]

APP = "cached"
PREFIX = f"/{APP}"
MODEL = "sim-embedding-cached"
DIM = 384


@pytest.fixture(scope="module")
def redis_server() -> Iterator[RedisServer]:
    with RedisServer(maxmemory="64mb") as server:
        yield server


@pytest.fixture(scope="module")
def upstream() -> Iterator[RunningUpstream]:
    with run_upstream(UpstreamConfig(base_latency_ms=20.0, per_token_ms=0.0, jitter=0.0, max_concurrency=8)) as up:
        yield up


@pytest.fixture(scope="module")
def cached_app(serve_instance: Service, upstream: RunningUpstream, redis_server: RedisServer,
               tmp_path_factory: pytest.TempPathFactory) -> Iterator[Service]:
    from deployments.app import build_app

    url_file = tmp_path_factory.mktemp("secrets") / "redis-url"
    url_file.write_text(redis_server.url)
    args = {
        "models": [{
            "name": MODEL, "backend": "openai", "base_url": upstream.base_url,
            "upstream_model": "text-embedding-3-small", "num_replicas": 1,
            "batching": {"max_batch_size": 64, "max_wait_ms": 10, "max_concurrent_batches": 2},
            "cache": {"store": "redis", "timeout_ms": 100},
            "ray_actor_options": {"num_cpus": 0, "runtime_env": {
                "env_vars": {"EMBEDDINGS_CACHE_REDIS_URL_FILE": str(url_file)}}},
        }],
        "ingress": {"env_vars": {"EMBEDDINGS_API_KEYS": API_KEYS[0]}},
    }
    with deployed(serve_instance.url, {APP: build_app(args)}, MODEL):  # at /<APP>, deleted on exit
        yield serve_instance


def test_a_repeated_text_costs_the_upstream_nothing(cached_app: Service, upstream: RunningUpstream) -> None:
    client = cached_app.client(PREFIX)
    texts = [f"lighthouse keeper's log, entry {i}" for i in range(40)]
    upstream.reset()
    first = client.embeddings.create(model=MODEL, input=texts)
    billed = upstream.stats()["items_billed"]
    again = client.embeddings.create(model=MODEL, input=texts[::-1])
    assert billed == 40 and upstream.stats()["items_billed"] == 40
    assert [row.embedding for row in again.data] == [row.embedding for row in first.data][::-1]
    assert again.usage.prompt_tokens == first.usage.prompt_tokens == sum(tokens.count(text) for text in texts)
    assert all(matches(text, np.asarray(row.embedding, dtype=np.float32), DIM)
               for text, row in zip(texts[::-1], again.data))


async def test_redis_killed_with_requests_in_flight_costs_no_request(cached_app: Service,
                                                                     redis_server: RedisServer) -> None:
    texts = [f"harbour report {i % 100}" for i in range(400)]  # each text four times
    async with cached_app.async_client(PREFIX) as client:
        async def embed(text: str) -> np.ndarray:
            response = await client.embeddings.create(model=MODEL, input=[text], extra_headers={"X-Priority": "low"})
            return np.asarray(response.data[0].embedding, dtype=np.float32)

        first = [asyncio.ensure_future(embed(text)) for text in texts[:200]]
        await asyncio.sleep(0.2)  # some answered, some in flight
        redis_server.kill()
        rest = [asyncio.ensure_future(embed(text)) for text in texts[200:]]
        vectors = await asyncio.gather(*first, *rest)
    assert all(matches(text, vector, DIM) for text, vector in zip(texts, vectors))

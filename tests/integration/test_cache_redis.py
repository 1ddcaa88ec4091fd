"""The Redis store against a real ``redis-server`` on a free loopback port (no Ray): vectors round-trip with a TTL,
the server's maxmemory bounds the bytes, and the server killed while requests are in flight costs no request."""

from __future__ import annotations

import asyncio
import logging
import shutil
from pathlib import Path
from typing import Iterator, Sequence

import numpy as np
import pytest

from batching import BatcherConfig, BatcherMetrics
from deployments.config import CacheConfig, ModelConfig
from deployments.model.cache.redis_store import RedisStore
from deployments.model.embedder import EmbeddingModel
from load.redis_process import RedisServer
from tests.unit.cache_fakes import RecordingMetrics
from tests.unit.test_deployments_embedder import DIM, FakeBackend, vector

pytestmark = pytest.mark.skipif(shutil.which("redis-server") is None, reason="redis-server is not installed")

PASSWORD = "a-test-password"


@pytest.fixture
def server() -> Iterator[RedisServer]:
    with RedisServer(maxmemory="64mb", password=PASSWORD) as running:
        yield running


@pytest.fixture
def small_server() -> Iterator[RedisServer]:
    with RedisServer(maxmemory="4mb", password=PASSWORD) as running:
        yield running


async def test_vectors_round_trip_with_their_ttl_and_the_bound_is_checked(server: RedisServer,
                                                                         caplog: pytest.LogCaptureFixture) -> None:
    store = RedisStore(server.url, password=PASSWORD, ttl_s=3600.0, timeout_s=1.0)
    value = np.arange(DIM, dtype="<f4").tobytes()
    try:
        with caplog.at_level(logging.INFO, logger="ray.serve"):
            await store.set_many({"emb:a": value})
            assert await store.get_many(["emb:a", "emb:b"]) == [value, None]
    finally:
        await store.aclose()
    assert 0 < server.client().pttl("emb:a") <= 3600 * 1000
    assert not caplog.records  # maxmemory set, evicting policy: nothing to warn about
    server.client().config_set("maxmemory", 0)
    unbounded = RedisStore(server.url, password=PASSWORD, ttl_s=3600.0, timeout_s=1.0)
    try:
        with caplog.at_level(logging.WARNING, logger="ray.serve"):
            await unbounded.get_many(["emb:a"])
    finally:
        await unbounded.aclose()
    assert "no maxmemory" in caplog.text and PASSWORD not in caplog.text


async def test_a_server_that_refuses_scripts_gets_each_write_as_set_commands(server: RedisServer) -> None:
    server.client().execute_command("ACL", "SETUSER", "default", "-@scripting")
    store = RedisStore(server.url, password=PASSWORD, ttl_s=60.0, timeout_s=1.0)
    values = {f"emb:{i}": np.full(DIM, i, dtype="<f4").tobytes() for i in range(3)}
    client = server.client()
    try:
        for _ in range(2):  # refused, then sent as SET commands from the start
            await store.set_many(values)
            assert await store.get_many(list(values)) == list(values.values())
            assert all(0 < client.pttl(key) <= 60_000 for key in values)
            client.flushall()
    finally:
        await store.aclose()


async def test_the_servers_maxmemory_bounds_the_bytes(small_server: RedisServer) -> None:
    server = small_server
    store = RedisStore(server.url, password=PASSWORD, ttl_s=3600.0, timeout_s=5.0)
    value = bytes(1536)  # a 384-dimensional float32 vector
    try:
        for chunk in range(80):  # ~12 MB into a 4 MB server
            await store.set_many({f"emb:{chunk}-{i}": value for i in range(100)})
        assert await store.get_many(["emb:79-99"]) == [value]
    finally:
        await store.aclose()
    client = server.client()
    assert client.dbsize() < 8000
    assert client.info("memory")["used_memory"] <= 4 * 1024 * 1024 * 1.05


class SlowBackend(FakeBackend):
    """Each call takes a while, so requests are in flight when the store dies."""

    async def embed(self, items: Sequence, dimensions: int | None = None, background: bool = False) -> list:
        await asyncio.sleep(0.02)
        return await super().embed(items, dimensions, background)


async def test_redis_killed_while_requests_are_in_flight_costs_no_request(
        server: RedisServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "url").write_text(server.url)
    (tmp_path / "password").write_text(PASSWORD)
    monkeypatch.setenv("EMBEDDINGS_CACHE_REDIS_URL_FILE", str(tmp_path / "url"))
    monkeypatch.setenv("EMBEDDINGS_CACHE_REDIS_PASSWORD_FILE", str(tmp_path / "password"))
    metrics = RecordingMetrics()
    config = ModelConfig(name="fake", backend="openai", base_url="http://upstream/v1",
                         batcher=BatcherConfig(max_batch_size=32, max_wait_ms=2.0, max_concurrent_batches=2),
                         cache=CacheConfig(store="redis", timeout_ms=100.0))
    model = EmbeddingModel(config, backend=SlowBackend(), metrics=BatcherMetrics(),
                                         cache_metrics=metrics)
    texts = [f"document {i % 150}" for i in range(600)]  # each text four times over the run

    async def wave(start: int) -> list:
        batch = texts[start:start + 60]
        return await asyncio.gather(*(model.embed([text], priority="low") for text in batch),
                                    return_exceptions=True)

    outcomes: list = []
    try:
        for start in range(0, 180, 60):
            outcomes += await wave(start)
        hits_before_the_kill = metrics.lookups["hit"]
        in_flight = asyncio.ensure_future(wave(180))
        await asyncio.sleep(0.01)  # requests reached the store and the backend
        server.kill()
        outcomes += await in_flight
        for start in range(240, 420, 60):
            outcomes += await wave(start)
        server.start()  # back, empty
        await asyncio.sleep(1.1)  # the guard's cool-down
        for start in range(420, 600, 60):
            outcomes += await wave(start)
    finally:
        await model.aclose()
    failures = [outcome for outcome in outcomes if isinstance(outcome, BaseException)]
    assert not failures
    for text, (vectors, counts) in zip(texts, outcomes):
        np.testing.assert_array_equal(vectors[0], vector(text, DIM))
        assert counts == [2]
    assert hits_before_the_kill > 0
    assert sum(count for (op, _), count in metrics.store_errors.items() if op == "get") > 0
    assert metrics.lookups["hit"] > hits_before_the_kill  # the restarted server serves again

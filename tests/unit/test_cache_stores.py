"""The embedded store (diskcache) under its byte bound and expiry, on a controlled clock; keys; the identity that
keeps a changed model from finding old vectors; a model entry's ``cache:`` settings."""

from __future__ import annotations

import json
import logging
import os
import signal
import stat
from pathlib import Path

import diskcache
import pytest

from deployments.config import ConfigError, ModelConfig, parse_app_config
from deployments.model.cache.build import vector_identity
from deployments.model.cache.disk_store import DiskStore
from deployments.model.cache.keys import CacheKeys

ENTRY = 40 * 1024  # over diskcache's 32 KiB inline limit: each value is a file, counted to the byte


class FakeClock:
    """Stands in for the ``time`` module diskcache reads its clock from (access and expiry times)."""

    def __init__(self) -> None:
        self.now = 1_000_000.0

    def time(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> FakeClock:
    fake = FakeClock()
    monkeypatch.setattr(diskcache.core, "time", fake)
    return fake


def value(i: int) -> bytes:
    return bytes([i % 256]) * ENTRY


def vector(i: int) -> bytes:
    """The size of a 384-float vector: stored in its SQLite row."""
    return bytes([i % 256]) * 1536


async def test_the_disk_store_evicts_the_least_recently_stored_entries_past_its_byte_bound(
        tmp_path: Path) -> None:
    bound = 1024 * 1024
    store = DiskStore(tmp_path / "vectors", max_bytes=bound, ttl_s=None, lock_timeout_s=1.0)
    try:  # each write lands in the writer process before the next is sent, so store times follow this order
        for i in range(20):
            await store.set_many({f"k{i}": value(i)})
        assert await store.get_many(["k0"]) == [value(0)]  # a read does not keep an entry
        for i in range(20, 28):
            await store.set_many({f"k{i}": value(i)})
        found = await store.get_many([f"k{i}" for i in range(28)])
    finally:
        await store.aclose()
    kept = [i for i, entry in enumerate(found) if entry is not None]
    assert all(found[i] == value(i) for i in kept)
    assert kept == list(range(28 - len(kept), 28)), "the oldest stored went first"
    assert 0 not in kept and 27 in kept
    with diskcache.Cache(str(tmp_path / "vectors")) as reopened:
        assert reopened.volume() <= bound + ENTRY  # over by at most the entry whose write evicts


async def test_disk_entries_expire_after_their_ttl(tmp_path: Path, clock: FakeClock) -> None:
    store = DiskStore(tmp_path / "vectors", max_bytes=1024 * 1024, ttl_s=60.0, lock_timeout_s=1.0,
                      write_in_process=False)  # diskcache reads the test's clock in this process only
    try:
        await store.set_many({"key": b"vector"})
        clock.now += 59
        assert await store.get_many(["key", "other"]) == [b"vector", None]
        clock.now += 2
        assert await store.get_many(["key"]) == [None]
    finally:
        await store.aclose()


async def test_a_disk_lookup_reads_what_diskcache_reads_key_by_key(tmp_path: Path, clock: FakeClock) -> None:
    store = DiskStore(tmp_path / "vectors", max_bytes=64 * 1024 * 1024, ttl_s=None, lock_timeout_s=1.0,
                      write_in_process=False)
    keys = [f"emb:{i}" for i in range(1_200)]  # more than one query's worth of keys
    try:
        await store.set_many({key: vector(i) for i, key in enumerate(keys) if i % 3})  # in SQLite's rows
        await store.set_many({"large": value(7)})  # in a file of its own
        with diskcache.Cache(str(tmp_path / "vectors")) as cache:
            cache.set("expiring", b"vector", expire=10)
        clock.now += 11
        asked = ["large", "expiring", "absent", *reversed(keys), keys[1]]
        found = await store.get_many(asked)
        with diskcache.Cache(str(tmp_path / "vectors")) as cache:
            assert found == [cache.get(key) for key in asked]
    finally:
        await store.aclose()
    assert found[:3] == [value(7), None, None]
    assert found[-1] == vector(1) and sum(entry is not None for entry in found) == 1 + 800 + 1


async def test_a_key_written_again_holds_its_new_value_in_one_row(tmp_path: Path, clock: FakeClock) -> None:
    store = DiskStore(tmp_path / "vectors", max_bytes=64 * 1024 * 1024, ttl_s=60.0, lock_timeout_s=1.0,
                      write_in_process=False)
    try:
        await store.set_many({"a": vector(1), "b": vector(2)})
        clock.now += 50
        await store.set_many({"a": vector(3)})  # its expiry starts again
        clock.now += 20
        assert await store.get_many(["a", "b"]) == [vector(3), None]
    finally:
        await store.aclose()
    with diskcache.Cache(str(tmp_path / "vectors")) as cache:
        assert len(cache) == 2 and cache.check() == []  # counted once each; diskcache finds nothing to repair


async def test_the_disk_store_is_shared_by_the_processes_of_a_node(tmp_path: Path) -> None:
    one = DiskStore(tmp_path / "vectors", max_bytes=1024 * 1024, ttl_s=None, lock_timeout_s=1.0)
    other = DiskStore(tmp_path / "vectors", max_bytes=1024 * 1024, ttl_s=None, lock_timeout_s=1.0)
    try:
        await one.set_many({"key": b"vector"})
        assert await other.get_many(["key"]) == [b"vector"]
    finally:
        await one.aclose()
        await other.aclose()
    assert stat.S_IMODE(os.stat(tmp_path / "vectors").st_mode) == 0o700  # users' vectors: this user only


def writer_processes() -> list[int]:
    """This process's children that are disk cache writers."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            ppid = int((entry / "stat").read_text().rpartition(")")[2].split()[1])
            command = (entry / "cmdline").read_bytes()
        except (OSError, ValueError, IndexError):
            continue
        if ppid == os.getpid() and b"disk_writer" in command:
            found.append(int(entry.name))
    return found


async def test_a_writer_process_that_died_is_started_again_by_the_next_write(tmp_path: Path) -> None:
    store = DiskStore(tmp_path / "vectors", max_bytes=1024 * 1024, ttl_s=None, lock_timeout_s=1.0)
    try:
        await store.set_many({"before": b"vector"})
        (writer,) = writer_processes()
        os.kill(writer, signal.SIGKILL)
        with pytest.raises(OSError):  # the write that finds it dead fails: the guard counts it as a lost write
            await store.set_many({"lost": b"vector"})
        await store.set_many({"after": b"vector"})
        assert await store.get_many(["before", "lost", "after"]) == [b"vector", None, b"vector"]
        assert len(writer_processes()) == 1
    finally:
        await store.aclose()
    assert writer_processes() == []  # closing the store ends its writer


def test_keys_are_hashes_that_differ_by_model_identity_size_and_input_encoding() -> None:
    keys = CacheKeys("entry", "model v1", None)
    text = keys.key("a private sentence")
    assert text == CacheKeys("entry", "model v1", None).key("a private sentence")
    assert "private" not in text and len(text) == len("emb:") + 64
    others = {
        CacheKeys("other entry", "model v1", None).key("a private sentence"),
        CacheKeys("entry", "model v2", None).key("a private sentence"),
        CacheKeys("entry", "model v1", 256).key("a private sentence"),
        keys.key("a private sentence "),
    }
    assert text not in others and len(others) == 4
    assert keys.key("1") != keys.key((1,)) and keys.key((1, 2)) != keys.key((12,))
    assert keys.key("\ud800") != keys.key("\ud801")  # lone surrogates (valid JSON) are keyed, not refused
    with pytest.raises(TypeError):
        keys.key(3.5)


def test_an_upstream_model_or_url_change_changes_the_identity() -> None:
    base = ModelConfig(name="m", backend="openai", base_url="https://a/v1", upstream_model="small")
    assert vector_identity(base) == vector_identity(ModelConfig(**{**base.__dict__}))
    assert vector_identity(base) != vector_identity(ModelConfig(**{**base.__dict__, "upstream_model": "large"}))
    assert vector_identity(base) != vector_identity(ModelConfig(**{**base.__dict__, "base_url": "https://b/v1"}))


def test_a_changed_local_model_file_or_engine_changes_the_identity(tmp_path: Path) -> None:
    model_dir = tiny_model_dir(tmp_path / "model")
    entry = ModelConfig(name="m", backend="local", model_path=str(model_dir))
    before = vector_identity(entry)
    assert before != vector_identity(ModelConfig(**{**entry.__dict__, "engine": "torch"}))
    (model_dir / "model.safetensors").write_bytes(b"retrained weights")
    assert vector_identity(entry) != before


def tiny_model_dir(root: Path) -> Path:
    """The files ``ModelDir.read`` needs, no real weights."""
    (root / "1_Pooling").mkdir(parents=True)
    (root / "modules.json").write_text(json.dumps([
        {"type": "sentence_transformers.models.Transformer", "path": ""},
        {"type": "sentence_transformers.models.Pooling", "path": "1_Pooling"}]))
    (root / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode_mean_tokens": True,
                                                                "word_embedding_dimension": 8}))
    (root / "config.json").write_text(json.dumps({"hidden_size": 8, "max_position_embeddings": 16}))
    (root / "tokenizer.json").write_text("{}")
    (root / "model.safetensors").write_bytes(b"weights")
    return root


def test_a_model_entry_takes_a_disk_or_redis_cache() -> None:
    disk, redis = parse_app_config({"models": [
        {"name": "a", "cache": {"store": "disk", "max_bytes": 2**30, "directory": "/var/cache/vectors"}},
        {"name": "b", "backend": "openai", "base_url": "http://u/v1",
         "cache": {"store": "redis", "url_env": "MY_REDIS_URL", "timeout_ms": 20}},
    ]}).models
    assert disk.cache.store == "disk" and disk.cache.max_bytes == 2**30 and disk.cache.effective_ttl_s is None
    assert redis.cache.url_env == "MY_REDIS_URL" and redis.cache.timeout_ms == 20
    assert redis.cache.effective_ttl_s == 7 * 24 * 3600
    assert parse_app_config({"models": [{"name": "c"}]}).models[0].cache is None


def test_cache_settings_are_checked() -> None:
    with pytest.raises(ConfigError) as caught:
        parse_app_config({"models": [
            {"name": "a", "cache": {"store": "memcached"}},
            {"name": "b", "cache": {"store": "redis", "max_bytes": 2**30, "timeout_ms": 0}},
            {"name": "c", "cache": {"store": "disk", "max_bytes": 1000, "url_env": "X", "colour": "red"}},
        ]})
    message = str(caught.value)
    for problem in ("models[0].cache.store: must be one of disk, redis", "models[1].cache.max_bytes: only the disk",
                    "models[1].cache.timeout_ms: must be a number > 0", "models[2].cache.max_bytes: must be an integer",
                    "models[2].cache.url_env: only the redis", "models[2].cache: unknown setting(s) colour"):
        assert problem in message


def test_a_redis_url_in_runtime_env_is_warned_about_and_its_file_is_not(caplog: pytest.LogCaptureFixture) -> None:
    def entry(env_vars: dict[str, str]) -> dict:
        return {"name": "m", "cache": {"store": "redis", "url_env": "MY_REDIS_URL"},
                "ray_actor_options": {"runtime_env": {"env_vars": env_vars}}}

    with caplog.at_level(logging.WARNING):
        parse_app_config({"models": [entry({"MY_REDIS_URL_FILE": "/run/secrets/redis-url"})]})
    assert not caplog.records
    with caplog.at_level(logging.WARNING):
        parse_app_config({"models": [entry({"MY_REDIS_URL": "redis://:hunter2@cache:6379/0"})]})
    assert "MY_REDIS_URL holds a secret" in caplog.text and "hunter2" not in caplog.text

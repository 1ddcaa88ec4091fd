"""The cache a model entry names (``cache:`` in ``serve_config.yaml``), or none."""

from __future__ import annotations

from pathlib import Path

from deployments.config import DEFAULT_REDIS_TTL_S, CacheConfig, ModelConfig
from deployments.model.cache.disk_store import DiskStore
from deployments.model.cache.front import EmbeddingCache
from deployments.model.cache.metrics import CacheMetrics, RayServeCacheMetrics
from deployments.model.cache.redis_store import RedisStore
from deployments.model.cache.store import GuardedStore, VectorStore, longest_call_s
from deployments.model.stage import EmbeddingStage
from deployments.secrets import read_secret
from deployments.usage import ModelUsage

DEFAULT_DIRECTORY = Path("~/.cache/adaptive-embeddings/vectors")


def make_cache(model: ModelConfig, next_stage: EmbeddingStage, metrics: CacheMetrics | None = None,
               usage: ModelUsage | None = None) -> EmbeddingCache | None:
    """The entry's cache in front of ``next_stage``, or None when it has none. ``metrics`` defaults to the Ray
    Serve sink; ``usage`` counts each tenant's tokens the cache answered."""
    if model.cache is None:
        return None
    metrics = metrics if metrics is not None else RayServeCacheMetrics()
    store = GuardedStore(make_store(model.cache, model.name), cache=model.name,
                         timeout_s=model.cache.timeout_ms / 1000.0,
                         patient_timeout_s=model.cache.low_timeout_ms / 1000.0, metrics=metrics)
    return EmbeddingCache(store, next_stage, name=model.name, backend_identity=vector_identity(model),
                          metrics=metrics, usage=usage)


def make_store(config: CacheConfig, model_name: str) -> VectorStore:
    timeout_s = config.timeout_ms / 1000.0
    if config.store == "disk":
        directory = Path(config.directory) if config.directory else DEFAULT_DIRECTORY / model_name
        return DiskStore(directory, max_bytes=config.max_bytes, ttl_s=config.effective_ttl_s,
                         lock_timeout_s=timeout_s)
    url = read_secret(config.url_env)
    if not url:
        raise ValueError(f"model {model_name!r}: the redis cache needs its URL in ${config.url_env} "
                         f"(or a file holding it named by ${config.url_env}_FILE)")
    return RedisStore(url, password=read_secret(config.password_env) or None,
                      ttl_s=config.effective_ttl_s or DEFAULT_REDIS_TTL_S,
                      timeout_s=longest_call_s(timeout_s, config.low_timeout_ms / 1000.0))


def vector_identity(model: ModelConfig) -> str:
    """What the entry's vectors depend on besides the input: the local model's files, engine (ONNX Runtime and
    torch agree to ~1e-6, not to the bit), and, off the CPU, device and precision; or the upstream's URL and model."""
    if model.backend == "local":
        from deployments.model.backends.model_dir import ModelDir, packaged_model_path

        fingerprint = ModelDir.read(model.model_path or packaged_model_path()).fingerprint()
        gpu = f" {model.device} {model.precision}" if model.device != "cpu" else ""  # CPU keys as they always were
        return f"local {fingerprint} {model.engine} optimize={model.onnx_optimize}{gpu}"
    return f"openai {model.base_url} {model.upstream_model or model.name}"

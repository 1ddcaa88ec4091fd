"""The application's arguments (``args`` in ``serve_config.yaml``), typed and checked once at start-up.

```yaml
args:
  models:
    - name: all-MiniLM-L6-v2
      backend: local                 # local | openai
      model_path: null               # local: defaults to the packaged all-MiniLM-L6-v2
      engine: onnx                   # local: onnx | torch; threads: N (default: the machine's cores)
      batching: {max_batch_size: 64, max_wait_ms: 25, max_batch_tokens: 8192}   # BatcherConfig fields
      autoscaling: {min_replicas: 1, max_replicas: 2, policy: {...}}            # Ray Serve autoscaling_config
      cache: {store: disk, max_bytes: 1073741824}                               # CacheConfig fields; none: off
  ingress: {max_ongoing_requests: 1024}
```
Every problem is reported at once, each prefixed with where it is (``models[1].batching: ...``).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Mapping

from batching import BatcherConfig

logger = logging.getLogger(__name__)

BACKENDS = ("local", "openai")
ENGINES = ("onnx", "torch")  # how the local backend runs its model (deployments/backends/engines.py)
_LOCAL_ONLY = ("engine", "threads", "onnx_cache_dir", "onnx_optimize")
_ONNX_ONLY = ("onnx_cache_dir", "onnx_optimize")
MAX_INPUTS = 2048  # the most items one request may carry (OpenAI's limit)
# The largest request body the ingress reads. OpenAI caps a request at 300,000 tokens; as JSON that is at most
# ~7 bytes per token id, or a few bytes per token of text (up to 6 per character when \u-escaped): 16 MiB holds any
# request OpenAI would take, with room to spare, and bounds what one request can make a replica buffer.
DEFAULT_MAX_BODY_BYTES = 16 * 1024 * 1024
# Environment variables that hold secrets. Ray writes a replica's runtime_env (env_vars included) to
# runtime_env_agent.log, so a secret must reach the replica another way (see deployments/secrets.py).
SECRET_ENV_VARS = frozenset({"EMBEDDINGS_API_KEYS", "EMBEDDINGS_CACHE_REDIS_URL", "EMBEDDINGS_CACHE_REDIS_PASSWORD"})
CACHE_STORES = ("disk", "redis")
MIN_CACHE_BYTES = 1024 * 1024  # diskcache's SQLite file alone takes tens of kilobytes
DEFAULT_REDIS_TTL_S = 7 * 24 * 3600.0

_MODEL_KEYS = frozenset({
    "name", "backend", "model_path", "base_url", "api_key_env", "upstream_model", "upstream_timeout_s",
    "batching", "autoscaling", "num_replicas", "max_ongoing_requests", "max_queued_requests", "max_input_tokens",
    "max_surge_percent", "ray_actor_options", "cache", *_LOCAL_ONLY,
})
_BATCHING_KEYS = BatcherConfig.field_names() | {"max_batch_tokens"}
_CACHE_STORE_ONLY = {"disk": ("max_bytes", "directory"), "redis": ("url_env", "password_env")}
_CACHE_KEYS = frozenset({"store", "timeout_ms", "ttl_s", *_CACHE_STORE_ONLY["disk"], *_CACHE_STORE_ONLY["redis"]})
_INGRESS_KEYS = frozenset({"max_ongoing_requests", "num_replicas", "env_vars", "ray_actor_options", "max_body_bytes"})
_APP_KEYS = frozenset({"models", "ingress"})


class ConfigError(ValueError):
    """The application's arguments are invalid; the message lists every problem."""


@dataclass(frozen=True)
class CacheConfig:
    """A model entry's embedding cache (``deployments/cache/``): where vectors are kept, and for how long."""

    store: str  # disk: this node's replicas share a directory | redis: every node shares one server
    timeout_ms: float = 50.0  # each store call; a slower one is a miss
    ttl_s: float | None = None  # entries expire after; None: disk keeps them (bytes bound only), redis a week
    max_bytes: int = 1024**3  # disk only: the directory's bound (least recently used entries go first)
    directory: str | None = None  # disk only; None: ~/.cache/adaptive-embeddings/vectors/<model name>
    url_env: str = "EMBEDDINGS_CACHE_REDIS_URL"  # redis only: the variable holding the URL (or NAME_FILE a file)
    password_env: str = "EMBEDDINGS_CACHE_REDIS_PASSWORD"  # redis only, optional: the same for the password

    @property
    def effective_ttl_s(self) -> float | None:
        return DEFAULT_REDIS_TTL_S if self.ttl_s is None and self.store == "redis" else self.ttl_s


@dataclass(frozen=True)
class ModelConfig:
    name: str
    backend: str
    batcher: BatcherConfig = field(default_factory=BatcherConfig)
    model_path: str | None = None
    engine: str = "onnx"  # local only: onnx | torch
    threads: int | None = None  # local only: the model's intra-op threads; None: the machine's cores
    onnx_cache_dir: str | None = None  # onnx only: where the export is cached; None: ~/.cache/adaptive-embeddings/onnx
    onnx_optimize: bool = False  # onnx only: run ORT's offline-optimised graph, saved in the cache
    base_url: str | None = None
    api_key_env: str | None = None
    upstream_model: str | None = None
    upstream_timeout_s: float = 30.0
    autoscaling: Mapping[str, Any] | None = None
    num_replicas: int | None = None
    max_ongoing_requests: int | None = None
    max_queued_requests: int | None = None
    max_input_tokens: int | None = None
    max_surge_percent: int | None = None
    ray_actor_options: Mapping[str, Any] | None = None
    cache: CacheConfig | None = None

    @property
    def deployment_name(self) -> str:
        return f"embed-{self.name}"

    @property
    def min_ongoing_requests(self) -> int:
        """Fewer concurrent requests per replica than this and single-text requests could never fill the batches."""
        return self.batcher.max_batch_size * self.batcher.max_concurrent_batches

    @property
    def effective_max_ongoing_requests(self) -> int:
        """The user's value, raised to ``min_ongoing_requests`` if lower. By default enough for a full queue of
        single-input requests plus the batches in flight (``max_queue_depth + min_ongoing_requests``), and at
        least twice the floor: every request reaches the batcher, whose admission refuses LOW first and answers
        429 when the queue is full, instead of waiting unseen (and unbounded) in the callers' handle queues."""
        floor = self.min_ongoing_requests
        if self.max_ongoing_requests is None:
            return max(2 * floor, self.batcher.max_queue_depth + floor)
        return max(floor, self.max_ongoing_requests)

    @property
    def effective_max_queued_requests(self) -> int:
        """Requests a caller (the ingress) may hold for this deployment while no replica can take them (e.g.
        while a lost replica is replaced); beyond it they are refused (429) rather than queued without bound.
        By default one replica's worth."""
        if self.max_queued_requests is not None:
            return self.max_queued_requests
        return self.effective_max_ongoing_requests

    @property
    def effective_max_surge_percent(self) -> int:
        """Extra replicas Serve may start during a redeploy, so the old ones serve until the new ones are ready
        (Serve's default, 0, stops the old replicas first: nothing serves while the new ones start). By default
        100% for a replica that reserves no CPU; 0 for one that does, whose extra replica might find no free core."""
        if self.max_surge_percent is not None:
            return self.max_surge_percent
        return 100 if not self.effective_ray_actor_options.get("num_cpus") else 0

    @property
    def effective_ray_actor_options(self) -> dict[str, Any]:
        # A local model computes on one core; an API client mostly waits, so it reserves none.
        options: dict[str, Any] = {"num_cpus": 1 if self.backend == "local" else 0}
        options.update(self.ray_actor_options or {})
        return options


@dataclass(frozen=True)
class IngressConfig:
    max_ongoing_requests: int = 1024
    num_replicas: int = 1
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    env_vars: Mapping[str, str] = field(default_factory=dict)
    ray_actor_options: Mapping[str, Any] | None = None

    @property
    def effective_ray_actor_options(self) -> dict[str, Any]:
        options: dict[str, Any] = {"num_cpus": 0}  # it parses JSON and awaits handles
        options.update(self.ray_actor_options or {})
        if self.env_vars:
            runtime_env = dict(options.get("runtime_env") or {})
            runtime_env["env_vars"] = {**(runtime_env.get("env_vars") or {}), **self.env_vars}
            options["runtime_env"] = runtime_env
        return options


@dataclass(frozen=True)
class AppConfig:
    models: tuple[ModelConfig, ...]
    ingress: IngressConfig = field(default_factory=IngressConfig)

    def model(self, name: str) -> ModelConfig:
        return next(model for model in self.models if model.name == name)


def parse_app_config(args: Mapping[str, Any] | None) -> AppConfig:
    """Check ``args`` and build the typed config; raise ``ConfigError`` naming every problem."""
    problems: list[str] = []
    if not isinstance(args, Mapping):
        raise ConfigError(f"application args must be a mapping with a 'models' list, not {type(args).__name__}")
    _unknown_keys(args, _APP_KEYS, "args", problems)
    entries = args.get("models")
    models: list[ModelConfig] = []
    if not isinstance(entries, list) or not entries:
        problems.append("args.models: must be a non-empty list of model entries")
        entries = []
    for i, entry in enumerate(entries):
        model = _parse_model(entry, f"models[{i}]", problems)
        if model is not None:
            models.append(model)
    names = [model.name for model in models]
    for name in sorted({name for name in names if names.count(name) > 1}):
        problems.append(f"models: the name {name!r} is used more than once")
    ingress = _parse_ingress(args.get("ingress") or {}, problems)
    if problems:
        raise ConfigError("invalid application config:\n  - " + "\n  - ".join(problems))
    return AppConfig(models=tuple(models), ingress=ingress)


def _parse_model(entry: Any, where: str, problems: list[str]) -> ModelConfig | None:
    before = len(problems)
    if not _check_mapping(entry, _MODEL_KEYS, f"a mapping, not {type(entry).__name__}", where, problems):
        return None
    name = entry.get("name")
    if not isinstance(name, str) or not name.strip() or "#" in name or name != name.strip():
        problems.append(f"{where}.name: must be a non-empty string without '#' or surrounding spaces, not {name!r}")
    backend = entry.get("backend", "local")
    if backend not in BACKENDS:
        problems.append(f"{where}.backend: must be one of {', '.join(BACKENDS)}, not {backend!r}")
    if backend == "openai" and not isinstance(entry.get("base_url"), str):
        problems.append(f"{where}.base_url: the openai backend needs the upstream's base URL (e.g. https://api.openai.com/v1)")
    if backend == "local":
        for key in ("base_url", "api_key_env", "upstream_model"):
            if entry.get(key) is not None:
                problems.append(f"{where}.{key}: only the openai backend takes this option")
    _check_engine_options(entry, backend, where, problems)
    for key in ("model_path", "base_url", "api_key_env", "upstream_model"):
        if entry.get(key) is not None and not isinstance(entry.get(key), str):
            problems.append(f"{where}.{key}: must be a string")
    timeout = entry.get("upstream_timeout_s", 30.0)
    if not _is_number(timeout) or timeout <= 0:
        problems.append(f"{where}.upstream_timeout_s: must be a number > 0")
    batcher = _parse_batching(entry.get("batching") or {}, f"{where}.batching", problems)
    cache = _parse_cache(entry.get("cache"), f"{where}.cache", problems)
    autoscaling = entry.get("autoscaling")
    num_replicas = entry.get("num_replicas")
    if autoscaling is not None:
        _check_autoscaling(autoscaling, f"{where}.autoscaling", problems)
        if num_replicas not in (None, "auto"):
            problems.append(f"{where}: set either autoscaling or num_replicas, not both")
        num_replicas = None
    elif num_replicas is not None and (not isinstance(num_replicas, int) or num_replicas < 1):
        problems.append(f"{where}.num_replicas: must be an integer >= 1")
    max_ongoing = entry.get("max_ongoing_requests")
    if max_ongoing is not None and (not _is_int(max_ongoing) or max_ongoing < 1):
        problems.append(f"{where}.max_ongoing_requests: must be an integer >= 1")
    max_queued = entry.get("max_queued_requests")
    if max_queued is not None and (not _is_int(max_queued) or max_queued < 1):
        problems.append(f"{where}.max_queued_requests: must be an integer >= 1")
    max_input_tokens = entry.get("max_input_tokens")
    if max_input_tokens is not None and (not _is_int(max_input_tokens) or max_input_tokens < 1):
        problems.append(f"{where}.max_input_tokens: must be an integer >= 1")
    max_surge = entry.get("max_surge_percent")
    if max_surge is not None and (not _is_int(max_surge) or not 0 <= max_surge <= 100):
        problems.append(f"{where}.max_surge_percent: must be an integer from 0 to 100")
    actor_options = entry.get("ray_actor_options")
    if actor_options is not None and not isinstance(actor_options, Mapping):
        problems.append(f"{where}.ray_actor_options: must be a mapping")
    elif actor_options is not None:
        secrets = set(SECRET_ENV_VARS)
        if isinstance(entry.get("api_key_env"), str):
            secrets.add(entry["api_key_env"])
        if cache is not None and cache.store == "redis":
            secrets |= {cache.url_env, cache.password_env}
        _warn_about_secrets_in_runtime_env(actor_options.get("runtime_env"), secrets, f"{where}.ray_actor_options")
    if len(problems) > before or batcher is None:
        return None
    return ModelConfig(
        name=name,
        backend=backend,
        batcher=batcher,
        model_path=entry.get("model_path"),
        engine=entry.get("engine") or ModelConfig.engine,
        threads=entry.get("threads"),
        onnx_cache_dir=entry.get("onnx_cache_dir"),
        onnx_optimize=bool(entry.get("onnx_optimize", False)),
        base_url=entry.get("base_url"),
        api_key_env=entry.get("api_key_env"),
        upstream_model=entry.get("upstream_model"),
        upstream_timeout_s=float(timeout),
        autoscaling=dict(autoscaling) if autoscaling is not None else None,
        num_replicas=num_replicas,
        max_ongoing_requests=max_ongoing,
        max_queued_requests=max_queued,
        max_input_tokens=max_input_tokens,
        max_surge_percent=max_surge,
        ray_actor_options=dict(actor_options) if actor_options is not None else None,
        cache=cache,
    )


def _parse_cache(section: Any, where: str, problems: list[str]) -> CacheConfig | None:
    if section is None:
        return None
    if not _check_mapping(section, _CACHE_KEYS, "a mapping of cache settings", where, problems):
        return None
    before = len(problems)
    store = section.get("store")
    if store not in CACHE_STORES:
        problems.append(f"{where}.store: must be one of {', '.join(CACHE_STORES)}, not {store!r}")
    other = {"disk": "redis", "redis": "disk"}.get(store)
    for key in _CACHE_STORE_ONLY.get(other, ()):
        if key in section:
            problems.append(f"{where}.{key}: only the {other} store takes this option")
    for key in ("timeout_ms", "ttl_s"):
        if section.get(key) is not None and (not _is_number(section[key]) or section[key] <= 0):
            problems.append(f"{where}.{key}: must be a number > 0")
    max_bytes = section.get("max_bytes")
    if max_bytes is not None and (not _is_int(max_bytes) or max_bytes < MIN_CACHE_BYTES):
        problems.append(f"{where}.max_bytes: must be an integer >= {MIN_CACHE_BYTES} (bytes)")
    for key in ("directory", "url_env", "password_env"):
        if section.get(key) is not None and not isinstance(section[key], str):
            problems.append(f"{where}.{key}: must be a string")
    if len(problems) > before:
        return None
    return CacheConfig(**{key: value for key, value in section.items() if value is not None})


def _check_engine_options(entry: Mapping[str, Any], backend: Any, where: str, problems: list[str]) -> None:
    if backend != "local":
        for key in _LOCAL_ONLY:
            if entry.get(key) is not None:
                problems.append(f"{where}.{key}: only the local backend takes this option")
        return
    engine = ModelConfig.engine if entry.get("engine") is None else entry["engine"]
    if engine not in ENGINES:
        problems.append(f"{where}.engine: must be one of {', '.join(ENGINES)}, not {engine!r}")
    threads = entry.get("threads")
    if threads is not None and (not _is_int(threads) or threads < 1):
        problems.append(f"{where}.threads: must be an integer >= 1 (the model's intra-op threads; omit it for "
                        f"one per core), not {threads!r}")
    if entry.get("onnx_cache_dir") is not None and not isinstance(entry["onnx_cache_dir"], str):
        problems.append(f"{where}.onnx_cache_dir: must be a directory path (a string)")
    if entry.get("onnx_optimize") is not None and not isinstance(entry["onnx_optimize"], bool):
        problems.append(f"{where}.onnx_optimize: must be true or false")
    if engine == "torch":
        for key in _ONNX_ONLY:
            if entry.get(key) is not None:
                problems.append(f"{where}.{key}: only the onnx engine takes this option")


def _warn_about_secrets_in_runtime_env(runtime_env: Any, secrets: set[str], where: str) -> None:
    env_vars = runtime_env.get("env_vars") if isinstance(runtime_env, Mapping) else None
    if isinstance(env_vars, Mapping):
        _warn_about_secrets(env_vars, secrets, f"{where}.runtime_env.env_vars")


def _warn_about_secrets(env_vars: Mapping[str, Any], secrets: set[str], where: str) -> None:
    for name in sorted(secrets & set(env_vars)):
        logger.warning(
            "%s: %s holds a secret, and Ray writes every runtime_env (env_vars included) to runtime_env_agent.log; "
            "set %s_FILE to a file holding it instead, or set %s in the environment that starts Ray",
            where, name, name, name,
        )


def _parse_batching(section: Any, where: str, problems: list[str]) -> BatcherConfig | None:
    before = len(problems)
    if not _check_mapping(section, _BATCHING_KEYS, "a mapping of BatcherConfig fields", where, problems):
        return None
    fields_ = {key: value for key, value in section.items() if key in BatcherConfig.field_names()}
    if "max_batch_tokens" in section:
        if "max_batch_cost" in section:
            problems.append(f"{where}: set max_batch_tokens or max_batch_cost, not both (they are the same budget)")
        fields_["max_batch_cost"] = section["max_batch_tokens"]
    if len(problems) > before:
        return None
    try:
        config = BatcherConfig(**fields_)
    except (TypeError, ValueError) as exc:
        problems.append(f"{where}: {exc}")
        return None
    if config.max_queue_depth < MAX_INPUTS:
        logger.warning("%s: max_queue_depth=%d is below %d, so a full-size request can never be admitted",
                       where, config.max_queue_depth, MAX_INPUTS)
    return config


def _check_autoscaling(section: Any, where: str, problems: list[str]) -> None:
    if not isinstance(section, Mapping):
        problems.append(f"{where}: must be a mapping (Ray Serve autoscaling_config)")
        return
    from pydantic import ValidationError
    from ray.serve.config import AutoscalingConfig

    try:
        AutoscalingConfig(**section)
    except (ValidationError, ValueError, TypeError, ImportError, AttributeError) as exc:
        problems.append(f"{where}: {exc}".replace("\n", " "))


def _parse_ingress(section: Any, problems: list[str]) -> IngressConfig:
    if not isinstance(section, Mapping):
        problems.append("args.ingress: must be a mapping")
        return IngressConfig()
    _unknown_keys(section, _INGRESS_KEYS, "ingress", problems)
    defaults = IngressConfig()
    max_ongoing = section.get("max_ongoing_requests", defaults.max_ongoing_requests)
    if not isinstance(max_ongoing, int) or max_ongoing < 1:
        problems.append("ingress.max_ongoing_requests: must be an integer >= 1")
    num_replicas = section.get("num_replicas", defaults.num_replicas)
    if not isinstance(num_replicas, int) or num_replicas < 1:
        problems.append("ingress.num_replicas: must be an integer >= 1")
    env_vars = section.get("env_vars") or {}
    if not isinstance(env_vars, Mapping) or not all(isinstance(k, str) and isinstance(v, str) for k, v in env_vars.items()):
        problems.append("ingress.env_vars: must map names to string values")
        env_vars = {}
    actor_options = section.get("ray_actor_options")
    if actor_options is not None and not isinstance(actor_options, Mapping):
        problems.append("ingress.ray_actor_options: must be a mapping")
        actor_options = None
    max_body_bytes = section.get("max_body_bytes", defaults.max_body_bytes)
    if not _is_int(max_body_bytes) or max_body_bytes < 1024:
        problems.append("ingress.max_body_bytes: must be an integer >= 1024")
        max_body_bytes = defaults.max_body_bytes
    _warn_about_secrets(env_vars, set(SECRET_ENV_VARS), "ingress.env_vars")
    if actor_options is not None:
        _warn_about_secrets_in_runtime_env(actor_options.get("runtime_env"), set(SECRET_ENV_VARS),
                                           "ingress.ray_actor_options")
    return IngressConfig(
        max_ongoing_requests=max_ongoing if isinstance(max_ongoing, int) else defaults.max_ongoing_requests,
        num_replicas=num_replicas if isinstance(num_replicas, int) else defaults.num_replicas,
        max_body_bytes=max_body_bytes,
        env_vars=dict(env_vars),
        ray_actor_options=dict(actor_options) if actor_options is not None else None,
    )


def _check_mapping(section: Any, allowed: frozenset[str], must_be: str, where: str, problems: list[str]) -> bool:
    """Whether ``section`` is a mapping at all (if not, the problem says it must be ``must_be``); its keys outside
    ``allowed`` are problems too."""
    if not isinstance(section, Mapping):
        problems.append(f"{where}: must be {must_be}")
        return False
    _unknown_keys(section, allowed, where, problems)
    return True


def _unknown_keys(section: Mapping[str, Any], allowed: frozenset[str], where: str, problems: list[str]) -> None:
    unknown = sorted(str(key) for key in section if key not in allowed)
    if unknown:
        problems.append(f"{where}: unknown setting(s) {', '.join(unknown)}; allowed: {', '.join(sorted(allowed))}")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)

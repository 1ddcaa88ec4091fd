"""The application's arguments (``args`` in ``serve_config.yaml``), typed with pydantic and checked once at start-up.

```yaml
args:
  models:
    - name: all-MiniLM-L6-v2
      backend: local                 # local | openai
      model_path: null               # local: defaults to the packaged all-MiniLM-L6-v2
      engine: onnx                   # local: onnx | torch; threads: N (default: the CPUs it reserved)
      device: cpu                    # local: cpu | cuda (torch only; precision: fp32 | fp16 | bf16, num_gpus: 1)
      batching: {max_batch_size: 64, max_wait_ms: 25, max_batch_tokens: 8192}   # BatcherConfig fields
      autoscaling: {min_replicas: 1, max_replicas: 2, policy: {...}}            # Ray Serve autoscaling_config
      cache: {store: disk, max_bytes: 1073741824}                               # CacheConfig fields; none: off
      limits: {rpm: 3000, tpm: 1000000, headroom: 0.9}                          # openai: QuotaLimits fields
      provider_batches: {poll_s: 60}              # openai, with a cache: ProviderBatchConfig fields; none: off
  ingress: {max_ongoing_requests: 1024}
  batch: {directory: /var/lib/embeddings/batch}                                  # BatchConfig fields (Batch API)
```
Serve hands ``build_app`` an ``AppConfig`` (its typed application builder). Every problem is reported at once
(an entry's cross-field rules once its fields are valid), each prefixed with where it is (``models[1].batching:``).
What the settings mean for Ray (replicas' limits, CPUs, shutdown) is decided in ``deployments.sizing``.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Annotated, Any

from pydantic import (BaseModel, BeforeValidator, ConfigDict, Field, InstanceOf, ValidationError, ValidationInfo,
                      field_validator, model_validator)

from batching import BatcherConfig

logger = logging.getLogger(__name__)

BACKENDS = ("local", "openai")
ENGINES = ("onnx", "torch")  # how the local backend runs its model (deployments/model/backends/engines.py)
DEVICES = ("cpu", "cuda")  # where it runs; cuda: the torch engine only
PRECISIONS = ("fp32", "fp16", "bf16")  # its weights' and activations' type; below fp32 on cuda only
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
BATCHING_KEYS = BatcherConfig.field_names() | {"max_batch_tokens"}


class ConfigError(ValueError):
    """The application's arguments are invalid; the message lists every problem."""


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _rule(test: Callable[[Any], bool], must: str, *, quoted: bool = False) -> BeforeValidator:
    """A setting that is None (unset) or passes ``test``; otherwise "must ``must``" (and the value, if ``quoted``)."""

    def check(value: Any) -> Any:
        if value is not None and not test(value):
            raise ValueError(f"must {must}, not {value!r}" if quoted else f"must {must}")
        return value

    return BeforeValidator(check)


def _one_of(choices: tuple[str, ...]) -> BeforeValidator:
    return _rule(lambda value: value in choices, f"be one of {', '.join(choices)}", quoted=True)


def _int_at_least(minimum: int, unit: str = "") -> BeforeValidator:
    return _rule(lambda value: _is_int(value) and value >= minimum, f"be an integer >= {minimum}{unit}")


Name = Annotated[str, _rule(lambda value: isinstance(value, str), "be a string")]
Text = Name | None
Count = Annotated[int | None, _int_at_least(1)]
Seconds = Annotated[float, _rule(lambda value: _is_number(value) and value > 0, "be a number > 0")]
Options = Annotated[dict[str, Any] | None, _rule(lambda value: isinstance(value, Mapping), "be a mapping")]


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, validate_by_name=True, validate_by_alias=True)


class CacheConfig(_Section):
    """A model entry's embedding cache (``deployments/model/cache/``): where vectors are kept, and for how long."""

    store: Annotated[str, _one_of(CACHE_STORES)]  # disk: this node's replicas share a directory | redis: every node
    timeout_ms: Seconds = 50.0  # each store call; a slower one is a miss
    # a LOW request's lookups: bulk work, for which a late hit costs far less than computing the input again
    low_timeout_ms: Seconds = 500.0
    ttl_s: Seconds | None = None  # entries expire after; None: disk keeps them (bytes bound only), redis a week
    # disk only: the directory's bound (least recently stored entries go first)
    max_bytes: Annotated[int, _int_at_least(MIN_CACHE_BYTES, " (bytes)")] = 1024**3
    directory: Text = None  # disk only; None: ~/.cache/adaptive-embeddings/vectors/<model name>
    url_env: Name = "EMBEDDINGS_CACHE_REDIS_URL"  # redis only: the variable holding the URL (or NAME_FILE a file)
    password_env: Name = "EMBEDDINGS_CACHE_REDIS_PASSWORD"  # redis only, optional: the same for the password

    @field_validator("max_bytes", "directory", "url_env", "password_env", mode="before")
    @classmethod
    def _for_its_store_only(cls, value: Any, info: ValidationInfo) -> Any:
        owner = "disk" if info.field_name in ("max_bytes", "directory") else "redis"
        if info.data.get("store") not in (None, owner):
            raise ValueError(f"only the {owner} store takes this option")
        return value

    @property
    def effective_ttl_s(self) -> float | None:
        return DEFAULT_REDIS_TTL_S if self.ttl_s is None and self.store == "redis" else self.ttl_s


class QuotaLimits(_Section):
    """An ``openai`` model entry's provider quota (``deployments/model/quota/``): one budget shared by every replica."""

    rpm: Count = None  # requests per minute the account allows
    tpm: Count = None  # tokens per minute the account allows
    # the share of the limits the service spends: the rest absorbs what it cannot see (clocks, other clients)
    headroom: Annotated[float, _rule(lambda v: _is_number(v) and 0 < v <= 1, "be a number > 0 and <= 1",
                                     quoted=True)] = 0.9
    # what LOW may take past the reserve kept for HIGH, from what the bucket holds (never ahead of HIGH)
    low_share: Annotated[float, _rule(lambda v: _is_number(v) and 0 <= v < 1, "be a number >= 0 and < 1",
                                      quoted=True)] = 0.1

    @model_validator(mode="after")
    def _a_limit(self) -> QuotaLimits:
        if self.rpm is None and self.tpm is None:
            raise ValueError("set rpm, tpm or both")
        return self


class ProviderBatchConfig(_Section):
    """An ``openai`` entry's Batch API work relayed to the provider's own Batch API, at its batch price
    (``deployments/ingress/batch/relay.py``): a batch's distinct uncached inputs go in provider batches of at most
    these sizes, their vectors into the entry's cache, and its lines are then answered from the cache."""

    poll_s: Seconds = 30.0  # how often a provider batch in progress is looked at
    max_lines: Annotated[int, _int_at_least(1)] = 50_000  # request lines in one provider batch (OpenAI's limit)
    # bytes of one provider batch's input file, kept under OpenAI's 200 MB
    max_file_bytes: Annotated[int, _int_at_least(1024, " (bytes)")] = 190 * 1024 * 1024
    inputs_per_line: Annotated[int, _int_at_least(1)] = 256  # inputs in one request line (OpenAI takes 2048)
    # provider batches an input is sent in before its line is an error (a failed line's inputs go alone after)
    tries: Annotated[int, _int_at_least(1)] = 3


def _batcher_config(section: Any, info: ValidationInfo) -> BatcherConfig:
    """``batching:`` (BatcherConfig fields, with ``max_batch_tokens`` for ``max_batch_cost``) as a BatcherConfig."""
    if isinstance(section, BatcherConfig):
        return section
    section = {} if section is None else section
    if not isinstance(section, Mapping):
        raise ValueError("must be a mapping of BatcherConfig fields")
    unknown = sorted(str(key) for key in section if key not in BATCHING_KEYS)
    if unknown:
        raise ValueError(f"unknown setting(s) {', '.join(unknown)}; allowed: {', '.join(sorted(BATCHING_KEYS))}")
    fields = {key: value for key, value in section.items() if key != "max_batch_tokens"}
    if "max_batch_tokens" in section:
        if "max_batch_cost" in section:
            raise ValueError("set max_batch_tokens or max_batch_cost, not both (they are the same budget)")
        fields["max_batch_cost"] = section["max_batch_tokens"]
    try:
        config = BatcherConfig(**fields)
    except TypeError as exc:
        raise ValueError(str(exc)) from None
    if config.max_queue_depth < MAX_INPUTS:
        logger.warning("model %r: max_queue_depth=%d is below %d, so a full-size request can never be admitted",
                       info.data.get("name"), config.max_queue_depth, MAX_INPUTS)
    return config


def _autoscaling_config(section: Any) -> Any:
    if section is None:
        return None
    if not isinstance(section, Mapping):
        raise ValueError("must be a mapping (Ray Serve autoscaling_config)")
    from ray.serve.config import AutoscalingConfig

    try:
        AutoscalingConfig(**section)
    except (ValidationError, ValueError, TypeError, AttributeError) as exc:
        raise ValueError(str(exc).replace("\n", " ")) from None
    return dict(section)


def _warn_about_secrets(env_vars: Any, secrets: set[str], where: str) -> None:
    if not isinstance(env_vars, Mapping):
        return
    for name in sorted(secrets & set(env_vars)):
        logger.warning(
            "%s: %s holds a secret, and Ray writes every runtime_env (env_vars included) to runtime_env_agent.log; "
            "set %s_FILE to a file holding it instead, or set %s in the environment that starts Ray",
            where, name, name, name,
        )


def _runtime_env_vars(actor_options: Mapping[str, Any]) -> Any:
    runtime_env = actor_options.get("runtime_env")
    return runtime_env.get("env_vars") if isinstance(runtime_env, Mapping) else None


def _gpu_share(value: Any) -> bool:
    """Ray's GPU reservation: a share of one GPU (replicas may share it) or whole GPUs."""
    return _is_number(value) and (0 < value <= 1 or (value >= 1 and float(value).is_integer()))


class ModelConfig(_Section):
    name: str
    backend: Annotated[str, _one_of(BACKENDS)] = "local"
    # local only. Declared before the options they decide, which check them.
    device: Annotated[str, _one_of(DEVICES)] = "cpu"
    precision: Annotated[str, _one_of(PRECISIONS)] = "fp32"  # fp16, bf16: device cuda only
    # device cuda only: the GPUs each replica reserves (a fraction lets replicas share one); None: 1 (sizing.py)
    num_gpus: Annotated[int | float | None, _rule(
        _gpu_share, "be a number > 0 and <= 1 (a share of one GPU) or a whole number >= 1", quoted=True)] = None
    engine: Annotated[str, _one_of(ENGINES)] = "onnx"  # local only: onnx | torch (on device cuda: torch)
    # local only
    threads: Annotated[int | None, _rule(lambda v: _is_int(v) and v >= 1, "be an integer >= 1 (the cores the model "
                                         "computes on; omit it for one per CPU it reserved)", quoted=True)] = None
    onnx_cache_dir: Annotated[str | None, _rule(lambda v: isinstance(v, str), "be a directory path (a string)")] = None
    onnx_optimize: Annotated[bool, _rule(lambda v: isinstance(v, bool), "be true or false")] = False  # onnx only
    model_path: Text = None
    default_prompt_name: Text = None  # local only: a request naming no prompt gets it (default: the model's own)
    # local only: the shorter sizes the model was trained to keep its meaning in, that ``dimensions`` may ask for
    matryoshka_dims: Annotated[tuple[int, ...] | None, _rule(
        lambda v: isinstance(v, (list, tuple)) and bool(v) and all(_is_int(n) and n >= 1 for n in v),
        "be a non-empty list of integers >= 1")] = None
    base_url: Text = Field(default=None, validate_default=True)
    api_key_env: Text = None
    upstream_model: Text = None
    upstream_timeout_s: Seconds = 30.0
    batcher: Annotated[InstanceOf[BatcherConfig], BeforeValidator(_batcher_config)] = Field(
        default_factory=BatcherConfig, validation_alias="batching")
    cache: CacheConfig | None = None
    limits: QuotaLimits | None = None  # openai only: the provider's rate limits
    provider_batches: ProviderBatchConfig | None = None  # openai only, with a cache: Batch API work relayed
    autoscaling: Annotated[dict[str, Any] | None, BeforeValidator(_autoscaling_config)] = None
    num_replicas: Count = None
    max_ongoing_requests: Count = None
    max_queued_requests: Count = None
    max_input_tokens: Count = None
    max_surge_percent: Annotated[int | None, _rule(lambda v: _is_int(v) and 0 <= v <= 100,
                                                   "be an integer from 0 to 100")] = None
    ray_actor_options: Options = None

    @field_validator("name", mode="before")
    @classmethod
    def _a_plain_name(cls, name: Any) -> Any:
        if not isinstance(name, str) or not name.strip() or "#" in name or name != name.strip():
            raise ValueError(f"must be a non-empty string without '#' or surrounding spaces, not {name!r}")
        return name

    @model_validator(mode="before")
    @classmethod
    def _torch_on_cuda(cls, entry: Any) -> Any:
        """On device cuda the engine is torch unless the entry names one (onnx there is refused below)."""
        if (isinstance(entry, Mapping) and entry.get("backend", "local") == "local" and entry.get("device") == "cuda"
                and entry.get("engine") is None):
            return {**entry, "engine": "torch"}
        return entry

    @field_validator("device", "precision", "num_gpus", "engine", "threads", "onnx_cache_dir", "onnx_optimize",
                     "default_prompt_name", "matryoshka_dims", mode="before")
    @classmethod
    def _local_only(cls, value: Any, info: ValidationInfo) -> Any:
        """Set only for the local backend, the onnx options only for its onnx engine, the GPU's only for device
        cuda; unset (None) or the default is no setting, so a config passed back in as it came out is valid."""
        name = info.field_name or ""
        if name == "engine" and value == "onnx" and info.data.get("device") == "cuda":
            raise ValueError("the onnx engine runs on the CPU only; device cuda takes engine torch (its default "
                             "there: leave engine out)")
        default = cls.model_fields[name].default
        if value is None or (type(value) is type(default) and value == default):
            return default
        if info.data.get("backend", "local") != "local":
            raise ValueError("only the local backend takes this option")
        if name.startswith("onnx_") and info.data.get("engine") == "torch":
            raise ValueError("only the onnx engine takes this option")
        if name in ("precision", "num_gpus") and info.data.get("device") != "cuda":
            raise ValueError("only device cuda takes this option (the CPU computes in fp32 and reserves no GPU)")
        return value

    @field_validator("base_url", "api_key_env", "upstream_model", "limits", "provider_batches", mode="before")
    @classmethod
    def _openai_only(cls, value: Any, info: ValidationInfo) -> Any:
        backend = info.data.get("backend")
        if backend == "local" and value is not None:
            raise ValueError("only the openai backend takes this option")
        if info.field_name == "provider_batches" and value is not None and info.data.get("cache") is None:
            raise ValueError("relaying batches needs the entry's cache: the provider's vectors wait in it for the "
                             "batch's output (set cache: {store: disk} or {store: redis})")
        if backend == "openai" and info.field_name == "base_url" and not isinstance(value, str):
            raise ValueError("the openai backend needs the upstream's base URL (e.g. https://api.openai.com/v1)")
        return value

    @field_validator("num_replicas", mode="before")
    @classmethod
    def _replicas_fixed_or_scaled(cls, value: Any, info: ValidationInfo) -> Any:
        if info.data.get("autoscaling") is None:
            return value
        if value not in (None, "auto"):
            raise ValueError("set either autoscaling or num_replicas, not both")
        return None

    @field_validator("ray_actor_options", mode="after")
    @classmethod
    def _no_secrets_in_runtime_env(cls, options: dict[str, Any] | None, info: ValidationInfo) -> Any:
        if options is not None:
            secrets = set(SECRET_ENV_VARS)
            if info.data.get("api_key_env"):
                secrets.add(info.data["api_key_env"])
            cache = info.data.get("cache")
            if cache is not None and cache.store == "redis":
                secrets |= {cache.url_env, cache.password_env}
            where = f"model {info.data.get('name')!r}: ray_actor_options.runtime_env.env_vars"
            _warn_about_secrets(_runtime_env_vars(options), secrets, where)
        return options

    @property
    def deployment_name(self) -> str:
        return f"embed-{self.name}"


class IngressConfig(_Section):
    max_ongoing_requests: Annotated[int, _int_at_least(1)] = 1024
    num_replicas: Annotated[int, _int_at_least(1)] = 1
    # On a cluster, 1 with num_replicas = the node count: every node's proxy then has an ingress of its own, so a
    # node's loss takes no other node's requests with it (Serve's proxy answers a request whose ingress died 500).
    max_replicas_per_node: Count = None
    max_body_bytes: Annotated[int, _int_at_least(1024)] = DEFAULT_MAX_BODY_BYTES
    env_vars: Annotated[dict[str, str], _rule(
        lambda v: isinstance(v, Mapping) and all(isinstance(k, str) and isinstance(s, str) for k, s in v.items()),
        "map names to string values")] = Field(default_factory=dict)
    ray_actor_options: Options = None

    @field_validator("env_vars", mode="after")
    @classmethod
    def _no_secrets_in_env_vars(cls, env_vars: dict[str, str]) -> dict[str, str]:
        _warn_about_secrets(env_vars, set(SECRET_ENV_VARS), "ingress.env_vars")
        return env_vars

    @field_validator("ray_actor_options", mode="after")
    @classmethod
    def _no_secrets_in_runtime_env(cls, options: dict[str, Any] | None) -> dict[str, Any] | None:
        if options is not None:
            _warn_about_secrets(_runtime_env_vars(options), set(SECRET_ENV_VARS), "ingress.ray_actor_options")
        return options


class BatchConfig(_Section):
    """OpenAI's Batch API (``/v1/files``, ``/v1/batches``; ``deployments/ingress/batch/``): where its files and
    batches are kept, and its limits."""

    # None: $XDG_DATA_HOME (or ~/.local/share)/adaptive-embeddings/batch. On a cluster: storage every node mounts here.
    directory: Text = None
    max_file_bytes: Annotated[int, _int_at_least(1024, " (bytes)")] = 200 * 1024 * 1024  # OpenAI's
    max_lines: Annotated[int, _int_at_least(1)] = 50_000  # requests a batch's input file may hold (OpenAI's)
    retention_days: Seconds = 30.0  # files and finished batches are removed this long after their creation

    @property
    def path(self) -> Path:
        if self.directory is not None:
            return Path(self.directory).expanduser()
        data_home = os.environ.get("XDG_DATA_HOME") or Path.home() / ".local" / "share"
        return Path(data_home) / "adaptive-embeddings" / "batch"


class AppConfig(_Section):
    models: tuple[ModelConfig, ...]
    ingress: IngressConfig = Field(default_factory=IngressConfig)
    batch: BatchConfig = Field(default_factory=BatchConfig)

    @model_validator(mode="wrap")
    @classmethod
    def _every_problem_at_once(cls, args: Any, handler: Callable[[Any], AppConfig]) -> AppConfig:
        if not isinstance(args, (Mapping, AppConfig)):
            raise ConfigError(f"application args must be a mapping with a 'models' list, not {type(args).__name__}")
        try:
            return handler(args)
        except ValidationError as exc:
            raise ConfigError("invalid application config:\n  - " + "\n  - ".join(_problems(exc))) from None

    @field_validator("models", mode="before")
    @classmethod
    def _a_list_of_entries(cls, entries: Any) -> Any:
        if not isinstance(entries, (list, tuple)) or not entries:
            raise ValueError("must be a non-empty list of model entries")
        return entries

    @field_validator("models", mode="after")
    @classmethod
    def _names_are_unique(cls, models: tuple[ModelConfig, ...]) -> tuple[ModelConfig, ...]:
        names = [model.name for model in models]
        repeated = sorted({name for name in names if names.count(name) > 1})
        if repeated:
            raise ValueError("; ".join(f"the name {name!r} is used more than once" for name in repeated))
        return models

    @field_validator("ingress", "batch", mode="before")
    @classmethod
    def _unset_is_the_default(cls, section: Any) -> Any:
        return {} if section is None else section

    def model(self, name: str) -> ModelConfig:
        return next(model for model in self.models if model.name == name)


def parse_app_config(args: Any) -> AppConfig:
    """``args`` as the typed config; ``ConfigError`` naming every problem."""
    try:
        return AppConfig.model_validate(args)
    except ValidationError as exc:
        cause = exc.errors()[0].get("ctx", {}).get("error")
        raise cause if isinstance(cause, ConfigError) else ConfigError(str(exc)) from None


# The sections whose unknown keys are reported, by the setting that holds them (the top level: "").
_SECTIONS: dict[str, type[_Section]] = {"": AppConfig, "models": ModelConfig, "cache": CacheConfig,
                                        "ingress": IngressConfig, "limits": QuotaLimits, "batch": BatchConfig,
                                        "provider_batches": ProviderBatchConfig}


def _problems(exc: ValidationError) -> list[str]:
    problems: list[str] = []
    unknown: dict[tuple[Any, ...], list[str]] = {}
    for error in exc.errors(include_url=False):
        loc = tuple(error["loc"])
        if error["type"] == "extra_forbidden":
            unknown.setdefault(loc[:-1], []).append(str(loc[-1]))
            continue
        problems.append(f"{_where(loc)}: {_message(error)}")
    for loc, keys in unknown.items():
        section = _SECTIONS[next((str(part) for part in reversed(loc) if isinstance(part, str)), "")]
        allowed = sorted(field.validation_alias or name for name, field in section.model_fields.items())
        problems.append(f"{_where(loc)}: unknown setting(s) {', '.join(sorted(keys))}; allowed: {', '.join(allowed)}")
    return problems


def _where(loc: tuple[Any, ...]) -> str:
    """``models[1].batching``; a top-level setting is ``args.<name>``, the top level itself ``args``."""
    if len(loc) <= 1:
        return ".".join(["args", *map(str, loc)])
    where = ""
    for part in loc:
        where += f"[{part}]" if isinstance(part, int) else f".{part}" if where else str(part)
    return where


def _message(error: Any) -> str:
    if error["type"] in ("model_type", "model_attributes_type", "dict_type"):
        return "must be a mapping"
    if error["type"] == "missing":
        return "is required"
    return str(error["msg"]).removeprefix("Value error, ")

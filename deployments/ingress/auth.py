"""Bearer-key auth, and the tenant each key names.

The keys come from ``EMBEDDINGS_API_KEYS`` (comma-separated) or from the file ``EMBEDDINGS_API_KEYS_FILE`` names
(which keeps them out of Ray's runtime_env logs, see ``deployments.secrets``). That file is either a plain list of
keys (comma- or newline-separated: every key is tenant ``default``), or a keys file in YAML naming tenants:

    tenants:
      search:
        keys: [sha256:9f86d081...]          # each key's SHA-256 in hex: python -m deployments.ingress.auth hash KEY
        models: [text-embedding-3-small]    # the models it may use (left out: every model)
        rpm: 600                            # requests and tokens per minute, over every model
        tpm: 200000
        per_model: {text-embedding-3-small: {rpm: 300, tpm: 100000}}
        tokens_per_day: 5000000             # and per UTC month: tokens_per_month
      indexer:
        keys: [sha256:60303ae2...]
        max_priority: low                   # a batch-only key: its requests are LOW, and X-Priority: high is refused
        weight: 1                           # its share of a model beside other tenants' requests of one priority
      finance:
        keys: [sha256:fcde2b2e...]
        admin: true                         # may read every tenant's usage (GET /v1/organization/usage/embeddings)
        models: []                          # and embed nothing

A keys file holds hashes, not keys, so it is no secret. It is read again when it changes (looked at every
``RELOAD_S`` at most, by the request that comes then): a key revoked or a tenant changed takes effect within seconds,
without a restart. A file that no longer reads keeps the keys read before, and the log says why (never with a key).
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Callable, Literal, Mapping

import yaml
from pydantic import BaseModel, ConfigDict, Field, StringConstraints, ValidationError

from batching import Priority

from deployments.errors import AuthenticationFailed, PermissionDenied
from deployments.secrets import FILE_SUFFIX, read_secret
from deployments.usage import DEFAULT_TENANT
from deployments.wire import Share

Limit = Annotated[int, Field(ge=1)]

logger = logging.getLogger("ray.serve")

API_KEYS_ENV = "EMBEDDINGS_API_KEYS"
HASH_PREFIX = "sha256:"
RELOAD_S = 2.0


@dataclass(frozen=True)
class TenantLimits:
    """A tenant's limits, held across every ingress replica (``tenant_budget.py``); None: not limited."""

    rpm: int | None = None
    tpm: int | None = None
    per_model: tuple[tuple[str, int | None, int | None], ...] = ()  # (model, rpm, tpm)
    tokens_per_day: int | None = None
    tokens_per_month: int | None = None

    def __bool__(self) -> bool:
        return self._any

    @functools.cached_property
    def _any(self) -> bool:  # asked for every request of a tenant: worked out once
        return self != NO_LIMITS

    def buckets(self, model: str) -> list[tuple[str, str, int]]:
        """The limits a request to ``model`` counts against: (scope: "*" or the model, kind, capacity)."""
        found = [("*", kind, capacity) for kind, capacity in (
            ("rpm", self.rpm), ("tpm", self.tpm), ("day", self.tokens_per_day), ("month", self.tokens_per_month))
            if capacity is not None]
        for name, rpm, tpm in self.per_model:
            if name == model:
                found += [(name, kind, capacity) for kind, capacity in (("rpm", rpm), ("tpm", tpm))
                          if capacity is not None]
        return found


NO_LIMITS = TenantLimits()


@dataclass(frozen=True)
class Tenant:
    """Who a key belongs to, and what it may do."""

    name: str
    models: frozenset[str] | None = None  # None: every model
    max_priority: Priority = Priority.HIGH
    limits: TenantLimits = NO_LIMITS
    weight: float = 1.0  # its share of a model beside other tenants of the same priority, relative to theirs
    admin: bool = False  # may read every tenant's usage

    @functools.cached_property
    def share(self) -> Share | None:
        """Whose its requests are, for fair shares of the model (None: the default tenant, nobody's in particular)."""
        return None if self.name == DEFAULT_TENANT else Share(self.name, self.weight)

    def priority(self, asked: Priority | None) -> Priority:
        """The priority of a request that asked for ``asked`` (None: it asked for none, and gets the highest it may
        have); ``PermissionDenied`` past the tenant's highest."""
        if asked is None:
            return self.max_priority
        if asked < self.max_priority:  # Priority orders HIGH first
            raise PermissionDenied(f"this API key may not send X-Priority: {asked.name.lower()}; it sends "
                                   f"{self.max_priority.name.lower()} work only", param="X-Priority")
        return asked

    def check_model(self, model: str) -> None:
        if self.models is not None and model not in self.models:
            raise PermissionDenied(f"this API key may not use the model {model!r}", param="model")


ANYONE = Tenant(DEFAULT_TENANT)  # every request, while no key is required

KeyHash = Annotated[str, StringConstraints(pattern=r"^sha256:[0-9a-f]{64}$")]


class _ModelLimits(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    rpm: Limit | None = None
    tpm: Limit | None = None


class _TenantEntry(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    keys: list[KeyHash] = Field(min_length=1)
    models: list[str] | None = None
    max_priority: Literal["high", "low"] = "high"
    weight: float = Field(default=1.0, gt=0)
    admin: bool = False
    rpm: Limit | None = None
    tpm: Limit | None = None
    per_model: dict[str, _ModelLimits] = Field(default_factory=dict)
    tokens_per_day: Limit | None = None
    tokens_per_month: Limit | None = None

    def limits(self) -> TenantLimits:
        return TenantLimits(self.rpm, self.tpm, tuple((model, limits.rpm, limits.tpm)
                                                      for model, limits in sorted(self.per_model.items())),
                            self.tokens_per_day, self.tokens_per_month)


class _KeysFile(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    tenants: dict[str, _TenantEntry]


def key_hash(key: str) -> str:
    """What a keys file holds for ``key``."""
    return HASH_PREFIX + hashlib.sha256(key.encode("utf-8")).hexdigest()


def parse_keys(text: str) -> dict[str, Tenant]:
    """A keys file's or a plain list's content as ``{key hash: tenant}``; ``ValueError`` naming what is wrong."""
    try:
        document = yaml.safe_load(text) if text.strip() else None
    except yaml.YAMLError:
        document = None
    if not isinstance(document, dict):  # a plain list of keys
        keys = [key.strip() for key in text.replace("\n", ",").split(",") if key.strip()]
        return {key_hash(key): ANYONE for key in keys}
    try:
        parsed = _KeysFile.model_validate(document)
    except ValidationError as exc:
        first = exc.errors(include_url=False)[0]
        where = ".".join(str(part) for part in first["loc"])
        raise ValueError(f"the keys file is invalid at {where}: {first['msg']}") from None
    tenants: dict[str, Tenant] = {}
    for name, entry in parsed.tenants.items():
        tenant = Tenant(name, None if entry.models is None else frozenset(entry.models),
                        Priority.parse(entry.max_priority), entry.limits(), entry.weight, entry.admin)
        for digest in entry.keys:
            if digest in tenants and tenants[digest].name != name:
                raise ValueError(f"the keys file gives one key to tenants {tenants[digest].name!r} and {name!r}")
            tenants[digest] = tenant
    return tenants


class ApiKeys:
    def __init__(self, keys: list[str], *, path: Path | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        """``keys``: plain keys, each tenant ``default``; or ``path``, a keys file read now and again when it
        changes."""
        self._path = path
        self._clock = clock
        self._tenants: dict[str, Tenant] = {key_hash(key): ANYONE for key in keys}
        self._by_name: dict[str, Tenant] = {}
        self._stamp: tuple[int, int] | None = None  # the file's (mtime_ns, size) when it was read
        self._looked_at = -RELOAD_S
        if path is not None:
            self._tenants = parse_keys(path.read_text(encoding="utf-8"))
            self._stamp = _stamp(path)
            self._looked_at = clock()
        self._by_name = _by_name(self._tenants)

    @classmethod
    def from_env(cls, environ: Mapping[str, str] = os.environ) -> "ApiKeys":
        if environ.get(API_KEYS_ENV, "").strip():
            return cls([key.strip() for key in environ[API_KEYS_ENV].split(",") if key.strip()])
        path = environ.get(API_KEYS_ENV + FILE_SUFFIX, "").strip()
        if not path:
            return cls([])
        read_secret(API_KEYS_ENV, environ)  # a file that cannot be read is refused as any secret's file is
        return cls([], path=Path(path))

    @property
    def required(self) -> bool:
        return bool(self._tenants) or self._path is not None

    def check(self, authorization: str | None) -> Tenant:
        """The tenant of the key the header carries, or ``AuthenticationFailed`` (the key never logged or
        echoed); ``ANYONE`` while no key is required."""
        self._reload_if_changed()
        if not self.required:
            return ANYONE
        scheme, _, presented = (authorization or "").partition(" ")
        if scheme.lower() != "bearer" or not presented.strip():
            raise AuthenticationFailed("missing API key: send it as 'Authorization: Bearer <key>'")
        tenant = self._tenants.get(key_hash(presented.strip()))  # by hash: no comparison with any key's bytes
        if tenant is None:
            raise AuthenticationFailed("incorrect API key provided")
        return tenant

    @property
    def names_tenants(self) -> bool:
        """Whether the keys name a tenant (other than the default one every key of a plain list is)."""
        return any(name != DEFAULT_TENANT for name in self._by_name)

    def tenant(self, name: str) -> Tenant | None:
        """The tenant named ``name`` as the keys say now (work it left, such as a batch, runs as it is now), or None
        once no key names it; the default tenant is always there."""
        self._reload_if_changed()
        return self._by_name.get(name, ANYONE if name == DEFAULT_TENANT else None)

    def _reload_if_changed(self) -> None:
        if self._path is None or self._clock() - self._looked_at < RELOAD_S:
            return
        self._looked_at = self._clock()
        try:
            stamp = _stamp(self._path)
            if stamp == self._stamp:
                return
            tenants = parse_keys(self._path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, ValueError) as exc:
            logger.error("API keys file %s not read again (%s); the keys read before still apply", self._path,
                         exc if isinstance(exc, ValueError) else type(exc).__name__)
            return
        self._tenants, self._stamp, self._by_name = tenants, stamp, _by_name(tenants)
        logger.info("API keys file %s read again: %d key(s) of %d tenant(s)", self._path, len(tenants),
                    len({tenant.name for tenant in tenants.values()}))


def _by_name(tenants: Mapping[str, Tenant]) -> dict[str, Tenant]:
    return {tenant.name: tenant for tenant in tenants.values()}


def _stamp(path: Path) -> tuple[int, int]:
    status = path.stat()
    return status.st_mtime_ns, status.st_size


def main(argv: list[str] | None = None) -> None:
    """``python -m deployments.ingress.auth hash KEY``: the line a keys file holds for KEY."""
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2 or args[0] != "hash":
        sys.exit("usage: python -m deployments.ingress.auth hash KEY")
    print(key_hash(args[1]))


if __name__ == "__main__":
    main()

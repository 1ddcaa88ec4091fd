"""What each tenant used of each model, counted where it happens: requests, inputs and tokens where its requests
arrive (the ingress), and where its inputs are answered (the model replicas) the tokens the cache answered and the
tokens the model's backend was paid for (an upstream model's provider bills them; a local model computed them).

Counted in the process and handed on (``flush``) within ``FLUSH_S`` and at most that often: a metric's update costs
more than the rest of the count, and a request on the gateway's path has a fraction of a millisecond to spend. What
is handed on goes to the metrics (``RayTenantUsage``) and to the tenants' ledger (``UsageLedger``, one actor every
replica of the application writes to), by the UTC hour, which the usage endpoint
(``deployments/ingress/usage_routes.py``) reads.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Callable, Protocol

from deployments.named_actor import NamedActor

logger = logging.getLogger("ray.serve")

FLUSH_S = 1.0
HOUR_S = 3600
DEFAULT_TENANT = "default"  # every caller where no keys file names a tenant: in the metrics only, not in the ledger

# What is counted of a tenant's use of a model, in this order. ``tokens`` is what its answers' ``usage`` says (each
# input's tokens, as the provider would bill a direct call); ``cached_tokens`` of those were answered without the
# backend (from the cache, by another request's computation of the same input, or a repeat within the request);
# ``billed_tokens`` is what the backend's successful calls cost, an input counted once, for the tenant whose input
# was sent (a Batch API batch relayed to the provider: its owner).
COUNTS = ("requests", "inputs", "tokens", "cached_tokens", "billed_tokens")
REQUESTS, INPUTS, TOKENS, CACHED_TOKENS, BILLED_TOKENS = range(len(COUNTS))

Totals = dict[tuple[str, str], list[int]]  # (tenant, model) -> one count per COUNTS
Row = tuple  # (UTC hour's start, tenant, model, *one count per COUNTS)


class UsageStore(Protocol):
    async def record_usage(self, rows: list[Row]) -> None: ...

    async def usage(self, start: int, end: int) -> list[Row]: ...


class UsageLedger:
    """Every replica's usage, by UTC hour, tenant and model: in the process, or as the application's actor
    (``RayUsageLedger``), in memory (the metrics are the lasting record)."""

    def __init__(self) -> None:
        self._rows: dict[tuple[int, str, str], list[int]] = {}

    async def record_usage(self, rows: list[Row]) -> None:
        for hour, tenant, model, *counts in rows:
            totals = self._rows.setdefault((hour, tenant, model), [0] * len(COUNTS))
            for position, count in enumerate(counts):
                totals[position] += count

    async def usage(self, start: int, end: int) -> list[Row]:
        """The rows of the hours that start in ``[start, end)``."""
        return [(hour, tenant, model, *counts) for (hour, tenant, model), counts in sorted(self._rows.items())
                if start <= hour < end]


class RayUsageLedger:
    """The application's ``UsageLedger`` actor (``deployments.named_actor``: created by the first replica, ingress or
    model, to write to it; made again, empty, if it died)."""

    def __init__(self) -> None:
        self._actor: NamedActor | None = None

    def start(self) -> None:
        """Find or make the ledger now (``NamedActor.start``)."""
        self._ledger().start()

    async def record_usage(self, rows: list[Row]) -> None:
        await self._ledger().call("record_usage", rows)

    async def usage(self, start: int, end: int) -> list[Row]:
        return await self._ledger().call("usage", start, end)

    def _ledger(self) -> NamedActor:
        if self._actor is None:  # the application's name is known once in a replica
            from ray import serve

            self._actor = NamedActor(UsageLedger, f"usage:{serve.get_replica_context().app_name}")
        return self._actor


class TenantUsage:
    def __init__(self, store: UsageStore | None = None, wall: Callable[[], float] = time.time) -> None:
        """``store``: the shared ledger (None: none, the metrics only)."""
        self.store = store
        self._wall = wall
        self._pending: Totals = {}
        self._timer: asyncio.TimerHandle | None = None
        self._writes: set[asyncio.Task[None]] = set()

    def record(self, tenant: str, model: str, inputs: int, tokens: int) -> None:
        """A request answered."""
        counts = self._counts(tenant, model)
        counts[REQUESTS] += 1
        counts[INPUTS] += inputs
        counts[TOKENS] += tokens

    def add(self, tenant: str, model: str, count: int, amount: int) -> None:
        """``amount`` more of one of ``COUNTS`` (its position)."""
        if amount:
            self._counts(tenant, model)[count] += amount

    def flush_now(self) -> None:
        """Hand on what was counted since the last flush."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        pending, self._pending = self._pending, {}
        if pending:
            self.flush(pending)

    def flush(self, totals: Totals) -> None:
        """Usage since the last flush, by tenant and model: the keys file's tenants' to the shared ledger (the
        default tenant's is in the metrics only)."""
        rows = [(tenant, model, counts) for (tenant, model), counts in totals.items() if tenant != DEFAULT_TENANT]
        if self.store is None or not rows:  # without a keys file of tenants there is no ledger to keep
            return
        hour = int(self._wall()) // HOUR_S * HOUR_S
        task = asyncio.ensure_future(self._write([(hour, tenant, model, *counts) for tenant, model, counts in rows]))
        self._writes.add(task)
        task.add_done_callback(self._writes.discard)

    async def written(self) -> None:
        """Return once what was handed on so far is in the ledger."""
        while self._writes:
            await asyncio.gather(*self._writes, return_exceptions=True)

    def _counts(self, tenant: str, model: str) -> list[int]:
        counts = self._pending.get((tenant, model))
        if counts is None:
            counts = self._pending[tenant, model] = [0] * len(COUNTS)
        if self._timer is None:
            self._timer = asyncio.get_running_loop().call_later(FLUSH_S, self.flush_now)
        return counts

    async def _write(self, rows: list[Row]) -> None:
        try:
            await self.store.record_usage(rows)  # type: ignore[union-attr]
        except Exception as exc:  # noqa: BLE001 - the ledger is gone (a new one starts empty): the metrics keep it
            logger.warning("tenant usage not written to the ledger (%s)", type(exc).__name__)


class ModelUsage:
    """A model replica's side of its tenants' usage: the tokens its cache answered and those its backend's calls
    were paid for, each under the tenant it was for. Its ``TenantUsage`` is made (``make``) on the first count: a
    replica no tenant of a keys file uses keeps no usage at all."""

    def __init__(self, model: str, make: Callable[[], TenantUsage]) -> None:
        self._model = model
        self._make = make
        self._usage: TenantUsage | None = None

    def cached(self, tenant: str, tokens: int) -> None:
        self._made().add(tenant, self._model, CACHED_TOKENS, tokens)

    def billed(self, tenant: str, tokens: int) -> None:
        self._made().add(tenant, self._model, BILLED_TOKENS, tokens)

    async def aclose(self) -> None:
        """Hand on what was counted, and return once it is in the ledger."""
        if self._usage is not None:
            self._usage.flush_now()
            await self._usage.written()

    def _made(self) -> TenantUsage:
        if self._usage is None:
            self._usage = self._make()
        return self._usage


class RayTenantUsage(TenantUsage):
    """Each tenant's counts by model as Ray Serve metrics (``ray_embedding_tenant_requests_total``,
    ``..._inputs_total``, ``..._tokens_total``, ``..._cached_tokens_total``, ``..._billed_tokens_total``; ``tenant``
    is a name from the keys file, never a key), and to the shared ledger."""

    def __init__(self, store: UsageStore | None = None) -> None:
        from ray.serve import metrics as serve_metrics

        super().__init__(store)
        self._counters = [serve_metrics.Counter(f"embedding_tenant_{what}_total",
                                                f"{what.replace('_', ' ').capitalize()} by tenant",
                                                tag_keys=("tenant", "model"))
                          for what in COUNTS]

    def flush(self, totals: Totals) -> None:
        for (tenant, model), counts in totals.items():
            for counter, count in zip(self._counters, counts):
                if count:
                    counter.inc(count, tags={"tenant": tenant, "model": model})
        super().flush(totals)

"""What each tenant used of each model, counted where its requests arrive: requests, inputs and tokens.

Counted in this process and handed on (``flush``) within ``FLUSH_S`` of a request and at most that often: a
metric's update costs more than the rest of the count, and a request on the gateway's path has a fraction of a
millisecond to spend. What is handed on goes to the metrics (``deployments.ingress.metrics.RayTenantUsage``) and to
the tenants' ledger (``UsageLedger``, in the ``TenantLimiter`` every replica shares), by the UTC hour, which the
usage endpoint (``usage_routes.py``) reads.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Callable, Protocol

from deployments.ingress.auth import DEFAULT_TENANT

logger = logging.getLogger("ray.serve")

FLUSH_S = 1.0
HOUR_S = 3600

Totals = dict[tuple[str, str], list[int]]  # (tenant, model) -> [requests, inputs, tokens]
Row = tuple[int, str, str, int, int, int]  # (UTC hour's start, tenant, model, requests, inputs, tokens)


class UsageStore(Protocol):
    async def record_usage(self, rows: list[Row]) -> None: ...

    async def usage(self, start: int, end: int) -> list[Row]: ...


class UsageLedger:
    """Every replica's usage, by UTC hour, tenant and model (kept by the ``TenantLimiter`` actor, in memory: the
    metrics are the lasting record)."""

    def __init__(self) -> None:
        self._rows: dict[tuple[int, str, str], list[int]] = {}

    def add(self, rows: list[Row]) -> None:
        for hour, tenant, model, *counts in rows:
            totals = self._rows.setdefault((hour, tenant, model), [0, 0, 0])
            for position, count in enumerate(counts):
                totals[position] += count

    def between(self, start: int, end: int) -> list[Row]:
        """The rows of the hours that start in ``[start, end)``."""
        return [(hour, tenant, model, *counts) for (hour, tenant, model), counts in sorted(self._rows.items())
                if start <= hour < end]


class TenantUsage:
    def __init__(self, store: UsageStore | None = None, wall: Callable[[], float] = time.time) -> None:
        """``store``: the shared ledger (None: none, the metrics only)."""
        self._store = store
        self._wall = wall
        self._pending: Totals = {}
        self._timer: asyncio.TimerHandle | None = None
        self._writes: set[asyncio.Task[None]] = set()

    def record(self, tenant: str, model: str, inputs: int, tokens: int) -> None:
        counts = self._pending.get((tenant, model))
        if counts is None:
            counts = self._pending[tenant, model] = [0, 0, 0]
        counts[0] += 1
        counts[1] += inputs
        counts[2] += tokens
        if self._timer is None:
            self._timer = asyncio.get_running_loop().call_later(FLUSH_S, self.flush_now)

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
        ``default`` tenant, every caller where keys name no tenant, is in the metrics only)."""
        rows = [(tenant, model, counts) for (tenant, model), counts in totals.items() if tenant != DEFAULT_TENANT]
        if self._store is None or not rows:  # without a keys file of tenants there is no ledger to keep
            return
        hour = int(self._wall()) // HOUR_S * HOUR_S
        task = asyncio.ensure_future(self._write([(hour, tenant, model, *counts) for tenant, model, counts in rows]))
        self._writes.add(task)
        task.add_done_callback(self._writes.discard)

    async def written(self) -> None:
        """Return once what was handed on so far is in the ledger."""
        while self._writes:
            await asyncio.gather(*self._writes, return_exceptions=True)

    async def _write(self, rows: list[Row]) -> None:
        try:
            await self._store.record_usage(rows)  # type: ignore[union-attr]
        except Exception as exc:  # noqa: BLE001 - the ledger is gone (a new one starts empty): the metrics keep it
            logger.warning("tenant usage not written to the ledger (%s)", type(exc).__name__)

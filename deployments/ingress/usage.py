"""What each tenant used of each model, counted where its requests arrive: requests, inputs and tokens.

Counted in this process and handed to the sink (``flush``) at most once every ``FLUSH_S``: a metric's update costs
more than the rest of the count, and a request on the gateway's path has a fraction of a millisecond to spend.
"""

from __future__ import annotations

import time
from typing import Callable

FLUSH_S = 1.0

Totals = dict[tuple[str, str], list[int]]  # (tenant, model) -> [requests, inputs, tokens]


class TenantUsage:
    """Counts usage; this base class's ``flush`` drops it (``deployments.ingress.metrics.RayTenantUsage`` exports
    it)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._pending: Totals = {}
        self._flushed = clock()

    def record(self, tenant: str, model: str, inputs: int, tokens: int) -> None:
        counts = self._pending.get((tenant, model))
        if counts is None:
            counts = self._pending[tenant, model] = [0, 0, 0]
        counts[0] += 1
        counts[1] += inputs
        counts[2] += tokens
        if self._clock() - self._flushed >= FLUSH_S:
            pending, self._pending, self._flushed = self._pending, {}, self._clock()
            self.flush(pending)

    def flush(self, totals: Totals) -> None:
        """Usage since the last flush, by tenant and model."""

"""Each ingress replica's side of the tenants' limits (``tenant_budget.py``): a request of a limited tenant is let in
only with its share of the one budget that every replica on every node claims from, a ``TenantLimiter`` actor.

Far from the limits a replica asks the actor for a lease with each claim, about its next ``LEASE_S`` of the
tenant's use of the model, and spends it without asking; near them no lease fits and every request asks, so the
actor's traffic grows with closeness to a limit, not with the request rate. A request's tokens are not known before
the model has read its inputs, so it claims its length (characters, or token ids) and gives back the difference
once its answer counts them. What a replica has not spent for ``IDLE_RETURN_S`` goes back. A refused request is a
429 with ``Retry-After`` from when it would fit; past a day's or a month's token budget, ``insufficient_quota``.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from dataclasses import dataclass, field
from typing import Any, Callable, NamedTuple, Protocol, Sequence

from deployments.errors import TenantOverBudget, TenantRateLimited
from deployments.ingress.auth import Tenant, TenantLimits
from deployments.ingress.tenant_budget import Grant, Remaining, TenantBudgets
from deployments.named_actor import NamedActor

logger = logging.getLogger("ray.serve")

LEASE_S = 1.0
IDLE_RETURN_S = 5.0
SWEEP_S = 1.0


class Limiter(Protocol):
    async def claim(self, tenant: str, limits: TenantLimits, model: str, requests: int, tokens: int,
                    lease: tuple[int, int]) -> Grant: ...

    async def give_back(self, tenant: str, limits: TenantLimits, model: str, requests: int, tokens: int) -> None: ...


class TenantLimiter:
    """The one budget (a Ray actor on a cluster; in the process where there is no Ray)."""

    def __init__(self, clock: Callable[[], float] = time.time) -> None:
        self._budgets = TenantBudgets()
        self._clock = clock

    async def claim(self, tenant: str, limits: TenantLimits, model: str, requests: int, tokens: int,
                    lease: tuple[int, int]) -> Grant:
        return self._budgets.claim(tenant, limits, model, requests, tokens, lease, self._clock())

    async def give_back(self, tenant: str, limits: TenantLimits, model: str, requests: int, tokens: int) -> None:
        self._budgets.give_back(tenant, limits, model, requests, tokens, self._clock())


class RayLimiter:
    """The application's ``TenantLimiter`` actor (``deployments.named_actor``: created by the first replica to ask;
    made again, with full buckets, if it died)."""

    def __init__(self, application: str) -> None:
        self._actor = NamedActor(TenantLimiter, f"tenants:{application}")

    def start(self) -> None:
        """Find or make the budget now (``NamedActor.start``)."""
        self._actor.start()

    async def claim(self, *args: Any) -> Grant:
        return await self._actor.call("claim", *args)

    async def give_back(self, *args: Any) -> None:
        await self._actor.call("give_back", *args)


class Ticket(NamedTuple):
    key: tuple[str, str]
    tokens: int  # what the request claimed


@dataclass
class _Allowance:
    """What a replica holds of a tenant's budget for one model, and its use since it last asked."""

    requests: int = 0
    tokens: int = 0
    used_at: float = 0.0
    asked_at: float = 0.0
    spent: list[int] = field(default_factory=lambda: [0, 0])  # requests and tokens since it last asked
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)

    def spend(self, tokens: int, now: float) -> None:
        self.requests -= 1
        self.tokens -= tokens
        self.spent[0] += 1
        self.spent[1] += tokens
        self.used_at = now


class TenantGate:
    def __init__(self, limiter: Limiter, clock: Callable[[], float] = time.monotonic) -> None:
        self._limiter = limiter
        self._clock = clock
        self._held: dict[tuple[str, str], _Allowance] = {}
        self._limits: dict[tuple[str, str], TenantLimits] = {}
        self._shown: dict[str, tuple[dict[str, Remaining], float]] = {}  # a tenant's limits when last told
        self._swept = 0.0
        self._returns: set[asyncio.Task[None]] = set()

    async def admit(self, tenant: Tenant, model: str, inputs: Sequence[Any]) -> Ticket | None:
        """Let a request of ``tenant`` to ``model`` in, or raise ``TenantRateLimited`` / ``TenantOverBudget``. None
        for a tenant without limits."""
        if not tenant.limits:
            return None
        now = self._clock()
        self._sweep(now)
        key = (tenant.name, model)
        self._limits[key] = tenant.limits
        held = self._held.get(key)
        if held is None:
            held = self._held[key] = _Allowance(asked_at=now)
        tokens = sum(map(len, inputs))  # at least its tokens, for text as for token ids
        if held.lock.locked() or held.requests < 1 or held.tokens < tokens:  # behind whoever is asking, or ask
            async with held.lock:
                if held.requests < 1 or held.tokens < tokens:
                    await self._ask(tenant, model, held, tokens, now)
                held.spend(tokens, now)
        else:  # what the replica holds covers it: nothing to wait for
            held.spend(tokens, now)
        return Ticket(key, tokens)

    def settle(self, ticket: Ticket | None, tokens: int) -> None:
        """The request's answer counted ``tokens``: what it claimed beyond that is the replica's to spend again."""
        if ticket is not None and ticket.key in self._held:
            self._held[ticket.key].tokens += ticket.tokens - tokens

    def headers(self, tenant: Tenant) -> dict[str, str]:
        """OpenAI's ``x-ratelimit-*`` headers for the tenant's per-minute limits, as last told by the budget."""
        shown = self._shown.get(tenant.name)
        if shown is None:
            return {}
        remaining, told_at = shown
        headers = {}
        for kind, limit in remaining.items():
            refilled = (self._clock() - told_at) * limit.limit / 60.0
            left = min(limit.limit, limit.remaining + refilled)
            headers[f"x-ratelimit-limit-{kind}"] = str(limit.limit)
            headers[f"x-ratelimit-remaining-{kind}"] = str(math.floor(left))
            headers[f"x-ratelimit-reset-{kind}"] = f"{(limit.limit - left) * 60.0 / limit.limit:.3f}s"
        return headers

    async def _ask(self, tenant: Tenant, model: str, held: _Allowance, tokens: int, now: float) -> None:
        """Claim what the request lacks, and a lease of about the next ``LEASE_S`` of this use."""
        elapsed = max(now - held.asked_at, 0.05)
        lease = (math.ceil(held.spent[0] * LEASE_S / elapsed), math.ceil(held.spent[1] * LEASE_S / elapsed))
        need = (max(0, 1 - held.requests), max(0, tokens - held.tokens))
        grant = await self._limiter.claim(tenant.name, tenant.limits, model, need[0], need[1], lease)
        self._shown[tenant.name] = (grant.remaining, self._clock())
        held.asked_at, held.spent = now, [0, 0]
        if not grant.granted:
            error = TenantOverBudget if grant.over_budget else TenantRateLimited
            raise error(f"tenant {tenant.name!r} is past its {'token budget' if grant.over_budget else 'rate limit'}"
                        f" for {model!r}; retry in {grant.wait_s:.1f} s", retry_after_s=grant.wait_s,
                        headers=self.headers(tenant))
        held.requests += need[0] + grant.leased[0]
        held.tokens += need[1] + grant.leased[1]

    async def _give_back(self, key: tuple[str, str], requests: int, tokens: int) -> None:
        try:
            await self._limiter.give_back(key[0], self._limits[key], key[1], requests, tokens)
        except Exception as exc:  # noqa: BLE001 - the budget is gone (a new one starts full): nothing to give back to
            logger.warning("tenant %r: unspent allowance not given back (%s)", key[0], type(exc).__name__)

    def _sweep(self, now: float) -> None:
        """Give back what was not spent for ``IDLE_RETURN_S``."""
        if now - self._swept < SWEEP_S:
            return
        self._swept = now
        for key, held in self._held.items():
            if now - held.used_at >= IDLE_RETURN_S and (held.requests > 0 or held.tokens != 0) \
                    and not held.lock.locked():
                returned, held.requests, held.tokens = (held.requests, held.tokens), 0, 0
                task = asyncio.ensure_future(self._give_back(key, *returned))
                self._returns.add(task)
                task.add_done_callback(self._returns.discard)

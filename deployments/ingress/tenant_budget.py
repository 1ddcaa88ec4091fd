"""Tenants' limits as one budget: the arithmetic, for whoever holds it (the ``TenantLimiter`` actor every ingress
replica claims from, or a test). Pure: every call is told the time.

A tenant's limits (``auth.TenantLimits``) are buckets: requests and tokens per minute, for the tenant and for each
model it names, refilled evenly over a minute; and tokens per UTC day and month, full again when the period turns.
A claim is one request to one model: it takes a request from each requests bucket and its tokens from each tokens
bucket that applies, all or none. Refused, it says when it would fit (the slowest bucket's wait) and whether a
period's budget refused it. A granted claim may come with a lease: more requests and tokens taken now (at most
``LEASE_SHARE`` of any bucket, and only what each holds), which a replica spends without asking and gives back
when it has not used them for a while. A replica charges a request's tokens beyond what it claimed (its estimate
was low) once the answer says so; a bucket may then go below zero, and claims wait until it refills.
"""

from __future__ import annotations

import calendar
import datetime
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

if TYPE_CHECKING:
    from deployments.ingress.auth import TenantLimits

LEASE_SHARE = 0.02


class Remaining(NamedTuple):
    """A limit for the ``x-ratelimit-*`` headers: the limit, what is left, seconds until it is full again."""

    limit: int
    remaining: int
    reset_s: float


class Grant(NamedTuple):
    granted: bool
    wait_s: float  # refused: when the claim would fit
    over_budget: bool  # refused by a day's or a month's token budget (not a per-minute rate)
    leased: tuple[int, int]  # granted: the extra requests and tokens taken
    remaining: dict[str, Remaining]  # "requests", "tokens": the tenant's own per-minute limits, where set


@dataclass
class _Bucket:
    capacity: int
    per_minute: bool  # refilled over a minute; else a budget for a period
    period: str | None  # "day" | "month"
    level: float
    updated: float
    counts: str  # "requests" | "tokens"

    def advance(self, now: float) -> None:
        if self.per_minute:
            self.level = min(self.capacity, self.level + (now - self.updated) * self.capacity / 60.0)
        elif _period_start(self.period, now) > self.updated:
            self.level = self.capacity  # a new day or month
        self.updated = now

    def wait_s(self, amount: float, now: float) -> float:
        if self.level >= amount:
            return 0.0
        if self.per_minute:
            return (amount - self.level) * 60.0 / self.capacity
        return _period_end(self.period, now) - now

    def spare(self) -> float:
        return max(0.0, min(self.level, LEASE_SHARE * self.capacity))


class TenantBudgets:
    def __init__(self) -> None:
        self._buckets: dict[tuple[str, str, str], _Bucket] = {}

    def claim(self, tenant: str, limits: TenantLimits, model: str, requests: int, tokens: int,
              lease: tuple[int, int], now: float) -> Grant:
        buckets = self._buckets_for(tenant, limits, model, now)
        needs = [(bucket, requests if bucket.counts == "requests" else tokens) for bucket in buckets]
        waits = [(bucket.wait_s(amount, now), bucket) for bucket, amount in needs if amount > 0]
        refused = [(wait, bucket) for wait, bucket in waits if wait > 0]
        if refused:
            wait, bucket = max(refused, key=lambda refusal: refusal[0])
            return Grant(False, wait, not bucket.per_minute, (0, 0), self._remaining(tenant, limits, now))
        for bucket, amount in needs:
            bucket.level -= amount
        leased = tuple(int(min([want] + [math.floor(bucket.spare()) for bucket in buckets if bucket.counts == kind]))
                       for want, kind in zip(lease, ("requests", "tokens")))
        for bucket in buckets:
            bucket.level -= leased[0] if bucket.counts == "requests" else leased[1]
        return Grant(True, 0.0, False, (leased[0], leased[1]), self._remaining(tenant, limits, now))

    def give_back(self, tenant: str, limits: TenantLimits, model: str, requests: int, tokens: int,
                  now: float) -> None:
        """Return what a replica leased and did not spend (negative ``tokens``: a request cost more than claimed)."""
        for bucket in self._buckets_for(tenant, limits, model, now):
            amount = requests if bucket.counts == "requests" else tokens
            bucket.level = min(bucket.capacity, bucket.level + amount)

    def _buckets_for(self, tenant: str, limits: TenantLimits, model: str, now: float) -> list[_Bucket]:
        found = []
        for scope, kind, capacity in limits.buckets(model):
            key = (tenant, scope, kind)
            bucket = self._buckets.get(key)
            per_minute = kind in ("rpm", "tpm")
            if bucket is None:
                bucket = _Bucket(capacity, per_minute, None if per_minute else kind, float(capacity), now,
                                 "requests" if kind == "rpm" else "tokens")
                self._buckets[key] = bucket
            elif bucket.capacity != capacity:  # the keys file changed it: keep what was spent
                bucket.level = min(capacity, bucket.level + capacity - bucket.capacity)
                bucket.capacity = capacity
            bucket.advance(now)
            found.append(bucket)
        return found

    def _remaining(self, tenant: str, limits: TenantLimits, now: float) -> dict[str, Remaining]:
        shown = {}
        for kind, counts in (("rpm", "requests"), ("tpm", "tokens")):
            bucket = self._buckets.get((tenant, "*", kind))
            if bucket is not None:
                left = max(0.0, bucket.level)
                shown[counts] = Remaining(bucket.capacity, math.floor(left),
                                          (bucket.capacity - left) * 60.0 / bucket.capacity)
        return shown


def _period_start(period: str | None, now: float) -> float:
    day = datetime.datetime.fromtimestamp(now, datetime.timezone.utc).date()
    start = day if period == "day" else day.replace(day=1)
    return calendar.timegm(start.timetuple())


def _period_end(period: str | None, now: float) -> float:
    day = datetime.datetime.fromtimestamp(now, datetime.timezone.utc).date()
    if period == "day":
        end = day + datetime.timedelta(days=1)
    else:
        end = (day.replace(day=1) + datetime.timedelta(days=32)).replace(day=1)
    return calendar.timegm(end.timetuple())

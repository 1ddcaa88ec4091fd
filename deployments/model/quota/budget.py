"""The provider quota's arithmetic, for whoever holds the one budget (the ``QuotaLimiter`` actor, or a replica on its
own while the actor cannot be reached). Pure: every call is told the time, so tests run it on a made-up clock.

Each limit (requests, tokens per minute) is a token bucket of ``headroom x limit``, refilled evenly over a minute, as
the provider's own. A claim is one upstream call: one request and its tokens.

- HIGH has first claim: it is granted at once, or reserved for the moment the bucket will hold it (the level goes
  below zero; later claims wait behind that debt), unless that moment is past its deadline.
- LOW is granted only when it leaves HIGH a reserve: a second of refill, or two seconds of HIGH's recent use,
  whichever is more. It never reserves ahead, so a HIGH claim never waits behind a LOW one, whatever LOW asks for;
  it is told when to ask again instead.
- LOW is owed ``low_share`` of the refill: a credit that grows at that rate (up to that share of the bucket) and lets
  a LOW claim in past the reserve, down to what the bucket holds now (never below it). HIGH's reservations come
  first, so while HIGH alone asks for more than the limit, LOW waits.
- A claim may come with a lease: more calls of the same priority, taken now, for the replica to spend without
  asking (at most ``LEASE_SHARE`` of a limit, only from what the bucket holds now, and for LOW only from above
  HIGH's reserve). Far from the limits a lease covers a replica's next second of calls; near them no lease fits and
  every call is claimed on its own. What a replica does not spend it gives back (``release``).
- The provider's account wins: its ``x-ratelimit-*`` headers lower the level to what it says is left (less what was
  granted since), a lower limit it reports replaces the configured one, and a 429 stops every claim for its
  Retry-After.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from typing import NamedTuple

from batching import Priority

KINDS = ("requests", "tokens")
RESERVE_FLOOR_S = 1.0  # LOW leaves HIGH at least this much refill
RESERVE_S = 2.0  # and at least this long of HIGH's recent use
DEMAND_TAU_S = 10.0  # HIGH's recent use: a sum decaying with this time constant
GRANTS_KEPT_S = 60.0  # grants remembered to reconcile a provider's report on a call granted that long ago
LEASE_SHARE = 0.02  # a lease holds at most this share of a limit's bucket
# A limit only the provider's headers gave is forgotten when no answer has repeated it for this long: it was learned
# from answers, and a budget that sends nothing (spent on a limit since lifted) would otherwise hear none again.
LEARNED_FOR_S = 10.0


class Claim(NamedTuple):
    """The answer to a claim: ``granted`` (send after ``wait_s``), or not (ask again, or retry, after ``wait_s``).
    ``leased`` is the extra the claim was also granted, to spend later without asking (requests, tokens)."""

    granted: bool
    wait_s: float
    leased: tuple[int, int] = (0, 0)


class Account(NamedTuple):
    """What the provider said of one limit on a response: its limit, what is left, and when it is full again."""

    limit: int | None
    remaining: int | None
    reset_s: float | None


@dataclass(frozen=True)
class Limits:
    """Per-minute limits (None: none) and how much of them to spend."""

    rpm: int | None
    tpm: int | None
    headroom: float = 0.9
    low_share: float = 0.1

    def shared_by(self, replicas: int) -> Limits:
        """One replica's equal share, for when the shared budget cannot be reached."""
        def part(limit: int | None) -> int | None:
            return None if limit is None else max(1, limit // replicas)

        return Limits(part(self.rpm), part(self.tpm), self.headroom, self.low_share)


class _Bucket:
    """One limit: its level (below zero: reserved ahead), LOW's credit, HIGH's recent use, and recent grants."""

    def __init__(self, configured: int | None, headroom: float, low_share: float, now: float) -> None:
        self.configured = configured
        self.learned: int | None = None  # the limit the provider reported, while it reports one
        self.learned_at = now
        self.headroom = headroom
        self.low_share = low_share
        self.level = self.capacity
        self.credit = self.credit_cap
        self.demand = 0.0
        self.updated = now
        self.grants: deque[tuple[float, float]] = deque()

    @property
    def limit(self) -> int | None:
        present = [limit for limit in (self.configured, self.learned) if limit is not None]
        return min(present) if present else None

    @property
    def capacity(self) -> float:
        return self.headroom * self.limit if self.limit is not None else math.inf

    @property
    def rate(self) -> float:
        return self.capacity / 60.0

    @property
    def credit_cap(self) -> float:
        return self.low_share * self.capacity if self.limit is not None else 0.0

    def advance(self, now: float) -> None:
        elapsed = max(0.0, now - self.updated)
        self.updated = now
        if self.learned is not None and now - self.learned_at > LEARNED_FOR_S:
            self.relearn(None, now)
        self.demand *= math.exp(-elapsed / DEMAND_TAU_S)  # kept with no limit too: one may be reported later
        if self.limit is None:
            return
        self.level = min(self.capacity, self.level + elapsed * self.rate)
        self.credit = min(self.credit_cap, self.credit + elapsed * self.low_share * self.rate)
        while self.grants and self.grants[0][0] < now - GRANTS_KEPT_S:
            self.grants.popleft()

    def reserve(self) -> float:
        return max(RESERVE_FLOOR_S * self.rate, self.demand / DEMAND_TAU_S * RESERVE_S)

    def wait_s(self, amount: float, keep: float = 0.0) -> float:
        """Seconds until the level holds ``amount`` and still ``keep`` (0 if it does now)."""
        if self.limit is None:
            return 0.0
        return max(0.0, (min(amount, self.capacity) + keep - self.level) / self.rate)

    def credit_wait_s(self, amount: float) -> float:
        if self.limit is None:
            return 0.0
        if self.low_share == 0:
            return math.inf
        return max(0.0, min(amount, self.credit_cap) - self.credit) / (self.low_share * self.rate)

    def take(self, amount: float, now: float) -> None:
        if self.limit is None:
            return
        self.level -= min(amount, self.capacity)
        self.grants.append((now, amount))

    def relearn(self, limit: int | None, now: float) -> None:
        """The provider reports ``limit`` (None: no longer reports one); the level keeps what it has spent."""
        limit = limit if limit else None  # a limit of 0 would be no budget at all: read as none reported
        self.learned_at = now
        if limit == self.learned:
            return
        spent = self.capacity - self.level if self.limit is not None else 0.0
        self.learned = limit
        if self.limit is not None:
            self.level = self.capacity - min(spent, self.capacity)
            self.credit = min(self.credit, self.credit_cap)

    def follow(self, account: Account, called_at: float) -> None:
        """Lower the level to what the provider says is left, less what was granted after that call was."""
        if self.limit is None:
            return
        since = sum(amount for granted_at, amount in self.grants if granted_at > called_at)
        if account.remaining is not None:
            self.level = min(self.level, self.headroom * account.remaining - since)
        if account.reset_s is not None:  # the provider's bucket is not full before then, so ours is not either
            self.level = min(self.level, self.capacity - account.reset_s * self.rate - since)


class QuotaBudget:
    def __init__(self, limits: Limits, now: float) -> None:
        self.limits = limits
        self._buckets = {kind: _Bucket(limit, limits.headroom, limits.low_share, now)
                         for kind, limit in zip(KINDS, (limits.rpm, limits.tpm))}

    def claim(self, priority: Priority, tokens: int, now: float, *, max_wait_s: float | None = None,
              requests: int = 1, lease: tuple[int, int] = (0, 0)) -> Claim:
        """Claim one upstream call's ``requests`` and ``tokens``, and a ``lease`` on top if the bucket holds it now
        (granted only with a call granted at once)."""
        self._advance(now)
        amounts = {"requests": requests, "tokens": tokens}
        buckets = self._buckets
        if priority is Priority.HIGH:
            wait = max(bucket.wait_s(amounts[kind]) for kind, bucket in buckets.items())
            if max_wait_s is not None and wait > max_wait_s:
                return Claim(False, wait)
            self._take(amounts, now, high=True)
            return Claim(True, wait, self._lease(priority, lease, now) if wait == 0 else (0, 0))
        free_wait = max(bucket.wait_s(amounts[kind], bucket.reserve()) for kind, bucket in buckets.items())
        if free_wait == 0:
            self._take(amounts, now)
            return Claim(True, 0.0, self._lease(priority, lease, now))
        credit_wait = max(bucket.credit_wait_s(amounts[kind]) for kind, bucket in buckets.items())
        held_wait = max(bucket.wait_s(amounts[kind]) for kind, bucket in buckets.items())
        if credit_wait == 0 and held_wait == 0:  # LOW's share, from what the bucket holds now
            self._take(amounts, now)
            for kind, bucket in buckets.items():
                bucket.credit -= amounts[kind]
            return Claim(True, 0.0)
        return Claim(False, min(free_wait, max(credit_wait, held_wait)))

    def lease(self, priority: Priority, wanted: tuple[int, int], now: float) -> tuple[int, int]:
        """A lease alone (requests, tokens): as much of ``wanted`` as a lease may hold, if the bucket holds it now."""
        self._advance(now)
        return self._lease(priority, wanted, now)

    def release(self, tokens: int, now: float, requests: int = 1) -> None:
        """Give back what was taken and not sent: a granted call cancelled before it was, a lease not spent."""
        self._advance(now)
        for kind, amount in zip(KINDS, (requests, tokens)):
            bucket = self._buckets[kind]
            if bucket.limit is not None:
                bucket.level = min(bucket.capacity, bucket.level + min(amount, bucket.capacity))

    def remaining(self, priority: Priority, now: float) -> dict[str, float]:
        """What a claim of ``priority`` could take now, per limit (a LOW claim: above HIGH's reserve)."""
        self._advance(now)
        return {kind: max(0.0, bucket.level - (bucket.reserve() if priority is Priority.LOW else 0.0))
                for kind, bucket in self._buckets.items() if bucket.limit is not None}

    @property
    def limited(self) -> bool:
        """Whether any limit is known (configured, or reported by the provider)."""
        return any(bucket.limit is not None for bucket in self._buckets.values())

    def follow(self, accounts: dict[str, Account], called_at: float, now: float) -> None:
        """A response's ``x-ratelimit-*`` headers (a kind without them: the provider no longer reports that limit),
        for a call granted at ``called_at``."""
        self._advance(now)
        for kind, bucket in self._buckets.items():
            account = accounts.get(kind)
            bucket.relearn(account.limit if account is not None else None, now)
            if account is not None:
                bucket.follow(account, called_at)

    def refused(self, retry_after_s: float, now: float) -> None:
        """The provider answered 429: nothing is granted before its Retry-After."""
        self._advance(now)
        for bucket in self._buckets.values():
            if bucket.limit is not None:
                bucket.level = min(bucket.level, -retry_after_s * bucket.rate)

    def _lease(self, priority: Priority, wanted: tuple[int, int], now: float) -> tuple[int, int]:
        """As much of ``wanted`` as a lease may hold, if the bucket holds it now (LOW's: above HIGH's reserve); else
        nothing."""
        amounts = {kind: int(min(amount, LEASE_SHARE * bucket.capacity))
                   for (kind, bucket), amount in zip(self._buckets.items(), wanted)}
        high = priority is Priority.HIGH
        if amounts["requests"] < 1 or any(
                bucket.limit is not None and bucket.level - (0.0 if high else bucket.reserve()) < amounts[kind]
                for kind, bucket in self._buckets.items()):
            return (0, 0)
        self._take(amounts, now, high=high)
        return amounts["requests"], amounts["tokens"]

    def _take(self, amounts: dict[str, int], now: float, *, high: bool = False) -> None:
        for kind, bucket in self._buckets.items():
            bucket.take(amounts[kind], now)
            if high:
                bucket.demand += amounts[kind]

    def _advance(self, now: float) -> None:
        for bucket in self._buckets.values():
            bucket.advance(now)

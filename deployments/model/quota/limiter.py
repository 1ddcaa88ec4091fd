"""``QuotaLimiter``: a model deployment's one budget, a Ray actor every replica of every node claims from.

Why an actor and not the Redis the cache can use: every deployment runs on Ray, while Redis is there only when a
cache is configured on it; and a claim is a few arithmetic steps on state that must not be split (check, then take),
which an async actor does on one event loop with no lock and no script.

Its lifetime follows the replicas: the first replica to ask creates it (owned by that replica, so nothing outlives
the application), Ray restarts it if its node is lost (``max_restarts``), and if its owner goes, the next replica to
find it gone creates a new one. Every new one starts empty of history, with the configured limits and a full bucket;
the provider's headers then bring it back to the real account.
"""

from __future__ import annotations

import hashlib
import time
from typing import Any, NamedTuple

from batching import Priority

from deployments.model.quota.budget import Account, Claim, Limits, QuotaBudget

NAMESPACE = "adaptive-embeddings-quota"


class Report(NamedTuple):
    """What one upstream response said: the provider's ``accounts`` for a call granted ``age_s`` ago, or a 429
    asking for ``refused_for_s``."""

    accounts: dict[str, Account] | None
    age_s: float
    refused_for_s: float | None = None


class Answer(NamedTuple):
    claim: Claim
    remaining: dict[str, dict[str, float]]  # by priority ("high", "low"), what a claim could take now, per limit
    limited: bool  # whether any limit is known; if not, replicas need not ask until a response reports one


class QuotaLimiter:
    def __init__(self, limits: Limits) -> None:
        self._budget = QuotaBudget(limits, time.monotonic())

    async def claim(self, priority: int, tokens: int, max_wait_s: float | None, lease: tuple[int, int],
                    reports: list[Report]) -> Answer:
        return answer(self._budget, Priority(priority), tokens, max_wait_s, lease, reports, time.monotonic())

    async def renew(self, priority: int, lease: tuple[int, int], reports: list[Report]) -> Answer:
        return renewal(self._budget, Priority(priority), lease, reports, time.monotonic())

    async def report(self, reports: list[Report]) -> None:
        apply_reports(self._budget, reports, time.monotonic())

    async def release(self, requests: int, tokens: int) -> None:
        self._budget.release(tokens, time.monotonic(), requests)


def answer(budget: QuotaBudget, priority: Priority, tokens: int, max_wait_s: float | None, lease: tuple[int, int],
           reports: list[Report], now: float) -> Answer:
    """A claim on ``budget`` after the ``reports`` it comes with (the actor's and a replica's own budget alike)."""
    apply_reports(budget, reports, now)
    return _answer(budget, budget.claim(priority, tokens, now, max_wait_s=max_wait_s, lease=lease), now)


def renewal(budget: QuotaBudget, priority: Priority, lease: tuple[int, int], reports: list[Report],
            now: float) -> Answer:
    """A lease alone on ``budget`` (its claim granted, with nothing but the lease), after the ``reports``."""
    apply_reports(budget, reports, now)
    return _answer(budget, Claim(True, 0.0, budget.lease(priority, lease, now)), now)


def _answer(budget: QuotaBudget, claim: Claim, now: float) -> Answer:
    remaining = {level.name.lower(): budget.remaining(level, now) for level in Priority}
    return Answer(claim, remaining, budget.limited)


def apply_reports(budget: QuotaBudget, reports: list[Report], now: float) -> None:
    for report in reports:
        if report.refused_for_s is not None:
            budget.refused(report.refused_for_s, now)
        if report.accounts is not None:
            budget.follow(report.accounts, now - report.age_s, now)


def limiter_name(application: str, deployment: str, limits: Limits) -> str:
    """One actor per deployment and limits: a redeploy with other limits starts a new budget."""
    fingerprint = hashlib.sha256(repr(limits).encode()).hexdigest()[:10]
    return f"quota:{application}:{deployment}:{fingerprint}"


def connect(name: str, limits: Limits) -> Any:
    """A handle to the limiter called ``name``, created (owned by the caller) if there is none, once it answers: its
    worker's start-up is not counted against the first claim's time."""
    import ray

    actor = ray.remote(QuotaLimiter).options(
        name=name, namespace=NAMESPACE, get_if_exists=True, max_restarts=-1, max_task_retries=0, num_cpus=0,
        max_concurrency=10_000,
    ).remote(limits)
    ray.get(actor.__ray_ready__.remote())
    return actor

"""The shared quota on real Ray: replicas' pacers claim from one ``QuotaLimiter`` actor, a lost one is met by pacing
alone, and its replacement starts empty of history."""

from __future__ import annotations

import asyncio
import uuid

import ray

from batching import Priority
from deployments.errors import UpstreamRateLimited
from deployments.quota.budget import Limits
from deployments.quota.limiter import NAMESPACE
from deployments.quota.pacer import PacedInput, QuotaPacer, RemoteLedger

LIMITS = Limits(rpm=None, tpm=60_000, headroom=1.0)


def pacer(name: str) -> QuotaPacer:
    return QuotaPacer(LIMITS, RemoteLedger(name, LIMITS), replicas=2)


def batch(tokens: int, timeout_s: float) -> list[PacedInput]:
    return [PacedInput("text", tokens, Priority.HIGH, asyncio.get_running_loop().time() + timeout_s)]


async def send() -> list[str]:
    return ["sent"]


async def test_replicas_share_one_budget_and_a_lost_limiter_is_replaced_empty(serve_instance) -> None:
    name = f"quota:test:{uuid.uuid4().hex}"
    first, second = pacer(name), pacer(name)
    assert await first.paced(batch(60_000, 5.0), send) == ["sent"]
    (refused,) = await second.paced(batch(6_000, 1.0), send)  # alone, its share would have held it
    assert isinstance(refused, UpstreamRateLimited) and 5.0 < refused.retry_after_s <= 6.0

    ray.kill(ray.get_actor(name, namespace=NAMESPACE))
    assert await second.paced(batch(6_000, 1.0), send) == ["sent"]  # paced alone on its share: served
    assert await pacer(name).paced(batch(60_000, 1.0), send) == ["sent"]  # a new limiter, full again

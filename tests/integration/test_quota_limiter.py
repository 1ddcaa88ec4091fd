"""The shared quota on real Ray: replicas' pacers claim from one ``QuotaLimiter`` actor, a lost one is met by pacing
alone, and its replacement starts empty of history."""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

import ray

from batching import Priority
from deployments.errors import UpstreamRateLimited
from deployments.model.quota.budget import Limits
from deployments.model.quota.limiter import connect
from deployments.model.quota.pacer import PacedInput, QuotaPacer, RemoteLedger
from deployments.wire import Deadline

from .helpers import killed

LIMITS = Limits(rpm=None, tpm=60_000, headroom=1.0)


def pacer(name: str) -> QuotaPacer:
    return QuotaPacer(LIMITS, RemoteLedger(name, LIMITS), replicas=2)


def batch(tokens: int, timeout_s: float) -> list[PacedInput]:
    return [PacedInput("text", tokens, Priority.HIGH, Deadline.after(timeout_s))]


async def send() -> list[str]:
    return ["sent"]


async def started(name: str) -> Any:
    """A handle to the limiter called ``name``, created and answering, as a replica's first claim finds it once the
    deployment has run a while (a claim that waits longer than CALL_TIMEOUT_S for it paces alone). The limiter lives
    while a handle to it does."""
    return await asyncio.to_thread(connect, name, LIMITS)


async def test_replicas_share_one_budget_and_a_lost_limiter_is_replaced_empty(serve_instance) -> None:
    name = f"quota:test:{uuid.uuid4().hex}"
    limiter = await started(name)
    first, second = pacer(name), pacer(name)
    assert await first.paced(batch(60_000, 5.0), send) == ["sent"]
    (refused,) = await second.paced(batch(6_000, 1.0), send)  # alone, its share would have held it
    assert isinstance(refused, UpstreamRateLimited) and 5.0 < refused.retry_after_s <= 6.0

    await killed(limiter)  # gone before the next claim: one sent meanwhile would still be answered by it
    assert await second.paced(batch(6_000, 1.0), send) == ["sent"]  # paced alone on its share: served
    replacement = await started(name)  # what the next replica to claim does, in its connecting thread
    assert await pacer(name).paced(batch(60_000, 1.0), send) == ["sent"]  # a new limiter, full again
    ray.kill(replacement)


async def test_a_lease_is_lent_and_given_back_through_the_limiter_actor(serve_instance) -> None:
    name = f"quota:test:{uuid.uuid4().hex}"
    limiter = await started(name)
    ledger = RemoteLedger(name, LIMITS)
    lent = await ledger.renew(Priority.LOW, (10, 1_000), [])
    assert lent.claim.leased == (10, 1_000)
    assert lent.remaining["high"]["tokens"] == 59_000
    await ledger.release(10, 1_000)  # sent, not awaited (as a replica gives back): the next call may overtake it
    deadline = asyncio.get_running_loop().time() + 5.0
    while True:
        after = await ledger.renew(Priority.HIGH, (0, 0), [])  # nothing asked: what the budget holds now
        if after.remaining["high"]["tokens"] >= 60_000 - 1 or asyncio.get_running_loop().time() > deadline:
            break
        await asyncio.sleep(0.05)
    assert after.claim.leased == (0, 0) and after.remaining["high"]["tokens"] >= 60_000 - 1
    ray.kill(limiter)

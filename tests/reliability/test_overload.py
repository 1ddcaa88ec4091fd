"""Overload: 5x capacity is refused early with 429 + Retry-After (LOW first), the replica's queue and memory stay
bounded by max_queue_depth, and latency is back to normal within seconds."""

from __future__ import annotations

import asyncio
from typing import Iterator

import httpx
import pytest

from tests.integration.helpers import Service

from .cluster import SLOW
from .scale import Scale
from .scenarios import OVERLOAD_BATCHING, Target, overload
from .setups import overload_target
from .traffic import new_client

pytestmark = pytest.mark.integration

MAX_QUEUE_DEPTH = OVERLOAD_BATCHING["max_queue_depth"]
LOW_LIMIT = int(MAX_QUEUE_DEPTH * 0.8)


@pytest.fixture(scope="module")
def target(serve_instance: Service) -> Iterator[Target]:
    with overload_target(serve_instance.url) as running:
        yield running


def test_low_is_refused_from_80_percent_of_the_queue_and_high_only_when_it_is_full(target: Target) -> None:
    """Deterministic: one slow call holds the only batch slot while single-input requests fill the queue."""
    target.upstream.set_faults(slow_ms=6000)

    async def run() -> tuple[list[httpx.Response], list[httpx.Response], httpx.Response]:
        async with new_client() as client:
            def post(text: str, priority: str):
                body = {"model": target.model, "input": text}
                return asyncio.create_task(client.post(target.url, json=body, headers={"X-Priority": priority}))

            blocker = post(f"holds the only batch slot {SLOW}", "high")
            await asyncio.sleep(0.5)
            low = [post(f"low {i}", "low") for i in range(LOW_LIMIT + 10)]
            await _until_settled_or_queued(target, low, LOW_LIMIT)
            high = [post(f"high {i}", "high") for i in range(MAX_QUEUE_DEPTH - LOW_LIMIT + 5)]
            await _until_settled_or_queued(target, high, MAX_QUEUE_DEPTH - LOW_LIMIT, already_queued=LOW_LIMIT)
            stats = await asyncio.to_thread(target.batcher_stats)
            assert sum(s.dispatched_items for s in stats.values()) == 1, "the blocking call ended too soon to test"
            return await asyncio.gather(*low), await asyncio.gather(*high), await blocker

    try:
        low, high, blocker = asyncio.run(run())
    finally:
        target.upstream.set_faults(slow_ms=0)
    assert blocker.status_code == 200
    assert [r.status_code for r in low].count(429) == 10 and [r.status_code for r in low].count(200) == LOW_LIMIT
    assert [r.status_code for r in high].count(429) == 5
    assert [r.status_code for r in high].count(200) == MAX_QUEUE_DEPTH - LOW_LIMIT
    refused = next(r for r in low if r.status_code == 429)
    assert int(refused.headers["Retry-After"]) >= 1
    assert refused.json()["error"]["code"] == "overloaded" and refused.json()["error"]["type"] == "rate_limit_error"


async def _until_settled_or_queued(target: Target, requests: list[asyncio.Task], queued: int,
                                   already_queued: int = 0) -> None:
    """Wait until ``queued`` of ``requests`` wait in the replica's queue and every other one has been answered."""
    for _ in range(300):
        depth = sum(s.queue_depth for s in (await asyncio.to_thread(target.batcher_stats)).values())
        answered = sum(task.done() for task in requests)
        if depth >= already_queued + queued and answered >= len(requests) - queued:
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"queue depth {depth}, {answered} answered")


def test_five_times_capacity_is_refused_early_within_the_queue_and_memory_bounds(target: Target, scale: Scale) -> None:
    result = overload(target, scale)
    extra = result.extra
    unexpected = [(o.status, o.message[:160]) for o in result.outcomes if o.kind in ("unclear", "lost", "misrouted")]
    assert result.counts["lost"] == result.counts["misrouted"] == result.counts["unclear"] == 0, unexpected
    assert result.counts["late"] == 0
    refused, offered = extra["refused_429"], extra["offered"]
    assert refused["low"] > 0, extra  # and every 429 carried Retry-After (else it would be unclear)
    assert refused["low"] / offered["low"] > refused["high"] / offered["high"], extra
    assert 0 < extra["max_queue_depth_seen"] <= MAX_QUEUE_DEPTH, extra  # five times capacity does queue
    assert extra["rss_mib"]["peak"] - extra["rss_mib"]["before"] < 100, extra
    assert result.billed <= result.sent_clean
    # How fast latency recovers after the overload is measured at full scale (docs/reliability.md), not asserted here:
    # at CI scale the calm tail is 2.5 s, and on a busy machine the queue may still be draining when it ends.

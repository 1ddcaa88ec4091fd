"""The actor an application's replicas share by name (deployments/named_actor.py) on real Ray: many requests of one
replica asking for it at once make it once and keep it alive (two creations racing had left it dead under every
replica: each request a 500), and one that died is made again by the next call."""

from __future__ import annotations

import asyncio
import uuid

import pytest
import ray

from deployments.named_actor import NAMESPACE, NamedActor

from .helpers import killed

pytestmark = pytest.mark.integration


class Counter:
    def __init__(self) -> None:
        self.calls = 0

    async def add(self) -> int:
        self.calls += 1
        return self.calls


async def test_concurrent_first_calls_make_one_actor_that_lives_and_a_dead_one_is_made_again(serve_instance) -> None:
    name = f"counter:{uuid.uuid4().hex}"
    shared = NamedActor(Counter, name)
    assert sorted(await asyncio.gather(*(shared.call("add") for _ in range(50)))) == list(range(1, 51))
    await asyncio.sleep(1.0)  # a dropped creating handle ends the actor within moments
    assert await shared.call("add") == 51

    await killed(ray.get_actor(name, namespace=NAMESPACE))
    assert await shared.call("add") == 1  # a new one, made by the call that found the old one dead

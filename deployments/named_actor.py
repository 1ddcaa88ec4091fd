"""One actor an application's replicas share by name (the tenants' budget, the usage ledger): found, or created by the
first replica to ask, and called.

A named actor that is not detached lives while its creator holds the handle it was created with (handles found by
name do not keep it alive). So a process makes it once, however many of its requests ask at the same moment, and keeps
that handle; two creations racing in one process would leave the first handle dropped and the actor dead under every
replica. An actor that died (its creator went, or its node) is made again by the next call that finds it dead.
"""

from __future__ import annotations

import asyncio
from typing import Any

NAMESPACE = "adaptive-embeddings-tenants"


class NamedActor:
    def __init__(self, cls: type, name: str) -> None:
        self._cls = cls
        self._name = name
        self._actor: Any = None
        self._creating: asyncio.Future[Any] | None = None

    def start(self) -> None:
        """Find or make the actor now, and return once it answers: a replica's start-up, not a request, waits for its
        worker to start (a second or more of CPU on a small machine)."""
        import ray

        if self._actor is None:
            actor = self._new()
            ray.get(actor.__ray_ready__.remote())
            self._actor = actor

    async def call(self, method: str, *args: Any) -> Any:
        """``method(*args)`` on the actor; once more on a new one if it had died."""
        from ray.exceptions import ActorDiedError

        actor = await self._handle()
        try:
            return await getattr(actor, method).remote(*args)
        except ActorDiedError:
            if self._actor is actor:
                self._actor = self._creating = None
            return await getattr(await self._handle(), method).remote(*args)

    async def _handle(self) -> Any:
        if self._actor is not None:
            return self._actor
        if self._creating is None:
            self._creating = asyncio.ensure_future(self._create())
        creating = self._creating
        try:
            self._actor = await asyncio.shield(creating)  # a caller that stops waiting leaves it to the next
        except asyncio.CancelledError:
            raise
        except Exception:
            if self._creating is creating:
                self._creating = None  # tried again by the next call
            raise
        return self._actor

    async def _create(self) -> Any:
        actor = self._new()
        await actor.__ray_ready__.remote()
        return actor

    def _new(self) -> Any:
        import ray

        return ray.remote(self._cls).options(
            name=self._name, namespace=NAMESPACE, get_if_exists=True, max_restarts=-1, max_task_retries=0,
            num_cpus=0, max_concurrency=10_000).remote()

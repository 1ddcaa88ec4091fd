"""The shared store for a cluster: Redis, through ``redis.asyncio``.

Every entry is written with a TTL (``SET ... EX``). The byte bound is the server's: ``maxmemory`` with an evicting
``maxmemory-policy`` (``allkeys-lru``, or ``volatile-lru``, which evicts only keys with a TTL — all of ours — and so
spares other data on a shared server). The service does not count bytes itself: on its first call it reads both
settings and logs a warning if the server is unbounded or refuses writes when full (then writes fail, are counted,
and cost later misses, never a request). The URL (it may carry the password) and the password come from the
environment or a file, like the API keys (``deployments/secrets.py``); neither is ever logged.
"""

from __future__ import annotations

import logging
from typing import Mapping, Sequence

import redis.asyncio as redis
from redis.exceptions import ResponseError

logger = logging.getLogger("ray.serve")

EVICTING_POLICIES = frozenset({"allkeys-lru", "volatile-lru", "allkeys-lfu", "volatile-lfu", "allkeys-random",
                               "volatile-random", "volatile-ttl"})


class RedisStore:
    name = "redis"

    def __init__(self, url: str, *, password: str | None, ttl_s: float, timeout_s: float) -> None:
        """``timeout_s``: the client's own bound on a call, a backstop behind the guard's (``longest_call_s``: one
        as short as a HIGH lookup's cut the LOW lookups and the writes short, and under a bulk flood they were
        computed and billed again)."""
        self._client = redis.Redis.from_url(url, password=password or None, socket_timeout=timeout_s,
                                            socket_connect_timeout=timeout_s)
        self._ttl_ms = max(1, round(ttl_s * 1000))
        self._bound_checked = False

    async def get_many(self, keys: Sequence[str]) -> list[bytes | None]:
        if not self._bound_checked:
            await self._check_bound()
        return await self._client.mget(list(keys))

    async def set_many(self, entries: Mapping[str, bytes]) -> None:
        pipeline = self._client.pipeline(transaction=False)
        for key, value in entries.items():
            pipeline.set(key, value, px=self._ttl_ms)
        await pipeline.execute()

    async def aclose(self) -> None:
        await self._client.aclose()

    async def _check_bound(self) -> None:
        try:
            settings = await self._client.config_get("maxmemory*")
        except ResponseError:  # CONFIG is disabled on many managed servers: their operator sets the bound
            logger.info("embedding cache: this Redis does not allow CONFIG GET; its maxmemory bound is not checked")
        else:
            if int(settings.get("maxmemory", 0) or 0) == 0:
                logger.warning("embedding cache: this Redis has no maxmemory; the cache grows until its TTL expires "
                               "entries (set maxmemory and maxmemory-policy volatile-lru to bound it in bytes)")
            elif settings.get("maxmemory-policy") not in EVICTING_POLICIES:
                logger.warning("embedding cache: this Redis's maxmemory-policy is %r, so writes fail once it is full; "
                               "volatile-lru or allkeys-lru keeps it within maxmemory",
                               settings.get("maxmemory-policy"))
        self._bound_checked = True


"""The shared store for a cluster: Redis, through ``redis.asyncio``.

Every entry is written with a TTL (``SET ... PX``). The byte bound is the server's: ``maxmemory`` with an evicting
``maxmemory-policy`` (``allkeys-lru``, or ``volatile-lru``, which evicts only keys with a TTL — all of ours — and so
spares other data on a shared server). The service does not count bytes itself: on its first call it reads both
settings and logs a warning if the server is unbounded or refuses writes when full (then writes fail, are counted,
and cost later misses, never a request). The URL (it may carry the password) and the password come from the
environment or a file, like the API keys (``deployments/secrets.py``); neither is ever logged.

A write-back's entries go in one command, a script that sets each with its TTL: with a pipeline of one ``SET`` an
entry, redis-py builds and parses a command for every entry on the replica's event loop, and during a cold bulk night
that loop also serves the interactive requests. A server that refuses scripts (an ACL
without ``@scripting``, or a managed server that disables them) gets the pipeline instead, from its first refusal on.
"""

from __future__ import annotations

import logging
from typing import Mapping, Sequence

import redis.asyncio as redis
from redis.commands.core import AsyncScript
from redis.exceptions import NoPermissionError, ResponseError

logger = logging.getLogger("ray.serve")

# KEYS: the keys; ARGV: their values, in the same order, then the TTL in milliseconds.
_SET_ALL_WITH_TTL = """
local ttl = ARGV[#ARGV]
for i = 1, #KEYS do
    redis.call('SET', KEYS[i], ARGV[i], 'PX', ttl)
end
"""
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
        self._set_all: AsyncScript | None = self._client.register_script(_SET_ALL_WITH_TTL)

    async def get_many(self, keys: Sequence[str]) -> list[bytes | None]:
        if not self._bound_checked:
            await self._check_bound()
        return await self._client.mget(list(keys))

    async def set_many(self, entries: Mapping[str, bytes]) -> None:
        if self._set_all is not None:
            try:
                await self._set_all(keys=list(entries), args=[*entries.values(), self._ttl_ms])
                return
            except ResponseError as exc:  # NoPermissionError among them
                if not _refuses_scripts(exc):
                    raise
                logger.info("embedding cache: this Redis refuses scripts; writes go as pipelines of SET commands")
                self._set_all = None
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


def _refuses_scripts(error: ResponseError) -> bool:
    """The server does not run scripts for this client (no permission, or the commands are disabled or renamed), as
    opposed to a script that failed (out of memory, a read-only replica), which fails this write only."""
    return isinstance(error, NoPermissionError) or "unknown command" in str(error).lower()

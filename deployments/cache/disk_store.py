"""The embedded store: a ``diskcache`` directory (SQLite and files) on this node, shared by its replicas.

Process-safe (SQLite's locking), bounded in bytes (``size_limit``: every write evicts the least recently *stored*
entries while the directory's volume is over it), with an optional expiry. The directory is created readable by
this user only: it holds vectors of users' texts.

Lookups are plain reads on the event loop (~2 ms for 256 keys in the page cache); one that waits for another
process's lock longer than ``lock_timeout_s`` (the guard's timeout) raises, which the guard serves as a miss. Both
choices keep concurrent lookups from queueing past the guard's timeout (README, "Cache": a bulk re-run with 16
requests of 256 keys in flight):
- eviction by store time, so a read never writes: under diskcache's LRU policy each read is a write transaction,
  and the lookups queued on SQLite's write lock (64% of the re-run's tokens billed again, 7% with reads only);
- reads on the loop, not a worker thread, where each of a lookup's many SQLite calls gives up the GIL and must win
  it back from the busy loop (31% billed).
Writes, which run after the request was answered, stay on a thread of their own.
"""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Mapping, Sequence

import diskcache


class DiskStore:
    name = "disk"

    def __init__(self, directory: str | Path, *, max_bytes: int, ttl_s: float | None, lock_timeout_s: float) -> None:
        path = Path(directory).expanduser()
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
        self._ttl_s = ttl_s
        self._cache = diskcache.Cache(str(path), timeout=lock_timeout_s, size_limit=max_bytes,
                                      eviction_policy="least-recently-stored")
        self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="embedding-cache-disk-write")

    async def get_many(self, keys: Sequence[str]) -> list[bytes | None]:
        return [self._cache.get(key) for key in keys]  # plain reads, on the loop's own connection

    async def set_many(self, entries: Mapping[str, bytes]) -> None:
        await asyncio.get_running_loop().run_in_executor(self._writer, self._set_now, dict(entries))

    async def aclose(self) -> None:
        await asyncio.get_running_loop().run_in_executor(self._writer, self._cache.close)  # the writer's connection
        self._writer.shutdown(wait=False)
        self._cache.close()  # the loop's

    def _set_now(self, entries: Mapping[str, bytes]) -> None:
        with self._cache.transact():
            for key, value in entries.items():
                self._cache.set(key, value, expire=self._ttl_s)

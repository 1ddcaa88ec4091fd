"""The embedded store: a ``diskcache`` directory (SQLite and files) on this node, shared by its replicas.

Process-safe (SQLite's locking), bounded in bytes (``size_limit``: every write evicts the least recently *stored*
entries while the directory's volume is over it), with an optional expiry. The directory is created readable by
this user only: it holds vectors of users' texts.

Lookups are plain reads, run on the event loop: a 256-key lookup takes ~2 ms of CPU (in the page cache), and a read
that waits for another process's lock longer than ``lock_timeout_s`` (the guard's timeout) raises, which the guard
serves as a miss. Two measured reasons for that shape, from a cached bulk re-run with 16 requests of 256 keys in
flight (embed-bulk --concurrency 16):
- Eviction goes by store time, not by last use, so that a read never writes. Under diskcache's LRU policy each read
  rewrites the entry's access time in a write transaction, concurrent lookups queued on SQLite's write lock past
  the guard's 50 ms, and the re-run billed 64% of its tokens again (7% is what changed). A vector that stays in use
  is evicted once it is the oldest, and stored again by the request that next misses it.
- On a worker thread the same reads took up to 75 ms: each of a lookup's hundreds of SQLite calls gives up the GIL
  and must win it back from a busy event loop. On one thread 17 of 159 lookups passed 50 ms (31% billed; on four,
  45 of 159); inline, none did (7%).
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

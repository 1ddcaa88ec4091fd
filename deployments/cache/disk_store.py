"""The embedded store: a ``diskcache`` directory (SQLite and files) on this node, shared by its replicas.

Process-safe (SQLite's locking), bounded in bytes (``size_limit``: every write evicts the least recently *used*
entries — reads refresh an entry — while the directory's volume is over it), with an optional expiry. Its calls
block on disk, so they run on worker threads of their own: lookups on ``READ_THREADS`` (SQLite serves readers at
once; on one thread, 8 concurrent 256-key lookups queued past the guard's 50 ms and most of a re-run missed),
writes on one; a call that waits for another process's lock longer than ``lock_timeout_s`` raises (and the guard
serves a miss). The directory is created readable by this user only:
it holds vectors of users' texts.
"""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Mapping, Sequence

import diskcache

READ_THREADS = 4


class DiskStore:
    name = "disk"

    def __init__(self, directory: str | Path, *, max_bytes: int, ttl_s: float | None, lock_timeout_s: float) -> None:
        path = Path(directory).expanduser()
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
        self._ttl_s = ttl_s
        self._cache = diskcache.Cache(str(path), timeout=lock_timeout_s, size_limit=max_bytes,
                                      eviction_policy="least-recently-used")
        self._readers = ThreadPoolExecutor(max_workers=READ_THREADS, thread_name_prefix="embedding-cache-disk-read")
        self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="embedding-cache-disk-write")

    async def get_many(self, keys: Sequence[str]) -> list[bytes | None]:
        return await asyncio.get_running_loop().run_in_executor(self._readers, self._get_now, keys)

    async def set_many(self, entries: Mapping[str, bytes]) -> None:
        await asyncio.get_running_loop().run_in_executor(self._writer, self._set_now, dict(entries))

    async def aclose(self) -> None:
        self._readers.shutdown(wait=False)
        await asyncio.get_running_loop().run_in_executor(self._writer, self._cache.close)
        self._writer.shutdown(wait=False)

    def _get_now(self, keys: Sequence[str]) -> list[bytes | None]:
        with self._cache.transact():  # one lock and one commit for the whole request
            return [self._cache.get(key) for key in keys]

    def _set_now(self, entries: Mapping[str, bytes]) -> None:
        with self._cache.transact():
            for key, value in entries.items():
                self._cache.set(key, value, expire=self._ttl_s)

"""The embedded store: a ``diskcache`` directory (SQLite and files) on this node, shared by its replicas.

Process-safe (SQLite's locking), bounded in bytes (``size_limit``: every write evicts the least recently *stored*
entries while the directory's volume is over it), with an optional expiry. The directory is created readable by
this user only: it holds vectors of users' texts.

Lookups are plain reads on the event loop, one query a lookup (``read_many``; diskcache's own API makes one query a
key, paying SQLite's per-statement cost 256 times for a bulk request); one that waits for another process's lock
longer than ``lock_timeout_s`` (the guard's timeout) raises, which the guard serves as a miss.
Writes, which run after the request was answered, go to a process of their own (``disk_writer.py`` says why),
started with the first write and again after it ends. Choices that keep lookups quick (docs/cache.md: a bulk
re-run with 16 requests of 256 keys in flight):
- eviction by store time, so a read never writes: under diskcache's LRU policy each read is a write transaction,
  and the lookups queue on SQLite's write lock past their timeout, so cached texts are missed and billed again;
- reads on the loop, not a worker thread, where each of a lookup's SQLite calls must win the GIL back from the busy
  loop, which makes lookups outlast their timeout in the same way.
"""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path
from typing import Mapping, Sequence

import diskcache

from deployments.model.cache import disk_writer

READ_CHUNK = 500  # keys a query: under SQLite's bound on a statement's parameters (999 before SQLite 3.32)
_SELECT_LIVE = ("SELECT key, mode, filename, value FROM Cache WHERE raw = 1"
                " AND (expire_time IS NULL OR expire_time > ?) AND key IN ({})")


class DiskStore:
    name = "disk"

    def __init__(self, directory: str | Path, *, max_bytes: int, ttl_s: float | None, lock_timeout_s: float,
                 write_in_process: bool = True) -> None:
        """``write_in_process=False`` writes on a thread of this process instead (tests, whose clock diskcache
        reads)."""
        path = Path(directory).expanduser()
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
        self._ttl_s = ttl_s
        self._where = (str(path), lock_timeout_s, max_bytes)
        self._cache = disk_writer.open_cache(*self._where)
        self._write_in_process = write_in_process
        self._writer: asyncio.subprocess.Process | None = None
        self._one_at_a_time = asyncio.Lock()

    async def get_many(self, keys: Sequence[str]) -> list[bytes | None]:
        return read_many(self._cache, keys)  # plain reads, on the loop's own connection

    async def set_many(self, entries: Mapping[str, bytes]) -> None:
        if not self._write_in_process:
            await asyncio.to_thread(disk_writer.write, self._cache, entries, self._ttl_s)
            return
        # Shielded: a write given up on by its caller still finishes, so the next one reads its own answer.
        await asyncio.shield(self._send(disk_writer.frame(entries, self._ttl_s)))

    async def aclose(self) -> None:
        async with self._one_at_a_time:
            if self._writer is not None:
                assert self._writer.stdin is not None
                self._writer.stdin.close()
                await self._writer.wait()
                self._writer = None
        self._cache.close()

    async def _send(self, message: bytes) -> None:
        async with self._one_at_a_time:
            writer = await self._running_writer()
            assert writer.stdin is not None and writer.stdout is not None
            try:
                writer.stdin.write(message)
                await writer.stdin.drain()
                answer = await writer.stdout.readline()
            except ConnectionError:  # a broken pipe or reset: it ended
                answer = b""
            if not answer:
                self._writer = None
                raise ConnectionError(f"the disk cache's writer process ended (exit status {writer.returncode})")
        if answer != b"ok\n":
            raise OSError(f"the disk cache's writer failed: {answer.decode(errors='replace').strip()}")

    async def _running_writer(self) -> asyncio.subprocess.Process:
        if self._writer is None or self._writer.returncode is not None:
            directory, lock_timeout_s, max_bytes = self._where
            self._writer = await asyncio.create_subprocess_exec(
                sys.executable, "-c", disk_writer.COMMAND, directory, str(lock_timeout_s), str(max_bytes),
                stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE)
        return self._writer


def read_many(cache: diskcache.Cache, keys: Sequence[str]) -> list[bytes | None]:
    """``[cache.get(key) for key in keys]`` in one query a chunk of keys: the same rows (diskcache 5's table, str keys
    stored raw, unexpired), read as ``get`` reads them, under a policy whose reads write nothing and with statistics
    off, as ``disk_writer.open_cache`` opens it."""
    found: dict[str, bytes] = {}
    now = diskcache.core.time.time()  # the clock diskcache stamped the expiry times with
    for start in range(0, len(keys), READ_CHUNK):
        chunk = keys[start:start + READ_CHUNK]
        for key, mode, filename, value in cache._sql(_SELECT_LIVE.format(",".join("?" * len(chunk))),
                                                     (now, *chunk)).fetchall():
            try:
                found[key] = cache._disk.fetch(mode, filename, value, False)
            except OSError:  # its file went between the query and the read (evicted): a miss, as get has it
                pass
    return [found.get(key) for key in keys]

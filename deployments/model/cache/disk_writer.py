"""The disk store's writes, in a process of their own: ``main`` (``COMMAND`` followed by the directory, lock timeout
and byte bound) reads frames from stdin (4-byte big-endian length, then the pickle of ``(entries,
ttl_s)``), writes each frame's entries in one transaction and answers one line per frame: ``ok``, or the name of
the exception that failed it. It ends when stdin closes.

Why a process: each SQLite call gives up the GIL and must win it back, and diskcache makes five a key. On a thread
of a replica, beside its busy event loop, a writer wins the GIL back so rarely that a bulk run's write-backs queue
past their timeout and many vectors are never stored.

The process runs at the lowest CPU priority, and evicts once a frame rather than once a key (``cull_limit=0``, then
``Cache.cull``, so the store's volume is checked once a frame instead of on every key): during a cold bulk run,
which already fills the machine's cores, its writes compete with the request path, and the interactive requests
beside the job would pay for that CPU (docs/cache.md).
"""

from __future__ import annotations

import pickle
import struct
import sys
from typing import Mapping

import diskcache

from deployments.model.cpu_priority import lowest_cpu_priority

EVICTION_POLICY = "least-recently-stored"  # a read never writes (docs/cache.md)
# SQLite reads the database through a memory map this long (diskcache's default, 64 MiB, is 40,000 vectors of 384
# floats; past it each page is a read() call, a system call a lookup's keys pay for one by one).
MMAP_BYTES = 2**30
HEADER = struct.Struct(">I")
COMMAND = "from deployments.model.cache.disk_writer import main; main()"  # for ``python -c``


def open_cache(directory: str, lock_timeout_s: float, max_bytes: int) -> diskcache.Cache:
    # No eviction inside ``set`` (diskcache's default checks the volume on every key): ``write`` evicts once a frame.
    return diskcache.Cache(directory, timeout=lock_timeout_s, size_limit=max_bytes, eviction_policy=EVICTION_POLICY,
                           cull_limit=0, sqlite_mmap_size=MMAP_BYTES)


def write(cache: diskcache.Cache, entries: Mapping[str, bytes], ttl_s: float | None) -> None:
    """The entries in one transaction, then the least recently stored (and the expired) evicted until the volume is
    back under the bound."""
    with cache.transact():
        for key, value in entries.items():
            cache.set(key, value, expire=ttl_s)
    cache.cull()


def frame(entries: Mapping[str, bytes], ttl_s: float | None) -> bytes:
    body = pickle.dumps((dict(entries), ttl_s), protocol=pickle.HIGHEST_PROTOCOL)
    return HEADER.pack(len(body)) + body


def main() -> None:
    lowest_cpu_priority()
    directory, lock_timeout_s, max_bytes = sys.argv[1], float(sys.argv[2]), int(sys.argv[3])
    source, answers = sys.stdin.buffer, sys.stdout.buffer
    with open_cache(directory, lock_timeout_s, max_bytes) as cache:
        while len(header := source.read(HEADER.size)) == HEADER.size:
            entries, ttl_s = pickle.loads(source.read(HEADER.unpack(header)[0]))
            try:
                write(cache, entries, ttl_s)
            except Exception as exc:  # noqa: BLE001 - reported to the replica, which counts it
                answers.write(f"{type(exc).__name__}\n".encode())
            else:
                answers.write(b"ok\n")
            answers.flush()

"""What a vector store is, and the guard every store call passes through.

A store maps keys to the bytes of one float32 vector. The guard gives each read ``timeout_s`` and each write, which
runs after its request was answered, up to ``WRITE_TIMEOUT_S``; a read that fails, times out or finds the store
failing a moment ago is a miss, a write that fails is lost (a later miss): never an error for the request. A failed
read keeps requests off the store for ``COOL_DOWN_S`` unless the store answered another call meanwhile: a store
that answers nothing is skipped, one that answers late under load (a bulk job's lookups queued behind each other)
is still asked, for a skipped lookup is paid for by computing every input it would have found. Each failure is
counted; the log says when a store starts failing and when it answers again, naming the store and the error's type
only: no key or value is ever logged.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Mapping, Protocol, Sequence

from deployments.model.cache.metrics import CacheMetrics

logger = logging.getLogger("ray.serve")

COOL_DOWN_S = 1.0  # after a failed read, how long the store is not asked
# A write runs after its request was answered, so it may take longer than a read: a bulk job's 256-vector write to
# the disk store can outlast the time a read gets on a busy machine, and cutting it short (and then skipping the
# store for a second) loses vectors the next night then computes and bills again.
WRITE_TIMEOUT_S = 5.0


class VectorStore(Protocol):
    name: str  # "disk" | "redis": the store's tag in metrics and logs

    async def get_many(self, keys: Sequence[str]) -> list[bytes | None]:
        """The value of each key, in order, or None where it has none."""

    async def set_many(self, entries: Mapping[str, bytes]) -> None:
        """Store every entry (under the store's own expiry and byte bound)."""

    async def aclose(self) -> None:
        """Release connections and threads."""


def longest_call_s(timeout_s: float, patient_timeout_s: float | None = None) -> float:
    """The longest the guard lets any store call take (a patient read, or a write): a store client's own timeout
    must not be shorter, or it cuts those calls short behind the guard's back."""
    return max(timeout_s, patient_timeout_s or 0.0, WRITE_TIMEOUT_S)


class GuardedStore:
    def __init__(self, store: VectorStore, *, cache: str, timeout_s: float, metrics: CacheMetrics,
                 patient_timeout_s: float | None = None) -> None:
        """``timeout_s`` bounds a read, ``patient_timeout_s`` (default: the same) a patient one: a bulk request's,
        whose lookups a replica busy with the bulk flood answers late, and each late one is computed and billed
        again."""
        self._store = store
        self._cache = cache
        self._timeout_s = timeout_s
        self._patient_timeout_s = patient_timeout_s or timeout_s
        self._write_timeout_s = longest_call_s(timeout_s, patient_timeout_s)  # the bound a store's client must allow
        self._metrics = metrics
        self._failing_until: float | None = None  # loop time; None while the store answers
        self._answered_at: float | None = None  # loop time of the last call the store answered

    @property
    def name(self) -> str:
        return self._store.name

    async def get_many(self, keys: Sequence[str], *, patient: bool = False) -> dict[str, bytes]:
        """The keys the store holds, with their values; {} if it cannot say in time."""
        if not keys or self._cooling_down():
            return {}
        sent = asyncio.get_running_loop().time()
        timeout_s = self._patient_timeout_s if patient else self._timeout_s
        try:
            values = await asyncio.wait_for(self._store.get_many(keys), timeout_s)
        except Exception as exc:  # noqa: BLE001 - any failure of the store is a miss
            self._failed("get", exc, cool_down=self._answered_at is None or self._answered_at < sent)
            return {}
        self._answered()
        found = {key: value for key, value in zip(keys, values) if value is not None}
        self._metrics.bytes_moved(self._cache, "read", sum(map(len, found.values())))
        return found

    async def set_many(self, entries: Mapping[str, bytes]) -> None:
        if not entries:  # a write is tried even while reads cool down: it costs no request, and a slow store keeps it
            return
        try:
            await asyncio.wait_for(self._store.set_many(entries), self._write_timeout_s)
        except Exception as exc:  # noqa: BLE001 - a lost write costs a later miss, nothing more
            self._failed("set", exc, cool_down=False)
            return
        self._answered()
        self._metrics.bytes_moved(self._cache, "written", sum(map(len, entries.values())))

    async def aclose(self) -> None:
        await self._store.aclose()

    def _cooling_down(self) -> bool:
        """A read failed a moment ago: lookups are not asked of the store (writes still are)."""
        if self._failing_until is None or asyncio.get_running_loop().time() >= self._failing_until:
            return False
        self._metrics.store_failed(self._cache, self.name, "get", "skipped")
        return True

    def _failed(self, op: str, exc: Exception, cool_down: bool = True) -> None:
        """Count a failed call; with ``cool_down`` (a read the store answered nothing else during), it is also logged
        (when the store starts failing) and keeps requests off the store for ``COOL_DOWN_S``. A failed write costs
        no request, only a later miss: it is counted only."""
        reason = "timeout" if isinstance(exc, TimeoutError) else "error"
        self._metrics.store_failed(self._cache, self.name, op, reason)
        if cool_down and self._failing_until is None:
            logger.warning("embedding cache %r: the %s store failed (%s on %s); inputs are computed as misses "
                           "until it answers again", self._cache, self.name, type(exc).__name__, op)
        if cool_down:
            self._failing_until = asyncio.get_running_loop().time() + COOL_DOWN_S

    def _answered(self) -> None:
        self._answered_at = asyncio.get_running_loop().time()
        if self._failing_until is not None:
            logger.info("embedding cache %r: the %s store answers again", self._cache, self.name)
            self._failing_until = None

"""Stand-ins for the cache's tests: an in-memory store that can be made slow or down, a recording metrics sink, and
a model whose calls can be held, each counted."""

from __future__ import annotations

import asyncio
from collections import Counter
from typing import Awaitable, Hashable, Mapping, Sequence, TypeVar

import numpy as np

from batching import DeadlineExceeded, Priority
from deployments.model.backends import Prepared
from deployments.model.cache import CacheMetrics, EmbeddingCache
from deployments.model.cache.store import GuardedStore
from deployments.wire import Deadline, Share

T = TypeVar("T")
DIM = 8
TIMEOUT_S = 0.05


def vector(content: Hashable, dimensions: int | None = None) -> np.ndarray:
    seed = abs(hash(("fake-model", content, dimensions))) % 2**32
    return np.random.default_rng(seed).standard_normal(dimensions or DIM).astype(np.float32)


def prepared(*contents: Hashable) -> list[Prepared]:
    return [Prepared(content, len(content)) for content in contents]


class MemoryStore:
    name = "memory"

    def __init__(self) -> None:
        self.data: dict[str, bytes] = {}
        self.down = False
        self.delay_s = 0.0
        self.calls = Counter[str]()

    async def get_many(self, keys: Sequence[str]) -> list[bytes | None]:
        await self._answer("get")
        return [self.data.get(key) for key in keys]

    async def set_many(self, entries: Mapping[str, bytes]) -> None:
        await self._answer("set")
        self.data.update(entries)

    async def aclose(self) -> None:
        pass

    async def _answer(self, op: str) -> None:
        self.calls[op] += 1
        if self.delay_s:
            await asyncio.sleep(self.delay_s)
        if self.down:
            raise ConnectionError("store down")


class RecordingMetrics(CacheMetrics):
    def __init__(self) -> None:
        self.lookups = Counter[str]()
        self.saved_inputs = 0
        self.saved_tokens = 0
        self.store_errors = Counter[tuple[str, str]]()
        self.bytes = Counter[str]()

    def looked_up(self, cache: str, outcome: str, count: int) -> None:
        if count:
            self.lookups[outcome] += count

    def saved(self, cache: str, inputs: int, tokens: int) -> None:
        self.saved_inputs += inputs
        self.saved_tokens += tokens

    def store_failed(self, cache: str, store: str, op: str, reason: str) -> None:
        self.store_errors[op, reason] += 1

    def bytes_moved(self, cache: str, op: str, count: int) -> None:
        self.bytes[op] += count


class FakeModel:
    """The stage behind the cache (the batchers, in the service): vectors derived from the content; ``gate`` (when
    set) holds every call until released, within the call's deadline; then ``refuse`` (when set) is raised instead,
    or ``refuse_next`` for the first call alone."""

    def __init__(self) -> None:
        self.calls: list[list[Hashable]] = []
        self.gate: asyncio.Event | None = None
        self.refuse: BaseException | None = None
        self.refuse_next: BaseException | None = None
        self.failing: set[Hashable] = set()

    async def embed(self, items: Sequence[Prepared], *, dimensions: int | None, priority: Priority,
                    deadline: Deadline | None, share: Share | None = None) -> list[np.ndarray | BaseException]:
        self.calls.append([item.content for item in items])
        refusal, self.refuse_next = self.refuse_next or self.refuse, None
        if self.gate is not None:
            try:
                await asyncio.wait_for(self.gate.wait(), Deadline.seconds_left(deadline))
            except TimeoutError:
                return [DeadlineExceeded("late") for _ in items]
        if refusal is not None:
            raise refusal
        return [ValueError("bad input") if item.content in self.failing else vector(item.content) for item in items]

    def computed(self) -> list[Hashable]:
        return [content for call in self.calls for content in call]


def make_cache(store: MemoryStore | None = None, metrics: RecordingMetrics | None = None, *,
               model: FakeModel | None = None, identity: str = "fake-model v1", name: str = "fake",
               patient_timeout_s: float | None = None) -> EmbeddingCache:
    metrics = metrics or RecordingMetrics()
    guarded = GuardedStore(store or MemoryStore(), cache=name, timeout_s=TIMEOUT_S, metrics=metrics,
                           patient_timeout_s=patient_timeout_s)
    return EmbeddingCache(guarded, model or FakeModel(), name=name, backend_identity=identity, metrics=metrics)


def held_model() -> FakeModel:
    """A model whose calls wait until ``gate`` is set."""
    model = FakeModel()
    model.gate = asyncio.Event()
    return model


async def started(call: Awaitable[T]) -> asyncio.Future[T]:
    """``call`` running, and by now waiting where it waits (for the store, a held model, or a flight)."""
    task = asyncio.ensure_future(call)
    await asyncio.sleep(0.01)
    return task


async def embed(cache: EmbeddingCache, *contents: Hashable, priority: Priority = Priority.HIGH,
                timeout_s: float | None = None, dimensions: int | None = None) -> list[np.ndarray | BaseException]:
    return await cache.embed(prepared(*contents), dimensions=dimensions, priority=priority,
                             deadline=Deadline.of(timeout_s))


async def settle() -> None:
    """Let the background writes land (the loop's clock is looptime's: no real time passes)."""
    await asyncio.sleep(1.0)

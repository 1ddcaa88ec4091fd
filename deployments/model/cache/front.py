"""The cache in front of a model's batchers: hits never enter a batcher, misses are batched and written back.

A stage of the model's path (``deployments.model.stage``): ``embed`` receives a request's prepared inputs and
returns one outcome per input, in order (a vector, or the exception that failed that input), passing what it does
not hold to the next stage (the batchers):
- each distinct input is keyed (``keys.py``); one already being computed is joined (``single_flight.py``); the
  rest are looked up in the store in one call; what the store lacks goes to the next stage, in one call, by this
  request, which leads their flights;
- a computed vector is handed to the joiners at once and written to the store in the background (the flight stays
  joinable until the write lands, so no request computes it again meanwhile); only vectors are stored, never
  failures;
- a store that fails or is slow costs a miss (``store.py``), never the request; a LOW request's lookup may take
  longer than a HIGH one's (bulk work, which a late hit costs less than computing it again).
Token counts are not stored: ``usage`` comes from ``Prepared.tokens``, counted for every request when it arrives.
A tenant's request counts, as its cached tokens, the tokens of every input it was answered without computing.
"""

from __future__ import annotations

import asyncio
from typing import Mapping, Sequence

import numpy as np

from batching import DeadlineExceeded, Priority

from deployments.errors import NotCached
from deployments.model.backends import Prepared
from deployments.model.cache.keys import CacheKeys
from deployments.model.cache.metrics import CacheMetrics
from deployments.model.cache.single_flight import Flight, FlightAbandoned, Flights
from deployments.model.cache.store import GuardedStore
from deployments.model.stage import EmbeddingStage, Outcome
from deployments.usage import ModelUsage
from deployments.wire import Deadline, Share

VECTOR_DTYPE = np.dtype("<f4")  # stored as little-endian float32: the bytes the model returned
# A provider batch's thousands of vectors are read and written this many at a time: each store call has its timeout
STORE_CALL_KEYS = 1024


class EmbeddingCache:
    def __init__(self, store: GuardedStore, next_stage: EmbeddingStage, *, name: str, backend_identity: str,
                 metrics: CacheMetrics, usage: ModelUsage | None = None) -> None:
        """``usage``: where a tenant's cached tokens are counted."""
        self._store = store
        self._next = next_stage
        self._name = name
        self._backend_identity = backend_identity
        self._metrics = metrics
        self._usage = usage
        self._keys: dict[int | None, CacheKeys] = {}
        self._flights: Flights[Outcome] = Flights()
        self._writes: set[asyncio.Task[None]] = set()

    async def embed(self, prepared: Sequence[Prepared], *, dimensions: int | None, priority: Priority,
                    deadline: Deadline | None, share: Share | None = None) -> list[Outcome]:
        keys = self._keys_of(dimensions)
        request_keys = [keys.key(item.content) for item in prepared]
        inputs = dict(zip(request_keys, prepared))  # one entry per distinct input
        joined = {key: flight for key in inputs if (flight := self._flights.joinable(key, priority)) is not None}
        hits = await self._look_up([key for key in inputs if key not in joined], patient=priority is Priority.LOW)
        found: dict[str, Outcome] = dict(hits)
        saved = list(hits)
        pending = [key for key in inputs if key not in joined and key not in found]
        counted = share is not None and self._usage is not None  # a tenant's: its cached tokens are counted
        computed: set[str] = set()
        while pending or joined:
            led, also_joined = self._flights.claim(pending, priority)
            joined.update(also_joined)
            if led:
                outcomes = await self._compute(led, inputs, dimensions, priority, deadline, share)
                found.update(outcomes)
                if counted:
                    computed.update(outcomes)
            settled, pending = await self._wait_for(joined, deadline)
            found.update(settled)
            saved += [key for key, outcome in settled.items() if isinstance(outcome, np.ndarray)]
            joined = {}
        self._metrics.looked_up(self._name, "joined", len(saved) - len(hits))
        self._metrics.saved(self._name, len(saved), sum(inputs[key].tokens for key in saved))
        answers = [found[key] for key in request_keys]
        if counted:
            self._count_cached(share.key, prepared, request_keys, answers, computed)  # type: ignore[union-attr]
        return answers

    async def cached(self, prepared: Sequence[Prepared], *, dimensions: int | None) -> list[Outcome]:
        """What the store holds of each input, in order, and ``NotCached`` where it holds nothing: nothing is
        computed (a relayed batch's line, whose vectors come from the provider's Batch API, never in real time)."""
        keys = self._keys_of(dimensions)
        request_keys = [keys.key(item.content) for item in prepared]
        distinct = list(dict.fromkeys(request_keys))
        found: dict[str, np.ndarray] = {}
        for start in range(0, len(distinct), STORE_CALL_KEYS):
            found.update(await self._look_up(distinct[start:start + STORE_CALL_KEYS], patient=True))
        return [found[key] if key in found else NotCached("the provider's batch has not returned this input")
                for key in request_keys]

    async def put(self, vectors: Mapping[Prepared, np.ndarray], *, dimensions: int | None) -> None:
        """Store vectors computed elsewhere (a provider's batch) and return once they are written, or the write is
        given up (it costs a later miss)."""
        keys = self._keys_of(dimensions)
        items = list(vectors.items())
        for start in range(0, len(items), STORE_CALL_KEYS):  # keyed a chunk at a time: the loop serves between
            await self._store.set_many({keys.key(item.content): np.ascontiguousarray(vector, dtype=VECTOR_DTYPE)
                                        .tobytes() for item, vector in items[start:start + STORE_CALL_KEYS]})

    async def written(self) -> None:
        """Return once every vector computed so far has been written back (or its write given up: each is bounded
        by the store's timeout), including writes started meanwhile."""
        while self._writes:
            await asyncio.gather(*self._writes, return_exceptions=True)

    async def aclose(self) -> None:
        """Let the writes in progress land, then close the store."""
        await self.written()
        await self._store.aclose()

    def _count_cached(self, tenant: str, prepared: Sequence[Prepared], request_keys: list[str],
                      answers: list[Outcome], computed: set[str]) -> None:
        """The tokens of the inputs answered with a vector but not computed for this request: from the store, by
        another request's flight, or as a repeat of an input of its own."""
        tokens = 0
        for item, key, answer in zip(prepared, request_keys, answers):
            if isinstance(answer, np.ndarray):
                if key in computed:
                    computed.discard(key)  # its first occurrence was computed; a repeat is not
                else:
                    tokens += item.tokens
        self._usage.cached(tenant, tokens)  # type: ignore[union-attr]

    def _keys_of(self, dimensions: int | None) -> CacheKeys:
        keys = self._keys.get(dimensions)
        if keys is None:
            keys = self._keys[dimensions] = CacheKeys(self._name, self._backend_identity, dimensions)
        return keys

    async def _look_up(self, keys: list[str], *, patient: bool) -> dict[str, np.ndarray]:
        vectors: dict[str, np.ndarray] = {}
        for key, value in (await self._store.get_many(keys, patient=patient)).items():
            if value and len(value) % VECTOR_DTYPE.itemsize == 0:
                vectors[key] = np.frombuffer(value, dtype=VECTOR_DTYPE)
            else:
                self._metrics.store_failed(self._name, self._store.name, "get", "corrupt")
        self._metrics.looked_up(self._name, "hit", len(vectors))
        return vectors

    async def _compute(self, led: list[Flight[Outcome]], inputs: Mapping[str, Prepared], dimensions: int | None,
                       priority: Priority, deadline: Deadline | None, share: Share | None) -> dict[str, Outcome]:
        self._metrics.looked_up(self._name, "miss", len(led))
        if deadline is not None and deadline.remaining() <= 0:  # spent waiting for flights that were abandoned
            outcomes: Sequence[Outcome] = [_timed_out() for _ in led]
        else:
            try:
                outcomes = await self._next.embed([inputs[flight.key] for flight in led], dimensions=dimensions,
                                                  priority=priority, deadline=deadline, share=share)
            except BaseException:  # refused, or the request was cancelled: the joiners compute it themselves
                for flight in led:
                    flight.abandon()
                raise
        computed: dict[Flight[Outcome], np.ndarray] = {}
        for flight, outcome in zip(led, outcomes):
            if isinstance(outcome, DeadlineExceeded):  # this request's deadline; a joiner may have longer
                flight.abandon()
                continue
            flight.settle(outcome)
            if isinstance(outcome, np.ndarray):
                computed[flight] = outcome
            else:
                flight.land()
        if computed:
            self._write_back(computed)
        return {flight.key: outcome for flight, outcome in zip(led, outcomes)}

    def _write_back(self, computed: dict[Flight[Outcome], np.ndarray]) -> None:
        task = asyncio.ensure_future(self._write(computed))
        self._writes.add(task)
        task.add_done_callback(self._writes.discard)

    async def _write(self, computed: dict[Flight[Outcome], np.ndarray]) -> None:
        try:
            await self._store.set_many({flight.key: np.ascontiguousarray(vector, dtype=VECTOR_DTYPE).tobytes()
                                        for flight, vector in computed.items()})
        finally:
            for flight in computed:
                flight.land()

    async def _wait_for(self, joined: Mapping[str, Flight[Outcome]],
                        deadline: Deadline | None) -> tuple[dict[str, Outcome], list[str]]:
        """The outcomes of the joined flights, by key, and the keys whose flight was abandoned."""
        if not joined:
            return {}, []
        timeout = None if deadline is None else max(0.0, deadline.remaining())
        await asyncio.wait({flight.outcome for flight in joined.values()}, timeout=timeout)
        settled: dict[str, Outcome] = {}
        abandoned: list[str] = []
        for key, flight in joined.items():
            outcome = flight.outcome.result() if flight.outcome.done() else _timed_out()
            if isinstance(outcome, FlightAbandoned):
                abandoned.append(key)
            else:
                settled[key] = outcome
        return settled, abandoned


def _timed_out() -> DeadlineExceeded:
    return DeadlineExceeded("the request timed out before it was embedded")

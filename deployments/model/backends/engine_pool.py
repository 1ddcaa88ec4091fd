"""The cores a local model computes on, shared by the engine calls of every batch in flight.

One engine per core (a *slot*), each run by a thread of its own: under load the cores run separate calls side by
side, which serves more texts a second than one engine spreading each call over every core, whose threads meet at
every operator. A call that would run alone (no other call running or waiting) runs instead on a *wide* engine over
all the slots' cores: a lone request then gets everything the cores can do for it, and since the wide engine starts
only while every slot is free and holds them all until it returns, no two calls ever share a core.

A caller's first call goes before any caller's next one, and then the callers take turns, one call each: a batch sent
beside a running one starts on the next core that frees, not after all of its calls, so a HIGH batch beside a LOW
one (the batcher never gives LOW the last batch slot) waits for one call; a lone batch spreads its calls over every
core.

The threads run at the lowest CPU priority (nice 19), and so do the threads an engine starts, which inherit it from
the thread that built the engine: on a machine the model keeps busy, the cheap work that moves requests (HAProxy,
the ingress, the replica's event loop) gets a core the moment it needs one, instead of queueing behind a call.
"""

from __future__ import annotations

import asyncio
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable, Sequence, TypeVar

from deployments.model.backends.engines import Engine
from deployments.model.cpu_priority import lowest_cpu_priority

T = TypeVar("T")
EngineCall = Callable[[Engine], T]  # one engine call: given the engine to run on, its result
_Queued = deque[tuple[EngineCall, asyncio.Future]]  # one caller's calls not yet started, with their results' futures


class EnginePool:
    def __init__(self, build: Callable[[int], Engine], slots: int, *, slot_threads: int = 1,
                 wide: bool = False) -> None:
        """``build(threads)`` makes an engine computing on that many threads; ``slots`` of ``slot_threads`` threads
        each run calls side by side, and with ``wide`` (and more than one slot) a lone call runs on an engine of all
        their threads."""
        if slots < 1 or slot_threads < 1:
            raise ValueError("an engine pool needs at least one slot of at least one thread")
        self._executor = ThreadPoolExecutor(max_workers=slots, thread_name_prefix="local-embed",
                                            initializer=lowest_cpu_priority)
        # Built on the pool's own threads, so the threads an engine starts inherit their priority.
        self.slot_engines: list[Engine] = [self._executor.submit(build, slot_threads).result() for _ in range(slots)]
        self.wide_engine: Engine | None = (
            self._executor.submit(build, slots * slot_threads).result() if wide and slots > 1 else None)
        self._free: list[Engine] = list(self.slot_engines)
        self._arrived: deque[_Queued] = deque()  # callers none of whose calls has started, in arrival order
        self._turns: deque[_Queued] = deque()  # callers with calls running or done, taking turns
        self._waiting = 0  # calls queued, not yet started

    @property
    def engines(self) -> list[Engine]:
        """Every engine of the pool: the slots' and the wide one."""
        return self.slot_engines + ([self.wide_engine] if self.wide_engine is not None else [])

    def run_on_each(self, call: EngineCall[T]) -> list[T]:
        """``call`` on every engine of the pool in turn, from a thread of the pool, blocking (start-up: a first call
        sizes an engine's buffers)."""
        return [self._executor.submit(call, engine).result() for engine in self.engines]

    async def run(self, calls: Sequence[EngineCall[T]]) -> list[T]:
        """Each call's result, in order. The calls take turns with other callers' (one call each), and run side by
        side on free slots. Once one fails, or the caller is cancelled, its calls not yet started never start."""
        loop = asyncio.get_running_loop()
        caller: _Queued = deque((call, loop.create_future()) for call in calls)
        futures = [future for _, future in caller]
        self._arrived.append(caller)
        self._waiting += len(futures)
        self._dispatch()
        try:
            return list(await asyncio.gather(*futures))
        finally:
            self._drop(caller)

    def shutdown(self) -> None:
        self._executor.shutdown(wait=False)

    def _drop(self, caller: _Queued) -> None:
        """Forget the caller's calls not yet started."""
        self._waiting -= len(caller)
        for _, future in caller:
            future.cancel()
        caller.clear()

    def _dispatch(self) -> None:
        while self._free and (self._arrived or self._turns):
            caller = (self._arrived or self._turns).popleft()
            if not caller:
                continue
            call, future = caller.popleft()
            self._waiting -= 1
            if caller:
                self._turns.append(caller)
            if self.wide_engine is not None and self._waiting == 0 and len(self._free) == len(self.slot_engines):
                held, engine = self._free, self.wide_engine
                self._free = []
            else:
                engine = self._free.pop()
                held = [engine]
            running = self._executor.submit(call, engine)
            loop = future.get_loop()
            running.add_done_callback(lambda done, args=(held, caller, future): loop.call_soon_threadsafe(
                self._finished, *args, done))

    def _finished(self, held: list[Engine], caller: _Queued, future: asyncio.Future, running: Future) -> None:
        self._free.extend(held)
        error = running.exception()
        if not future.done():
            if error is None:
                future.set_result(running.result())
            else:
                future.set_exception(error)
        if error is not None:
            self._drop(caller)  # before the next call is chosen: the caller's others are not wanted now
        self._dispatch()

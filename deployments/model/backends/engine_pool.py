"""The cores a local model computes on, shared by the engine calls of every batch in flight.

One engine per core (a *slot*), each run by a thread of its own: under load the cores run separate calls side by
side, which serves more texts a second than one engine spreading each call over every core, whose threads meet at
every operator. A call that would run alone runs instead on a *wide* engine over all the slots' cores: a lone
request then gets everything the cores can do for it, and since the wide engine starts only while every slot is free
and holds them all until it returns, no two calls ever share a core.

A caller's first call goes before any caller's next one, and then the callers take turns, one call each: a batch sent
beside a running one starts on the next core that frees, not after all of its calls; a lone batch spreads its calls
over every core.

A *background* caller (a LOW batch) yields a core: when a call of another caller waits and no core runs one of the
others' calls, the background call started last is stopped (at its engine's next operator) and the waiting call runs
on its core at once; the stopped call runs again, first of its caller's, in its caller's next turn. So a HIGH request
beside a bulk job waits for an operator, not for a LOW call, and the job loses the part of a call it had done; once a
HIGH call holds a core, the callers take turns as above, so a HIGH flood does not starve LOW of the cores the
batcher's ``low_share`` gives it. An engine that cannot stop a call (torch) lets it finish first.

The threads run at the lowest CPU priority (nice 19), and so do the threads an engine starts, which inherit it from
the thread that built the engine: on a machine the model keeps busy, the cheap work that moves requests (HAProxy,
the ingress, the replica's event loop, which Ray starts at nice 15) gets a core ahead of a call, instead of queueing
behind it. Ray's 15 is left as it is: at nice 0 that work preempts the calls so often that the cores serve less.
"""

from __future__ import annotations

import asyncio
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable, Sequence, TypeVar

from deployments.model.backends.engines import Engine, EngineInterrupted
from deployments.model.cpu_priority import lowest_cpu_priority

T = TypeVar("T")
EngineCall = Callable[[Engine], T]  # one engine call: given the engine to run on, its result


@dataclass(eq=False)
class _Caller:
    """One ``run``'s calls not yet started, with their results' futures."""

    background: bool
    calls: deque[tuple[EngineCall, asyncio.Future]] = field(default_factory=deque)
    dropped: bool = False  # failed or gave up: none of its calls is wanted any more


@dataclass(eq=False)
class _Running:
    caller: _Caller
    call: EngineCall
    future: asyncio.Future
    held: list[Engine]  # the slots it holds: its own, or every one for the wide engine
    stopping: bool = False


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
        self._arrived: deque[_Caller] = deque()  # callers none of whose calls has started, in arrival order
        self._turns: deque[_Caller] = deque()  # callers with calls running or done, taking turns
        self._waiting = {False: 0, True: 0}  # calls not yet started, by background
        self._running: dict[Engine, _Running] = {}  # in the order the calls started

    @property
    def engines(self) -> list[Engine]:
        """Every engine of the pool: the slots' and the wide one."""
        return self.slot_engines + ([self.wide_engine] if self.wide_engine is not None else [])

    def run_on_each(self, call: EngineCall[T]) -> list[T]:
        """``call`` on every engine of the pool in turn, from a thread of the pool, blocking (start-up: a first call
        sizes an engine's buffers)."""
        return [self._executor.submit(call, engine).result() for engine in self.engines]

    async def run(self, calls: Sequence[EngineCall[T]], background: bool = False) -> list[T]:
        """Each call's result, in order. The calls take turns with other callers' (one call each), and run side by
        side on free slots; ``background`` ones yield a core to the others'. Once one fails, or the caller is
        cancelled, its calls not yet started never start."""
        loop = asyncio.get_running_loop()
        caller = _Caller(background, deque((call, loop.create_future()) for call in calls))
        futures = [future for _, future in caller.calls]
        self._arrived.append(caller)
        self._waiting[background] += len(futures)
        self._dispatch()
        try:
            return list(await asyncio.gather(*futures))
        finally:
            self._drop(caller)

    def shutdown(self) -> None:
        self._executor.shutdown(wait=False)

    def _drop(self, caller: _Caller) -> None:
        """Forget the caller's calls not yet started."""
        caller.dropped = True
        self._waiting[caller.background] -= len(caller.calls)
        for _, future in caller.calls:
            future.cancel()
        caller.calls.clear()

    def _dispatch(self) -> None:
        while self._free:
            caller = self._next_caller()
            if caller is None:
                break
            call, future = caller.calls.popleft()
            self._waiting[caller.background] -= 1
            if caller.calls:
                self._turns.append(caller)
            if self.wide_engine is not None and not any(self._waiting.values()) \
                    and len(self._free) == len(self.slot_engines):
                held, engine = self._free, self.wide_engine  # a call alone: every core
                self._free = []
            else:
                engine = self._free.pop()
                held = [engine]
            self._start(engine, _Running(caller, call, future, held))
        if self._foreground_coreless():
            self._stop_latest_background()

    def _next_caller(self) -> _Caller | None:
        """Whose call runs next: a caller's first call before any caller's next, then turns; but while the others
        have no core, theirs first."""
        first = self._foreground_coreless()
        for line in (self._arrived, self._turns):
            for caller in list(line):
                if not caller.calls:  # done, failed or gone
                    line.remove(caller)
                elif not first or not caller.background:
                    line.remove(caller)
                    return caller
        return None

    def _foreground_coreless(self) -> bool:
        """Whether a call of a foreground caller waits while no core runs one."""
        return bool(self._waiting[False]) and all(running.caller.background for running in self._running.values())

    def _stop_latest_background(self) -> None:
        """Stop the background call started last, unless one is being stopped already (its core is on its way)."""
        if not self._running or any(call.stopping for call in self._running.values()):
            return
        engine, call = next(reversed(self._running.items()))  # called while only background calls run
        call.stopping = True
        engine.interrupt()

    def _start(self, engine: Engine, running: _Running) -> None:
        self._running[engine] = running
        started = self._executor.submit(running.call, engine)
        loop = running.future.get_loop()
        started.add_done_callback(lambda done: loop.call_soon_threadsafe(self._finished, engine, done))

    def _finished(self, engine: Engine, done: Future) -> None:
        running = self._running.pop(engine)
        self._free.extend(running.held)
        error = done.exception()
        stopped = isinstance(error, EngineInterrupted)  # asked to, or the stop asked of the call before it
        if stopped and not running.caller.dropped:  # its caller's next call, and its caller's turn next
            caller = running.caller
            if caller.calls:
                self._turns.remove(caller)
            caller.calls.appendleft((running.call, running.future))
            self._turns.appendleft(caller)
            self._waiting[caller.background] += 1
        elif not running.future.done():
            if error is None:
                running.future.set_result(done.result())
            else:
                running.future.set_exception(error)
        if error is not None and not stopped:
            self._drop(running.caller)  # before the next call is chosen: the caller's others are not wanted now
        self._dispatch()

"""``EnginePool``: a call alone on every core, a batch's calls side by side on the slots, callers taking turns, a
caller's calls not yet started dropped when one fails or the caller gives up, and background callers' calls stopped
for the others'. The calls are gates the test opens, so nothing here depends on how fast a thread runs."""

from __future__ import annotations

import asyncio
import itertools
import threading
import os
import time
from typing import Iterator

import pytest

from deployments.model.backends.engine_pool import EnginePool
from deployments.model.backends.engines import EngineInterrupted

WAIT_S = 10.0  # a bound on waiting for a thread that must start (or finish) a call, never a measured time


class FakeEngine:
    ids = itertools.count()

    def __init__(self, threads: int, stoppable: bool = True) -> None:
        self.threads = threads
        self.stoppable = stoppable
        self.id = next(self.ids)
        self.priority = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())  # of the thread that built it
        self.running: Gate | None = None
        self.stop_next = False  # as ONNX Runtime's engine: a stop asked while no call runs stops the next one
        self.lock = threading.Lock()

    def interrupt(self) -> None:
        with self.lock:
            if not self.stoppable:
                return
            if self.running is not None:
                self.running.stop.set()
            else:
                self.stop_next = True


class Gate:
    """A call that records the engines it ran on and returns its label only once opened (or raises, if told to); an
    engine's ``interrupt`` stops it (``EngineInterrupted``) until it is opened."""

    def __init__(self, label: str, fails: bool = False) -> None:
        self.label, self.fails = label, fails
        self.engines: list[FakeEngine] = []
        self.started, self.opened, self.stop = threading.Event(), threading.Event(), threading.Event()
        self.stopped = threading.Event()

    @property
    def engine(self) -> FakeEngine | None:
        """The engine it last ran on."""
        return self.engines[-1] if self.engines else None

    def __call__(self, engine: FakeEngine) -> str:
        with engine.lock:
            if engine.stop_next:
                engine.stop_next = False
                raise EngineInterrupted(self.label)
            self.engines.append(engine)
            engine.running = self
        self.started.set()
        try:
            deadline = time.monotonic() + WAIT_S
            while not self.opened.wait(0.001):
                if self.stop.is_set():
                    self.stop.clear()
                    self.started.clear()
                    self.stopped.set()
                    raise EngineInterrupted(self.label)
                assert time.monotonic() < deadline, f"{self.label} never opened"
        finally:
            with engine.lock:
                engine.running = None
        if self.fails:
            raise RuntimeError(self.label)
        return self.label

    async def wait_stopped(self) -> None:
        assert await asyncio.to_thread(self.stopped.wait, WAIT_S), f"{self.label} was never stopped"

    async def wait_started(self) -> None:
        assert await asyncio.to_thread(self.started.wait, WAIT_S), f"{self.label} never started"


def gates(*labels: str) -> list[Gate]:
    return [Gate(label) for label in labels]


@pytest.fixture
def pool() -> Iterator[EnginePool]:
    pool = EnginePool(FakeEngine, 2, wide=True)
    yield pool
    pool.shutdown()


async def test_a_call_alone_runs_on_an_engine_of_every_core(pool) -> None:
    (alone,) = gates("alone")
    alone.opened.set()
    assert await pool.run([alone]) == ["alone"]
    assert alone.engine is pool.wide_engine and alone.engine.threads == 2
    assert [engine.threads for engine in pool.slot_engines] == [1, 1]


async def test_a_batch_runs_its_calls_side_by_side_on_the_slots_and_answers_in_order(pool) -> None:
    a, b, c = gates("a", "b", "c")
    task = asyncio.ensure_future(pool.run([a, b, c]))
    await a.wait_started()
    await b.wait_started()
    assert {a.engine, b.engine} == set(pool.slot_engines) and not c.started.is_set()
    b.opened.set()
    await c.wait_started()  # on the slot b freed, while a still runs
    assert c.engine is b.engine
    a.opened.set()
    c.opened.set()
    assert await task == ["a", "b", "c"]


async def test_callers_take_turns_one_call_each(pool) -> None:
    x1, x2, x3, x4 = gates("x1", "x2", "x3", "x4")
    (y1,) = gates("y1")
    first = asyncio.ensure_future(pool.run([x1, x2, x3, x4]))
    await x1.wait_started()
    await x2.wait_started()
    second = asyncio.ensure_future(pool.run([y1]))
    await asyncio.sleep(0)
    x1.opened.set()
    await y1.wait_started()  # the next free slot goes to the caller that waited, not to x3
    assert not x3.started.is_set() and y1.engine in pool.slot_engines
    x2.opened.set()
    await x3.wait_started()
    for gate in (y1, x3, x4):
        gate.opened.set()
    assert await second == ["y1"] and await first == ["x1", "x2", "x3", "x4"]


async def test_a_call_while_another_runs_takes_the_free_slot_not_every_core(pool) -> None:
    x1, x2 = gates("x1", "x2")
    (y1,) = gates("y1")
    first = asyncio.ensure_future(pool.run([x1, x2]))
    await x1.wait_started()
    await x2.wait_started()
    x2.opened.set()
    second = asyncio.ensure_future(pool.run([y1]))
    await y1.wait_started()
    assert y1.engine is x2.engine  # x1 still holds its core: the wide engine would share it
    x1.opened.set()
    y1.opened.set()
    assert await first == ["x1", "x2"] and await second == ["y1"]


async def test_a_failed_call_fails_its_caller_and_its_calls_not_started_never_start() -> None:
    pool = EnginePool(FakeEngine, 1)
    try:
        failing, after = Gate("failing", fails=True), Gate("after")
        failing.opened.set()
        with pytest.raises(RuntimeError, match="failing"):
            await pool.run([failing, after])
        (next_caller,) = gates("next")
        next_caller.opened.set()
        assert await pool.run([next_caller]) == ["next"]
        assert not after.started.is_set()
    finally:
        pool.shutdown()


async def test_a_caller_that_gives_up_leaves_its_calls_not_started_unstarted() -> None:
    pool = EnginePool(FakeEngine, 1)
    try:
        running, queued = gates("running", "queued")
        task = asyncio.ensure_future(pool.run([running, queued]))
        await running.wait_started()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        running.opened.set()
        (next_caller,) = gates("next")
        next_caller.opened.set()
        assert await pool.run([next_caller]) == ["next"]  # the slot came back once the running call returned
        assert not queued.started.is_set()
    finally:
        pool.shutdown()


def test_one_slot_has_no_wide_engine_and_every_engine_is_built_at_the_lowest_priority() -> None:
    narrow = EnginePool(FakeEngine, 1, slot_threads=3, wide=True)
    wide = EnginePool(FakeEngine, 2, wide=True)
    try:
        assert narrow.wide_engine is None and [engine.threads for engine in narrow.engines] == [3]
        assert [engine.threads for engine in wide.engines] == [1, 1, 2]
        assert {engine.priority for engine in narrow.engines + wide.engines} == {19}
        assert wide.run_on_each(lambda engine: engine.id) == [engine.id for engine in wide.engines]
    finally:
        narrow.shutdown()
        wide.shutdown()


async def test_a_call_beside_background_calls_on_every_core_stops_the_latest_and_takes_its_core(pool) -> None:
    b1, b2, b3 = gates("b1", "b2", "b3")
    (f1,) = gates("f1")
    bulk = asyncio.ensure_future(pool.run([b1, b2, b3], background=True))
    await b1.wait_started()
    await b2.wait_started()
    interactive = asyncio.ensure_future(pool.run([f1]))
    await b2.wait_stopped()  # the one started last: the least work lost
    await f1.wait_started()
    assert f1.engine is b2.engines[0] and not b1.stopped.is_set() and not b3.started.is_set()
    f1.opened.set()
    assert await interactive == ["f1"]
    await b2.wait_started()  # the stopped call runs again first, on the core it gave up
    assert not b3.started.is_set() and b2.engine is f1.engine
    for gate in (b1, b2, b3):
        gate.opened.set()
    assert await bulk == ["b1", "b2", "b3"]


async def test_a_call_beside_a_background_call_on_every_core_stops_it_and_takes_a_core(pool) -> None:
    (b1,) = gates("b1")
    (f1,) = gates("f1")
    bulk = asyncio.ensure_future(pool.run([b1], background=True))
    await b1.wait_started()
    assert b1.engine is pool.wide_engine  # alone, the background call had every core
    interactive = asyncio.ensure_future(pool.run([f1]))
    await b1.wait_stopped()
    await f1.wait_started()
    await b1.wait_started()  # again, on the other core: neither is alone now
    assert {f1.engine, b1.engine} == set(pool.slot_engines)
    f1.opened.set()
    b1.opened.set()
    assert await interactive == ["f1"] and await bulk == ["b1"]


async def test_once_a_call_of_the_others_holds_a_core_background_calls_take_their_turns(pool) -> None:
    f1, f2, f3 = gates("f1", "f2", "f3")
    b1, b2 = gates("b1", "b2")
    interactive = asyncio.ensure_future(pool.run([f1, f2, f3]))
    await f1.wait_started()
    await f2.wait_started()
    bulk = asyncio.ensure_future(pool.run([b1, b2], background=True))
    await asyncio.sleep(0)
    f1.opened.set()
    await b1.wait_started()  # a caller's first call before another's next: LOW is not starved by a HIGH flood
    assert not f3.started.is_set()
    b1.opened.set()
    await f3.wait_started()  # then turns, one call each
    assert not b2.started.is_set()
    for gate in (f2, f3, b2):
        gate.opened.set()
    assert await interactive == ["f1", "f2", "f3"] and await bulk == ["b1", "b2"]
    assert not b1.stopped.is_set() and not b2.stopped.is_set()


async def test_a_foreground_caller_without_a_core_stops_one_background_call_at_a_time(pool) -> None:
    b1, b2 = gates("b1", "b2")
    f1, f2 = gates("f1", "f2")
    bulk = asyncio.ensure_future(pool.run([b1, b2], background=True))
    await b1.wait_started()
    await b2.wait_started()
    interactive = asyncio.ensure_future(pool.run([f1, f2]))
    await f1.wait_started()  # on the core b2 gave up; b1 goes on: the others have a core now
    assert b2.stopped.is_set() and not b1.stopped.is_set() and f1.engine is b2.engines[0]
    for gate in (f1, f2, b1, b2):
        gate.opened.set()
    assert await interactive == ["f1", "f2"] and await bulk == ["b1", "b2"]


async def test_an_engine_that_cannot_stop_a_call_lets_it_finish_first() -> None:
    pool = EnginePool(lambda threads: FakeEngine(threads, stoppable=False), 1)
    try:
        (b1,) = gates("b1")
        (f1,) = gates("f1")
        bulk = asyncio.ensure_future(pool.run([b1], background=True))
        await b1.wait_started()
        interactive = asyncio.ensure_future(pool.run([f1]))
        await asyncio.sleep(0.01)
        assert not f1.started.is_set()
        b1.opened.set()
        f1.opened.set()
        assert await bulk == ["b1"] and await interactive == ["f1"]
        assert not b1.stopped.is_set()
    finally:
        pool.shutdown()


async def test_a_stopped_call_of_a_caller_that_gave_up_never_runs_again(pool) -> None:
    b1, b2 = gates("b1", "b2")
    (f1,) = gates("f1")
    bulk = asyncio.ensure_future(pool.run([b1, b2], background=True))
    await b1.wait_started()
    await b2.wait_started()
    bulk.cancel()
    interactive = asyncio.ensure_future(pool.run([f1]))
    await b2.wait_stopped()
    await f1.wait_started()
    f1.opened.set()
    assert await interactive == ["f1"]
    with pytest.raises(asyncio.CancelledError):
        await bulk
    (after,) = gates("after")
    after.opened.set()
    assert await pool.run([after]) == ["after"]  # on the core b2 gave up, b2 not run again
    b1.opened.set()
    assert [len(gate.engines) for gate in (b1, b2)] == [1, 1]


async def test_a_stop_that_finds_no_call_running_stops_the_next_which_runs_again(pool) -> None:
    (f1,) = gates("f1")
    f1.opened.set()
    pool.wide_engine.interrupt()  # as if asked just as its last call returned
    assert await pool.run([f1]) == ["f1"]
    assert f1.engines == [pool.wide_engine]  # stopped before it started (not counted), then run

"""``EnginePool``: a call alone on every core, a batch's calls side by side on the slots, callers taking turns, and a
caller's calls not yet started dropped when one fails or the caller gives up. The calls are gates the test opens, so
nothing here depends on how fast a thread runs."""

from __future__ import annotations

import asyncio
import itertools
import threading
import os
from typing import Iterator

import pytest

from deployments.model.backends.engine_pool import EnginePool

WAIT_S = 10.0  # a bound on waiting for a thread that must start (or finish) a call, never a measured time


class FakeEngine:
    ids = itertools.count()

    def __init__(self, threads: int) -> None:
        self.threads = threads
        self.id = next(self.ids)
        self.priority = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())  # of the thread that built it


class Gate:
    """A call that records the engine it ran on and returns its label only once opened (or raises, if told to)."""

    def __init__(self, label: str, fails: bool = False) -> None:
        self.label, self.fails = label, fails
        self.engine: FakeEngine | None = None
        self.started, self.opened = threading.Event(), threading.Event()

    def __call__(self, engine: FakeEngine) -> str:
        self.engine = engine
        self.started.set()
        assert self.opened.wait(WAIT_S)
        if self.fails:
            raise RuntimeError(self.label)
        return self.label

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

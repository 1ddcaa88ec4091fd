"""How a run ends when asked to (SIGINT, SIGTERM), always within a bound:

1. the first signal stops the job taking new batches; the requests in flight get `grace_s` to finish and be saved;
2. then the job is cancelled: it saves nothing more, closes its output and reports what it did;
3. a watchdog thread ends the process (`os._exit`) if it is still alive `CLEANUP_S` after that, whatever holds it;
4. a second signal ends the process at once.

Exit status 128 + the signal's number (130, 143), as a shell reports a process a signal ended. Every saved batch was
fsynced before it counted, so an exit at any of these points leaves an output the same command continues.

The handlers are `signal.signal` handlers, not the event loop's: those run only when the loop gets control back, and
a run holds it away at times (reading its input, recovering and assembling its output, waiting for its saving thread
to finish a write). Nor is the loop left to `asyncio.run`, whose teardown waits without a bound for every task left
on the loop, including those the run did not start (aiohttp's body writers and connection closers, which wait on the
peer), and then for the default executor's threads (aiohttp's netrc lookups): an interrupted run was found idle in
that teardown (`_cancel_all_tasks`) for ten minutes.
"""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time
from collections.abc import Callable, Coroutine
from types import FrameType
from typing import Any, TypeVar

T = TypeVar("T")

SIGNALS = (signal.SIGINT, signal.SIGTERM)
CLEANUP_S = 3.0  # after the grace: cancelling the job, a write the saving thread has begun, closing the output
TEARDOWN_S = 1.0  # the most the loop's teardown waits for tasks the run left behind


def _status_of(signum: int) -> int:
    return 128 + signum


class Interruption:
    """Runs one coroutine on a fresh event loop, stopping it as the module docstring says. `stop` is called (from
    the signal handler, on the main thread) to stop taking new batches. Handlers are installed while `run` runs
    and kept after a signal, so that a second one still ends the process while it exits."""

    def __init__(self, grace_s: float, stop: Callable[[], None]) -> None:
        self.signum: int | None = None
        self._grace_s = grace_s
        self._stop = stop
        self._watchdog = Watchdog()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._task: asyncio.Task[Any] | None = None

    @property
    def exit_status(self) -> int | None:
        return None if self.signum is None else _status_of(self.signum)

    def run(self, job: Coroutine[Any, Any, T]) -> T:
        """The job's result; `asyncio.CancelledError` if the grace ran out before it ended."""
        self._watchdog.start()
        previous = {signum: signal.signal(signum, self._on_signal) for signum in _handled()}
        loop = self._loop = asyncio.new_event_loop()
        try:
            self._task = loop.create_task(job)
            return loop.run_until_complete(self._task)
        finally:
            _tear_down(loop)
            if self.signum is None:
                self._watchdog.stand_down()
                for signum, handler in previous.items():
                    signal.signal(signum, handler)

    def _on_signal(self, signum: int, _: FrameType | None) -> None:
        if self.signum is not None:
            _say(f"embed-bulk: second signal ({signal.Signals(signum).name}): exiting now")
            os._exit(_status_of(signum))
        self.signum = signum
        self._watchdog.arm(time.monotonic() + self._grace_s + CLEANUP_S, _status_of(signum))
        _say(f"embed-bulk: {signal.Signals(signum).name}: taking no new batches; up to {self._grace_s:g} s for those "
             "in flight (a second signal exits at once)")
        self._stop()
        if self._loop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._start_grace)

    def _start_grace(self) -> None:
        assert self._loop is not None and self._task is not None
        self._loop.call_later(self._grace_s, self._task.cancel)


class Watchdog:
    """A daemon thread that ends the process at a deadline once armed, needing nothing from the main thread. It is
    started before any signal can arrive: a handler starting a thread could wait for a lock the code it interrupted
    holds (a thread pool starting its thread)."""

    def __init__(self) -> None:
        self._armed = threading.Event()
        self._deadline: float | None = None
        self._status = 0
        self._thread = threading.Thread(target=self._wait, name="embed-bulk-watchdog", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def arm(self, deadline: float, status: int) -> None:
        self._deadline, self._status = deadline, status
        self._armed.set()

    def stand_down(self) -> None:
        """Ends the thread, unarmed."""
        self._armed.set()

    def _wait(self) -> None:
        self._armed.wait()
        if self._deadline is None:
            return
        time.sleep(max(0.0, self._deadline - time.monotonic()))
        _say("embed-bulk: did not stop in time after the signal; exiting (saved batches are kept)")
        os._exit(self._status)


def _say(line: str) -> None:
    """Straight to stderr's file descriptor: a handler may run while `sys.stderr` is mid-write, and writing to it
    again from there raises."""
    os.write(2, (line + "\n").encode())


def _handled() -> list[int]:
    """The signals to handle: on the main thread (the only one Python delivers them to), those not ignored when the
    run began, which stay ignored as Python and asyncio leave them (SIGINT for a shell script's background job)."""
    if threading.current_thread() is not threading.main_thread():
        return []
    return [signum for signum in SIGNALS if signal.getsignal(signum) is not signal.SIG_IGN]


def _tear_down(loop: asyncio.AbstractEventLoop) -> None:
    """Cancels what the run left on the loop, waits for it `TEARDOWN_S` at most, and closes the loop without
    waiting for the default executor's threads (idle or not, they end with the process)."""
    leftover = asyncio.all_tasks(loop)
    for task in leftover:
        task.cancel()
    if leftover:
        loop.run_until_complete(asyncio.wait(leftover, timeout=TEARDOWN_S))
    loop.run_until_complete(asyncio.wait([loop.create_task(loop.shutdown_asyncgens())], timeout=TEARDOWN_S))
    loop.close()

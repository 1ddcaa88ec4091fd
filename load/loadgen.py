"""The load generator: closed and open loop, and runs of "embed one text" calls that record what each caller saw.

- ``send_closed_loop``: a fixed pool of callers, each sending one call and waiting for it before the next.
- ``send_open_loop``: calls go out at given times whatever happens to earlier ones (Poisson traffic). Calls still
  unfinished when the run's time cap passes are cancelled.
- ``closed_loop`` / ``open_loop``: those two over a list of texts, each text embedded once, recorded in a
  ``RunResult``. Open-loop latency counts from the scheduled arrival, so a generator that falls behind does not hide
  queueing; items cancelled at the cap are reported as backlog.

Results are kept and checked against ``load.hashvec`` after the timed part, so checking costs the run nothing.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable, Sequence

from load.hashvec import matches
from load.stats import latency_summary, percentile

EmbedOne = Callable[[str], Awaitable[Any]]
Until = Callable[[], bool]  # once it holds, nothing more is sent


@dataclass
class RunResult:
    submitted: int
    completed: int  # items that got a vector
    elapsed_s: float  # first arrival to last completion (or to the cap)
    latencies_ms: list[float]  # one per completed item
    errors: int = 0
    error_sample: str | None = None
    mismatches: int = 0  # completed items whose vector is not their text's embedding
    cpu_s: float = 0.0  # CPU time of this process during the run (all threads)
    vectors: list[Any] = field(default_factory=list, repr=False)  # per submitted item: vector or None
    latency_of: dict[int, float] = field(default_factory=dict, repr=False)  # item index -> latency (completed only)
    extra: dict[str, Any] = field(default_factory=dict, repr=False)  # whatever a scenario's driver adds

    @property
    def backlog(self) -> int:
        """Items neither completed nor failed when the run ended."""
        return self.submitted - self.completed - self.errors

    @property
    def throughput(self) -> float:
        return self.completed / self.elapsed_s if self.elapsed_s > 0 else 0.0

    def percentile_ms(self, pct: float) -> float:
        """Latency percentile over every submitted item; an item that never completed counts as infinitely late."""
        return percentile(self.latencies_ms, pct, self.submitted - self.completed)

    def summary(self) -> dict[str, Any]:
        return {
            "submitted": self.submitted,
            "completed": self.completed,
            "errors": self.errors,
            "error_sample": self.error_sample,
            "backlog": self.backlog,
            "mismatches": self.mismatches,
            "elapsed_s": self.elapsed_s,
            "items_per_s": self.throughput,
            **latency_summary(self.latencies_ms, self.submitted - self.completed),
            "cpu_s": self.cpu_s,
        }


class _Recorder:
    def __init__(self, count: int) -> None:
        self.vectors: list[Any] = [None] * count
        self.latencies_ms: list[float] = []
        self.latency_of: dict[int, float] = {}
        self.errors = 0
        self.error_sample: str | None = None
        self.last_done = 0.0

    async def call(self, embed: EmbedOne, index: int, text: str, since: float) -> None:
        try:
            vector = await embed(text)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # a failed item is counted, not fatal: the run reports it
            self.errors += 1
            self.error_sample = self.error_sample or f"{type(exc).__name__}: {exc}"[:300]
            return
        done = time.perf_counter()
        self.last_done = done
        latency_ms = (done - since) * 1000
        self.latencies_ms.append(latency_ms)
        self.latency_of[index] = latency_ms
        self.vectors[index] = vector

    def result(self, texts: Sequence[str], elapsed_s: float, cpu_s: float) -> RunResult:
        return RunResult(
            submitted=len(texts),
            completed=len(self.latencies_ms),
            elapsed_s=elapsed_s,
            latencies_ms=self.latencies_ms,
            errors=self.errors,
            error_sample=self.error_sample,
            cpu_s=cpu_s,
            vectors=self.vectors,
            latency_of=self.latency_of,
        )


async def send_closed_loop(
    send: Callable[[int], Awaitable[Any]], callers: int, count: int | None = None, until: Until | None = None
) -> None:
    """``callers`` callers each ``send(i)`` for the next index ``i`` and wait for it, until ``count`` indexes are
    taken (with None, never) or ``until()`` holds."""
    indexes = iter(range(count)) if count is not None else itertools.count()

    async def caller() -> None:
        for index in indexes:
            if until is not None and until():
                return
            await send(index)

    await asyncio.gather(*(caller() for _ in range(callers)))


@dataclass(frozen=True)
class OpenLoopRun:
    start: float  # perf_counter at the start; send i was scheduled for start + offsets[i]
    submitted: int  # sends made (none after ``until()`` held)
    unfinished: int  # sends cancelled at the cap


async def send_open_loop(
    send: Callable[[int, float], Awaitable[Any]], offsets: Sequence[float], cap_s: float, until: Until | None = None
) -> OpenLoopRun:
    """``send(i, scheduled_at)`` at ``offsets[i]`` seconds from the start, whatever became of earlier sends; stop
    waiting ``cap_s`` after the start and cancel what is unfinished then. Once ``until()`` holds nothing more is sent
    (what was sent is still waited for, up to the cap)."""
    tasks: list[asyncio.Task] = []
    start = time.perf_counter()

    async def arrivals() -> None:
        for index, offset in enumerate(offsets):
            delay = start + offset - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            if until is not None and until():
                return
            tasks.append(asyncio.ensure_future(send(index, start + offset)))

    feeder = asyncio.ensure_future(arrivals())
    unfinished: list[asyncio.Task] = []
    try:
        await asyncio.wait_for(asyncio.shield(feeder), timeout=cap_s)
        remaining = cap_s - (time.perf_counter() - start)
        if tasks and remaining > 0:
            await asyncio.wait(tasks, timeout=remaining)
    except TimeoutError:
        pass
    finally:
        feeder.cancel()
        unfinished = [task for task in tasks if not task.done()]
        for task in unfinished:
            task.cancel()
        await asyncio.gather(feeder, *unfinished, return_exceptions=True)
    return OpenLoopRun(start, len(tasks), len(unfinished))


async def closed_loop(embed: EmbedOne, texts: Sequence[str], callers: int) -> RunResult:
    """``callers`` callers share ``texts``; each embeds one text, waits for it, then takes the next."""
    recorder = _Recorder(len(texts))
    cpu_start, start = time.process_time(), time.perf_counter()
    await send_closed_loop(lambda index: recorder.call(embed, index, texts[index], time.perf_counter()),
                           callers, len(texts))
    elapsed = time.perf_counter() - start
    return recorder.result(texts, elapsed, time.process_time() - cpu_start)


async def open_loop(
    embed: EmbedOne, texts: Sequence[str], offsets: Sequence[float], cap_s: float, until: Until | None = None
) -> RunResult:
    """Embed ``texts[i]`` at ``offsets[i]`` seconds from the start (``send_open_loop``); items unfinished at the cap
    count as backlog, arrivals after ``until()`` held never happened."""
    if len(texts) != len(offsets):
        raise ValueError("one offset per text")
    recorder = _Recorder(len(texts))
    cpu_start = time.process_time()
    run = await send_open_loop(lambda index, at: recorder.call(embed, index, texts[index], at), offsets, cap_s, until)
    end = recorder.last_done if not run.unfinished and recorder.latencies_ms else time.perf_counter()
    elapsed = min(end, run.start + cap_s) - run.start
    result = recorder.result(texts, elapsed, time.process_time() - cpu_start)
    result.submitted = run.submitted
    return result


def count_mismatches(texts: Sequence[str], vectors: Sequence[Any], dim: int) -> int:
    """How many returned vectors are not their own text's embedding (items without a vector are not counted)."""
    return sum(1 for text, vector in zip(texts, vectors) if vector is not None and not matches(text, vector, dim))


def check(result: RunResult, texts: Sequence[str], dim: int) -> RunResult:
    """Fill in ``result.mismatches`` and drop the kept vectors."""
    result.mismatches = count_mismatches(texts, result.vectors, dim)
    result.vectors = []
    return result

"""Load generators that drive an "embed one text" call and record what each caller saw.

- ``closed_loop``: a fixed pool of callers, each embedding one text at a time (the article's experiment).
- ``open_loop``: texts arrive at given times whatever happens to earlier ones (Poisson traffic); latency counts
  from the scheduled arrival, so a generator that falls behind does not hide queueing. Items still unfinished when
  the run's time cap passes are cancelled and reported as backlog.

Results are kept and checked against ``load.hashvec`` after the timed part, so checking costs the run nothing.
"""

from __future__ import annotations

import asyncio
import math
import time
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable, Sequence

from load.hashvec import matches

EmbedOne = Callable[[str], Awaitable[Any]]


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
        return censored_percentile(self.latencies_ms, self.submitted - self.completed, pct)

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
            "p50_ms": _finite_or_none(self.percentile_ms(50)),
            "p99_ms": _finite_or_none(self.percentile_ms(99)),
            "mean_ms": sum(self.latencies_ms) / len(self.latencies_ms) if self.latencies_ms else None,
            "cpu_s": self.cpu_s,
        }


def censored_percentile(values: Sequence[float], missing: int, pct: float) -> float:
    """Nearest-rank percentile of ``values`` plus ``missing`` values known only to be larger than all of them."""
    total = len(values) + missing
    if total == 0:
        return math.nan
    rank = max(1, math.ceil(pct / 100 * total))
    if rank > len(values):
        return math.inf
    return sorted(values)[rank - 1]


def _finite_or_none(value: float) -> float | None:
    return value if math.isfinite(value) else None


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


async def closed_loop(embed: EmbedOne, texts: Sequence[str], callers: int) -> RunResult:
    """``callers`` callers share ``texts``; each embeds one text, waits for it, then takes the next."""
    recorder = _Recorder(len(texts))
    next_index = iter(range(len(texts)))

    async def caller() -> None:
        for index in next_index:
            await recorder.call(embed, index, texts[index], time.perf_counter())

    cpu_start, start = time.process_time(), time.perf_counter()
    await asyncio.gather(*(caller() for _ in range(callers)))
    elapsed = time.perf_counter() - start
    return recorder.result(texts, elapsed, time.process_time() - cpu_start)


async def open_loop(
    embed: EmbedOne, texts: Sequence[str], offsets: Sequence[float], cap_s: float, stop: asyncio.Event | None = None
) -> RunResult:
    """Submit ``texts[i]`` at ``offsets[i]`` seconds from the start; stop waiting ``cap_s`` after the start.

    Items unfinished at the cap are cancelled and count as backlog. Once ``stop`` is set nothing more arrives
    (what was submitted is still waited for, up to the cap).
    """
    if len(texts) != len(offsets):
        raise ValueError("one offset per text")
    recorder = _Recorder(len(texts))
    tasks: list[asyncio.Task] = []
    cpu_start, start = time.process_time(), time.perf_counter()

    async def arrivals() -> None:
        for index, (text, offset) in enumerate(zip(texts, offsets)):
            delay = start + offset - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            if stop is not None and stop.is_set():
                return
            tasks.append(asyncio.ensure_future(recorder.call(embed, index, text, start + offset)))

    feeder = asyncio.ensure_future(arrivals())
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
    end = recorder.last_done if not unfinished and recorder.latencies_ms else time.perf_counter()
    elapsed = min(end, start + cap_s) - start
    result = recorder.result(texts, elapsed, time.process_time() - cpu_start)
    result.submitted = len(tasks)  # arrivals after the cap never happened
    return result


def count_mismatches(texts: Sequence[str], vectors: Sequence[Any], dim: int) -> int:
    """How many returned vectors are not their own text's embedding (items without a vector are not counted)."""
    return sum(1 for text, vector in zip(texts, vectors) if vector is not None and not matches(text, vector, dim))


def check(result: RunResult, texts: Sequence[str], dim: int) -> RunResult:
    """Fill in ``result.mismatches`` and drop the kept vectors."""
    result.mismatches = count_mismatches(texts, result.vectors, dim)
    result.vectors = []
    return result

"""Per-item cost of batching with a no-op process function: this batcher vs @serve.batch vs the article's.

Figure 1 runs the three side by side in one process and one event loop, in interleaved rounds (the order rotates
every round, so no contender always runs right after the same other one). A round is N single-item submits
gathered at once; its wall time over N is the per-item cost. All three get the same ``max_batch_size`` and a
5 ms wait; ours and ``@serve.batch`` also get the same ``max_concurrent_batches`` (the article's batcher has no
such limit). With N concurrent submits the size trigger forms the batches, so all three do the same work; the
batches counted per round show it.

Figure 2 puts one time-triggered batch whose process call sleeps 100 ms in flight, then times how long N new
submits take to be accepted into the queue: ours vs the article's, whose lock is held for the whole batch.

Figure 3 is figure 1 for streaming handlers: N concurrent callers of an async-generator handler that yields its
input list once (the per-item cost) or ``stream_steps`` times (the per-step cost: the round's time over N x steps),
``batching.batch`` vs ``@serve.batch``, same settings, interleaved rounds.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import statistics
import time
from dataclasses import asdict, dataclass
from typing import Any, Awaitable, Callable

import batching
from batching import AdaptiveBatcher, BatcherConfig
from load.article_batcher import ArticleBatcher
from load.serve_batch import close_serve_batched, serve_batch_outside_replica, serve_batched
from load.stats import median, percentile

from .options import chosen_settings
from .report import markdown_table, write_report

TARGET_RATIO = 0.5  # ours costs at most half of @serve.batch per item
OURS, DROP_IN, SERVE, ARTICLE = "adaptive", "batching.batch", "serve.batch", "article"
LABELS = {
    OURS: "batching.AdaptiveBatcher",
    DROP_IN: "batching.batch (the @serve.batch drop-in)",
    SERVE: "ray.serve @serve.batch",
    ARTICLE: "article §4.1 (re-implementation)",
}
_STALL_GIVE_UP_S = 30.0

Submit = Callable[[Any], Awaitable[Any]]


@dataclass(frozen=True)
class Settings:
    rounds: int = 30  # measured rounds per contender, after the warm-up
    warmup: int = 3  # rounds run first and discarded
    items: int = 1000  # single-item submits per round
    batch_size: int = 100
    concurrent_batches: int = 4
    max_wait_ms: float = 5.0
    stall_items: int = 1000  # submits timed in figure 2
    stall_batch_ms: float = 100.0  # how long the batch in flight takes
    stall_repeats: int = 7
    stream_steps: int = 10  # steps each stream yields in figure 3's per-step rounds

    def __post_init__(self) -> None:
        counts = (self.rounds, self.items, self.batch_size, self.concurrent_batches, self.stall_items,
                  self.stall_repeats, self.stream_steps)
        if min(counts) < 1 or min(self.warmup, self.max_wait_ms, self.stall_batch_ms) < 0:
            raise ValueError(
                "overhead: counts and sizes must be >= 1; --warmup, --max-wait-ms, --stall-batch-ms >= 0")


QUICK = Settings(rounds=3, warmup=1, items=200, batch_size=20, stall_items=200, stall_batch_ms=20.0, stall_repeats=1,
                 stream_steps=3)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    defaults = Settings()
    parser.add_argument("--rounds", type=int, help=f"measured rounds (default {defaults.rounds})")
    parser.add_argument("--warmup", type=int, help=f"discarded warm-up rounds (default {defaults.warmup})")
    parser.add_argument("--items", type=int, help=f"submits per round (default {defaults.items})")
    parser.add_argument("--batch-size", type=int, help=f"max_batch_size (default {defaults.batch_size})")
    parser.add_argument(
        "--concurrent-batches", type=int, help=f"max_concurrent_batches (default {defaults.concurrent_batches})"
    )
    parser.add_argument("--max-wait-ms", type=float, help=f"max wait (default {defaults.max_wait_ms})")
    parser.add_argument("--stall-items", type=int, help=f"submits timed in figure 2 (default {defaults.stall_items})")
    parser.add_argument(
        "--stall-batch-ms", type=float, help=f"duration of the batch in flight (default {defaults.stall_batch_ms})"
    )
    parser.add_argument("--stall-repeats", type=int, help=f"figure 2 repetitions (default {defaults.stall_repeats})")
    parser.add_argument("--stream-steps", type=int,
                        help=f"steps per stream in figure 3 (default {defaults.stream_steps})")


def run(args: argparse.Namespace) -> dict[str, Any]:
    settings = chosen_settings(args, Settings(), QUICK)
    with serve_batch_outside_replica():
        per_item = asyncio.run(measure_per_item(settings))
        streaming = asyncio.run(measure_streaming(settings))
    stall = asyncio.run(measure_submission_stall(settings))
    data = {"settings": asdict(settings), "per_item": per_item, "submission_stall": stall, "streaming": streaming}
    return write_report("overhead", "Batching overhead", render(settings, per_item, stall, streaming), data,
                        getattr(args, "results_dir", None))


# ---- contenders ---------------------------------------------------------------------------------------------------


class NoopProcess:
    """Returns its inputs; counts calls and items so the contenders' work can be compared."""

    def __init__(self) -> None:
        self.batches = 0
        self.items = 0

    async def __call__(self, payloads: list[Any]) -> list[Any]:
        self.batches += 1
        self.items += len(payloads)
        return payloads


class SleepyProcess(NoopProcess):
    """Takes ``seconds`` per batch and says when a batch has started."""

    def __init__(self, seconds: float) -> None:
        super().__init__()
        self.seconds = seconds
        self.started = asyncio.Event()

    async def __call__(self, payloads: list[Any]) -> list[Any]:
        self.batches += 1
        self.items += len(payloads)
        self.started.set()
        await asyncio.sleep(self.seconds)
        return payloads


def serve_batch_submit(settings: Settings, process: NoopProcess) -> Submit:
    """A plain object with a ``@serve.batch`` method, decorated afresh so its queue belongs to this event loop."""
    return serve_batched(
        process,
        max_batch_size=settings.batch_size,
        batch_wait_timeout_s=settings.max_wait_ms / 1000,
        max_concurrent_batches=settings.concurrent_batches,
    )


def our_batcher(settings: Settings, process: NoopProcess) -> AdaptiveBatcher:
    config = BatcherConfig(
        max_batch_size=settings.batch_size,
        max_wait_ms=settings.max_wait_ms,
        max_concurrent_batches=settings.concurrent_batches,
        max_queue_depth=max(10_000, 2 * max(settings.items, settings.stall_items)),
    )
    return AdaptiveBatcher(process, config, name="bench-overhead")


def drop_in_submit(settings: Settings, process: NoopProcess) -> Submit:
    """A method batched by ``batching.batch`` with ``@serve.batch``'s settings, called the Serve way."""

    class Model:
        @batching.batch(max_batch_size=settings.batch_size, batch_wait_timeout_s=settings.max_wait_ms / 1000,
                        max_concurrent_batches=settings.concurrent_batches)
        async def handle(self, payloads: list[Any]) -> list[Any]:
            return await process(payloads)

    return Model().handle


def article_batcher(settings: Settings, process: NoopProcess) -> ArticleBatcher:
    return ArticleBatcher(process, max_batch_size=settings.batch_size, max_wait_ms=settings.max_wait_ms)


# ---- figure 1: per-item cost ---------------------------------------------------------------------------------------


async def timed_round(submit: Submit, payloads: list[int]) -> float:
    gc.collect()  # the previous contender's garbage is not this one's cost
    start = time.perf_counter()
    results = await asyncio.gather(*map(submit, payloads))
    elapsed = time.perf_counter() - start
    if results != payloads:
        raise RuntimeError("a contender returned results that do not match its inputs")
    await asyncio.sleep(0.001)  # let trailing callbacks (batch tasks finishing) run outside the next timing
    return elapsed


async def measure_per_item(settings: Settings) -> dict[str, Any]:
    processes = {key: NoopProcess() for key in LABELS}
    ours = our_batcher(settings, processes[OURS])
    article = article_batcher(settings, processes[ARTICLE])
    submits: dict[str, Submit] = {
        OURS: ours.submit,
        DROP_IN: drop_in_submit(settings, processes[DROP_IN]),
        SERVE: serve_batch_submit(settings, processes[SERVE]),
        ARTICLE: article.add,
    }
    payloads = list(range(settings.items))
    order = list(submits)
    per_item_s: dict[str, list[float]] = {key: [] for key in order}
    batches: dict[str, list[int]] = {key: [] for key in order}
    for round_no in range(settings.warmup + settings.rounds):
        shift = round_no % len(order)
        for key in order[shift:] + order[:shift]:
            before = processes[key].batches
            elapsed = await timed_round(submits[key], payloads)
            if round_no >= settings.warmup:
                per_item_s[key].append(elapsed / settings.items)
                batches[key].append(processes[key].batches - before)
    await ours.aclose()
    await submits[DROP_IN].aclose()  # type: ignore[attr-defined]
    await close_serve_batched(submits[SERVE])

    submitted = (settings.warmup + settings.rounds) * settings.items
    contenders = {}
    for key in order:
        micros = [s * 1e6 for s in per_item_s[key]]
        mean_batches = statistics.fmean(batches[key])
        contenders[key] = {
            "label": LABELS[key],
            "median_us": median(micros),
            "p10_us": percentile(micros, 10),
            "p90_us": percentile(micros, 90),
            "rounds_us": micros,
            "batches_per_round": mean_batches,
            "mean_batch_size": settings.items / mean_batches,
            "items_submitted": submitted,
            "items_processed": processes[key].items,
        }
    ratio = contenders[OURS]["median_us"] / contenders[SERVE]["median_us"]
    drop_in_ratio = contenders[DROP_IN]["median_us"] / contenders[SERVE]["median_us"]
    paired = median(o / s for o, s in zip(per_item_s[OURS], per_item_s[SERVE]))
    return {
        "contenders": contenders,
        "ratio_ours_to_serve_batch": ratio,
        "ratio_drop_in_to_serve_batch": drop_in_ratio,
        "paired_ratio_median": paired,
        "target_ratio": TARGET_RATIO,
        "target_met": max(ratio, drop_in_ratio) <= TARGET_RATIO,
        "ray_version": _ray_version(),
    }


# ---- figure 3: streaming handlers ---------------------------------------------------------------------------------


def streaming_handlers(settings: Settings, steps: int) -> dict[str, Callable[[Any], Any]]:
    """An async-generator method yielding its input ``steps`` times, batched by each decorator the Serve way."""
    from ray import serve

    def generator(decorator: Callable) -> Callable:
        return decorator(max_batch_size=settings.batch_size, batch_wait_timeout_s=settings.max_wait_ms / 1000,
                       max_concurrent_batches=settings.concurrent_batches)

    class Model:
        @generator(batching.batch)
        async def drop_in(self, payloads: list[Any]):
            for _ in range(steps):
                yield payloads

        @generator(serve.batch)
        async def serve_batch(self, payloads: list[Any]):
            for _ in range(steps):
                yield payloads

    model = Model()
    return {DROP_IN: model.drop_in, SERVE: model.serve_batch}


async def timed_stream_round(open_stream: Callable[[Any], Any], payloads: list[int], steps: int) -> float:
    async def read(payload: int) -> int:
        count = 0
        async for value in open_stream(payload):
            if value != payload:
                raise RuntimeError("a stream returned a value that does not match its input")
            count += 1
        return count

    gc.collect()
    start = time.perf_counter()
    counts = await asyncio.gather(*map(read, payloads))
    elapsed = time.perf_counter() - start
    if counts != [steps] * len(payloads):
        raise RuntimeError("a stream ended early")
    await asyncio.sleep(0.001)
    return elapsed


async def measure_streaming(settings: Settings) -> dict[str, Any]:
    payloads = list(range(settings.items))
    rows: dict[str, dict[str, Any]] = {}
    for steps, row in ((1, "per_item_us"), (settings.stream_steps, "per_step_us")):
        handlers = streaming_handlers(settings, steps)
        samples: dict[str, list[float]] = {key: [] for key in handlers}
        for round_no in range(settings.warmup + settings.rounds):
            for key in (list(handlers) if round_no % 2 == 0 else list(handlers)[::-1]):
                elapsed = await timed_stream_round(handlers[key], payloads, steps)
                if round_no >= settings.warmup:
                    samples[key].append(elapsed / (settings.items * steps) * 1e6)
        await handlers[DROP_IN].aclose()  # type: ignore[attr-defined]
        await close_serve_batched(handlers[SERVE])
        for key, micros in samples.items():
            rows.setdefault(key, {"label": LABELS[key]})[row] = median(micros)
    per_item = rows[DROP_IN]["per_item_us"] / rows[SERVE]["per_item_us"]
    per_step = rows[DROP_IN]["per_step_us"] / rows[SERVE]["per_step_us"]
    return {
        "contenders": rows,
        "steps": settings.stream_steps,
        "ratio_per_item": per_item,
        "ratio_per_step": per_step,
        "target_met": max(per_item, per_step) <= TARGET_RATIO,
    }


# ---- figure 2: submissions accepted while a batch is in flight ----------------------------------------------------


async def time_to_accept(
    submit: Submit, admitted: Callable[[], int], process: SleepyProcess, count: int
) -> tuple[float, int]:
    """Seconds until ``count`` new submits are accepted while one time-triggered batch is in flight.

    "Accepted" is the same observable for both batchers: the batcher's own count of items it has put in its queue
    (ours: ``stats().items``, bumped as an item is enqueued; the article's: ``total_items``, bumped right after the
    append, inside its lock). The observer polls it once per event-loop turn, so both are measured to one turn.
    Returns the time and how many batches ran, after every submit has its result.
    """
    process.started.clear()
    batches_before = process.batches
    first = asyncio.ensure_future(submit(-1))  # a lone item: it leaves on the time trigger
    await process.started.wait()
    target = admitted() + count
    start = time.perf_counter()
    tasks = [asyncio.ensure_future(submit(i)) for i in range(count)]
    while admitted() < target:
        if time.perf_counter() - start > _STALL_GIVE_UP_S:
            raise RuntimeError(f"submits not accepted after {_STALL_GIVE_UP_S} s")
        await asyncio.sleep(0)
    elapsed = time.perf_counter() - start
    results = await asyncio.gather(first, *tasks)
    if results != [-1, *range(count)]:
        raise RuntimeError("a contender returned results that do not match its inputs")
    return elapsed, process.batches - batches_before


async def measure_submission_stall(settings: Settings) -> dict[str, Any]:
    seconds = settings.stall_batch_ms / 1000
    processes = {OURS: SleepyProcess(seconds), ARTICLE: SleepyProcess(seconds)}
    ours = our_batcher(settings, processes[OURS])
    article = article_batcher(settings, processes[ARTICLE])
    probes: dict[str, tuple[Submit, Callable[[], int]]] = {
        OURS: (ours.submit, lambda: ours.stats().items),
        ARTICLE: (article.add, lambda: article.get_stats()["total_items"]),
    }
    samples: dict[str, list[float]] = {key: [] for key in probes}
    for repeat in range(settings.stall_repeats):
        for key in (list(probes) if repeat % 2 == 0 else list(probes)[::-1]):
            submit, admitted = probes[key]
            elapsed, _ = await time_to_accept(submit, admitted, processes[key], settings.stall_items)
            samples[key].append(elapsed * 1000)
    await ours.aclose()
    submitted = settings.stall_repeats * (settings.stall_items + 1)
    return {
        key: {
            "label": LABELS[key],
            "median_ms": median(values),
            "min_ms": min(values),
            "max_ms": max(values),
            "samples_ms": values,
            "items_submitted": submitted,
            "items_processed": processes[key].items,
        }
        for key, values in samples.items()
    }


# ---- report -------------------------------------------------------------------------------------------------------


def render(settings: Settings, per_item: dict[str, Any], stall: dict[str, Any], streaming: dict[str, Any]) -> str:
    contenders = per_item["contenders"]
    figure1 = markdown_table(
        ["contender", "median µs/item", "p10", "p90", "batches/round", "mean batch size"],
        [
            [
                c["label"],
                f"{c['median_us']:.2f}",
                f"{c['p10_us']:.2f}",
                f"{c['p90_us']:.2f}",
                f"{c['batches_per_round']:.1f}",
                f"{c['mean_batch_size']:.1f}",
            ]
            for c in contenders.values()
        ],
    )
    verdict = "met" if per_item["target_met"] else "NOT met"
    partial = ""
    if any(c["mean_batch_size"] < settings.batch_size for c in contenders.values()):
        partial = (
            "\nA mean batch size under max_batch_size means some batches left on the time trigger with fewer items:"
            " ours reads the clock at every submit, so when the process is descheduled in the middle of a round (a busy"
            " machine), the oldest item's wait can pass before all of the round's submits are in.\n"
        )
    figure3 = markdown_table(
        ["contender", "µs/item (1-step streams)", f"µs/step ({streaming['steps']}-step streams)"],
        [[c["label"], f"{c['per_item_us']:.2f}", f"{c['per_step_us']:.2f}"] for c in streaming["contenders"].values()],
    )
    stream_verdict = "met" if streaming["target_met"] else "NOT met"
    figure2 = markdown_table(
        ["contender", "median ms", "min ms", "max ms"],
        [[s["label"], f"{s['median_ms']:.2f}", f"{s['min_ms']:.2f}", f"{s['max_ms']:.2f}"] for s in stall.values()],
    )
    return f"""\
## Figure 1: per-item cost, no-op process function

{settings.items:,} concurrent single-item submits per round, max_batch_size {settings.batch_size}, \
max_concurrent_batches {settings.concurrent_batches} (the article's batcher has no limit), max wait \
{settings.max_wait_ms:g} ms (serve.batch: batch_wait_timeout_s); {settings.rounds} interleaved rounds after \
{settings.warmup} warm-up; ray {per_item['ray_version']}.

{figure1}
{partial}
ours / @serve.batch per item: {per_item['ratio_ours_to_serve_batch']:.2f} (median of per-round ratios \
{per_item['paired_ratio_median']:.2f}); the drop-in called the Serve way: \
{per_item['ratio_drop_in_to_serve_batch']:.2f}; \
target <= {per_item['target_ratio']:.2f}: **{verdict}**

## Figure 2: accepting {settings.stall_items:,} submissions while a {settings.stall_batch_ms:g} ms batch is in flight

Time from the first new submit until the batcher has queued all of them (its own enqueued-items counter), \
{settings.stall_repeats} repetition(s).

{figure2}

## Figure 3: streaming handlers, no-op async generator

{settings.items:,} concurrent callers per round, each reading its own stream; same settings as figure 1.

{figure3}

batching.batch / @serve.batch: {streaming['ratio_per_item']:.2f} per item, {streaming['ratio_per_step']:.2f} per \
step; target <= {TARGET_RATIO:.2f}: **{stream_verdict}**
"""


def _ray_version() -> str:
    import ray

    return ray.__version__

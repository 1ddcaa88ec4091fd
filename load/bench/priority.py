"""Priorities under a bulk flood: an interactive HIGH stream's latency with and without a LOW flood.

One ``AdaptiveBatcher`` serves two kinds of traffic: a HIGH stream of single items (Poisson, ``--high-rate``) for
``--high-seconds``, and a bulk flood of ``--flood-items`` texts sent by ``--flood-workers`` workers, each
submitting ``--flood-chunk`` texts at a time with ``submit_many`` (the shape of the bulk client, ``embed_bulk``).
Five cases, interleaved over ``--repeats``:

- (a) ``no-flood``: the HIGH stream alone.
- (b) ``flood-low``: the flood at LOW priority.
- (c) ``flood-fifo``: the flood at HIGH priority too: one FIFO lane, as a batcher without priorities would have.
- (d) ``flood-low-no-share``: as (b) with ``low_share`` 0, so LOW only ever takes slots HIGH leaves free: shows
  what the anti-starvation share costs HIGH.
- (e) ``flood-separate``: a control. The same flood goes through a second batcher of its own, so it shares the
  machine's CPU, this process's event loop and the upstream with the HIGH stream, but not the batcher's queue or
  concurrency slots. What (e) adds over (a) is the cost of the flood's load itself; what (b) adds over (e) is the
  cost of sharing one batcher.

The default flood has the shape of the bulk client's defaults (8 workers, 64 texts a request); ``--flood-chunk``
makes the LOW queue deeper.

HIGH latency is counted over the HIGH items that arrived while the flood was still running (all of them in (a));
the table shows the median over repeats of each run's percentile. Every vector, HIGH and flood, is checked against
``load.hashvec``.
"""

from __future__ import annotations

import argparse
import asyncio
import time
from dataclasses import dataclass
from functools import partial
from typing import Any

from batching import AdaptiveBatcher, BatcherConfig, Overloaded, Priority
from load.loadgen import RunResult, count_mismatches, open_loop, send_closed_loop
from load.stats import censored_median, finite_or_none, percentile
from load.strategies import Batched, Strategy, adaptive
from load.upstream import UpstreamConfig
from load.upstream_client import UpstreamClient
from load.workload import poisson_arrivals, pseudo_sentences

from .harness import (
    REPEATS, Disturbance, add_common_arguments, add_seed_argument, measure_scenario, rotated, run_strategy,
    version_line,
)
from .options import chosen_settings
from .report import markdown_table, write_report

CASES = {
    "no-flood": "(a) HIGH stream alone",
    "flood-low": "(b) flood at LOW priority",
    "flood-fifo": "(c) flood at HIGH priority (one FIFO lane)",
    "flood-low-no-share": "(d) as (b), LOW gets no share (low_share = 0)",
    "flood-separate": "(e) control: flood through its own batcher",
}
FLOOD_PRIORITY = {"no-flood": None, "flood-low": Priority.LOW, "flood-fifo": Priority.HIGH,
                  "flood-low-no-share": Priority.LOW, "flood-separate": Priority.LOW}
TARGET_RATIO = 1.5  # (b) HIGH P99 at most 1.5x (a)


@dataclass(frozen=True)
class Settings:
    flood_items: int = 20_000
    flood_workers: int = 8
    flood_chunk: int = 64
    high_rate: float = 40.0
    high_seconds: float = 4.0
    repeats: int = REPEATS
    stall_factor: float | None = BatcherConfig().stall_factor  # the library's default
    low_share: float = BatcherConfig().low_share
    mean_chars: int = 120
    seed: int = 0

    def __post_init__(self) -> None:
        if (min(self.flood_items, self.flood_workers, self.flood_chunk, self.repeats) < 1
                or min(self.high_rate, self.high_seconds) <= 0):
            raise ValueError("priority: counts must be >= 1, --high-rate and --high-seconds > 0")


QUICK = Settings(flood_items=600, flood_workers=4, flood_chunk=50, high_rate=40.0, high_seconds=0.5, repeats=1)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    defaults = Settings()
    add_common_arguments(parser, repeats=defaults.repeats, strategies=False)
    parser.add_argument("--flood-items", type=int, help=f"LOW texts in the flood (default {defaults.flood_items})")
    parser.add_argument("--flood-workers", type=int,
                        help=f"concurrent submit_many calls (default {defaults.flood_workers})")
    parser.add_argument("--flood-chunk", type=int, help=f"texts per submit_many (default {defaults.flood_chunk})")
    parser.add_argument("--high-rate", type=float, help=f"HIGH arrivals per second (default {defaults.high_rate:g})")
    parser.add_argument("--high-seconds", type=float, help=f"HIGH stream duration (default {defaults.high_seconds:g})")
    parser.add_argument("--stall-factor", type=_factor,
                        help=f"BatcherConfig.stall_factor, or 'none' (default {defaults.stall_factor})")
    parser.add_argument("--low-share", type=float,
                        help=f"BatcherConfig.low_share (default {defaults.low_share:g})")
    add_seed_argument(parser, defaults.seed)


def _factor(text: str) -> float | None:
    return None if text.strip().lower() == "none" else float(text)


def batcher_strategy(settings: Settings, case: str = "flood-low") -> Strategy:
    share = 0.0 if case == "flood-low-no-share" else settings.low_share
    return adaptive("adaptive", low_share=share, stall_factor=settings.stall_factor)


def run(args: argparse.Namespace) -> dict[str, Any]:
    settings = chosen_settings(args, Settings(), QUICK)
    strategy = batcher_strategy(settings)
    measured = measure_scenario(args, partial(measure, settings))
    table = summarise(measured.runs)
    ratio = _ratio(table["flood-low"]["high_p99_ms"], table["no-flood"]["high_p99_ms"])
    verdict = {"ratio_b_to_a": ratio, "target": TARGET_RATIO, "met": ratio is not None and ratio <= TARGET_RATIO}
    if "flood-separate" in table:
        verdict["ratio_e_to_a"] = _ratio(table["flood-separate"]["high_p99_ms"], table["no-flood"]["high_p99_ms"])
        verdict["ratio_b_to_e"] = _ratio(table["flood-low"]["high_p99_ms"], table["flood-separate"]["high_p99_ms"])
    body = render(settings, measured.upstream, strategy, table, verdict, measured.disturbance)
    data = {
        **measured.record(settings),
        "batcher": strategy.description,
        "table": table,
        "target": verdict,
        "runs": {case: [record for _, record in records] for case, records in measured.runs.items()},
    }
    return write_report("priority", "Priorities under a bulk flood", f"{version_line(measured.code)}\n\n{body}",
                        data, measured.results_dir)


def _ratio(numerator: float | None, denominator: float | None) -> float | None:
    return None if numerator is None or not denominator else numerator / denominator


async def measure(settings: Settings, root_url: str, dim: int,
                  disturbance: Disturbance = Disturbance()) -> dict[str, list]:
    offsets = poisson_arrivals(settings.high_rate, 1_000_000, settings.high_seconds, seed=settings.seed + 1)
    texts = pseudo_sentences(settings.flood_items + len(offsets), settings.mean_chars, settings.seed)
    high_texts, flood_texts = texts[: len(offsets)], texts[len(offsets):]
    runs: dict[str, list] = {case: [] for case in CASES}
    connections = max(256, 2 * settings.flood_workers)
    async with UpstreamClient(root_url, connections=connections) as client:
        for repeat in range(settings.repeats):
            for case in rotated(list(CASES), repeat):
                async def drive(running: Batched) -> RunResult:
                    flood = Flood(flood_texts, FLOOD_PRIORITY[case], settings)
                    result = await drive_case(running, flood, high_texts, offsets, settings,
                                              separate=case == "flood-separate")
                    result.extra["after_run"] = lambda: {
                        **flood.summary(dim), "high_during_flood": flood.high_latencies(result, offsets)}
                    return result

                result, record = await run_strategy(
                    batcher_strategy(settings, case), client, high_texts, drive, dim, disturbance)
                record["case"] = case
                runs[case].append((result, record))
                during = record["high_during_flood"]
                print(f"  priority repeat {repeat + 1}/{settings.repeats} {case:>10}: HIGH P50 {_ms(during['p50_ms'])} "
                      f"P99 {_ms(during['p99_ms'])} ms over {during['count']} items; flood "
                      f"{record['flood']['completed']}/{record['flood']['items']} "
                      f"in {record['flood']['seconds']:.2f} s; "
                      f"loop lag max {record['loop_lag'].get('max_ms', 0):.0f} ms "
                      f"(attempts {1 + len(record['discarded_attempts'])})",
                      flush=True)
    return runs


def _ms(value: float | None) -> str:
    return "  —  " if value is None else f"{value:6.1f}"


class Flood:
    """The bulk flood: workers take chunks in order and ``submit_many`` each, waiting out ``Overloaded``."""

    def __init__(self, texts: list[str], priority: Priority | None, settings: Settings) -> None:
        self.texts = texts if priority is not None else []
        self.priority = priority
        self.settings = settings
        self.vectors: list[Any] = [None] * len(self.texts)
        self.errors = 0
        self.overloaded = 0
        self.started = self.finished = 0.0
        self.mismatches = 0

    async def run(self, batcher: AdaptiveBatcher) -> None:
        chunk = self.settings.flood_chunk

        async def submit_chunk(index: int) -> None:
            start = index * chunk
            payloads = self.texts[start: start + chunk]
            while True:
                try:
                    outcomes = await batcher.submit_many(payloads, priority=self.priority, return_exceptions=True)
                    break
                except Overloaded as exc:
                    self.overloaded += 1
                    await asyncio.sleep(exc.retry_after_s)
            for offset, outcome in enumerate(outcomes):
                if isinstance(outcome, BaseException):
                    self.errors += 1
                else:
                    self.vectors[start + offset] = outcome

        self.started = time.perf_counter()
        await send_closed_loop(submit_chunk, self.settings.flood_workers, -(-len(self.texts) // chunk))
        self.finished = time.perf_counter()

    def high_latencies(self, result: RunResult, offsets: list[float]) -> dict[str, Any]:
        """HIGH percentiles over the items that arrived while the flood ran (every item when there is no flood)."""
        if not self.texts:
            latencies, missing = result.latencies_ms, result.submitted - result.completed
        else:
            window = self.finished - self.started
            arrived = [i for i, offset in enumerate(offsets[: result.submitted]) if offset <= window]
            latencies = [result.latency_of[i] for i in arrived if i in result.latency_of]
            missing = len(arrived) - len(latencies)
        return {
            "count": len(latencies) + missing,
            "latencies_ms": latencies,
            "missing": missing,
            "p50_ms": finite_or_none(percentile(latencies, 50, missing)),
            "p99_ms": finite_or_none(percentile(latencies, 99, missing)),
        }

    def summary(self, dim: int) -> dict[str, Any]:
        self.mismatches = count_mismatches(self.texts, self.vectors, dim)
        completed = sum(vector is not None for vector in self.vectors)
        seconds = self.finished - self.started if self.texts else 0.0
        return {"flood": {
            "items": len(self.texts), "completed": completed, "errors": self.errors, "mismatches": self.mismatches,
            "overloaded_retries": self.overloaded, "seconds": seconds,
            "items_per_s": completed / seconds if seconds else 0.0,
        }}


def _discarded(records: list, key: str) -> int:
    """``key`` of the floods of attempts discarded as disturbed (their correctness still counts)."""
    return sum(attempt["flood"][key] for _, record in records for attempt in record["discarded_attempts"]
               if "flood" in attempt)


async def drive_case(running: Batched, flood: Flood, high_texts: list[str], offsets: list[float],
                     settings: Settings, separate: bool = False) -> RunResult:
    """The HIGH stream through ``running``'s batcher while the flood runs (through its own batcher if ``separate``)."""
    flood_batcher = (AdaptiveBatcher(running.embed_batch, running.batcher.config, name="bench-flood")
                     if separate else running.batcher)
    flood_task = asyncio.ensure_future(flood.run(flood_batcher))
    try:
        high = await open_loop(running.embed, high_texts, offsets, cap_s=settings.high_seconds + 30.0)
    finally:
        await flood_task
        if separate:
            await flood_batcher.aclose()
    return high


def summarise(runs: dict[str, list]) -> dict[str, dict[str, Any]]:
    table = {}
    for case, records in runs.items():
        latencies = [value for _, record in records for value in record["high_during_flood"]["latencies_ms"]]
        missing = sum(record["high_during_flood"]["missing"] for _, record in records)
        flood = [record["flood"] for _, record in records]
        per_run = [record["high_during_flood"] for _, record in records]
        table[case] = {
            "high_items": len(latencies) + missing,
            "high_p50_ms": censored_median(run["p50_ms"] for run in per_run),
            "high_p99_ms": censored_median(run["p99_ms"] for run in per_run),
            "high_p99_runs_ms": [run["p99_ms"] for run in per_run],
            "high_p50_pooled_ms": finite_or_none(percentile(latencies, 50, missing)),
            "high_p99_pooled_ms": finite_or_none(percentile(latencies, 99, missing)),
            "high_max_ms": max(latencies) if latencies else None,
            "high_errors": sum(record["errors_all_attempts"] for _, record in records),
            "high_mismatches": sum(record["mismatches_all_attempts"] for _, record in records),
            "attempts": sum(1 + len(record["discarded_attempts"]) for _, record in records),
            "high_completed": sum(result.completed for result, _ in records),
            "high_submitted": sum(result.submitted for result, _ in records),
            "flood_items": sum(f["items"] for f in flood),
            "flood_completed": sum(f["completed"] for f in flood),
            "flood_errors": sum(f["errors"] for f in flood) + _discarded(records, "errors"),
            "flood_mismatches": sum(f["mismatches"] for f in flood) + _discarded(records, "mismatches"),
            "flood_seconds": [f["seconds"] for f in flood],
            "flood_items_per_s": [f["items_per_s"] for f in flood],
            "upstream_calls": sum(record["upstream_calls"] for _, record in records),
            "items_billed": sum(record["items_billed"] for _, record in records),
        }
    for record_list in runs.values():
        for _, record in record_list:
            record["high_during_flood"].pop("latencies_ms", None)
    return table


def render(settings: Settings, upstream: UpstreamConfig, strategy: Strategy, table: dict[str, Any],
           verdict: dict[str, Any], disturbance: Disturbance) -> str:
    attempts = sum(row["attempts"] for row in table.values())
    base = table["no-flood"]["high_p99_ms"]
    rows = []
    for case, row in table.items():
        ratio = _ratio(row["high_p99_ms"], base)
        flood_rate = (f"{sum(row['flood_items_per_s']) / len(row['flood_items_per_s']):,.0f}"
                      if row["flood_items"] else "—")
        rows.append([
            CASES[case], row["high_items"], _fmt(row["high_p50_ms"]), _fmt(row["high_p99_ms"]),
            "—" if ratio is None else f"{ratio:.2f}×", " / ".join(_fmt(v) for v in row["high_p99_runs_ms"]),
            _fmt(row["high_p99_pooled_ms"]),
            f"{row['high_completed']}/{row['high_submitted']}",
            f"{row['flood_completed']}/{row['flood_items']}" if row["flood_items"] else "—", flood_rate,
            row["upstream_calls"], row["high_errors"] + row["flood_errors"],
            row["high_mismatches"] + row["flood_mismatches"],
        ])
    table_md = markdown_table(
        ["case", "HIGH items (during flood)", "HIGH P50 ms", "HIGH P99 ms", "P99 vs (a)", "P99 of each run",
         "P99 pooled", "HIGH done",
         "flood done", "flood items/s", "upstream calls", "errors", "mismatches"], rows)
    met = "met" if verdict["met"] else "**not met**"
    shown = "—" if verdict["ratio_b_to_a"] is None else f"{verdict['ratio_b_to_a']:.2f}×"
    return f"""\
HIGH: Poisson {settings.high_rate:g}/s single items for {settings.high_seconds:g} s. Flood: {settings.flood_items:,} \
texts, {settings.flood_workers} workers × submit_many of {settings.flood_chunk}. {settings.repeats} interleaved \
repeat(s); HIGH P50/P99 are the median over runs of each run's percentile (pooled P99 beside). Batcher: \
{strategy.description} ((d): low_share = 0). Upstream in its own process: base \
{upstream.base_latency_ms:g} ms + {upstream.per_token_ms:g} ms/token, jitter {upstream.jitter:g}, provider \
concurrency {upstream.max_concurrency}. A run during which the load generator's event loop stalled more than \
{disturbance.max_loop_lag_ms:g} ms (the machine is shared) was tried up to {disturbance.attempts} times and the \
calmest attempt kept ({attempts} runs made for {settings.repeats * len(table)} kept).

{table_md}

Target: HIGH P99 with the LOW flood ≤ {TARGET_RATIO:g}× its P99 with no flood: {met} ({shown}).
{_control_note(verdict)}"""


def _control_note(verdict: dict[str, Any]) -> str:
    e_to_a, b_to_e = verdict.get("ratio_e_to_a"), verdict.get("ratio_b_to_e")
    if e_to_a is None or b_to_e is None:
        return ""
    return (f"\nControl (e): the flood's load alone, through a batcher of its own, takes HIGH P99 to "
            f"{e_to_a:.2f}× (a); "
            f"sharing one batcher with it, (b), is {b_to_e:.2f}× (e).\n")


def _fmt(value: float | None) -> str:
    return "—" if value is None else f"{value:.1f}"

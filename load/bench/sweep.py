"""Open-loop load sweep: Poisson arrivals from idle to past saturation, every strategy at every rate.

At each offered rate, texts arrive as a Poisson process (the same arrival times and texts for every strategy) for
at most ``--max-items`` items or ``--max-seconds``, whichever comes first. Latency counts from each item's scheduled
arrival. A run stops ``--drain-seconds`` after its last arrival: what has not completed by then is cancelled and
reported as backlog, and counts as infinitely late in the percentiles (a P99 shown as "> cap" means more than 1% of
the items were still waiting). Strategies run interleaved at each rate (the order rotates every run). Writes
``sweep.md``/``sweep.json`` and two plots: P99 and upstream calls per item against offered load.
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

from load.loadgen import RunResult, open_loop
from load.stats import censored_median, finite_or_none, median, percentile
from load.strategies import Strategy
from load.upstream import UpstreamConfig
from load.upstream_client import UpstreamClient
from load.workload import poisson_arrivals, pseudo_sentences

from .harness import (
    REPEATS, Disturbance, add_common_arguments, add_seed_argument, chosen_strategies, measure_scenario, rotated,
    run_strategy, version_line,
)
from .options import chosen_settings
from .report import markdown_table, write_report

FIXED = ("fixed-50/50ms", "fixed-100/100ms", "serve.batch-200/25ms")
TARGET_NEAR_BEST_FIXED = 1.10  # adaptive P99 at most 10% above the best fixed strategy's, at every rate
TARGET_FIXED_WORSE = 2.0  # every fixed strategy at least 2x adaptive's P99 at some rate


@dataclass(frozen=True)
class Settings:
    rates: tuple[float, ...] = (10, 50, 100, 200, 400, 800, 1600, 3200, 4800)
    max_items: int = 8000  # at high rates a run must last seconds, or saturation never shows
    max_seconds: float = 4.0
    drain_seconds: float = 3.0
    repeats: int = REPEATS
    mean_chars: int = 120
    seed: int = 0

    def __post_init__(self) -> None:
        if (not self.rates or min(self.rates) <= 0 or min(self.max_items, self.repeats) < 1
                or min(self.max_seconds, self.drain_seconds) <= 0):
            raise ValueError("sweep: rates and times must be > 0, --max-items and --repeats >= 1")


QUICK = Settings(rates=(50, 400), max_items=40, max_seconds=0.3, drain_seconds=10.0, repeats=1)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    defaults = Settings()
    add_common_arguments(parser, repeats=defaults.repeats)
    parser.add_argument("--rates", type=lambda text: tuple(float(r) for r in text.split(",")),
                        help="offered rates, items/s, comma-separated "
                             f"(default {','.join(f'{r:g}' for r in defaults.rates)})")
    parser.add_argument("--max-items", type=int, help=f"arrivals per rate at most (default {defaults.max_items})")
    parser.add_argument("--max-seconds", type=float,
                        help=f"arrival window per rate at most (default {defaults.max_seconds})")
    parser.add_argument("--drain-seconds", type=float,
                        help=f"how long after the last arrival a run may finish (default {defaults.drain_seconds})")
    add_seed_argument(parser, defaults.seed, "workload and arrival")


def run(args: argparse.Namespace) -> dict[str, Any]:
    settings = chosen_settings(args, Settings(), QUICK)
    strategies = chosen_strategies(args)
    measured = measure_scenario(args, partial(measure, settings, strategies))
    table = summarise(settings, strategies, measured.runs)
    verdicts = judge(settings, table)
    plots = plot(settings, strategies, table, measured.results_dir)
    body = render(settings, measured.upstream, strategies, table, verdicts, plots, measured.disturbance)
    data = {
        **measured.record(settings),
        "strategies": {s.name: s.description for s in strategies},
        "table": table,
        "targets": verdicts,
        "plots": [path.name for path in plots],
        "runs": {f"{rate:g}": {name: [r for _, r in runs] for name, runs in per.items()}
                 for rate, per in measured.runs.items()},
    }
    return write_report("sweep", "Load sweep: open-loop Poisson arrivals", f"{version_line(measured.code)}\n\n{body}",
                        data, measured.results_dir, also_written=plots)


Runs = dict[float, dict[str, list[tuple[RunResult, dict[str, Any]]]]]


async def measure(settings: Settings, strategies: list[Strategy], root_url: str, dim: int,
                  disturbance: Disturbance = Disturbance()) -> Runs:
    texts = pseudo_sentences(settings.max_items, settings.mean_chars, settings.seed)
    results: Runs = {}
    turn = 0
    async with UpstreamClient(root_url, connections=256) as client:
        for rate in settings.rates:
            offsets = poisson_arrivals(rate, settings.max_items, settings.max_seconds, seed=settings.seed + int(rate))
            if not offsets:
                continue
            rate_texts = texts[: len(offsets)]
            cap_s = offsets[-1] + settings.drain_seconds
            per: dict[str, list[tuple[RunResult, dict[str, Any]]]] = {s.name: [] for s in strategies}
            for _ in range(settings.repeats):
                for strategy in rotated(strategies, turn):
                    result, record = await run_strategy(
                        strategy, client, rate_texts,
                        lambda running: open_loop(running.embed, rate_texts, offsets, cap_s), dim, disturbance,
                    )
                    per[strategy.name].append((result, record))
                    p99 = record["p99_ms"]
                    print(f"  sweep {rate:6g}/s {strategy.name:>22}: "
                          f"{record['completed']:5d}/{record['submitted']} done, "
                          f"{record['items_per_s']:7.0f} items/s, P50 {_ms(record['p50_ms'])}, P99 {_ms(p99)}, "
                          f"calls {record['upstream_calls']}, "
                          f"loop lag max {record['loop_lag'].get('max_ms', 0):.0f} ms "
                          f"(attempts {1 + len(record['discarded_attempts'])})",
                          flush=True)
                turn += 1
            results[rate] = per
    return results


def _ms(value: float | None) -> str:
    return "   > cap" if value is None else f"{value:8.1f}"


def summarise(settings: Settings, strategies: list[Strategy], results: Runs) -> dict[str, dict[str, Any]]:
    """Per rate and strategy: the median over repeats of each run's P50, P99 and throughput; counts summed.

    The median of per-run figures keeps one run disturbed by the shared machine from setting the result; the P99 of
    all repeats' latencies pooled is kept beside it.
    """
    table: dict[str, dict[str, Any]] = {}
    for rate, per in results.items():
        row: dict[str, Any] = {}
        for strategy in strategies:
            runs = per[strategy.name]
            latencies = [value for result, _ in runs for value in result.latencies_ms]
            submitted = sum(result.submitted for result, _ in runs)
            completed = sum(result.completed for result, _ in runs)
            calls = sum(record["upstream_calls"] for _, record in runs)
            row[strategy.name] = {
                "submitted": submitted,
                "completed": completed,
                "backlog": sum(result.backlog for result, _ in runs),
                "errors": sum(record["errors_all_attempts"] for _, record in runs),
                "mismatches": sum(record["mismatches_all_attempts"] for _, record in runs),
                "attempts": sum(1 + len(record["discarded_attempts"]) for _, record in runs),
                "items_per_s": median(result.throughput for result, _ in runs),
                "p50_ms": censored_median(result.percentile_ms(50) for result, _ in runs),
                "p99_ms": censored_median(result.percentile_ms(99) for result, _ in runs),
                "p99_runs_ms": [finite_or_none(result.percentile_ms(99)) for result, _ in runs],
                "p99_pooled_ms": finite_or_none(percentile(latencies, 99, submitted - completed)),
                "upstream_calls": calls,
                "items_billed": sum(record["items_billed"] for _, record in runs),
                "calls_per_item": calls / completed if completed else None,
                "cap_ms": max(result.elapsed_s for result, _ in runs) * 1000 if runs else None,
                "loadgen_cpu_share": max(result.cpu_s / result.elapsed_s for result, _ in runs if result.elapsed_s),
                "loop_lag_max_ms": max(record["loop_lag"].get("max_ms", 0.0) for _, record in runs),
            }
        table[f"{rate:g}"] = row
    return table


def _p99(cell: dict[str, Any]) -> float:
    return math.inf if cell["p99_ms"] is None else cell["p99_ms"]


def judge(settings: Settings, table: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The sweep targets for every adaptive variant (reported, never asserted)."""
    variants: dict[str, Any] = {}
    names = next(iter(table.values())).keys() if table else []
    fixed_names = [name for name in FIXED if name in names]
    for name in names:
        if not name.startswith("adaptive") or not fixed_names:
            continue
        per_rate = {}
        for rate, row in table.items():
            best_name = min(fixed_names, key=lambda n: (_p99(row[n]), -row[n]["completed"]))
            ours, best = _p99(row[name]), _p99(row[best_name])
            if math.isinf(ours) and math.isinf(best):
                ratio = row[best_name]["completed"] / max(1, row[name]["completed"])  # both capped: compare work done
            else:
                ratio = ours / best
            per_rate[rate] = {"best_fixed": best_name, "ratio": ratio, "met": ratio <= TARGET_NEAR_BEST_FIXED}
        worse = {}
        for fixed_name in fixed_names:
            ratios = {rate: _p99(row[fixed_name]) / _p99(row[name]) if not math.isinf(_p99(row[name])) else 0.0
                      for rate, row in table.items()}
            rate_of_max = max(ratios, key=ratios.get)
            worse[fixed_name] = {"max_ratio": ratios[rate_of_max], "at_rate": rate_of_max,
                                 "met": ratios[rate_of_max] >= TARGET_FIXED_WORSE}
        variants[name] = {
            "near_best_fixed": per_rate,
            "near_best_fixed_met": all(check["met"] for check in per_rate.values()),
            "fixed_worse": worse,
            "fixed_worse_met": all(check["met"] for check in worse.values()),
        }
    return variants


def plot(
    settings: Settings, strategies: list[Strategy], table: dict[str, dict[str, Any]], directory: Path
) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    directory.mkdir(parents=True, exist_ok=True)
    rates = [float(rate) for rate in table]
    paths = []
    for key, ylabel, filename in (
        ("p99_ms", "P99 latency (ms)", "sweep_p99.png"),
        ("calls_per_item", "upstream calls per item", "sweep_calls.png"),
    ):
        figure, axes = plt.subplots(figsize=(8, 5))
        for index, strategy in enumerate(strategies):
            cells = [table[f"{rate:g}"][strategy.name] for rate in rates]
            style = "-" if strategy.name.startswith("adaptive") else "--"
            values = [cell[key] for cell in cells]
            line, = axes.plot([r for r, v in zip(rates, values) if v is not None],
                              [v for v in values if v is not None], style, marker="o", label=strategy.name)
            if key == "p99_ms":
                capped = [(rate, cell["cap_ms"]) for rate, cell in zip(rates, cells) if cell["p99_ms"] is None]
                if capped:
                    axes.plot(*zip(*capped), linestyle="none", marker="^", color=line.get_color())
        axes.set_xscale("log")
        axes.set_yscale("log")
        axes.set_xlabel("offered load (items/s)")
        axes.set_ylabel(ylabel)
        if key == "p99_ms":
            axes.set_title("P99 vs offered load (▲ = run capped with backlog; P99 above the cap)")
        else:
            axes.set_title("Upstream calls per item vs offered load")
        axes.grid(True, which="both", alpha=0.3)
        axes.legend(fontsize=8)
        figure.tight_layout()
        path = directory / filename
        figure.savefig(path, dpi=110)
        plt.close(figure)
        paths.append(path)
    return paths


def render(settings: Settings, upstream: UpstreamConfig, strategies: list[Strategy], table: dict[str, dict[str, Any]],
           verdicts: dict[str, Any], plots: list[Path], disturbance: Disturbance) -> str:
    attempts = sum(cell["attempts"] for row in table.values() for cell in row.values())
    runs = settings.repeats * sum(len(row) for row in table.values())
    sections = []
    for rate, row in table.items():
        rows = []
        for name, cell in row.items():
            p99 = "> cap" if cell["p99_ms"] is None else f"{cell['p99_ms']:.1f}"
            p50 = "> cap" if cell["p50_ms"] is None else f"{cell['p50_ms']:.1f}"
            rows.append([name, f"{cell['completed']}/{cell['submitted']}", cell["backlog"],
                         f"{cell['items_per_s']:.0f}",
                         p50, p99, cell["upstream_calls"],
                         "—" if cell["calls_per_item"] is None else f"{cell['calls_per_item']:.3f}",
                         " / ".join("> cap" if v is None else f"{v:.0f}" for v in cell["p99_runs_ms"]),
                         f"{cell['loop_lag_max_ms']:.0f}", cell["errors"], cell["mismatches"]])
        sections.append(f"### {rate} items/s offered\n\n" + markdown_table(
            ["strategy", "completed", "backlog", "items/s", "P50 ms", "P99 ms", "calls", "calls/item",
             "P99 of each run", "max loop lag ms", "errors", "mismatches"], rows))
    p99_rows = [[name] + [("> cap" if table[rate][name]["p99_ms"] is None else f"{table[rate][name]['p99_ms']:.0f}")
                          for rate in table] for name in (s.name for s in strategies)]
    overview = markdown_table(["P99 ms at offered items/s →", *table.keys()], p99_rows)
    p50_rows = [[name] + [("> cap" if table[rate][name]["p50_ms"] is None else f"{table[rate][name]['p50_ms']:.0f}")
                          for rate in table] for name in (s.name for s in strategies)]
    overview_p50 = markdown_table(["P50 ms at offered items/s →", *table.keys()], p50_rows)
    calls_rows = [[name] + ["—" if table[rate][name]["calls_per_item"] is None
                            else f"{table[rate][name]['calls_per_item']:.3f}" for rate in table]
                  for name in (s.name for s in strategies)]
    overview_calls = markdown_table(["upstream calls per item at offered items/s →", *table.keys()], calls_rows)
    target_rows = []
    for name, verdict in verdicts.items():
        worst = max(verdict["near_best_fixed"].items(), key=lambda kv: kv[1]["ratio"])
        misses = [f"{rate}/s ({check['ratio']:.2f}× {check['best_fixed']})"
                  for rate, check in verdict["near_best_fixed"].items() if not check["met"]]
        worse = "; ".join(f"{fixed}: {check['max_ratio']:.1f}× at {check['at_rate']}/s"
                          for fixed, check in verdict["fixed_worse"].items())
        target_rows.append([
            name,
            ("met" if verdict["near_best_fixed_met"] else "**not met**")
            + f": worst {worst[1]['ratio']:.2f}× at {worst[0]}/s"
            + (f"; misses {', '.join(misses)}" if misses else ""),
            ("met" if verdict["fixed_worse_met"] else "**not met**") + f": {worse}",
        ])
    targets = markdown_table(
        ["variant", f"P99 ≤ {TARGET_NEAR_BEST_FIXED:.2f}× best fixed at every rate",
         f"every fixed ≥ {TARGET_FIXED_WORSE:g}× adaptive's P99 at some rate"], target_rows)
    cpu = max(cell["loadgen_cpu_share"] for row in table.values() for cell in row.values())
    described = "\n".join(f"- `{s.name}`: {s.description}" for s in strategies)
    images = "\n".join(f"![{path.stem}]({path.name})" for path in plots)
    return f"""\
Poisson arrivals at {', '.join(table)} items/s; each rate for at most {settings.max_items:,} items or \
{settings.max_seconds:g} s, then up to {settings.drain_seconds:g} s to finish; {settings.repeats} run(s) per \
strategy and rate, interleaved; P50, P99 and items/s are the median over the runs (each run's own percentile). \
Upstream in its own process: base {upstream.base_latency_ms:g} ms + \
{upstream.per_token_ms:g} ms/token, jitter {upstream.jitter:g}, provider concurrency {upstream.max_concurrency}. \
Load generator CPU: at most {cpu:.0%} of one core in any run. A run during which the load generator's event loop \
stalled more than {disturbance.max_loop_lag_ms:g} ms (the machine is shared) was tried up to {disturbance.attempts} \
times and the calmest attempt kept ({attempts} runs made for {runs} kept). "> cap": more than 1% (P99) or 50% (P50) \
of the items \
had not completed when the run was capped.

{overview}

{overview_p50}

{overview_calls}

{images}

## Targets

"Best fixed" at a rate is whichever of {', '.join(FIXED)} has the lowest P99 there.

{targets}

## Every rate

{(chr(10) * 2).join(sections)}

Strategies:
{described}
"""

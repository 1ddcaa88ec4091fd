"""The article's §6 experiment: 1,000 texts, 50 closed-loop callers, every strategy on the same upstream.

Each of the 50 callers embeds one text, waits for its vector, then takes the next, until the 1,000 texts
(deterministic pseudo-sentences averaging ~120 characters) are done. Every strategy runs ``--repeats`` times,
interleaved (the order rotates every repeat), against one simulated upstream in its own process; the table shows
the median of the repeats. Every vector is checked against ``load.hashvec``. The article's own figures are
printed beside ours for reference.
"""

from __future__ import annotations

import argparse
import statistics
from dataclasses import dataclass
from functools import partial
from typing import Any

from load.loadgen import closed_loop
from load.stats import median, median_of
from load.strategies import MAX_BATCH, MAX_WAIT_MS, SCALE_FACTOR, Strategy
from load.upstream import UpstreamConfig
from load.upstream_client import UpstreamClient
from load.workload import pseudo_sentences

from .harness import (
    REPEATS, Disturbance, add_common_arguments, add_seed_argument, chosen_strategies, measure_scenario, rotated,
    run_strategy, version_line,
)
from .options import chosen_settings
from .report import markdown_table, write_report

# The article's §6 table: strategy -> (items/s, P50 ms, P99 ms, upstream calls).
ARTICLE_ROWS = {
    "none": ("220", "45", "95", "1000"),
    "fixed-50/50ms": ("580", "52", "108", "20"),
    "fixed-100/100ms": ("820", "102", "215", "10"),
    "adaptive": ("1650", "30", "128", "6-8"),
}
FIXED = ("fixed-50/50ms", "fixed-100/100ms", "serve.batch-200/25ms")
TARGET_SPEEDUP = 5.0
TARGET_P99_MS = 150.0
TARGET_CALL_SHARE = 0.02
TARGET_NEAR_BEST_FIXED = 0.95


@dataclass(frozen=True)
class Settings:
    texts: int = 1000
    mean_chars: int = 120
    callers: int = 50
    repeats: int = REPEATS
    seed: int = 0

    def __post_init__(self) -> None:
        if min(self.texts, self.callers, self.repeats) < 1 or self.mean_chars < 2:
            raise ValueError("seed-table: --texts, --callers, --repeats must be >= 1, --mean-chars >= 2")


QUICK = Settings(texts=120, callers=10, repeats=1)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    defaults = Settings()
    add_common_arguments(parser, repeats=defaults.repeats)
    parser.add_argument("--texts", type=int, help=f"texts to embed (default {defaults.texts})")
    parser.add_argument("--callers", type=int, help=f"closed-loop callers (default {defaults.callers})")
    parser.add_argument("--mean-chars", type=int, help=f"mean text length (default {defaults.mean_chars})")
    add_seed_argument(parser, defaults.seed)


def run(args: argparse.Namespace) -> dict[str, Any]:
    settings = chosen_settings(args, Settings(), QUICK)
    strategies = chosen_strategies(args)
    measured = measure_scenario(args, partial(measure, settings, strategies))
    rows = summarise(measured.runs)
    verdicts = judge(rows, settings, measured.upstream)
    body = render(settings, measured.upstream, strategies, rows, verdicts, measured.disturbance)
    data = {
        **measured.record(settings),
        "strategies": {s.name: s.description for s in strategies},
        "rows": rows,
        "targets": verdicts,
        "runs": measured.runs,
    }
    return write_report("seed_table", "Seed table: the article's §6 experiment",
                        f"{version_line(measured.code)}\n\n{body}", data, measured.results_dir)


async def measure(
    settings: Settings, strategies: list[Strategy], root_url: str, dim: int, disturbance: Disturbance = Disturbance()
) -> dict[str, list[dict[str, Any]]]:
    texts = pseudo_sentences(settings.texts, settings.mean_chars, settings.seed)
    runs: dict[str, list[dict[str, Any]]] = {s.name: [] for s in strategies}
    async with UpstreamClient(root_url, connections=max(256, 2 * settings.callers)) as client:
        for repeat in range(settings.repeats):
            for strategy in rotated(strategies, repeat):
                _, record = await run_strategy(
                    strategy, client, texts, lambda running: closed_loop(running.embed, texts, settings.callers), dim,
                    disturbance,
                )
                record["repeat"] = repeat
                runs[strategy.name].append(record)
                print(f"  seed-table repeat {repeat + 1}/{settings.repeats} {strategy.name:>22}: "
                      f"{record['items_per_s']:7.0f} items/s  P50 {record['p50_ms']:6.1f}  P99 {record['p99_ms']:6.1f} "
                      f"ms  calls {record['upstream_calls']}  "
                      f"loop lag max {record['loop_lag'].get('max_ms', 0):.0f} ms "
                      f"(attempts {1 + len(record['discarded_attempts'])})", flush=True)
    return runs


def summarise(runs: dict[str, list[dict[str, Any]]]) -> dict[str, dict[str, Any]]:
    """Per strategy: the median of the repeats, and totals of what must be zero."""
    rows = {}
    for name, records in runs.items():
        rows[name] = {
            "items_per_s": median_of(records, "items_per_s"),
            "p50_ms": median_of(records, "p50_ms"),
            "p99_ms": median_of(records, "p99_ms"),
            "upstream_calls": median_of(records, "upstream_calls"),
            "items_billed": median_of(records, "items_billed"),
            "mean_batch": median_of(records, "upstream_mean_batch"),
            "loadgen_cpu_share": median(r["cpu_s"] / r["elapsed_s"] for r in records if r["elapsed_s"]),
            "submitted": sum(r["submitted"] for r in records),
            "completed": sum(r["completed"] for r in records),
            "errors": sum(r["errors_all_attempts"] for r in records),
            "mismatches": sum(r["mismatches_all_attempts"] for r in records),
            "attempts": sum(1 + len(r["discarded_attempts"]) for r in records),
            "repeats": len(records),
            "flushes": _flushes(records),
        }
    return rows


def _flushes(records: list[dict[str, Any]]) -> dict[str, int]:
    total: dict[str, int] = {}
    for record in records:
        for reason, count in record["batcher"].get("flushes", {}).items():
            total[reason] = total.get(reason, 0) + count
    return total


def closed_loop_bound(settings: Settings, upstream: UpstreamConfig, tokens_per_text: float) -> float:
    """Items/s if every round of ``callers`` items went out at once in one call and nothing else took time."""
    mean_factor = 2.718281828 ** (upstream.jitter ** 2 / 2)  # mean of the lognormal latency factor
    call_ms = (upstream.base_latency_ms + upstream.per_token_ms * tokens_per_text * settings.callers) * mean_factor
    return settings.callers / (call_ms / 1000) if call_ms > 0 else float("inf")


def judge(rows: dict[str, dict[str, Any]], settings: Settings, upstream: UpstreamConfig) -> dict[str, Any]:
    """The seed-table targets for every adaptive variant (reported, never asserted)."""
    none = rows.get("none")
    fixed = {name: rows[name] for name in FIXED if name in rows}
    best_fixed_name = max(fixed, key=lambda n: fixed[n]["items_per_s"]) if fixed else None
    from load.upstream import cl100k

    texts = pseudo_sentences(settings.texts, settings.mean_chars, settings.seed)
    tokens = statistics.fmean(len(cl100k().encode_ordinary(text)) for text in texts)
    bound = closed_loop_bound(settings, upstream, tokens)
    verdicts: dict[str, Any] = {
        "best_fixed": best_fixed_name,
        "tokens_per_text": tokens,
        "closed_loop_bound_items_per_s": bound,
        "bound_speedup_over_none": bound / none["items_per_s"] if none else None,
        "variants": {},
    }
    for name, row in rows.items():
        if not name.startswith("adaptive"):
            continue
        checks: dict[str, Any] = {}
        if none:
            speedup = row["items_per_s"] / none["items_per_s"]
            checks["speedup_over_none"] = {"value": speedup, "target": TARGET_SPEEDUP, "met": speedup >= TARGET_SPEEDUP,
                                           "share_of_bound": row["items_per_s"] / bound}
        checks["p99_ms"] = {"value": row["p99_ms"], "target": TARGET_P99_MS, "met": row["p99_ms"] < TARGET_P99_MS}
        share = row["upstream_calls"] / (row["completed"] / row["repeats"])
        checks["call_share"] = {"value": share, "target": TARGET_CALL_SHARE, "met": share <= TARGET_CALL_SHARE}
        if best_fixed_name:
            best = fixed[best_fixed_name]
            ratio = row["items_per_s"] / best["items_per_s"]
            met = ratio >= TARGET_NEAR_BEST_FIXED and row["p99_ms"] <= best["p99_ms"]
            checks["vs_best_fixed"] = {"value": ratio, "target": TARGET_NEAR_BEST_FIXED, "met": met,
                                       "p99_ms": row["p99_ms"], "best_fixed_p99_ms": best["p99_ms"]}
        verdicts["variants"][name] = checks
    return verdicts


def _fmt(value: float | None, digits: int = 0) -> str:
    return "—" if value is None else f"{value:,.{digits}f}"


def _shown(key: str, check: dict[str, Any]) -> str:
    value = check["value"]
    if key == "speedup_over_none":
        return f"{value:.2f}× ({check['share_of_bound']:.0%} of the bound)"
    if key == "p99_ms":
        return f"{value:.1f} ms"
    if key == "call_share":
        return f"{value:.1%}"
    return f"{value:.1%}, P99 {check['p99_ms']:.1f} vs {check['best_fixed_p99_ms']:.1f} ms"


def _bound_note(verdicts: dict[str, Any]) -> str:
    speedup = verdicts["bound_speedup_over_none"]
    if speedup is None or speedup >= TARGET_SPEEDUP:
        return ""
    return (f' "≥ {TARGET_SPEEDUP:g}× none" is therefore out of reach for every strategy here: the limit is the '
            "upstream's own latency per call, not the batcher.")


def render(settings: Settings, upstream: UpstreamConfig, strategies: list[Strategy], rows: dict[str, Any],
           verdicts: dict[str, Any], disturbance: Disturbance) -> str:
    attempts = sum(row["attempts"] for row in rows.values())
    runs = sum(row["repeats"] for row in rows.values())
    table = markdown_table(
        ["strategy", "items/s", "P50 ms", "P99 ms", "upstream calls", "items billed", "mean batch", "flushes",
         "errors", "mismatches", "article: items/s", "P50", "P99", "calls"],
        [
            [
                name, _fmt(row["items_per_s"]), _fmt(row["p50_ms"], 1), _fmt(row["p99_ms"], 1),
                _fmt(row["upstream_calls"]), _fmt(row["items_billed"]), _fmt(row["mean_batch"], 1),
                " ".join(f"{k}:{v}" for k, v in sorted(row["flushes"].items())) or "—",
                row["errors"], row["mismatches"], *ARTICLE_ROWS.get(name, ("", "", "", "")),
            ]
            for name, row in rows.items()
        ],
    )
    described = "\n".join(f"- `{s.name}`: {s.description}" for s in strategies)
    cpu = max((row["loadgen_cpu_share"] for row in rows.values()), default=0.0)
    target_rows = []
    for name, checks in verdicts["variants"].items():
        cells = [name]
        for key in ("speedup_over_none", "p99_ms", "call_share", "vs_best_fixed"):
            check = checks.get(key)
            if check is None:
                cells.append("—")
                continue
            cells.append(f"{'met' if check['met'] else '**not met**'}: {_shown(key, check)}")
        target_rows.append(cells)
    targets = markdown_table(
        ["variant", f"≥ {TARGET_SPEEDUP:g}× none", f"P99 < {TARGET_P99_MS:g} ms",
         f"calls ≤ {TARGET_CALL_SHARE:.0%}",
         f"≥ {TARGET_NEAR_BEST_FIXED:.0%} of best fixed ({verdicts['best_fixed']}) at ≤ its P99"],
        target_rows,
    )
    return f"""\
{settings.texts:,} texts (mean {settings.mean_chars} characters, {verdicts['tokens_per_text']:.1f} tokens), \
{settings.callers} closed-loop callers, {settings.repeats} interleaved repeat(s), medians shown. Upstream in its own \
process: base {upstream.base_latency_ms:g} ms + {upstream.per_token_ms:g} ms/token, jitter {upstream.jitter:g}, \
provider concurrency {upstream.max_concurrency}. Batchers: max_batch {MAX_BATCH}, max_wait {MAX_WAIT_MS:g} ms, \
scale_factor {SCALE_FACTOR:g}; flushes are counted over all repeats. Load generator CPU: at most {cpu:.0%} of one \
core. A run during which the \
load generator's event loop stalled more than {disturbance.max_loop_lag_ms:g} ms (the machine is shared) was tried up \
to {disturbance.attempts} times and the calmest attempt kept ({attempts} runs made for {runs} kept).

{table}

The article's columns are its own figures, for reference (different upstream; its rows do not all satisfy Little's \
law for 50 closed-loop callers: items/s × mean latency must equal 50).

Strategies:
{described}

## Targets

Closed-loop bound: each of the {settings.callers} callers has one text in flight, so with calls ≤ \
{TARGET_CALL_SHARE:.0%} of items (batches of {settings.callers}) no strategy beats one call carrying every caller \
per round: ≈ {verdicts['closed_loop_bound_items_per_s']:,.0f} items/s with this upstream (base latency + \
per-token cost of {settings.callers} texts, mean jitter) = {_fmt(verdicts['bound_speedup_over_none'], 2)}× the \
measured unbatched rate.{_bound_note(verdicts)} The share of that bound each variant reaches is shown.

{targets}
"""

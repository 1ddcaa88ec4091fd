"""The statistics every benchmark and reliability run reports: medians, percentiles and a latency summary.

Percentiles are nearest-rank. A value that is missing (an item that never completed) counts as larger than every
value present, so a percentile that lands among the missing is infinite ("censored"): a run that fell behind shows
as worse, never as better.
"""

from __future__ import annotations

import math
from typing import Any, Iterable, Mapping, Sequence


def percentile(values: Sequence[float], pct: float, missing: int = 0) -> float:
    """Nearest-rank percentile of ``values`` plus ``missing`` values known only to be larger than all of them.

    ``inf`` when the rank falls among the missing; ``nan`` when there is nothing at all.
    """
    total = len(values) + missing
    if total == 0:
        return math.nan
    rank = max(1, math.ceil(pct / 100 * total))
    if rank > len(values):
        return math.inf
    return sorted(values)[rank - 1]


def finite_or_none(value: float | None) -> float | None:
    """``value``, or None where it is none, infinite or not a number (what a JSON report can hold)."""
    return value if value is not None and math.isfinite(value) else None


def median(values: Iterable[float | None]) -> float | None:
    """The median of the values present (None left out); None if there are none."""
    present = sorted(value for value in values if value is not None)
    if not present:
        return None
    middle = len(present) // 2
    return present[middle] if len(present) % 2 else (present[middle - 1] + present[middle]) / 2


def median_of(records: Iterable[Mapping[str, Any]], key: str) -> float | None:
    """The median of ``record[key]`` over ``records`` (runs); those without it, or with None, left out."""
    return median(record.get(key) for record in records)


def censored_median(values: Iterable[float | None]) -> float | None:
    """The median of per-run percentiles where None or ``inf`` is a censored one (larger than every finite one).

    None when the median itself is censored.
    """
    ordered = sorted(math.inf if value is None else value for value in values)
    if not ordered:
        return None
    middle = len(ordered) // 2
    value = ordered[middle] if len(ordered) % 2 else (ordered[middle - 1] + ordered[middle]) / 2
    return finite_or_none(value)


def latency_summary(latencies_ms: Sequence[float], missing: int = 0) -> dict[str, float | None]:
    """P50 and P99 over every item (``missing`` ones count as infinitely late; a censored percentile is None) and
    the mean of those that completed (None if none did)."""
    return {
        "p50_ms": finite_or_none(percentile(latencies_ms, 50, missing)),
        "p99_ms": finite_or_none(percentile(latencies_ms, 99, missing)),
        "mean_ms": sum(latencies_ms) / len(latencies_ms) if latencies_ms else None,
    }

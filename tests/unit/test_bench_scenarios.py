"""The seed-table, sweep and priority benchmarks run end to end on a tiny workload, and every item comes back right.

Correctness only: files written, every strategy completed every item, no vector belongs to another text. No timing
is asserted (the machine is shared); the upstream runs with a small latency so the file stays fast.
"""

from __future__ import annotations

import importlib
import json
import math
import statistics
from pathlib import Path

import pytest

from load.bench.__main__ import SCENARIOS, build_parser
from load.bench.report import DEFAULT_RESULTS_DIR
from load.stats import censored_median, median, percentile
from load.strategies import standard_strategies
from load.workload import poisson_arrivals, pseudo_sentences

FAST_UPSTREAM = ["--upstream-base-latency-ms", "3", "--upstream-per-token-ms", "0", "--upstream-jitter", "0.1"]
ALL_STRATEGIES = {strategy.name for strategy in standard_strategies()}


def run_quick(scenario: str, tmp_path, *extra: str) -> dict:
    args = build_parser().parse_args([scenario, "--quick", "--results-dir", str(tmp_path), *FAST_UPSTREAM, *extra])
    returned = args.run(args)
    written = json.loads((tmp_path / f"{scenario.replace('-', '_')}.json").read_text())
    assert (tmp_path / f"{scenario.replace('-', '_')}.md").read_text().startswith("# ")
    assert written["machine"]["cpu_count"] >= 1
    assert returned["machine"] == written["machine"]
    return written


def test_quick_seed_table_runs_every_strategy_and_every_item_matches_its_text(tmp_path):
    written = run_quick("seed-table", tmp_path)

    assert set(written["rows"]) == ALL_STRATEGIES
    for name, row in written["rows"].items():
        assert row["completed"] == row["submitted"] == written["settings"]["texts"] * row["repeats"], name
        assert (row["errors"], row["mismatches"]) == (0, 0), name
        assert row["items_billed"] == written["settings"]["texts"], name
    assert written["rows"]["none"]["upstream_calls"] == written["settings"]["texts"]
    assert set(written["targets"]["variants"]) == {name for name in ALL_STRATEGIES if name.startswith("adaptive")}


def test_quick_sweep_runs_every_strategy_at_every_rate_and_draws_both_plots(tmp_path):
    written = run_quick("sweep", tmp_path)

    assert list(written["table"]) == [f"{rate:g}" for rate in written["settings"]["rates"]]
    for rate, row in written["table"].items():
        assert set(row) == ALL_STRATEGIES
        for name, cell in row.items():
            assert cell["submitted"] > 0, (rate, name)
            assert cell["completed"] == cell["submitted"] and cell["backlog"] == 0, (rate, name)
            assert (cell["errors"], cell["mismatches"]) == (0, 0), (rate, name)
    for plot in written["plots"]:
        assert (tmp_path / plot).read_bytes().startswith(b"\x89PNG")
    assert len(written["plots"]) == 2


def test_quick_priority_completes_the_high_stream_and_the_flood_in_every_case(tmp_path):
    written = run_quick("priority", tmp_path)

    assert set(written["table"]) == {"no-flood", "flood-low", "flood-fifo", "flood-low-no-share", "flood-separate"}
    for case, row in written["table"].items():
        assert row["high_completed"] == row["high_submitted"] > 0, case
        assert row["flood_completed"] == row["flood_items"], case
        assert row["high_errors"] + row["flood_errors"] == 0, case
        assert row["high_mismatches"] + row["flood_mismatches"] == 0, case
    assert written["table"]["no-flood"]["flood_items"] == 0
    assert written["table"]["flood-low"]["flood_items"] == written["settings"]["flood_items"]


def test_only_the_named_strategies_run(tmp_path):
    written = run_quick("seed-table", tmp_path, "--strategies", "none,adaptive", "--texts", "20")

    assert set(written["rows"]) == {"none", "adaptive"}


def test_pseudo_sentences_are_deterministic_distinct_and_about_the_asked_length():
    texts = pseudo_sentences(500, mean_chars=120, seed=3)

    assert texts == pseudo_sentences(500, mean_chars=120, seed=3)
    assert texts != pseudo_sentences(500, mean_chars=120, seed=4)
    assert len(set(texts)) == 500
    assert 110 <= statistics.fmean(map(len, texts)) <= 130


def test_poisson_arrivals_stop_at_the_count_or_the_duration():
    assert len(poisson_arrivals(1000, 50, 10.0)) == 50
    offsets = poisson_arrivals(100, 10_000, 2.0, seed=1)
    assert offsets == sorted(offsets) and offsets[-1] <= 2.0
    assert 150 <= len(offsets) <= 250


@pytest.mark.parametrize(
    ("values", "missing", "pct", "expected"),
    [([1, 2, 3, 4], 0, 50, 2), ([1, 2, 3, 4], 0, 99, 4), ([1, 2, 3], 1, 50, 2), ([1, 2, 3], 1, 99, math.inf)],
)
def test_unfinished_items_count_as_later_than_every_finished_one(values, missing, pct, expected):
    assert percentile(values, pct, missing) == expected


@pytest.mark.parametrize(
    ("values", "expected"), [([3, None, 1, 2], 2), ([4, 1, 3, 2], 2.5), ([None], None), ([], None)],
)
def test_a_median_leaves_out_what_a_run_could_not_give(values, expected):
    assert median(values) == expected


@pytest.mark.parametrize(
    ("values", "expected"),
    [([3, None, 1], 3), ([1, 2, 3, 4], 2.5), ([1, 2, None, math.inf], None), ([None, 1, None], None)],
)
def test_a_censored_percentile_counts_as_larger_than_every_finite_one(values, expected):
    assert censored_median(values) == expected


def test_the_help_lists_every_scenario(capsys):
    with pytest.raises(SystemExit) as exited:
        build_parser().parse_args(["--help"])
    assert exited.value.code == 0
    out = " ".join(capsys.readouterr().out.split())  # argparse wraps the summaries
    for name, module_name in SCENARIOS.items():
        summary = " ".join(importlib.import_module(module_name).__doc__.strip().splitlines()[0].split())
        assert f"{name} {summary}" in out  # each as written: a percent sign (bulk-rerun's "5% edited") kept


@pytest.mark.parametrize("scenario", ["overhead", "peers", "backlog"])
def test_results_go_outside_the_source_tree_unless_asked(scenario):
    repo = Path(__file__).resolve().parents[2]
    default = build_parser().parse_args([scenario]).results_dir.resolve()
    assert default == DEFAULT_RESULTS_DIR.resolve() and not default.is_relative_to(repo)
    assert build_parser().parse_args([scenario, "--results-dir", "load/results"]).results_dir == Path("load/results")

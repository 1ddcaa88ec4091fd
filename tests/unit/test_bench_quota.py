"""``load.bench quota``'s arithmetic: the job's samples after its reset, and each target from the runs' figures."""

from __future__ import annotations

import dataclasses

import pytest

from load.bench.__main__ import build_parser
from load.bench.options import chosen_settings
from load.bench.quota import QUICK, Settings, _since_reset, render, summarise
from load.upstream import UpstreamConfig


def stats(calls: int, tokens: int, refused: int = 0) -> dict:
    return {"calls": calls, "tokens_billed": tokens, "rejected_429": refused}


def test_the_samples_start_at_the_jobs_reset_and_its_first_call() -> None:
    samples = [(0.0, stats(40, 900)), (1.0, stats(0, 0)), (2.0, stats(3, 6_000)), (3.5, stats(5, 9_000))]
    assert _since_reset(samples) == [{"t_s": 0.0, "tokens": 6_000, "calls": 3, "rejected_429": 0},
                                     {"t_s": 1.5, "tokens": 9_000, "calls": 5, "rejected_429": 0}]


def test_each_target_is_judged_from_the_runs() -> None:
    settings = Settings(tpm=60_000)
    stream = {"submitted": 10, "p50_ms": 50.0, "errors": 0, "mismatches": 0}
    samples = [{"t_s": float(t), "tokens": 57_000 + 1_000 * max(0, t - 1), "calls": t, "rejected_429": 0}
               for t in range(0, 181, 30)]
    runs = {
        "high_alone": {**stream, "p99_ms": 100.0, "upstream": stats(100, 2_000)},
        "job_with_high": {"wall_s": 180.0, "high_stream": {**stream, "p99_ms": 140.0}, "samples": samples,
                          "upstream": stats(199, 231_000, refused=1), "mismatches": 0, "misplaced_ids": 0,
                          "documents": 10, "rows": 10},
        "clients_with_high": {"high_stream": {**stream, "p99_ms": 170.0}, "statuses": {"200": 45, "429": 5},
                              "wall_s": 60.0, "upstream": {"calls": 400, "tokens_billed": 54_000, "rejected_429": 4}},
    }
    data = summarise(runs, settings, UpstreamConfig(), job_tokens=200_000)
    targets = data["targets"]
    assert targets["upstream_429_share"] == {"value": pytest.approx(1 / 299), "needed": 0.005, "met": True}
    assert targets["tpm_share_over_job"]["value"] == pytest.approx(231_000 / 3 / 60_000)
    assert targets["tpm_share_after_first_minute"]["value"] == pytest.approx(1.0)
    assert targets["job_wall_ratio"] == {"value": pytest.approx(0.9), "needed": 1.15, "met": True}
    assert targets["high_p99_ratio"] == {"value": pytest.approx(1.4), "needed": 1.5, "met": True}
    assert targets["clients_upstream_429_share"] == {"value": pytest.approx(0.01), "needed": 0.005, "met": False}
    assert targets["clients_tpm_share"] == {"value": pytest.approx(0.9), "needed": 0.85, "met": True}
    assert targets["clients_high_p99_ratio"] == {"value": pytest.approx(1.7), "needed": 1.5, "met": False}
    assert targets["clients_low_answered"] == {"value": pytest.approx(0.9), "needed": 0.9, "met": True}
    report = render(data)
    assert "| HIGH P99 during the job / alone | 1.40× | ≤ 1.5× | met |" in report
    assert "| HIGH P99 beside the LOW clients / alone | 1.70× | ≤ 1.5× | **not met** |" in report
    assert "45× 200, 5× 429" in report


def test_quick_runs_the_quick_settings_and_a_given_option_still_wins() -> None:
    parser = build_parser()
    assert chosen_settings(parser.parse_args(["quota"]), Settings(), QUICK) == Settings()
    assert chosen_settings(parser.parse_args(["quota", "--quick"]), Settings(), QUICK) == QUICK
    given = parser.parse_args(["quota", "--quick", "--documents", "50"])
    assert chosen_settings(given, Settings(), QUICK) == dataclasses.replace(QUICK, documents=50)

"""The backlog under floods (findings 1-5 of the backlog issue), as ``python -m load.bench backlog`` measures it at
full scale for docs/reliability.md: the load comes from that benchmark in its own process, at CI scale (``--quick``),
and every status and latency is taken there.

- ``low-flood``: a LOW bulk flood beside a HIGH stream with ``X-Request-Timeout: 2``: HIGH answered 200 on time.
- ``deadline-flood``: single texts with ``X-Request-Timeout: 2`` from many connections: no answer later than 2.25 s.
- ``long-input``: a 100,000-character text beside small requests: every answer 200, small ones never stalled, the
  replica's memory flat.
- ``scale``: a flood that makes the autoscaler add a replica, then calm until it removes it: no 5xx at any point.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any, Iterator

import pytest

from tests.integration.helpers import API_KEYS, APP_NAME, ROOT, Service

from .setups import scale_target

pytestmark = pytest.mark.integration


def run_backlog(url: str, cases: str, results_dir: Path, *options: str) -> dict[str, Any]:
    command = [sys.executable, "-m", "load.bench", "backlog", "--quick", "--url", url, "--cases", cases,
               "--results-dir", str(results_dir), *options]
    finished = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert finished.returncode == 0, finished.stderr[-3000:]
    return json.loads((results_dir / "backlog.json").read_text())["cases"]


@pytest.fixture(scope="module")
def measured(embeddings_app: Service, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    yield run_backlog(embeddings_app.url, "low-flood,deadline-flood,long-input", tmp_path_factory.mktemp("backlog"),
                      "--app", APP_NAME, "--api-key", API_KEYS[0])


def test_a_low_flood_leaves_high_requests_answered_on_time(measured: dict[str, Any]) -> None:
    case = measured["low-flood"]
    assert case["low"]["requests"] > 0 and case["high"]["requests"] > 0, case
    assert case["target_met"], case  # >= 99% of HIGH answered 200 within 2.25 s


def test_no_answer_comes_after_the_deadline_under_a_flood(measured: dict[str, Any]) -> None:
    case = measured["deadline-flood"]
    assert set(case["statuses"]) <= {"200", "429", "504"}, case
    assert case["target_met"], case  # every answer, of any status, within 2.25 s


def test_a_long_input_fails_nothing_stalls_nothing_and_keeps_memory_flat(measured: dict[str, Any]) -> None:
    case = measured["long-input"]
    assert case["long"]["requests"] > 0 and case["small"]["requests"] > 0, case
    assert case["target_met"], case  # all 200, small <= 1 s, replica RSS growth < 300 MB


def test_scaling_up_and_back_down_under_a_flood_loses_nothing(serve_instance: Service, tmp_path: Path) -> None:
    with scale_target(serve_instance.url) as target:
        case = run_backlog(f"{serve_instance.url}{target.prefix}", "scale", tmp_path, "--app", target.app_name,
                           "--model", target.model)["scale"]
    assert case["scaled_up_after_s"] is not None, case
    assert case["scaled_down_after_s"] is not None, case
    # no 5xx, no failed connection
    assert case["failed"] == 0, {group: case[group]["first_errors"] for group in ("high", "low")}
    assert case["target_met"], case

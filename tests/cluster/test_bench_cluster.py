"""A smoke run of ``python -m load.bench cluster --quick``: one node and two nodes answer every request with the
vector of its text. No timing is asserted; the figures come from the full run (docs/cluster.md).

The benchmark connects to clusters of its own, so it runs in a process of its own (this session may hold another)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from load.bench.serving import without_serve_env

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
RUN_TIMEOUT_S = 180  # generous: each node count starts a fresh cluster, on cores a busy machine shares


@pytest.mark.timeout(RUN_TIMEOUT_S + 30)
def test_cluster_bench_serves_one_and_two_nodes_with_vectors_matching_their_texts(tmp_path: Path) -> None:
    run = subprocess.run(
        [sys.executable, "-m", "load.bench", "cluster", "--quick", "--nodes", "2", "--results-dir", str(tmp_path),
         "--upstream-base-latency-ms", "1", "--upstream-jitter", "0"],
        cwd=ROOT, capture_output=True, text=True, timeout=RUN_TIMEOUT_S, env=without_serve_env(),
    )
    assert run.returncode == 0, run.stderr[-4000:]
    assert (tmp_path / "cluster.md").exists()
    rows = json.loads((tmp_path / "cluster.json").read_text())["rows"]
    for row in rows.values():
        assert set(row) == {"1", "2"}
        for cell in row.values():
            assert cell["errors"] == cell["mismatches"] == 0 and cell["items_per_s"] > 0
        assert row["1"]["vs_one_node"] == 1.0

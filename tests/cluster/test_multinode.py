"""The shipped cluster config on a two-node Ray cluster: placement, every node's proxy, a lost node, autoscaling, and
the Batch API on a directory both nodes reach (a batch taken over when its node is lost).

The cluster is started by ``tests.cluster.multinode_check`` in a process of its own (a process can be connected to
one Ray cluster only, and the rest of the suite shares ``serve_instance``); its JSON report says what each step saw.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from load.bench.serving import without_serve_env
from tests.cluster.multinode_check import STEPS

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
RUN_TIMEOUT_S = 240  # generous: the nodes start and load their models on cores a busy machine shares


@pytest.mark.timeout(RUN_TIMEOUT_S + 30)
def test_two_nodes_place_serve_lose_a_node_and_scale_onto_free_cpu(tmp_path: Path) -> None:
    report_path = tmp_path / "report.json"
    run = subprocess.run(
        [sys.executable, "-m", "tests.cluster.multinode_check", "--report", str(report_path)],
        cwd=ROOT, capture_output=True, text=True, timeout=RUN_TIMEOUT_S, env=without_serve_env(),
    )
    report = json.loads(report_path.read_text()) if report_path.exists() else {}
    assert run.returncode == 0, f"{report.get('failed', 'no report')}\n--- stderr (tail) ---\n{run.stderr[-4000:]}"
    assert report["passed"] == list(STEPS)
    assert report["autoscaling"]["new_replica_on_free_node"]
    assert report["node_loss"]["outcomes"]["hung"] == 0
    surviving = report["node_loss"]["surviving_proxy"]
    assert surviving["ok"] > 0 and surviving["error"] == surviving["closed"] == 0, report["node_loss"]
    last_quarter = report["node_loss"]["head_proxy_last_quarter"]  # still serving by the end
    assert last_quarter["requests"] > 0 and last_quarter["ok"] == last_quarter["requests"], report["node_loss"]
    assert report["replacement"]["added_node_proxy"] == "ok"

"""The shipped Prometheus alert rules: well-formed, and about the batcher metrics as Ray exports them."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from batching import metrics as names

ALERTS = Path(__file__).resolve().parents[2] / "deployments" / "monitoring" / "alerts.yaml"
STANDARD = {getattr(names, attr) for attr in dir(names) if attr.isupper() and isinstance(getattr(names, attr), str)}


def rules() -> list[dict]:
    document = yaml.safe_load(ALERTS.read_text())
    assert set(document) == {"groups"}
    return [rule for group in document["groups"] for rule in group["rules"]]


def test_every_rule_has_the_fields_prometheus_needs() -> None:
    document = yaml.safe_load(ALERTS.read_text())
    for group in document["groups"]:
        assert group["name"] and group["rules"]
    for rule in rules():
        assert set(rule) <= {"alert", "expr", "for", "labels", "annotations", "keep_firing_for"}
        assert re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", rule["alert"])
        assert rule["expr"].strip()
        assert re.fullmatch(r"\d+[smh]", rule["for"])
        assert rule["labels"]["severity"] in {"info", "warning", "critical"}
        assert rule["annotations"]["summary"] and rule["annotations"]["description"]
    alerts = [rule["alert"] for rule in rules()]
    assert len(alerts) == len(set(alerts))


def test_rules_use_the_standard_metric_names_with_rays_prefix() -> None:
    used = set()
    for rule in rules():
        for metric in re.findall(r"\bray_(batcher_[a-z_]+?)(?:_bucket|_count|_sum)?\b", rule["expr"]):
            used.add(metric)
    assert used <= STANDARD
    assert {names.QUEUE_DEPTH, names.ITEM_WAIT_MS, names.FLUSH_TOTAL} <= used


def test_queue_depth_p99_wait_and_time_flush_ratio_are_covered() -> None:
    expressions = " ".join(rule["expr"] for rule in rules())
    assert "ray_batcher_queue_depth" in expressions
    assert re.search(r"histogram_quantile\(0\.99,\s*sum by \(le[^)]*\) \(rate\(ray_batcher_item_wait_ms_bucket\[5m\]\)\)\)",
                     expressions)
    assert 'ray_batcher_flush_total{reason="time"}' in expressions


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool is not installed")
def test_promtool_accepts_the_rules() -> None:
    result = subprocess.run(["promtool", "check", "rules", str(ALERTS)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr

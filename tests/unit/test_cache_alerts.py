"""The cache's alert rules: about the cache's metrics as Ray exports them, and (``promtool test rules``) firing
when the hit ratio collapses, not before."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from deployments.model.cache import metrics as names

from .test_deployments_alerts import ALERTS, rules

CACHE_METRICS = {getattr(names, attr) for attr in dir(names) if attr.endswith("_TOTAL")}
LABELS = 'application="embeddings",deployment="embed-m",replica="r1",cache="m"'


def test_the_cache_rules_use_the_cache_metric_names_with_rays_prefix() -> None:
    used = {metric for rule in rules() for metric in re.findall(r"\bray_(embedding_cache_[a-z_]+)\b", rule["expr"])}
    assert used and used <= CACHE_METRICS
    assert {names.LOOKUPS_TOTAL, names.STORE_ERRORS_TOTAL} <= used


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool is not installed")
def test_the_hit_ratio_alert_fires_when_the_ratio_collapses(tmp_path: Path) -> None:
    day = 24 * 60  # minutes of 90% hits, then two hours of none, at 100 inputs a minute throughout
    hits = f"0+90x{day} {90 * day}+0x120"
    misses = f"0+10x{day} {10 * day}+100x120"
    (rule,) = [rule for rule in rules() if rule.get("alert") == "EmbeddingCacheHitRatioCollapsed"]
    firing = [{"exp_labels": {"application": "embeddings", "deployment": "embed-m", "severity": "warning"},
               "exp_annotations": {"summary": "embed-m: cache hit ratio 0%, under half its last day's",
                                   "description": rule["annotations"]["description"]}}]
    tests = {
        "rule_files": [str(ALERTS)],
        "evaluation_interval": "1m",
        "tests": [{
            "interval": "1m",
            "input_series": [
                {"series": f'ray_embedding_cache_lookups_total{{{LABELS},outcome="hit"}}', "values": hits},
                {"series": f'ray_embedding_cache_lookups_total{{{LABELS},outcome="miss"}}', "values": misses},
            ],
            "alert_rule_test": [
                {"eval_time": f"{day}m", "alertname": "EmbeddingCacheHitRatioCollapsed", "exp_alerts": []},
                {"eval_time": f"{day + 10}m", "alertname": "EmbeddingCacheHitRatioCollapsed", "exp_alerts": []},
                {"eval_time": f"{day + 60}m", "alertname": "EmbeddingCacheHitRatioCollapsed",
                 "exp_alerts": firing},
            ],
        }],
    }
    test_file = tmp_path / "cache_alerts_test.yaml"
    test_file.write_text(yaml.safe_dump(tests))
    result = subprocess.run(["promtool", "test", "rules", str(test_file)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr

"""``load.bench tune``: the changed entry it builds from ``--set``, the CPUs the two need, and its report's figures.
The run itself is the integration suite's (tests/integration/test_bench_service_scenarios.py)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
import yaml

from deployments.config import ConfigError
from load.bench import tune
from load.bench.__main__ import build_parser
from load.bench.serving import default_models
from load.proc_cpu import descendants

ENTRY = {"name": "m", "backend": "local", "batching": {"max_batch_size": 64, "scale_factor": 40},
         "ray_actor_options": {"num_cpus": 2}, "autoscaling": {"min_replicas": 1, "max_replicas": 1}}


def test_each_setting_is_set_by_its_dotted_path_as_yaml_and_the_shipped_entry_is_untouched():
    changed = tune.changed_entry(ENTRY, ["batching.scale_factor=10", "batching.stall_factor=null",
                                         "max_input_tokens=128"])
    assert changed["batching"] == {"max_batch_size": 64, "scale_factor": 10, "stall_factor": None}
    assert changed["max_input_tokens"] == 128
    assert ENTRY["batching"] == {"max_batch_size": 64, "scale_factor": 40}
    assert tune.changes_between(ENTRY, changed) == {"batching.scale_factor": 10, "batching.stall_factor": None,
                                                    "max_input_tokens": 128}


@pytest.mark.parametrize("change", ["batching.scale_factor", "=3", "batching.scale_factor=40"])
def test_a_change_that_is_not_one_is_refused(change):
    with pytest.raises(ValueError):
        tune.changed_entry(ENTRY, [change])


@pytest.mark.parametrize("change", ["batching.scale_factr=10", "batching.max_batch_size=-1"])
def test_a_setting_the_service_would_refuse_is_refused_before_anything_starts(change):
    with pytest.raises(ConfigError):
        tune.changed_entry(ENTRY, [change])


def test_the_command_line_needs_a_change_or_a_commit_to_measure_against():
    with pytest.raises(SystemExit, match="--set KEY=VALUE.*--against REV"):
        tune.run(build_parser().parse_args(["tune"]))
    args = build_parser().parse_args(["tune", "--set", "batching.max_wait_ms=5", "--set", "batching.scale_factor=9"])
    assert args.changes == ["batching.max_wait_ms=5", "batching.scale_factor=9"] and args.against is None
    args = build_parser().parse_args(["tune", "--against", "HEAD~1"])
    assert args.changes == [] and args.against == "HEAD~1"


def test_a_revision_that_names_no_commit_is_refused_before_anything_starts():
    with pytest.raises(SystemExit, match="names no commit"):
        tune.run(build_parser().parse_args(["tune", "--against", "no-such-revision-anywhere"]))


def test_the_model_entries_are_read_from_the_config_file_named(tmp_path):
    config = {"applications": [{"name": "embeddings", "import_path": "deployments.app:build_app",
                                "args": {"models": [ENTRY, {**ENTRY, "name": "n"}]}}]}
    (tmp_path / "serve_config.yaml").write_text(yaml.safe_dump(config))
    assert default_models(tmp_path / "serve_config.yaml") == [ENTRY, {**ENTRY, "name": "n"}]
    assert default_models()[0]["name"] == "all-MiniLM-L6-v2"  # this checkout's


def test_the_cluster_reserves_each_variants_cpus_as_the_service_sizes_its_replicas():
    assert tune.cpus_reserved(ENTRY) == 2
    assert tune.cpus_reserved({**ENTRY, "autoscaling": {"min_replicas": 1, "max_replicas": 3}}) == 6
    assert tune.cpus_reserved({**ENTRY, "ray_actor_options": {"num_cpus": 0.5}}) == 1
    fixed = {key: value for key, value in ENTRY.items() if key not in ("autoscaling", "ray_actor_options")}
    assert tune.cpus_reserved({**fixed, "num_replicas": 2}) == 2  # a local model's default: one core a replica
    upstream = {"name": "u", "backend": "openai", "base_url": "http://127.0.0.1:1/v1", "upstream_model": "u",
                "num_replicas": 3}
    assert tune.cpus_reserved(upstream) == 0  # an API client reserves none


def _run(texts_s: float, p50: float, batch: float) -> dict:
    return {"items_per_s": texts_s, "p50_ms": p50, "p99_ms": 2 * p50, "mean_batch_size": batch, "errors": 0}


def test_the_summary_pairs_each_repeat_and_gives_the_ratios_range():
    runs = {"shipped": {16: [_run(100, 10, 4), _run(110, 9, 4), _run(90, 11, 4)]},
            "changed": {16: [_run(105, 10, 5), _run(99, 10, 5), _run(99, 12, 5)]}}
    for label, levels in runs.items():
        for run in levels[16]:
            run["cpu_ms_per_request"] = {f"ray::ServeReplica:{label}:embed-m": 7.0,
                                         f"ray::ServeReplica:{label}:EmbeddingsIngress": 1.0, "raylet": 0.5}
    row = tune.summarise(runs)["16"]
    assert row["shipped"]["items_per_s"] == 100 and row["changed"]["items_per_s"] == 99
    assert row["texts_ratio"] == pytest.approx(0.99)
    assert row["texts_ratio_range"] == pytest.approx([0.9, 1.1])
    assert row["p50_ratio"] == pytest.approx(1.0)
    assert row["changed"]["cpu_ms"] == {"ingress": 1.0, "model replica": 7.0, "the rest": 0.5}
    report = tune.render(tune.QUICK, {"shipped": ENTRY, "changes": {"batching.scale_factor": 10}, "rows": {"16": row}})
    assert "`batching.scale_factor: 10`" in report and "0.990×" in report and "0.900–1.100×" in report
    against = {"shipped": ENTRY, "against": "abc1234", "rows": {"16": row}}
    assert "commit abc1234; `changed`: this checkout's (the same entry)" in tune.render(
        tune.QUICK, {**against, "changes": {}})
    assert "this checkout's, its entry differing in `batching.scale_factor: 10`" in tune.render(
        tune.QUICK, {**against, "changes": {"batching.scale_factor": 10}})


def test_descendants_are_the_processes_started_below_this_one():
    child = subprocess.Popen([sys.executable, "-c", "import subprocess, sys, time; "
                              "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(30)']); time.sleep(30)"])
    try:
        for _ in range(200):
            grandchildren = descendants(child.pid)
            if grandchildren:
                break
            time.sleep(0.05)
        assert len(grandchildren) == 1
        found = descendants()
        assert child.pid in found and grandchildren[0] in found and os.getpid() not in found
    finally:
        for pid in descendants(child.pid):
            os.kill(pid, signal.SIGKILL)
        child.kill()
        child.wait()

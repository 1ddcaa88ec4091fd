"""``service@<rev>`` in ``load.bench peers``: the service as shipped at another commit, from a worktree that lives as
long as the run, and the service's figures over its own at that commit. No server is started."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import yaml

from load.bench import peers
from load.bench.service_at import names_a_commit, service_at
from load.bench.serving import serve_env
from load.bench.shipped_service import service_batching
from load.peers.launch import ROOT


def _git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, check=True).stdout.strip()


def test_a_commit_runs_from_its_own_checkout_with_its_own_serve_env_and_the_checkout_goes_after(tmp_path):
    head = _git("rev-parse", "--short", "HEAD")
    with service_at("service@HEAD") as server:
        assert server.name == f"service@{head}"
        launch = server.launch(tmp_path, 8123, tmp_path)
        tree = Path(launch.cwd)
        assert tree != ROOT and str(tree) in _git("worktree", "list")
        assert _git("-C", str(tree), "rev-parse", "--short", "HEAD") == head
        assert launch.env["PYTHONPATH"] == str(tree)
        assert serve_env(tree / "serve.env").items() <= launch.env.items()
        assert launch.argv[:2] == [str(tmp_path / "serve"), "run"]
        config = yaml.safe_load(Path(launch.argv[2]).read_text())
        shipped = yaml.safe_load((tree / "serve_config.yaml").read_text())
        assert config == {**shipped, "http_options": {**shipped["http_options"], "port": 8123}}
        assert server.batching["max_batch_size"] == shipped["applications"][0]["args"]["models"][0]["batching"][
            "max_batch_size"]
    assert not tree.exists() and str(tree) not in _git("worktree", "list")


def test_a_revision_that_names_no_commit_is_refused_before_anything_starts():
    with pytest.raises(SystemExit, match="names no commit"):
        with service_at("service@no-such-revision-anywhere"):
            pass
    assert not names_a_commit("service@") and names_a_commit("service@HEAD~1")


def test_the_report_puts_the_service_over_itself_at_each_commit():
    def row(rate: float, p50: float) -> dict:
        return {"levels": {"c1": {"texts_per_s": rate, "p50_ms": p50}, "c16": {"texts_per_s": 2 * rate, "p50_ms": None}}}

    rows = {"service": row(110.0, 9.0), "service@abc1234": row(100.0, 10.0), "mosec": row(50.0, 20.0)}
    table = peers.render_against_commits(rows, ["c1", "c16"])
    assert "| service@abc1234 | 1.100× (0.900×) | 1.100× (—) |" in table
    assert "mosec" not in table
    assert peers.render_against_commits({"service": row(1.0, 1.0), "mosec": row(1.0, 1.0)}, ["c1"]) == ""


def test_an_older_commits_entry_without_autoscaling_still_says_how_many_replicas_served():
    config = {"applications": [{"args": {"models": [{"name": "m", "num_replicas": 2, "batching": {"max_batch_size": 8}}]}}]}
    assert service_batching(config) == {"max_batch_size": 8, "num_replicas": 2}
    shipped = yaml.safe_load((ROOT / "serve_config.yaml").read_text())
    assert set(service_batching(shipped)["autoscaling"]) == {"min_replicas", "max_replicas"}

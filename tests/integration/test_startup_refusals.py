"""What a user sees when something is off at start-up: ``serve run`` on a config the application refuses stops with
the message (and, started without serve.env, warns what that costs, in its own output); ``serve status`` works in a
second shell that sourced serve.env; a model whose replicas cannot start is named, with the reason, by ``/healthz``."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator

import httpx
import pytest
import yaml

from load.bench.serving import serve_env
from load.peers.launch import stop
from tests.integration.helpers import ROOT, Service, free_port

pytestmark = pytest.mark.integration

SERVE = Path(sys.executable).parent / "serve"

SERVE_RUN_TIMEOUT_S = 150  # its own Ray starts, Serve starts, the build task runs and refuses, Serve shuts down


@contextmanager
def serve_run(tmp_path: Path, change_args: Callable[[dict], None]) -> Iterator[tuple[subprocess.Popen, Path]]:
    """``serve run`` as a user types it in a shell without serve.env, on serve_config.yaml with its args changed: its
    own Ray (a temp dir of its own, which stopping it clears), Serve's proxy on a free port. Yields the process and
    its output's file; stops what is left of it on exit."""
    config = yaml.safe_load((ROOT / "serve_config.yaml").read_text())
    config["http_options"]["port"] = free_port()
    (application,) = config["applications"]
    change_args(application["args"])
    config_path = tmp_path / "serve_config.yaml"
    config_path.write_text(yaml.safe_dump(config, sort_keys=False))
    ray_tmp = f"/tmp/ray-startup-{os.getpid()}"
    env = {key: value for key, value in os.environ.items() if key not in serve_env() and key != "RAY_ADDRESS"}
    env.update({"RAY_TMPDIR": ray_tmp, "RAY_USAGE_STATS_ENABLED": "0", "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"})
    log_path = tmp_path / "serve_run.log"
    with open(log_path, "wb") as log:
        process = subprocess.Popen([str(SERVE), "run", str(config_path)], cwd=ROOT, env=env, stdout=log,
                                   stderr=subprocess.STDOUT, start_new_session=True)
        try:
            yield process, log_path
        finally:
            stop(process, signal.SIGINT, ray_tmp)


def _misspelt(args: dict) -> None:
    args["models"][0]["max_batch_sise"] = 8


@pytest.mark.timeout(SERVE_RUN_TIMEOUT_S + 60)
def test_serve_run_stops_on_a_refused_config_and_says_why(tmp_path: Path) -> None:
    with serve_run(tmp_path, _misspelt) as (process, log_path):
        try:
            process.wait(timeout=SERVE_RUN_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            pass
        running = process.poll() is None
    output = log_path.read_text(errors="replace")
    assert not running, f"serve run kept running on a refused config; its output ends:\n{output[-3000:]}"
    assert "ERROR: the application config is refused, so `serve run` stops:" in output, output[-3000:]
    assert "models[0]: unknown setting(s) max_batch_sise" in output
    assert "RAY_SERVE_ENABLE_HA_PROXY is unset: HAProxy is off" in output  # printed where serve run shows it


def _one_replica(args: dict) -> None:
    model = args["models"][0]
    model["autoscaling"] = {**model["autoscaling"], "min_replicas": 1, "max_replicas": 1}
    model["ray_actor_options"] = {"num_cpus": 0}


@pytest.mark.timeout(SERVE_RUN_TIMEOUT_S + 60)
def test_serve_status_runs_in_a_second_shell_that_sourced_serve_env(tmp_path: Path) -> None:
    """Ray turns token auth on for the Ray ``serve run`` starts; the CLI sends the token only with
    ``RAY_AUTH_MODE=token``, which serve.env sets."""
    shell = {key: value for key, value in os.environ.items() if not key.startswith("RAY_") and key not in serve_env()}
    sourced = {**shell, **serve_env()}
    with serve_run(tmp_path, _one_replica) as (process, log_path):
        deadline = time.monotonic() + SERVE_RUN_TIMEOUT_S
        while True:
            status = subprocess.run([str(SERVE), "status"], env=sourced, capture_output=True, text=True, timeout=60)
            if (status.returncode == 0 and "embeddings:" in status.stdout) or time.monotonic() > deadline \
                    or process.poll() is not None:
                break
            time.sleep(2)
        plain = subprocess.run([str(SERVE), "status"], env=shell, capture_output=True, text=True, timeout=60)
    assert status.returncode == 0 and "embeddings:" in status.stdout, (
        f"{status.stdout[-1500:]}\n{status.stderr[-1500:]}\n--- serve run ---\n"
        f"{log_path.read_text(errors='replace')[-2000:]}")
    assert plain.returncode != 0 and "Missing authentication token" in plain.stderr  # what the setting fixes


@pytest.fixture()
def degraded_app(serve_instance: Service):
    """The ingress in front of a model that serves and one whose constructor always fails."""
    from ray import serve

    from deployments.ingress.api import EmbeddingsIngress

    @serve.deployment(ray_actor_options={"num_cpus": 0})
    class Fine:
        async def embed_many(self, requests):
            yield []

    @serve.deployment(ray_actor_options={"num_cpus": 0})
    class Broken:
        def __init__(self) -> None:
            raise ValueError("the model's weights are missing")

    name = "degraded"
    app = EmbeddingsIngress.options(ray_actor_options={"num_cpus": 0}).bind(
        {"fine": Fine.bind(), "broken": Broken.bind()})
    with pytest.raises(RuntimeError):  # Serve gives up on the broken deployment; the ingress stays up
        serve.run(app, name=name, route_prefix=f"/{name}")
    try:
        yield f"{serve_instance.url}/{name}"
    finally:
        serve.delete(name)


def test_healthz_names_the_model_that_cannot_start_and_why(degraded_app: str) -> None:
    deadline = time.monotonic() + 60
    with httpx.Client(base_url=degraded_app, timeout=30) as http:
        while True:
            health = http.get("/healthz")
            if "weights" in health.text or time.monotonic() > deadline:
                break
            time.sleep(1)
    assert health.status_code == 503, health.text
    body = health.json()
    assert body["status"] == "degraded" and body["models"] == ["broken", "fine"]
    assert list(body["unavailable"]) == ["broken"]
    assert "ValueError: the model's weights are missing" in body["unavailable"]["broken"]

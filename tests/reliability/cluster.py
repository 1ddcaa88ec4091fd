"""Ray-side helpers: deploy the applications the scenarios use, find a replica's process, read its memory, kill it.

The replica's pid comes from the GCS actor table (``ray._private.state.actors``): ``ray.util.state`` needs the
dashboard, which the test instance does not start.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from deployments.app import build_app

DIM = 384  # the simulated upstream's vector width
POISON = "<poison-input>"  # the upstream refuses any input holding this (fail_marker)
SLOW = "<slow-input>"  # a call holding this takes slow_ms longer (slow_marker)
UPSTREAM_MODEL = "text-embedding-3-small"


@dataclass(frozen=True)
class Replica:
    name: str  # the actor's name, SERVE_REPLICA::<app>#<deployment>#<id>
    pid: int
    node_id: str  # the Ray node it runs on


def deploy(app_name: str, route_prefix: str, args: dict[str, Any]) -> None:
    from ray import serve

    serve.run(build_app(args), name=app_name, route_prefix=route_prefix)


def delete(app_name: str) -> None:
    from ray import serve

    serve.delete(app_name)


def model_handle(app_name: str, model: str):
    from ray import serve

    return serve.get_deployment_handle(f"embed-{model}", app_name=app_name)


def replicas(app_name: str, deployment: str) -> list[Replica]:
    """The live replicas of a deployment, with their process ids and nodes."""
    from ray._private import state

    prefix = f"SERVE_REPLICA::{app_name}#{deployment}#"
    found = []
    for actor in state.actors().values():
        name = actor.get("Name") or ""
        if name.startswith(prefix) and actor.get("State") == "ALIVE" and actor.get("Pid"):
            found.append(Replica(name, int(actor["Pid"]), actor["Address"]["NodeID"]))
    return sorted(found, key=lambda replica: replica.name)


def running_replicas(app_name: str, deployment: str) -> int:
    """Replicas Serve reports RUNNING (serving traffic), from ``serve.status()``."""
    from ray import serve

    application = serve.status().applications.get(app_name)
    if application is None or deployment not in application.deployments:
        return 0
    return int(application.deployments[deployment].replica_states.get("RUNNING", 0))


def wait_for_running_replicas(app_name: str, deployment: str, count: int, timeout_s: float = 60.0) -> float:
    """Seconds until ``count`` replicas are RUNNING; ``TimeoutError`` if they are not within ``timeout_s``."""
    started = time.monotonic()
    while running_replicas(app_name, deployment) != count:
        if time.monotonic() - started > timeout_s:
            raise TimeoutError(f"{deployment}: {count} running replicas not reached within {timeout_s}s")
        time.sleep(0.1)
    return time.monotonic() - started


def kill_replica(replica: Replica) -> None:
    """Kill the replica's actor the way a crash would (no graceful shutdown); Serve must replace it."""
    import ray

    ray.kill(ray.get_actor(replica.name, namespace="serve"), no_restart=True)


def memory_kib(pid: int) -> dict[str, int]:
    """``VmRSS`` (now) and ``VmHWM`` (peak since the process started) of a process, in KiB."""
    fields: dict[str, int] = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            fields[key] = int(value.split()[0])
    return fields


def logs_dir() -> Path:
    """This Ray instance's log directory (not /tmp/ray/session_latest, which another user's Ray may own)."""
    import ray

    return Path(ray._private.worker.global_worker.node.get_logs_dir_path())


def metrics_url() -> str:
    import ray

    node = ray._private.worker.global_worker.node
    return f"http://127.0.0.1:{node.metrics_export_port}/metrics"

"""What ``build_app`` tells the person who typed ``serve run``: the ``serve.env`` settings Ray was started without
(and what each costs), and a config Serve cannot deploy (then ``serve run`` stops).

``serve run serve_config.yaml`` builds the application in a Ray task of Serve's (``build_serve_application``) and
shows that task's stderr in its own terminal, prefixed ``(build_serve_application pid=...)``. Serve's logger reaches
stderr there only while ``RAY_SERVE_LOG_TO_STDERR`` is on (the throughput preset turns it off), so what must be seen
is printed to stderr. ``serve run`` itself never looks at the deployment again: it submits the config and sleeps,
so an application that fails to build left it running, and the API answering nothing, for ever.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any, Mapping

logger = logging.getLogger("ray.serve")

SERVE_ENV_FILE = Path(__file__).resolve().parents[1] / "serve.env"  # the project's; an installed wheel has none
SOURCE_IT = "set -a && . ./serve.env && set +a"
# What each of serve.env's main settings costs when Ray starts without it (serve.env says what each does; its values
# are read from the file, never repeated here). Without the file, these are the settings checked.
UNSET_COSTS = {
    "RAY_SERVE_ENABLE_HA_PROXY": "HAProxy is off, so Serve's Python proxy relays each request over Ray (about half "
                                 "the throughput)",
    "RAY_SERVE_THROUGHPUT_OPTIMIZED": "Serve's throughput preset is off, so each request costs more CPU outside the "
                                      "model (thread hops, handle calls not over gRPC), which the model shares",
    "RAY_SERVE_REPLICA_GRPC_MAX_MESSAGE_LENGTH": "with the preset on, answers over gRPC's 4 MiB (large requests, "
                                                 "or many answered together) fail with 503",
    "RAY_SERVE_LOG_TO_STDERR": "with the preset on, the replicas' errors go to their log files only, not to this "
                               "terminal",
}
BUILD_TASK = "build_serve_application"  # Serve's task that calls the application builder
STOP_GRACE_S = 1.0  # for the refusal to reach `serve run`'s terminal before it stops
HOLD_S = 60.0  # the build task waits this long for Serve to go down, so Serve retries no build meanwhile


def serve_env_settings(path: Path = SERVE_ENV_FILE) -> dict[str, str] | None:
    """``NAME=value`` lines of ``path``; None if there is no such file."""
    try:
        text = path.read_text()
    except OSError:
        return None
    lines = (line.strip() for line in text.splitlines())
    return dict(line.split("=", 1) for line in lines if "=" in line and not line.startswith("#"))


def serve_env_warning(environ: Mapping[str, str] = os.environ, path: Path = SERVE_ENV_FILE) -> str | None:
    """The warning for a Ray started without some of ``serve.env``'s settings (unset in ``environ``; a setting given
    another value is a choice, not a miss), naming them and what they cost; None when none is missing."""
    settings = serve_env_settings(path)
    expected = list(settings) if settings is not None else list(UNSET_COSTS)
    missing = [name for name in expected if name not in environ]
    if not missing:
        return None
    costly = [name for name in missing if name in UNSET_COSTS]
    others = [name for name in missing if name not in UNSET_COSTS]
    where = f"{len(missing)} of serve.env's {len(expected)} settings" if settings is not None else \
        "serve.env's settings"
    lines = [f"WARNING: Ray was started without {where}, so this service runs slower than it should:"]
    lines += [f"  - {name} is unset: {UNSET_COSTS[name]}" for name in costly]
    if others:
        lines.append(f"  - also unset: {', '.join(others)} (serve.env says what each does)")
    lines.append(f"Stop `serve run` and start it again in a shell that has serve.env: {SOURCE_IT} && serve run "
                 "serve_config.yaml")
    return "\n".join(lines)


def warn_about_serve_env() -> None:
    """Print ``serve_env_warning`` for this process's environment (Ray's, in Serve's build task), unless Ray runs on
    several nodes: there Serve's own proxy on each node is meant (docs/cluster.md)."""
    warning = serve_env_warning()
    if warning is None:
        return
    if _alive_nodes() > 1:
        logger.info("serve.env's settings are unset; on a cluster of several nodes that is as meant")
        return
    print(warning, file=sys.stderr, flush=True)


def refuse(error: Exception) -> None:
    """Print ``error`` where ``serve run`` shows it and, in Serve's build task for a ``serve run`` whose cluster
    serves nothing yet, stop that ``serve run`` as Ctrl-C does (Serve shut down, Ray with it). The caller raises
    ``error`` afterwards (Serve then marks the application DEPLOY_FAILED, and a running version stays)."""
    driver = _serve_run_to_stop()
    consequence = "`serve run` stops" if driver is not None else "the application is not deployed"
    print(f"ERROR: the application config is refused, so {consequence}:\n{error}", file=sys.stderr, flush=True)
    if driver is None:
        return
    time.sleep(STOP_GRACE_S)
    # SIGINT's handler says "Got KeyboardInterrupt, shutting down..." and shuts Serve down; a `serve run` started as
    # a shell script's background job ignores SIGINT, and SIGTERM ends it (Ray's processes share its fate)
    os.kill(driver, signal.SIGTERM if ignores(driver, signal.SIGINT) else signal.SIGINT)
    time.sleep(HOLD_S)


def ignores(pid: int, signum: int) -> bool:
    """Process ``pid`` ignores signal ``signum`` (its ``SigIgn`` mask in ``/proc``); False when that cannot be read."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    mask = next((line.split()[1] for line in status.splitlines() if line.startswith("SigIgn:")), "0")
    return bool(int(mask, 16) >> (signum - 1) & 1)


def is_serve_run(argv: list[str]) -> bool:
    """``argv`` (a process's command line) is the ``serve`` CLI's ``run`` command."""
    return any(Path(arg).name == "serve" and argv[i + 1:i + 2] == ["run"] for i, arg in enumerate(argv))


def serves_something(status: Any) -> bool:
    """``status`` (``serve.status()``) has a deployment with a running replica: a version already serves, which a
    refused redeploy must leave serving."""
    return any(deployment.replica_states.get("RUNNING", 0) > 0
               for application in status.applications.values() for deployment in application.deployments.values())


def _serve_run_to_stop() -> int | None:
    """The pid of the ``serve run`` that owns Serve's controller, when this is Serve's build task on its node and no
    application serves yet; None otherwise (a driver calling ``build_app`` itself gets the exception instead)."""
    try:
        import ray
        from ray import serve
        from ray._private.state import jobs

        if not ray.is_initialized():
            return None
        context = ray.get_runtime_context()
        if context.get_task_name() != BUILD_TASK:
            return None
        job = next((job for job in jobs() if job["JobID"] == context.get_job_id()), None)
        if job is None or job["IsDead"] or job["DriverIPAddress"] != ray.util.get_node_ip_address():
            return None
        pid = int(job["DriverPid"])
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
        if not is_serve_run(argv) or serves_something(serve.status()):
            return None
        return pid
    except Exception:  # never let the check hide the refusal itself
        logger.debug("could not tell whether serve run is to be stopped", exc_info=True)
        return None


def _alive_nodes() -> int:
    try:
        import ray

        return sum(1 for node in ray.nodes() if node.get("Alive")) if ray.is_initialized() else 1
    except Exception:
        return 1

"""The simulated upstream in its own process, so it never shares the load generator's CPU or GIL."""

from __future__ import annotations

import argparse
import dataclasses
import json
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from contextlib import contextmanager
from typing import IO, Iterator

from load.upstream import UpstreamConfig

# The flags a benchmark passes on to the upstream (every other UpstreamConfig field keeps its default).
UPSTREAM_FLAGS = ("base_latency_ms", "per_token_ms", "jitter", "max_concurrency", "seed")


def add_upstream_arguments(parser: argparse.ArgumentParser) -> None:
    defaults = UpstreamConfig()
    group = parser.add_argument_group("simulated upstream (run in a separate process)")
    for name in UPSTREAM_FLAGS:
        default = getattr(defaults, name)
        group.add_argument(
            f"--upstream-{name.replace('_', '-')}", dest=f"upstream_{name}", type=type(default), default=default,
            help=f"UpstreamConfig.{name} (default {default})",
        )


def upstream_config_from(args: argparse.Namespace) -> UpstreamConfig:
    return dataclasses.replace(UpstreamConfig(), **{name: getattr(args, f"upstream_{name}") for name in UPSTREAM_FLAGS})


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@contextmanager
def upstream_process(config: UpstreamConfig, startup_timeout_s: float = 60.0) -> Iterator[str]:
    """Start ``python -m load.upstream`` with ``config`` on a free port; yield its root URL; stop it on exit."""
    port = free_port()
    flags = []
    for config_field in dataclasses.fields(UpstreamConfig):
        value = getattr(config, config_field.name)
        if value != config_field.default:
            flags += [f"--{config_field.name.replace('_', '-')}", "none" if value is None else str(value)]
    # Its log goes to a file, not a pipe: a pipe nobody reads would block the upstream once full.
    with tempfile.TemporaryFile() as log:
        process = subprocess.Popen(
            [sys.executable, "-m", "load.upstream", "--host", "127.0.0.1", "--port", str(port), *flags],
            stdout=log,
            stderr=subprocess.STDOUT,
            preexec_fn=_stop_with_parent if sys.platform == "linux" else None,
        )
        root_url = f"http://127.0.0.1:{port}"
        try:
            _wait_until_answering(process, log, root_url, startup_timeout_s)
            yield root_url
        finally:
            process.terminate()
            try:
                process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


def _stop_with_parent() -> None:
    """In the child: get SIGTERM when the benchmark dies, even if it is killed before its cleanup runs (Linux)."""
    import ctypes
    import signal

    pr_set_pdeathsig = 1
    ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGTERM)


def _wait_until_answering(process: subprocess.Popen, log: IO[bytes], root_url: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        if process.poll() is not None:
            log.seek(0)
            error = log.read().decode("utf-8", "replace")
            raise RuntimeError(f"the simulated upstream exited with {process.returncode}: {error[-2000:]}")
        try:
            with urllib.request.urlopen(f"{root_url}/stats", timeout=1) as response:
                json.load(response)
                return
        except OSError:
            if time.monotonic() > deadline:
                raise RuntimeError(f"the simulated upstream did not answer within {timeout_s} s") from None
            time.sleep(0.05)

"""The simulated upstream (``load.upstream``) in its own process, so it never competes for the test's GIL."""

from __future__ import annotations

import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

import httpx

from load.upstream import RunningUpstream
from tests.integration.helpers import free_port

ROOT = Path(__file__).resolve().parents[2]


@contextmanager
def upstream_process(startup_timeout_s: float = 30.0, **config: Any) -> Iterator[RunningUpstream]:
    """``python -m load.upstream`` on a free loopback port with ``config`` as its flags (UpstreamConfig fields)."""
    port = free_port()
    argv = [sys.executable, "-m", "load.upstream", "--host", "127.0.0.1", "--port", str(port)]
    for name, value in config.items():
        argv += [f"--{name.replace('_', '-')}", "none" if value is None else str(value)]
    root_url = f"http://127.0.0.1:{port}"
    with tempfile.TemporaryFile() as output:
        process = subprocess.Popen(argv, cwd=ROOT, stdout=output, stderr=subprocess.STDOUT)
        try:
            with httpx.Client(base_url=root_url, timeout=10.0) as client:
                _wait_until_serving(client, process, output, startup_timeout_s)
                yield RunningUpstream(root_url, client)
        finally:
            process.terminate()
            try:
                process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


def _wait_until_serving(client: httpx.Client, process: subprocess.Popen, output: Any, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        if process.poll() is not None:
            output.seek(0)
            raise RuntimeError(f"the simulated upstream exited: {output.read().decode(errors='replace')[-2000:]}")
        try:
            client.get("/stats").raise_for_status()
            return
        except httpx.HTTPError:
            if time.monotonic() > deadline:
                raise RuntimeError("the simulated upstream did not start") from None
            time.sleep(0.1)

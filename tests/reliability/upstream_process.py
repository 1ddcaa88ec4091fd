"""The simulated upstream (``load.upstream``) in its own process, so it never competes for the test's GIL."""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Iterator

import httpx

from load.bench.upstream_process import upstream_process as upstream_subprocess
from load.upstream import RunningUpstream, UpstreamConfig


@contextmanager
def upstream_process(startup_timeout_s: float = 30.0, **config: Any) -> Iterator[RunningUpstream]:
    """``python -m load.upstream`` on a free loopback port with ``config`` (UpstreamConfig fields)."""
    with upstream_subprocess(UpstreamConfig(**config), startup_timeout_s) as root_url, \
            httpx.Client(base_url=root_url, timeout=10.0) as client:
        yield RunningUpstream(root_url, client)

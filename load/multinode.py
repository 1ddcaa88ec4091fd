"""A Ray cluster of several nodes on this one machine, with a Serve HTTP proxy on every node, each on its own port.

Each node is a raylet of its own (``ray.cluster_utils.Cluster``) with ``cpus_per_node`` CPUs, so Ray places
replicas across nodes exactly as it would across machines. Ray's own ports are on the machine's address (Ray turns
a loopback address it is to connect to into that one); the Serve proxies listen on loopback only. The cluster keeps
to itself: its own temporary directory under /tmp, free ports for everything it listens on (GCS, agents, metrics,
proxies), and nothing another Ray instance on the machine uses is touched. A node can be killed the way a crash
would (its processes killed, no graceful drain) and nodes can be added at any time; the GCS declares a killed node
dead within about two seconds.

Every worker node's proxy binds the port given in ``RAY_SERVE_WORKER_PROXY_HTTP_PORT`` (read by the proxy actor
from its raylet's environment; the head's proxy binds ``http_options.port``), which is how several proxies share one
host. On separate machines every proxy binds the same ``http_options.port``.
"""

from __future__ import annotations

import itertools
import os
import shutil
import tempfile
import time
import urllib.request
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Awaitable, Callable, Iterator, Sequence, TypeVar

from load.bench.upstream_process import free_port

HOST = "127.0.0.1"
T = TypeVar("T")
R = TypeVar("R")
WORKER_PROXY_PORT_ENV = "RAY_SERVE_WORKER_PROXY_HTTP_PORT"
RAY_TMPDIR_ENV = "RAY_TMPDIR"
# Node liveness: checked every 500 ms, dead after 4 missed checks (Ray's defaults take ~15 s to declare it).
FAST_NODE_FAILURE_DETECTION = {
    "health_check_initial_delay_ms": 0,
    "health_check_period_ms": 500,
    "health_check_timeout_ms": 500,
    "health_check_failure_threshold": 4,
}


@dataclass(frozen=True)
class ClusterNode:
    """One raylet of the cluster and the port its Serve proxy listens on."""

    node: Any  # ray._private.node.Node
    proxy_port: int
    is_head: bool

    @property
    def node_id(self) -> str:
        return self.node.node_id

    @property
    def proxy_url(self) -> str:
        return f"http://{HOST}:{self.proxy_port}"


class LocalCluster:
    """Nodes of one Ray cluster on this machine; the process that made it is connected to it as the driver."""

    def __init__(self, cpus_per_node: int, temp_dir: Path) -> None:
        from ray.cluster_utils import Cluster

        self.cpus_per_node = cpus_per_node
        self.temp_dir = temp_dir
        self._cluster = Cluster()
        self.nodes: list[ClusterNode] = []
        self.head = self._add(is_head=True)

    def add_node(self) -> ClusterNode:
        """A new worker node; returns once it is registered (its proxy starts when Serve notices the node)."""
        return self._add(is_head=False)

    def kill_node(self, node: ClusterNode) -> None:
        """Kill every process of a worker node at once, as a crash or a lost machine would."""
        if node.is_head:
            raise ValueError("the head node holds the GCS and the driver: kill a worker node")
        self._cluster.remove_node(node.node, allow_graceful=False)
        self.nodes.remove(node)

    @property
    def address(self) -> str:
        return self._cluster.address

    @property
    def workers(self) -> list[ClusterNode]:
        return [node for node in self.nodes if not node.is_head]

    def node_of(self, node_id: str) -> ClusterNode | None:
        return next((node for node in self.nodes if node.node_id == node_id), None)

    def shutdown(self) -> None:
        self._cluster.shutdown()

    def _add(self, *, is_head: bool) -> ClusterNode:
        proxy_port = free_port()
        options: dict[str, Any] = {
            "num_cpus": self.cpus_per_node,
            "metrics_export_port": free_port(),
            "dashboard_agent_listen_port": free_port(),
            "runtime_env_agent_port": free_port(),
            "object_manager_port": free_port(),
        }
        if is_head:
            options.update(gcs_server_port=free_port(), include_dashboard=False, dashboard_port=free_port(),
                           temp_dir=str(self.temp_dir),
                           _system_config=FAST_NODE_FAILURE_DETECTION)
        else:
            options["env_vars"] = {WORKER_PROXY_PORT_ENV: str(proxy_port)}
        node = ClusterNode(self._cluster.add_node(**options), proxy_port, is_head)
        self.nodes.append(node)
        return node


def spread(calls: Sequence[Callable[[T], Awaitable[R]]]) -> Callable[[T], Awaitable[R]]:
    """One call that hands each use to the next of ``calls`` in turn, as a load balancer in front of the nodes'
    proxies would (e.g. each node's ``UpstreamClient.embed_one``)."""
    turns = itertools.cycle(calls)
    return lambda argument: next(turns)(argument)


def wait_for_proxies(nodes: Sequence[ClusterNode], timeout_s: float = 60.0) -> float:
    """Seconds until each node's proxy answers its health check; ``TimeoutError`` if one does not in time.

    With ``proxy_location: EveryNode`` Serve starts a proxy on each node that holds a replica, seconds after the
    replica is placed; a node without one has no proxy (a load balancer's health check leaves it out)."""
    started = time.monotonic()
    waiting = list(nodes)
    while waiting:
        waiting = [node for node in waiting if not _answers(f"{node.proxy_url}/-/healthz")]
        if waiting and time.monotonic() - started > timeout_s:
            raise TimeoutError(f"no proxy answering on port(s) {[node.proxy_port for node in waiting]} "
                               f"within {timeout_s} s")
        time.sleep(0.2)
    return time.monotonic() - started


def _answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as response:
            return response.status == 200
    except OSError:
        return False


@contextmanager
def local_cluster(nodes: int, cpus_per_node: int = 1) -> Iterator[LocalCluster]:
    """A fresh cluster of ``nodes`` nodes with Serve started on it (a proxy on every node); connected as driver.

    Everything is stopped, the temporary directory removed and ``RAY_TMPDIR`` restored on exit."""
    os.environ["HF_HUB_OFFLINE"] = "1"  # the raylets, and so the replicas, inherit it: never reach for a model hub
    os.environ["TRANSFORMERS_OFFLINE"] = "1"
    import ray
    from ray import serve

    temp_dir = Path(tempfile.mkdtemp(prefix="ray-mn-", dir="/tmp"))  # short: Ray's socket paths live under it
    (temp_dir / "ray").mkdir()
    # Ray records the newest cluster's address in $RAY_TMPDIR/ray/ray_current_cluster, where a plain ray.init()
    # elsewhere on the machine would find it and connect: keep that record inside this cluster's own directory.
    previous_tmpdir = os.environ.get(RAY_TMPDIR_ENV)
    os.environ[RAY_TMPDIR_ENV] = str(temp_dir)
    cluster: LocalCluster | None = None
    try:
        cluster = LocalCluster(cpus_per_node, temp_dir)
        for _ in range(nodes - 1):
            cluster.add_node()
        ray.init(address=cluster.address, logging_level="ERROR", log_to_driver=False)
        serve.start(proxy_location="EveryNode", http_options={"host": HOST, "port": cluster.head.proxy_port})
        yield cluster
    finally:
        try:
            if ray.is_initialized():
                serve.shutdown()
                ray.shutdown()
        finally:
            if cluster is not None:
                cluster.shutdown()
            shutil.rmtree(temp_dir, ignore_errors=True)
            if previous_tmpdir is None:
                os.environ.pop(RAY_TMPDIR_ENV, None)
            else:
                os.environ[RAY_TMPDIR_ENV] = previous_tmpdir

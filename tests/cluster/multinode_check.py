"""The application of ``serve_config.cluster.yaml`` on a two-node Ray cluster, checked step by step.

``python -m tests.cluster.multinode_check --report report.json`` starts its own cluster on this machine (two nodes of
one CPU each, a Serve proxy on every node: ``load.multinode``), deploys the real application (the packaged
all-MiniLM-L6-v2, offline) from the cluster config's own args, and checks, in order:

1. ``deploy``: one model replica running (min_replicas is lowered to 1 here so that autoscaling has work to do);
2. ``autoscaling``: under a queue deeper than the target, the queue-depth policy adds a replica, and it lands on the
   node with a free CPU, so both nodes hold one;
3. ``every_proxy``: requests through each node's own proxy port are answered, with the same vectors for the same texts;
4. ``node_loss``: the worker node killed under load (requests spread over both proxies), with one ingress replica
   on each node: no request hangs, every request that reached the surviving (head) node's proxy is answered with its
   vectors, and only the lost node's own connections fail;
5. ``replacement``: the lost replica waits for capacity, and once a node is added it starts there (whose proxy serves);
6. ``batch_api``: the Batch API on one directory both nodes reach (the cluster config's ``batch.directory`` points at
   storage every node mounts; on this machine, a directory of its disk): a file uploaded through the head's proxy is
   found through the worker's; a batch cancelled through the proxy of the node whose ingress does not run it ends
   cancelled; a batch created through the worker's proxy runs in the worker's ingress (one the head's takes first is
   cancelled, and another made), and when the worker node is killed a fifth of the way through, the head's ingress
   takes it over and completes it: every line once, in order, with the vectors ``/v1/embeddings`` gives.

Each step's outcome and figures go to the JSON report; the first failed step ends the run with exit status 1 and
its message on stderr. The cluster is this process's own: it runs as a separate process because a process can be
connected to one Ray cluster only, and the rest of the suite shares another (``serve_instance``).
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import functools
import json
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Awaitable, Callable, Collection, Sequence

import aiohttp
import numpy as np
import openai
import orjson
import yaml

from embeddings_wire import decode_embeddings
from load.loadgen import closed_loop, open_loop
from load.multinode import ClusterNode, LocalCluster, local_cluster, spread, wait_for_proxies
from load.upstream_client import UpstreamClient, UpstreamError
from load.workload import pseudo_sentences
from tests.reliability import cluster as replicas_of

ROOT = Path(__file__).resolve().parents[2]
CLUSTER_CONFIG = ROOT / "serve_config.cluster.yaml"
APP_NAME = "embeddings"
MODEL = "all-MiniLM-L6-v2"
DEPLOYMENT = f"embed-{MODEL}"
INGRESS = "EmbeddingsIngress"
DIM = 384
# The cluster config's autoscaling with delays of seconds (the reliability suite's CI timings), one replica to start
# and a downscale that never comes within the run, so the lost replica is one the deployment still wants.
CI_AUTOSCALING = {"min_replicas": 1, "max_replicas": 2, "upscale_delay_s": 1, "look_back_period_s": 2,
                  "metrics_interval_s": 0.5, "downscale_delay_s": 600}
TEXTS_PER_SCALING_REQUEST = 16  # 24 callers of 16 texts: ~6x the queue depth one replica's target allows
SCALING_CALLERS = 24
HANG_S = 30.0  # a request unanswered this long counts as hung
REPLICA_START_TIMEOUT_S = 120.0  # generous: loading the model competes for the cores with the load on a busy machine
LOSS_RATE_PER_S, LOSS_DURATION_S, KILL_AT_S = 16.0, 12.0, 3.0
BATCH_LINES = 3000  # seconds of work on the two nodes: long enough to lose a node in the middle
BATCH_KILL_AT_SHARE = 0.2  # the node running the batch is killed once this share of its lines is done
BATCH_TRIES = 4  # batches created through the worker's proxy until the worker's ingress is the one that runs one
BATCH_TIMEOUT_S = 180.0
BATCH_SAMPLE = 50  # output lines whose vectors are compared with /v1/embeddings


class CheckFailed(Exception):
    """A step of the run did not hold; the message says what was seen."""


@dataclass(frozen=True)
class Outcome:
    proxy: int  # the proxy port the request went to
    kind: str  # ok | error (answered with an error status) | closed (connection refused or dropped) | hung
    status: int | None = None
    vector: Any = None
    message: str = ""  # an error answer's text


def cluster_app_args(batch_directory: Path) -> dict[str, Any]:
    """``serve_config.cluster.yaml``'s application args, with ``CI_AUTOSCALING`` over each model's autoscaling and
    ``batch_directory`` (which every node of this one-machine cluster reaches) for the Batch API's shared storage."""
    config = yaml.safe_load(CLUSTER_CONFIG.read_text())
    (application,) = [app for app in config["applications"] if app["name"] == APP_NAME]
    args = copy.deepcopy(application["args"])
    for model in args["models"]:
        model["autoscaling"] = {**model["autoscaling"], **CI_AUTOSCALING}
    args["batch"] = {**args["batch"], "directory": str(batch_directory)}
    return args


async def request(client: UpstreamClient, texts: list[str]) -> Outcome:
    """One request and what became of it; never raises."""
    port = int(client.root_url.rsplit(":", 1)[1])
    try:
        vectors = await client.embed(texts)
    except UpstreamError as exc:
        return Outcome(port, "error", exc.status, message=str(exc)[:300])
    except asyncio.TimeoutError:
        return Outcome(port, "hung")
    except aiohttp.ClientError:
        return Outcome(port, "closed")
    return Outcome(port, "ok", 200, vectors)


def node_counts(nodes: Sequence[str]) -> dict[str, int]:
    return {node[:8]: nodes.count(node) for node in sorted(set(nodes))}


def replica_nodes() -> list[str]:
    return [replica.node_id for replica in replicas_of.replicas(APP_NAME, DEPLOYMENT)]


def replica_states() -> dict[str, int]:
    """The model deployment's replicas by state, as Serve reports them (RUNNING, STARTING, ...)."""
    from ray import serve

    return dict(serve.status().applications[APP_NAME].deployments[DEPLOYMENT].replica_states)


def wait_for_replicas(count: int) -> float:
    return replicas_of.wait_for_running_replicas(APP_NAME, DEPLOYMENT, count, REPLICA_START_TIMEOUT_S)


def flock_holder(path: Path) -> int | None:
    """The process holding a ``flock`` on ``path`` (from ``/proc/locks``), if one does."""
    try:
        inode = path.stat().st_ino
    except FileNotFoundError:
        return None
    for line in Path("/proc/locks").read_text().splitlines():
        fields = line.split()
        # "1: FLOCK  ADVISORY  WRITE 1234 fd:01:5678 0 EOF" (a blocked waiter's line has "->" after the number)
        if len(fields) > 5 and fields[1] == "FLOCK" and fields[2] != "->" and int(fields[5].rsplit(":", 1)[1]) == inode:
            return int(fields[4])
    return None


def batch_input(texts: Sequence[str]) -> bytes:
    return b"".join(orjson.dumps({"custom_id": f"line-{i}", "method": "POST", "url": "/v1/embeddings",
                                  "body": {"model": MODEL, "input": text}}) + b"\n" for i, text in enumerate(texts))


class Run:
    """The steps, in order, on one cluster; ``report`` collects each step's figures."""

    def __init__(self, cluster: LocalCluster, clients: dict[int, UpstreamClient], report: dict[str, Any],
                 batch_directory: Path) -> None:
        self.cluster = cluster
        self.clients = clients
        self.report = report
        self.batch_directory = batch_directory

    async def deploy(self) -> None:
        from ray import serve

        from deployments.app import build_app

        started = time.monotonic()
        await asyncio.to_thread(serve.run, build_app(cluster_app_args(self.batch_directory)), name=APP_NAME,
                                route_prefix="/")
        await asyncio.to_thread(wait_for_proxies, [self.cluster.head])
        nodes = replica_nodes()
        self.report["deploy"] = {"seconds": round(time.monotonic() - started, 1), "replica_nodes": node_counts(nodes)}
        if len(nodes) != 1:
            raise CheckFailed(f"expected one model replica after deploy (min_replicas 1), found {len(nodes)}")

    async def autoscaling(self) -> None:
        (first,) = replica_nodes()
        free = [node.node_id for node in self.cluster.nodes if node.node_id != first]
        started = time.monotonic()
        scaled = asyncio.create_task(asyncio.to_thread(wait_for_replicas, 2))
        sent = 0
        while not scaled.done():
            keys = [f"scaling {sent + i}" for i in range(4 * SCALING_CALLERS)]
            result = await closed_loop(self._spread(self._texts_of), keys, SCALING_CALLERS)
            sent += result.submitted
            if not any(outcome.kind == "ok" for outcome in result.vectors if outcome is not None):
                raise CheckFailed(f"no scaling request was answered with vectors: {result.error_sample}")
        try:
            scaled.result()
        except TimeoutError as exc:
            raise CheckFailed(f"queue-depth autoscaling did not bring a second replica up: {exc}") from None
        await asyncio.to_thread(wait_for_proxies, self.cluster.nodes)  # each node now holds a replica
        nodes = replica_nodes()
        added = [node for node in nodes if node != first]
        self.report["autoscaling"] = {"seconds_to_second_replica": round(time.monotonic() - started, 1),
                                      "requests_sent": sent, "replica_nodes": node_counts(nodes),
                                      "new_replica_on_free_node": added == free}
        if added != free:
            raise CheckFailed(f"the new replica went to {node_counts(added)}, not the node with a free CPU "
                              f"{node_counts(free)} (replicas per node: {node_counts(nodes)})")

    async def every_proxy(self) -> None:
        texts = pseudo_sentences(8, seed=1)
        answers = {port: await request(client, texts) for port, client in self.clients.items()}
        self.report["every_proxy"] = {str(port): outcome.kind for port, outcome in answers.items()}
        failed = {port: (outcome.kind, outcome.status) for port, outcome in answers.items() if outcome.kind != "ok"}
        if failed:
            raise CheckFailed(f"a node's proxy did not serve: {failed}")
        first, *others = (np.stack(outcome.vector) for outcome in answers.values())
        if first.shape != (len(texts), DIM) or any(not np.allclose(first, other, atol=1e-5) for other in others):
            raise CheckFailed("the proxies answered the same texts with different vectors")

    async def node_loss(self) -> None:
        victim = self.cluster.workers[0]
        ingress_nodes = [replica.node_id for replica in replicas_of.replicas(APP_NAME, INGRESS)]
        offsets = np.cumsum(np.random.default_rng(3).exponential(1 / LOSS_RATE_PER_S, 10_000))
        offsets = offsets[offsets < LOSS_DURATION_S].tolist()
        texts = pseudo_sentences(len(offsets), seed=2)
        t0 = time.monotonic()

        async def kill_later() -> float:
            await asyncio.sleep(KILL_AT_S)
            await asyncio.to_thread(self.cluster.kill_node, victim)
            return time.monotonic() - t0

        killer = asyncio.create_task(kill_later())
        result = await open_loop(self._spread(lambda text: [text]), texts, offsets, LOSS_DURATION_S + 2 * HANG_S)
        killed_at = await killer
        outcomes: list[Outcome | None] = result.vectors
        kinds = [outcome.kind if outcome is not None else "hung" for outcome in outcomes]
        tally = {kind: kinds.count(kind) for kind in ("ok", "error", "closed", "hung")}
        head = [(offset, outcome) for offset, outcome in zip(offsets, outcomes)
                if outcome is not None and outcome.proxy == self.cluster.head.proxy_port]
        tail = [outcome for offset, outcome in head if offset > LOSS_DURATION_S * 0.75]
        surviving = [outcome.kind for _, outcome in head]
        self.report["node_loss"] = {
            "requests": len(outcomes), "killed_at_s": round(killed_at, 2), "outcomes": tally,
            "ingress_replicas_on_lost_node": ingress_nodes.count(victim.node_id),
            "ingress_replicas_on_head": ingress_nodes.count(self.cluster.head.node_id),
            "error_statuses": sorted({o.status for o in outcomes if o is not None and o.kind == "error"}),
            "surviving_proxy": {kind: surviving.count(kind) for kind in ("ok", "error", "closed")},
            "surviving_proxy_errors": sorted({o.message for _, o in head if o.kind == "error"}),
            "head_proxy_last_quarter": {"requests": len(tail), "ok": sum(o.kind == "ok" for o in tail)},
        }
        if tally["hung"] or result.backlog:
            raise CheckFailed(f"{tally['hung'] + result.backlog} request(s) hung after the node was lost")
        if ingress_nodes.count(self.cluster.head.node_id) != 1:
            raise CheckFailed(f"expected one ingress replica on each node, found {node_counts(ingress_nodes)}")
        if any(kind != "ok" for kind in surviving):
            raise CheckFailed(f"a request that reached the surviving node's proxy failed: {self.report['node_loss']}")
        if not tail:
            raise CheckFailed(f"the surviving node's proxy was not serving by the end: {self.report['node_loss']}")

    async def replacement(self) -> None:
        alive = replica_nodes()
        states = await asyncio.to_thread(replica_states)
        self.report["replacement"] = {"replica_states_before_node_added": states}
        if len(alive) != 1 or sum(states.values()) != 2:
            raise CheckFailed(f"with one node left, expected one replica alive and the lost one waiting for a CPU; "
                              f"{len(alive)} alive, Serve reports {states}")
        started = time.monotonic()
        new = self.cluster.add_node()  # in the main thread: a node registers signal handlers
        try:
            await asyncio.to_thread(wait_for_replicas, 2)
        except TimeoutError as exc:
            raise CheckFailed(f"the lost replica was not replaced on the added node: {exc}") from None
        await asyncio.to_thread(wait_for_proxies, [new])
        nodes = replica_nodes()
        async with UpstreamClient(new.proxy_url, model=MODEL, timeout_s=HANG_S) as client:
            answer = await request(client, ["served by the added node's proxy"])
        self.report["replacement"].update(seconds_after_node_added=round(time.monotonic() - started, 1),
                                          replica_nodes=node_counts(nodes), added_node_proxy=answer.kind)
        if new.node_id not in nodes:
            raise CheckFailed(f"no replica on the added node: {node_counts(nodes)}")
        if answer.kind != "ok":
            raise CheckFailed(f"the added node's proxy did not serve: {answer}")

    async def batch_api(self) -> None:
        head, worker = self.cluster.head, self.cluster.workers[0]
        texts = pseudo_sentences(BATCH_LINES, seed=4)
        report: dict[str, Any] = {"lines": BATCH_LINES}
        self.report["batch_api"] = report
        via_head = openai.AsyncOpenAI(base_url=f"{head.proxy_url}/v1", api_key="unused", max_retries=0)
        via_worker = openai.AsyncOpenAI(base_url=f"{worker.proxy_url}/v1", api_key="unused", max_retries=0)
        uploaded = await via_head.files.create(file=("corpus.jsonl", batch_input(texts)), purpose="batch")
        found = await via_worker.files.retrieve(uploaded.id)
        if found.bytes != uploaded.bytes:
            raise CheckFailed(f"the worker's proxy sees the head's upload as {found}, not {uploaded}")

        ingress_nodes = {replica.pid: replica.node_id for replica in replicas_of.replicas(APP_NAME, INGRESS)}
        names = {head.node_id: "head", worker.node_id: "worker"}

        async def started() -> tuple[Any, str]:
            """A batch created through the worker's proxy, and the node whose ingress runs it."""
            batch = await via_worker.batches.create(input_file_id=uploaded.id, endpoint="/v1/embeddings",
                                                    completion_window="24h")
            return batch, names.get(ingress_nodes.get(await self._lock_holder(batch.id)), "none")

        async def cancel_elsewhere(batch: Any, runner: str) -> None:
            """Cancelled through the proxy of the node that does not run it: its runner sees another node's cancel."""
            await (via_head if runner == "worker" else via_worker).batches.cancel(batch.id)
            ended = await self._batch_ended(via_head, batch.id)
            if ended.status != "cancelled":
                raise CheckFailed(f"a batch cancelled through the other node's proxy ended {ended.status}")

        batch, runner = await started()
        await cancel_elsewhere(batch, runner)
        report["cancelled_through_the_other_node"] = runner

        # Batches created through the worker's proxy until one runs in the worker's ingress (the ingress a create
        # reaches looks at once, the other at its next poll); one the head's runs is cancelled.
        runners: list[str] = []
        for _ in range(BATCH_TRIES):
            batch, runner = await started()
            runners.append(runner)
            if runner == "worker":
                break
            await cancel_elsewhere(batch, runner)
        report["runner_of_each_try"] = runners
        if runners[-1] != "worker":
            raise CheckFailed(f"no batch ran in the worker's ingress in {BATCH_TRIES} tries: {runners}")

        # Its node killed mid-batch: the head's ingress takes the batch over after the lines finished before.
        while (done := (await via_head.batches.retrieve(batch.id)).request_counts.completed) < \
                BATCH_LINES * BATCH_KILL_AT_SHARE:
            await asyncio.sleep(0.1)
        await asyncio.to_thread(self.cluster.kill_node, worker)
        killed_at = time.time()
        report["lines_done_when_killed"] = done
        lost = {pid for pid, node in ingress_nodes.items() if node == worker.node_id}
        report["runner_after_kill"] = names.get(ingress_nodes.get(await self._lock_holder(batch.id, other_than=lost)),
                                                "none")
        finished = await self._batch_ended(via_head, batch.id)
        counts = finished.request_counts
        report.update(status=finished.status, completed=counts.completed, failed=counts.failed,
                      completed_s_after_kill=round(finished.completed_at - killed_at, 1))
        if finished.status != "completed" or counts.completed != BATCH_LINES or counts.failed:
            raise CheckFailed(f"the batch taken over after its node was lost ended {finished.status} with {counts}")
        output = (await via_head.files.content(finished.output_file_id)).content.splitlines()
        lines = [orjson.loads(raw) for raw in output]
        report["output_lines"] = len(lines)
        if [line["custom_id"] for line in lines] != [f"line-{i}" for i in range(BATCH_LINES)]:
            raise CheckFailed(f"the output is not every line once and in order ({len(lines)} lines)")
        sample = list(range(0, BATCH_LINES, BATCH_LINES // BATCH_SAMPLE))
        direct = np.stack(await self.clients[head.proxy_port].embed([texts[i] for i in sample]))
        batched = np.stack([decode_embeddings(lines[i]["response"]["body"], 1)[0] for i in sample])
        report["min_cosine"] = float((direct * batched).sum(axis=1).min())
        if report["min_cosine"] < 0.99999:
            raise CheckFailed(f"batch vectors differ from /v1/embeddings: min cosine {report['min_cosine']}")

    async def _lock_holder(self, batch_id: str, other_than: Collection[int] = ()) -> int | None:
        """The process that took the batch's lock (a runner running it), waiting up to 30 s for one not among
        ``other_than``."""
        lock = self.batch_directory / "batches" / f"{batch_id}.lock"
        deadline = time.monotonic() + 30.0
        while ((pid := flock_holder(lock)) is None or pid in other_than) and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        return pid

    @staticmethod
    async def _batch_ended(client: openai.AsyncOpenAI, batch_id: str) -> Any:
        deadline = time.monotonic() + BATCH_TIMEOUT_S
        while (batch := await client.batches.retrieve(batch_id)).status not in ("completed", "failed", "expired",
                                                                                 "cancelled"):
            if time.monotonic() > deadline:
                raise CheckFailed(f"batch {batch_id} still {batch.status} after {BATCH_TIMEOUT_S} s")
            await asyncio.sleep(0.2)
        return batch

    def _spread(self, texts_of: Callable[[str], list[str]]) -> Callable[[str], Awaitable[Outcome]]:
        """An "embed one" for the load generators: each request to the next node's proxy in turn."""
        return spread([functools.partial(_request_texts_of, client, texts_of) for client in self.clients.values()])

    @staticmethod
    def _texts_of(key: str) -> list[str]:
        return [f"{key} text {i}" for i in range(TEXTS_PER_SCALING_REQUEST)]


async def _request_texts_of(client: UpstreamClient, texts_of: Callable[[str], list[str]], key: str) -> Outcome:
    return await request(client, texts_of(key))


STEPS = ("deploy", "autoscaling", "every_proxy", "node_loss", "replacement", "batch_api")


async def run_steps(cluster: LocalCluster, report: dict[str, Any]) -> None:
    clients = {node.proxy_port: UpstreamClient(node.proxy_url, model=MODEL, timeout_s=HANG_S)
               for node in cluster.nodes}
    run = Run(cluster, clients, report, cluster.temp_dir / "batch")
    for client in clients.values():
        await client.__aenter__()
    try:
        for step in STEPS:
            await getattr(run, step)()
            report.setdefault("passed", []).append(step)
            print(f"passed: {step} {report.get(step, '')}", file=sys.stderr, flush=True)
    finally:
        for client in clients.values():
            await client.__aexit__(None, None, None)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.cluster.multinode_check", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--report", type=Path, required=True, help="where the JSON report goes")
    args = parser.parse_args(argv)
    report: dict[str, Any] = {"steps": list(STEPS)}
    started = time.monotonic()
    try:
        with local_cluster(nodes=2) as cluster:
            report["nodes"] = [node_summary(node) for node in cluster.nodes]
            asyncio.run(run_steps(cluster, report))
    except CheckFailed as exc:
        report["failed"] = str(exc)
    except Exception:  # the run broke rather than a check failing: the report says where
        report["failed"] = traceback.format_exc()
    report["seconds"] = round(time.monotonic() - started, 1)
    args.report.write_text(json.dumps(report, indent=2))
    print(json.dumps(report, indent=2))
    if "failed" in report:
        print(f"multi-node check failed: {report['failed']}", file=sys.stderr)
        return 1
    return 0


def node_summary(node: ClusterNode) -> dict[str, Any]:
    return {"node_id": node.node_id[:8], "proxy_port": node.proxy_port, "is_head": node.is_head}


if __name__ == "__main__":
    sys.exit(main())

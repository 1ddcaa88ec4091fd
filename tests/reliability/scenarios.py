"""The reliability scenarios, as plain functions shared by the pytest suite and ``python -m tests.reliability.run``.

Every scenario drives the full service over HTTP (Serve proxy -> ``EmbeddingsIngress`` -> ``embed-<model>`` with
the ``openai`` backend -> the simulated upstream in its own process) and returns a ``Result``: what became of every
request, what the upstream billed, and how long the service took to recover.
"""

from __future__ import annotations

import asyncio
import copy
import threading
import time
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Awaitable, Callable

from load.upstream import RunningUpstream

from . import cluster
from .cluster import POISON, SLOW, UPSTREAM_MODEL
from .scale import Scale
from .traffic import (Outcome, Phase, PlanMaker, Run, billing, counts, failure_window, new_session, normal_latency_s,
                      recovery_s, run_phases, statuses, summary_latency)

CLIENT_KEYS = ("rel-client-key-0123456789abcdef", "rel-client-key-fedcba9876543210")
UPSTREAM_KEY = "sk-rel-upstream-5f2b9c1e7d3a4b6f"
WRONG_UPSTREAM_KEY = "sk-rel-wrong-upstream-8e1d0c2b4a69"
UPSTREAM_KEY_ENV = "REL_UPSTREAM_KEY"
UPSTREAM_MAX_INPUT_TOKENS = 512


# ---- the applications ---------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Target:
    """One model of a deployed application, and the upstream behind it."""

    service_url: str
    app_name: str
    prefix: str
    model: str
    upstream: RunningUpstream
    api_key: str | None = None
    args: dict[str, Any] = field(default_factory=dict)

    @property
    def url(self) -> str:
        return f"{self.service_url}{self.prefix}/v1/embeddings"

    @property
    def deployment(self) -> str:
        return f"embed-{self.model}"

    def backend_stats(self) -> dict[str, int]:
        return cluster.model_handle(self.app_name, self.model).backend_stats.remote().result(timeout_s=30)

    def batcher_stats(self) -> dict[str, Any]:
        return cluster.model_handle(self.app_name, self.model).stats.remote().result(timeout_s=30)


FAULTS_UPSTREAM = dict(base_latency_ms=20, per_token_ms=0.02, jitter=0.2, max_concurrency=16, fail_marker=POISON,
                       max_input_tokens=UPSTREAM_MAX_INPUT_TOKENS, api_key=UPSTREAM_KEY)
OVERLOAD_UPSTREAM = dict(base_latency_ms=100, per_token_ms=0, jitter=0, max_concurrency=4, slow_marker=SLOW)
CHURN_UPSTREAM = dict(base_latency_ms=60, per_token_ms=0, jitter=0.1, max_concurrency=16)
SCALE_UPSTREAM = dict(base_latency_ms=100, per_token_ms=0, jitter=0.1, max_concurrency=16)


def write_secrets(directory: Path) -> dict[str, Path]:
    """Key files: the service reads its secrets from files, so no key travels in a runtime_env (Ray logs those)."""
    directory.mkdir(parents=True, exist_ok=True)
    files = {"client": directory / "client-keys", "upstream": directory / "upstream-key",
             "wrong_upstream": directory / "wrong-upstream-key"}
    files["client"].write_text("\n".join(CLIENT_KEYS) + "\n")
    files["upstream"].write_text(UPSTREAM_KEY + "\n")
    files["wrong_upstream"].write_text(WRONG_UPSTREAM_KEY + "\n")
    for path in files.values():
        path.chmod(0o600)
    return files


def _openai_model(name: str, upstream: RunningUpstream, batching: dict[str, Any], **options: Any) -> dict[str, Any]:
    return {"name": name, "backend": "openai", "base_url": upstream.base_url, "upstream_model": UPSTREAM_MODEL,
            "batching": batching, **{"upstream_timeout_s": 5, **options}}


def _key_file_env(path: Path) -> dict[str, Any]:
    return {"runtime_env": {"env_vars": {f"{UPSTREAM_KEY_ENV}_FILE": str(path)}}}


def faults_app_args(upstream: RunningUpstream, secrets: dict[str, Path]) -> dict[str, Any]:
    batching = {"max_batch_size": 32, "max_wait_ms": 20, "max_concurrent_batches": 4, "max_retries": 3,
                "batch_timeout_s": 0.5, "max_queue_depth": 4096}
    return {
        "models": [
            _openai_model("rel-faults", upstream, batching, api_key_env=UPSTREAM_KEY_ENV, num_replicas=1,
                          max_input_tokens=UPSTREAM_MAX_INPUT_TOKENS,
                          ray_actor_options=_key_file_env(secrets["upstream"])),
            # The same upstream with a key it refuses: the security test's source of upstream 401s.
            _openai_model("rel-badkey", upstream, {"max_batch_size": 8, "max_retries": 0},
                          api_key_env=UPSTREAM_KEY_ENV, num_replicas=1,
                          ray_actor_options=_key_file_env(secrets["wrong_upstream"])),
        ],
        "ingress": {"env_vars": {"EMBEDDINGS_API_KEYS_FILE": str(secrets["client"])}},
    }


OVERLOAD_BATCHING = {"max_batch_size": 8, "max_wait_ms": 10, "max_concurrent_batches": 1, "max_queue_depth": 200,
                     "max_retries": 1}


def overload_app_args(upstream: RunningUpstream) -> dict[str, Any]:
    # A generous upstream timeout: the admission test holds the only batch slot with one 6 s call.
    return {"models": [_openai_model("rel-overload", upstream, dict(OVERLOAD_BATCHING), num_replicas=1,
                                     upstream_timeout_s=30)]}


def churn_app_args(upstream: RunningUpstream, replicas: int) -> dict[str, Any]:
    batching = {"max_batch_size": 16, "max_wait_ms": 25, "max_concurrent_batches": 2, "max_retries": 2}
    return {"models": [_openai_model("rel-churn", upstream, batching, num_replicas=replicas)]}


def scale_app_args(upstream: RunningUpstream, name: str) -> dict[str, Any]:
    """One replica that a LOW flood of a few connections outgrows, and autoscaling quick enough for CI: the queue-
    depth policy of serve_config.yaml with delays of seconds instead of minutes."""
    batching = {"max_batch_size": 8, "max_wait_ms": 25, "max_concurrent_batches": 1}
    autoscaling = {"min_replicas": 1, "max_replicas": 2, "upscale_delay_s": 1, "downscale_delay_s": 6,
                   "look_back_period_s": 2,
                   "policy": {"policy_function": "deployments.autoscaling:QueueDepthPolicy",
                              "policy_kwargs": {"target_queue_depth_per_replica": 32}}}
    return {"models": [_openai_model(name, upstream, batching, autoscaling=autoscaling)]}


# ---- results ------------------------------------------------------------------------------------------------------

@dataclass
class Result:
    scenario: str
    scale: str
    load: str
    faults: str
    requests: int
    inputs: int
    counts: dict[str, int]
    statuses: dict[str, int]
    billed: int
    needed: int
    sent_clean: int
    abandoned: int
    recovery_s: float | None
    latency: dict[str, dict[str, float | None]]
    extra: dict[str, Any] = field(default_factory=dict)
    outcomes: list[Outcome] = field(default_factory=list, repr=False)

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data.pop("outcomes")
        return data

    def clean_requests(self) -> list[Outcome]:
        return [outcome for outcome in self.outcomes if not outcome.plan.poisoned]


def _result(name: str, scale: Scale, load: str, faults: str, run_outcomes: list[Outcome], billed: int,
            abandoned: int, recovery: float | None, latency: dict[str, dict[str, float | None]],
            **extra: Any) -> Result:
    bill = billing(run_outcomes)
    return Result(
        scenario=name, scale=scale.name, load=load, faults=faults, requests=len(run_outcomes),
        inputs=sum(len(outcome.plan.inputs) for outcome in run_outcomes), counts=counts(run_outcomes),
        statuses=statuses(run_outcomes), billed=billed, needed=bill["needed"], sent_clean=bill["sent_clean"],
        abandoned=abandoned, recovery_s=None if recovery is None else round(recovery, 2), latency=latency,
        extra=extra, outcomes=run_outcomes,
    )


class Sampler:
    """Samples, every ``interval_s`` while load runs, the model replica's queue (queued and delayed items, from its
    batchers) and its resident memory (VmRSS from /proc/<pid>/status); keeps the peaks."""

    def __init__(self, target: Target, interval_s: float = 0.1) -> None:
        self._handle = cluster.model_handle(target.app_name, target.model)
        self._pids = [replica.pid for replica in cluster.replicas(target.app_name, target.deployment)]
        self._interval_s = interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self.rss_before_kib = max(cluster.memory_kib(pid)["VmRSS"] for pid in self._pids)
        self.peak_rss_kib = self.rss_before_kib
        self.max_queue_depth = 0
        self.max_delayed = 0
        self.samples = 0  # samples taken; a missed one is not a finding, but figures() refuses a run with none
        self.missed: list[str] = []

    def __enter__(self) -> "Sampler":
        self._thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._stop.set()
        self._thread.join()

    def _sample(self) -> None:
        while not self._stop.is_set():
            try:
                snapshots = self._handle.stats.remote().result(timeout_s=5).values()
                self.max_queue_depth = max(self.max_queue_depth, sum(s.queue_depth for s in snapshots))
                self.max_delayed = max(self.max_delayed, sum(s.delayed for s in snapshots))
                self.peak_rss_kib = max([self.peak_rss_kib] + [cluster.memory_kib(pid)["VmRSS"] for pid in self._pids])
                self.samples += 1
            except Exception as exc:  # a sample missed under load, or a replica gone, is not a finding by itself
                self.missed.append(f"{type(exc).__name__}: {exc}"[:200])
            self._stop.wait(self._interval_s)

    def figures(self) -> dict[str, Any]:
        """The peaks; ``AssertionError`` if no sample was taken (peaks of 0 and an untouched memory figure would
        pass every bound on them)."""
        assert self.samples > 0, f"the sampler took no sample ({len(self.missed)} missed): {self.missed[-3:]}"
        return {"max_queue_depth_seen": self.max_queue_depth, "max_delayed_seen": self.max_delayed,
                "samples": self.samples, "samples_missed": len(self.missed),
                "rss_mib": {"before": round(self.rss_before_kib / 1024, 1),
                            "peak": round(self.peak_rss_kib / 1024, 1)}}


def _between(outcomes: list[Outcome], start: float, end: float) -> list[Outcome]:
    return [outcome for outcome in outcomes if start <= outcome.start < end]


def _drive(target: Target, make_plan: PlanMaker, phases: list[Phase],
           during: Callable[[float], Awaitable[dict[str, Any]]] | None = None) -> Run:
    """``run_phases`` against ``target`` over a new session; ``during(t0)``, if given, runs alongside."""
    async def drive() -> Run:
        async with new_session() as client:
            return await run_phases(client, target.url, target.model, make_plan, phases, api_key=target.api_key,
                                    during=during)

    return asyncio.run(drive())


# ---- upstream faults ------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class UpstreamFault:
    description: str
    fault_on: dict[str, Any] = field(default_factory=dict)  # set_faults(...) at the start of the fault window
    fault_off: dict[str, Any] = field(default_factory=dict)  # set_faults(...) after it
    marker_rate: float = 0.0
    over_limit_rate: float = 0.0
    down: bool = False
    extra_recovery_s: float = 0.0  # calm load after the fault, on top of the scale's recovery


STORM_RPM = 20
# A budget paced to the provider's limit learns that the limit was lifted only from its next call's answer, which may
# come one paced interval after the lift (60 / (headroom x rpm) s, the default headroom 0.9): the storm's recovery
# lasts that much longer, so that its last requests, which must all be served, come after it.
STORM_PACED_INTERVAL_S = 60 / (0.9 * STORM_RPM)

UPSTREAM_FAULTS = {
    "errors-500": UpstreamFault("5% of upstream calls answer 500", {"error_rate": 0.05}, {"error_rate": 0.0}),
    "poison": UpstreamFault(
        f"2% of inputs always refused: 1% hold the fail_marker (upstream 400), 1% exceed "
        f"{UPSTREAM_MAX_INPUT_TOKENS} tokens", marker_rate=0.01, over_limit_rate=0.01),
    "slow": UpstreamFault("10% of calls take +1.5 s, past the 0.5 s batch timeout",
                          {"slow_rate": 0.10, "slow_ms": 1500}, {"slow_rate": 0.0}),
    "429-storm": UpstreamFault(f"upstream limited to {STORM_RPM} calls/min: 429 + Retry-After",
                               {"rpm": STORM_RPM}, {"rpm": None}, extra_recovery_s=STORM_PACED_INTERVAL_S),
    "down": UpstreamFault("upstream answers 503 (+ Retry-After) to everything, then is back", down=True),
}


def upstream_fault(target: Target, scale: Scale, name: str) -> Result:
    fault = UPSTREAM_FAULTS[name]
    upstream = target.upstream
    upstream.set_faults(error_rate=0.0, slow_rate=0.0, rpm=None, tpm=None, down_for_s=0.0)
    fault_s = scale.down_s if fault.down else scale.fault_s
    long_deadline = max(8.0, scale.down_s + 5.0)  # outlasts an outage; a quarter of the requests allow only 2 s
    make_plan = PlanMaker(f"{name}-{uuid.uuid4().hex[:8]}", marker_rate=fault.marker_rate,
                          over_limit_rate=fault.over_limit_rate, over_limit_words=UPSTREAM_MAX_INPUT_TOKENS + 50,
                          low_fraction=0.2, timeouts=(2.0, long_deadline, long_deadline, long_deadline))
    make_plan.poisoning = False

    def fault_on() -> None:
        make_plan.poisoning = True
        upstream.set_faults(**({"down_for_s": fault_s} if fault.down else fault.fault_on))

    def fault_off() -> None:
        make_plan.poisoning = False
        if not fault.down:  # a down upstream comes back by itself
            upstream.set_faults(**fault.fault_off)

    phases = [Phase("baseline", scale.baseline_s, scale.rate_per_s),
              Phase("fault", fault_s, scale.rate_per_s, fault_on),
              Phase("recovery", scale.recovery_s + fault.extra_recovery_s, scale.rate_per_s, fault_off)]
    before_abandoned = target.backend_stats().get("abandoned_items", 0)
    upstream.reset()
    with Sampler(target) as sampler:
        run = _drive(target, make_plan, phases)
    time.sleep(2.0 if name == "slow" else 0.2)  # calls the service abandoned finish (and are billed) upstream
    stats = upstream.stats()
    abandoned = target.backend_stats().get("abandoned_items", 0) - before_abandoned
    baseline = _between(run.outcomes, 0, run.phase_ends["baseline"])
    threshold = normal_latency_s(baseline)
    clean = [outcome for outcome in run.outcomes if not outcome.plan.poisoned]
    recovery = recovery_s(clean, run.phase_ends["fault"], threshold)
    latency = {phase: summary_latency(_between(run.outcomes, run.phase_starts[phase], run.phase_ends[phase]))
               for phase in ("baseline", "fault", "recovery")}
    load = (f"{scale.rate_per_s:g} req/s (1-16 inputs, 20% LOW, deadlines 2 s / {long_deadline:g} s) for "
            f"{scale.baseline_s:g}+{fault_s:g}+{scale.recovery_s + fault.extra_recovery_s:g} s")
    return _result(name, scale, load, fault.description, run.outcomes, stats["items_billed"], abandoned, recovery,
                   latency, upstream=stats, normal_median_s=round(threshold, 3), **sampler.figures())


# ---- overload -------------------------------------------------------------------------------------------------------

OVERLOAD_INPUTS = 8  # per request
OVERLOAD_CAPACITY_ITEMS_S = 8 / 0.105  # one 8-item batch at a time, ~100 ms each


def overload(target: Target, scale: Scale) -> Result:
    upstream = target.upstream
    upstream.set_faults(error_rate=0.0, slow_rate=0.0, rpm=None, tpm=None, down_for_s=0.0)
    capacity_req_s = OVERLOAD_CAPACITY_ITEMS_S / OVERLOAD_INPUTS
    make_plan = PlanMaker(f"overload-{uuid.uuid4().hex[:8]}", sizes=(OVERLOAD_INPUTS,), low_fraction=0.5,
                          timeouts=(30.0,))
    calm_s = max(2.0, scale.baseline_s)
    phases = [Phase("baseline", calm_s, 0.5 * capacity_req_s),
              Phase("fault", scale.overload_s, 5 * capacity_req_s),
              Phase("recovery", max(6.0, scale.recovery_s), 0.5 * capacity_req_s)]
    (replica,) = cluster.replicas(target.app_name, target.deployment)
    upstream.reset()
    with Sampler(target) as sampler:
        run = _drive(target, make_plan, phases)
    memory_after = cluster.memory_kib(replica.pid)
    stats = upstream.stats()
    baseline = _between(run.outcomes, 0, run.phase_ends["baseline"])
    overloaded = _between(run.outcomes, run.phase_starts["fault"], run.phase_ends["fault"])
    threshold = normal_latency_s(baseline)
    recovery = recovery_s(run.outcomes, run.phase_ends["fault"], threshold)
    refused = {priority: sum(1 for o in overloaded if o.plan.priority == priority and o.status == 429)
               for priority in ("high", "low")}
    offered = {priority: sum(1 for o in overloaded if o.plan.priority == priority) for priority in ("high", "low")}
    ok_items_s = sum(len(o.plan.inputs) for o in overloaded if o.kind == "ok") / scale.overload_s
    latency = {phase: summary_latency(_between(run.outcomes, run.phase_starts[phase], run.phase_ends[phase]))
               for phase in ("baseline", "fault", "recovery")}
    load = (f"{OVERLOAD_INPUTS}-input requests, half LOW: 0.5x capacity ({0.5 * capacity_req_s:.1f} req/s) for "
            f"{calm_s:g} s, 5x ({5 * capacity_req_s:.0f} req/s = {5 * OVERLOAD_CAPACITY_ITEMS_S:.0f} inputs/s) for "
            f"{scale.overload_s:g} s, 0.5x for {phases[2].duration_s:g} s")
    faults = (f"capacity ~{OVERLOAD_CAPACITY_ITEMS_S:.0f} inputs/s (8-input batches, 1 at a time, 100 ms upstream); "
              f"max_queue_depth {OVERLOAD_BATCHING['max_queue_depth']}, LOW refused from "
              f"{int(OVERLOAD_BATCHING['max_queue_depth'] * 0.8)}")
    return _result("overload", scale, load, faults, run.outcomes, stats["items_billed"], 0, recovery, latency,
                   refused_429=refused, offered=offered, served_inputs_per_s=round(ok_items_s, 1),
                   **sampler.figures(), rss_after_mib=round(memory_after["VmRSS"] / 1024, 1),
                   vmhwm_mib=round(memory_after["VmHWM"] / 1024, 1), normal_median_s=round(threshold, 3))


# ---- replica loss and redeploy --------------------------------------------------------------------------------------

@dataclass(frozen=True)
class ChurnRun:
    """Steady load through a baseline and a fault phase, and an event (a kill, a redeploy) as the baseline ends."""

    scale: Scale
    load: str
    run: Run
    billed: int
    event_at: float  # seconds since the run started

    def result(self, name: str, faults: str, after_event: str, settled_at: float | None, **extra: Any) -> Result:
        """The scenario's result: latency before the event and after it (as ``after_event``); recovery counted as in
        ``_recovery_after``."""
        outcomes = self.run.outcomes
        baseline = _between(outcomes, 0, self.event_at)
        latency = {"baseline": summary_latency(baseline),
                   after_event: summary_latency(_between(outcomes, self.event_at, self.run.phase_ends["fault"]))}
        recovery = _recovery_after(outcomes, self.event_at, settled_at, normal_latency_s(baseline))
        return _result(name, self.scale, self.load, faults, outcomes, self.billed, 0, recovery, latency, **extra)


def _churn(target: Target, scale: Scale, plan_name: str, timeout_s: float,
           event: Callable[[float], Awaitable[dict[str, Any]]], event_mark: str) -> ChurnRun:
    """Steady load on ``target``; ``event(t0)`` starts as the baseline ends and returns its marks, ``event_mark``
    among them: when the event started."""
    make_plan = PlanMaker(f"{plan_name}-{uuid.uuid4().hex[:8]}", low_fraction=0.2, timeouts=(timeout_s,))
    phases = [Phase("baseline", scale.baseline_s + 1.0, scale.rate_per_s),
              Phase("fault", scale.churn_s, scale.rate_per_s)]

    async def event_after_baseline(t0: float) -> dict[str, Any]:
        await asyncio.sleep(phases[0].duration_s)
        return await event(t0)

    target.upstream.reset()
    run = _drive(target, make_plan, phases, during=event_after_baseline)
    load = f"{scale.rate_per_s:g} req/s (1-16 inputs) for {phases[0].duration_s:g} s, then {scale.churn_s:g} s more"
    return ChurnRun(scale, load, run, target.upstream.stats()["items_billed"], run.marks[event_mark])


def replica_loss(target: Target, scale: Scale) -> Result:
    cluster.wait_for_running_replicas(target.app_name, target.deployment, 2)
    marks: dict[str, Any] = {}

    async def kill_one(t0: float) -> dict[str, Any]:
        victim = cluster.replicas(target.app_name, target.deployment)[0]
        marks["killed_at"] = time.monotonic() - t0
        await asyncio.to_thread(cluster.kill_replica, victim)
        marks["victim_pid"] = victim.pid
        while True:  # until Serve reports two running replicas again, one of them new
            await asyncio.sleep(0.1)
            now = await asyncio.to_thread(cluster.replicas, target.app_name, target.deployment)
            running = await asyncio.to_thread(cluster.running_replicas, target.app_name, target.deployment)
            if running == 2 and victim.name not in {replica.name for replica in now} and len(now) == 2:
                marks["replaced_at"] = time.monotonic() - t0
                return marks
            if time.monotonic() - t0 > marks["killed_at"] + 120:
                return marks

    churn = _churn(target, scale, "loss", 10.0, kill_one, "killed_at")
    killed_at = churn.event_at
    window = failure_window(churn.run.outcomes)
    failed = [o for o in churn.run.outcomes if o.kind != "ok"]
    replaced = churn.run.marks.get("replaced_at")
    return churn.result(
        "replica-loss", "ray.kill of one of the two model replicas (no graceful shutdown)", after_event="after_kill",
        settled_at=replaced,
        failed_requests=len(failed),
        failure_window_s=None if window is None else {"first_failure_after_kill": round(window[0] - killed_at, 2),
                                                      "last_failure_after_kill": round(window[1] - killed_at, 2)},
        replaced_after_s=None if replaced is None else round(replaced - killed_at, 2),
    )


def _recovery_after(outcomes: list[Outcome], event_at: float, settled_at: float | None,
                    normal_s: float) -> float | None:
    """Seconds from an event (a kill, a redeploy) until latency is normal again once Serve has settled (the
    replacement running, the redeploy done): right after the event the survivors may not yet be degraded."""
    if settled_at is None:
        return None
    after = recovery_s(outcomes, settled_at, normal_s)
    return None if after is None else settled_at - event_at + after


def redeploy(target: Target, scale: Scale, *, replicas_after: int = 1) -> Result:
    new_args = copy.deepcopy(target.args)
    before = len(cluster.replicas(target.app_name, target.deployment))
    for model in new_args["models"]:
        model["num_replicas"] = replicas_after

    async def redeploy_now(t0: float) -> dict[str, Any]:
        marks = {"redeploy_started": time.monotonic() - t0}
        await asyncio.to_thread(cluster.deploy, target.app_name, target.prefix, new_args)
        marks["redeploy_done"] = time.monotonic() - t0
        return marks

    churn = _churn(target, scale, "redeploy", 20.0, redeploy_now, "redeploy_started")
    faults = f"serve.run of the app with num_replicas {before} -> {replicas_after} under load (every replica replaced)"
    return churn.result(
        "redeploy", faults, after_event="during_and_after", settled_at=churn.run.marks["redeploy_done"],
        redeploy_s=round(churn.run.marks["redeploy_done"] - churn.event_at, 2),
        replicas_after=len(cluster.replicas(target.app_name, target.deployment)),
    )

"""Open-loop traffic against ``POST /v1/embeddings``, and what became of every request.

Each request is planned up front (its inputs, priority, deadline and which inputs are poisoned), sent at its time
whatever happened to the ones before (open loop), and classified when it ends:

- ``ok``: 200 with one vector per input, in order, each the upstream's hash of its own input;
- ``misrouted``: 200 with a vector that is not its input's (or the wrong count or order);
- ``clear``: an error in OpenAI's shape whose status says what happened (a 400 only for a poisoned request, naming
  one of its poisoned inputs; 429 with ``Retry-After``; 502/503/504);
- ``unclear``: any other error (no OpenAI shape, a 500, a 400 for a valid request, a 400 naming the wrong input);
- ``lost``: no answer before the deadline plus a margin, or the connection failed.
Every answer is also checked against the request's deadline (``X-Request-Timeout``).
"""

from __future__ import annotations

import asyncio
import base64
import json
import math
import random
import time
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable, Sequence

import aiohttp
import httpx
import numpy as np

from load.hashvec import matches
from load.stats import finite_or_none, latency_summary, median, percentile

from .cluster import DIM, POISON

OPENAI_ERROR_FIELDS = {"message", "type", "param", "code"}
# The ingress answers at most 0.5 s past the deadline; allow as much again for a loaded 2-core machine.
DEADLINE_SLACK_S = 1.0
# How long past its deadline a request may stay unanswered before it counts as lost.
LOST_AFTER_S = 10.0
WORDS = ("lighthouse", "harbour", "engine", "meadow", "quartz", "signal", "ledger", "violin", "glacier", "orbit",
         "pepper", "canyon", "archive", "lantern", "ember", "tide", "falcon", "copper", "riddle", "summit")


@dataclass(frozen=True)
class Plan:
    inputs: tuple[str, ...]
    priority: str = "high"
    timeout_s: float = 10.0
    poisoned: tuple[int, ...] = ()  # indexes of inputs the service must refuse


def serving_again(outcomes: "list[Outcome]", tail: float = 0.1) -> bool:
    """Did the run end serving normally? Its last requests (by start time; 10%, at least 3) all succeeded, or were
    refused with a 400 for holding a poisoned input. Judged by outcomes, not latency, so a busy machine cannot fail
    it; recovery time is reported (docs/reliability.md), not asserted."""
    ordered = sorted(outcomes, key=lambda outcome: outcome.start)
    last = ordered[-max(3, int(len(ordered) * tail)):]
    return all(o.kind == "ok" or (o.plan.poisoned and o.status == 400) for o in last)


@dataclass
class Outcome:
    plan: Plan
    start: float
    end: float
    kind: str  # ok | misrouted | clear | unclear | lost
    status: int | None = None
    code: str | None = None
    message: str = ""
    retry_after: str | None = None
    body: bytes = b""

    @property
    def latency(self) -> float:
        return self.end - self.start

    @property
    def late(self) -> bool:
        return self.latency > self.plan.timeout_s + DEADLINE_SLACK_S


class PlanMaker:
    """Unique texts (so upstream billing can be compared item by item), some of them poisoned."""

    def __init__(self, run_id: str, *, seed: int = 0, sizes: Sequence[int] = (1, 1, 1, 2, 4, 8, 16),
                 marker_rate: float = 0.0, over_limit_rate: float = 0.0, over_limit_words: int = 0,
                 low_fraction: float = 0.0, timeouts: Sequence[float] = (10.0,)) -> None:
        self._run_id = run_id
        self._rng = random.Random(seed)
        self._sizes = sizes
        self._marker_rate = marker_rate
        self._over_limit_rate = over_limit_rate
        self._over_limit_words = over_limit_words
        self._low_fraction = low_fraction
        self._timeouts = timeouts
        self._count = 0
        self.poisoning = True  # a scenario turns poisoning on for its fault window only


    def __call__(self) -> Plan:
        rng = self._rng
        number = self._count
        self._count += 1
        inputs, poisoned = [], []
        for i in range(rng.choice(self._sizes)):
            words = " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 30)))
            text = f"{self._run_id} request {number} input {i}: {words}"
            draw = rng.random() if self.poisoning else 1.0
            if draw < self._marker_rate:
                text, poisoned = f"{text} {POISON}", poisoned + [i]
            elif draw < self._marker_rate + self._over_limit_rate:
                text, poisoned = f"{text} " + "overflow " * self._over_limit_words, poisoned + [i]
            inputs.append(text)
        priority = "low" if rng.random() < self._low_fraction else "high"
        return Plan(tuple(inputs), priority, rng.choice(self._timeouts), tuple(poisoned))


def new_client(max_connections: int = 1000) -> httpx.AsyncClient:
    """For a few requests at a time. Its connection pool costs CPU per connection, so load uses ``new_session``."""
    limits = httpx.Limits(max_connections=max_connections, max_keepalive_connections=max_connections)
    return httpx.AsyncClient(limits=limits, timeout=None)


def new_session() -> aiohttp.ClientSession:
    """The load generator's client: hundreds of requests in flight at once cost it little."""
    return aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), timeout=aiohttp.ClientTimeout(total=None))


async def send(session: aiohttp.ClientSession, url: str, model: str, plan: Plan, api_key: str | None,
               t0: float) -> Outcome:
    headers = {"X-Priority": plan.priority, "X-Request-Timeout": f"{plan.timeout_s:g}"}
    if api_key is not None:
        headers["Authorization"] = f"Bearer {api_key}"
    body = {"model": model, "input": list(plan.inputs), "encoding_format": "base64"}
    start = time.monotonic() - t0

    async def post() -> tuple[int, Any, bytes]:
        async with session.post(url, json=body, headers=headers) as response:
            return response.status, response.headers, await response.read()

    try:
        status, response_headers, content = await asyncio.wait_for(post(), timeout=plan.timeout_s + LOST_AFTER_S)
    except (asyncio.TimeoutError, aiohttp.ClientError) as exc:
        return Outcome(plan, start, time.monotonic() - t0, "lost", message=f"{type(exc).__name__}: {exc}")
    end = time.monotonic() - t0
    return classify(plan, status, response_headers, content, start, end)


def classify(plan: Plan, status: int, headers: Any, content: bytes, start: float,
             end: float) -> Outcome:
    retry_after = headers.get("retry-after")
    try:
        parsed = json.loads(content)
    except ValueError:
        return Outcome(plan, start, end, "unclear", status, message=content[:200].decode(errors="replace"),
                       retry_after=retry_after, body=content)
    if status == 200:
        return Outcome(plan, start, end, _check_vectors(plan, parsed), status, body=b"")
    error = parsed.get("error") if isinstance(parsed, dict) else None
    if not isinstance(error, dict) or set(error) != OPENAI_ERROR_FIELDS or not error.get("message"):
        return Outcome(plan, start, end, "unclear", status, message=str(parsed)[:200], retry_after=retry_after,
                       body=content)
    message, code = str(error["message"]), error.get("code")
    outcome = Outcome(plan, start, end, "clear", status, code, message, retry_after, content)
    if status == 400:  # only a poisoned request may be refused, and its param must name a poisoned input
        if error.get("param") not in {f"input[{index}]" for index in plan.poisoned}:
            outcome.kind = "unclear"
    elif status == 429:
        if not retry_after:
            outcome.kind = "unclear"
    elif status not in (502, 503, 504):
        outcome.kind = "unclear"
    return outcome


def _check_vectors(plan: Plan, body: Any) -> str:
    data = body.get("data") if isinstance(body, dict) else None
    if not isinstance(data, list) or len(data) != len(plan.inputs) or plan.poisoned:
        return "misrouted"
    for i, (text, entry) in enumerate(zip(plan.inputs, data)):
        if entry.get("index") != i:
            return "misrouted"
        vector = np.frombuffer(base64.b64decode(entry["embedding"]), dtype="<f4")
        if vector.shape != (DIM,) or not matches(text, vector, DIM):
            return "misrouted"
    return "ok"


@dataclass
class Phase:
    name: str
    duration_s: float
    rate_per_s: float
    enter: Callable[[], Any] | None = None  # run (in a thread) when the phase starts; e.g. turn a fault on


@dataclass
class Run:
    outcomes: list[Outcome]
    phase_starts: dict[str, float]  # seconds since the run started
    phase_ends: dict[str, float]
    marks: dict[str, float] = field(default_factory=dict)


async def run_phases(
    client: aiohttp.ClientSession, url: str, model: str, make_plan: Callable[[], Plan], phases: Sequence[Phase],
    *, api_key: str | None = None, during: Callable[[float], Awaitable[Any]] | None = None,
) -> Run:
    """Offer ``rate_per_s`` requests per second (Poisson arrivals) for each phase in turn; wait for every answer.

    ``during(t0)``, if given, runs alongside (e.g. kills a replica at some moment) and may record marks.
    """
    t0 = time.monotonic()
    tasks: list[asyncio.Task] = []
    starts, ends = {}, {}
    rng = random.Random(7)
    side = asyncio.create_task(during(t0)) if during is not None else None
    for phase in phases:
        starts[phase.name] = time.monotonic() - t0
        if phase.enter is not None:
            await asyncio.to_thread(phase.enter)
        phase_end = time.monotonic() + phase.duration_s
        next_at = time.monotonic()
        while True:
            next_at += rng.expovariate(phase.rate_per_s) if phase.rate_per_s > 0 else math.inf
            if next_at >= phase_end:
                break
            await asyncio.sleep(max(0.0, next_at - time.monotonic()))
            tasks.append(asyncio.create_task(send(client, url, model, make_plan(), api_key, t0)))
        await asyncio.sleep(max(0.0, phase_end - time.monotonic()))
        ends[phase.name] = time.monotonic() - t0
    outcomes = list(await asyncio.gather(*tasks))
    marks = (await side) if side is not None else None
    return Run(sorted(outcomes, key=lambda o: o.start), starts, ends, marks or {})


# ---- what a run shows -----------------------------------------------------------------------------------------

def counts(outcomes: Sequence[Outcome]) -> dict[str, int]:
    tally = {kind: 0 for kind in ("ok", "clear", "unclear", "lost", "misrouted")}
    for outcome in outcomes:
        tally[outcome.kind] += 1
    tally["late"] = sum(outcome.late for outcome in outcomes if outcome.kind != "lost")
    return tally


def statuses(outcomes: Sequence[Outcome]) -> dict[str, int]:
    tally: dict[str, int] = {}
    for outcome in outcomes:
        if outcome.kind in ("clear", "unclear"):
            key = f"{outcome.status} {outcome.code}" if outcome.code else str(outcome.status)
            tally[key] = tally.get(key, 0) + 1
    return dict(sorted(tally.items()))


def ok_latencies(outcomes: Sequence[Outcome]) -> list[float]:
    return [outcome.latency for outcome in outcomes if outcome.kind == "ok"]


def recovery_s(outcomes: Sequence[Outcome], since: float, normal_s: float, window_s: float = 1.0,
               step_s: float = 0.1) -> float | None:
    """Seconds after ``since`` until service is back to normal: the first ``window_s`` of requests (by start time)
    that all succeeded with a median latency within ``normal_s``. None if that never happened.

    A window, not "every request from then on": one stall of a shared machine long after the fault ended would
    otherwise count as the fault's recovery time."""
    after = [outcome for outcome in outcomes if outcome.start >= since]
    if not after:
        return None
    t = since
    last_start = after[-1].start
    while t + window_s <= last_start + 1e-9:
        window = [outcome for outcome in after if t <= outcome.start < t + window_s]
        if window and all(o.kind == "ok" for o in window) and median(o.latency for o in window) <= normal_s:
            return t - since
        t += step_s
    return None


def normal_latency_s(baseline: Sequence[Outcome]) -> float:
    """A median latency that still counts as normal: twice the calm median, at least 100 ms over it."""
    p50 = finite_or_none(percentile(ok_latencies(baseline), 50)) or 0.0
    return max(2 * p50, p50 + 0.1)


def failure_window(outcomes: Sequence[Outcome]) -> tuple[float, float] | None:
    failed = [outcome for outcome in outcomes if outcome.kind != "ok"]
    if not failed:
        return None
    return min(outcome.start for outcome in failed), max(outcome.end for outcome in failed)


def billing(outcomes: Sequence[Outcome]) -> dict[str, int]:
    """Distinct inputs delivered (``needed``) and distinct clean inputs sent at all (an upper bound of what may be
    billed once each)."""
    needed = {text for outcome in outcomes if outcome.kind == "ok" for text in outcome.plan.inputs}
    sent_clean = {text for outcome in outcomes for i, text in enumerate(outcome.plan.inputs)
                  if i not in outcome.plan.poisoned}
    return {"needed": len(needed), "sent_clean": len(sent_clean)}


def summary_latency(outcomes: Sequence[Outcome]) -> dict[str, float | None]:
    """P50, P99 and mean of the successful requests, in ms to a tenth."""
    summary = latency_summary([latency * 1000 for latency in ok_latencies(outcomes)])
    return {key: None if value is None else round(value, 1) for key, value in summary.items()}

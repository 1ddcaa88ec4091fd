"""The backlog under floods, measured at the client: priorities, deadlines and long inputs of the shipped service.

The service runs as users run it (``serve run serve_config.yaml`` with ``serve.env``, in its own processes, or
``--url`` of one already running); the load comes from this process, and every request's status and latency are
taken here. Cases (``--cases``, default the first three):

- ``low-flood``: 100 connections, each sending 64-input LOW requests back to back, beside a HIGH stream of
  single texts (Poisson, 4/s) with ``X-Request-Timeout: 2``; before it, the same HIGH stream alone (calm).
  Target: >= 99% of HIGH answered 200 within 2.25 s.
- ``deadline-flood``: 300 connections sending single texts with ``X-Request-Timeout: 2``, back to back.
  Target: no answer of any status later than 2.25 s.
- ``long-input``: a 500,000-character text sent 20 times, one after another, beside 4 connections of small
  requests. Targets: no answer but 200, no small request slower than 1 s, model replica RSS growth under 300 MB.
- ``scale``: the HIGH stream alone until the model has its fewest replicas (``--min-replicas``, what earlier floods
  left may take minutes to go), then the ``low-flood`` load until the autoscaler has added a replica and ``seconds``
  after, then the HIGH stream alone until it has removed one (each phase at most ``settle_seconds``). Target: both
  seen, and no answer of 5xx (nor a failed connection) at any point. It needs an application that can add a replica
  (``--app``, ``--model``): the shipped config runs one replica on both of this machine's cores from the start.

Replicas are counted and measured from ``/proc`` (the service must run on this machine).
"""

from __future__ import annotations

import argparse
import asyncio
import time
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Iterator, Sequence

import aiohttp

from load.loadgen import Until, send_closed_loop, send_open_loop
from load.stats import finite_or_none, percentile
from load.workload import poisson_arrivals, pseudo_sentences

from .options import chosen_settings
from .report import markdown_table, write_report
from .shipped_service import MODEL, SERVICE, packaged_model_path

REQUEST_TIMEOUT_S = 600.0  # the client's bound on any one request
DEADLINE_S = 2.0
ON_TIME_S = 2.25
APP = "embeddings"
CASES = ("low-flood", "deadline-flood", "long-input", "scale")
DEFAULT_CASES = CASES[:3]


@dataclass(frozen=True)
class Settings:
    seconds: float = 30.0  # length of each flood
    calm_seconds: float = 15.0
    low_connections: int = 100
    low_inputs: int = 64
    high_rate: float = 4.0
    deadline_connections: int = 300
    long_chars: int = 500_000
    long_requests: int = 20
    small_connections: int = 4
    settle_seconds: float = 240.0  # the shipped config scales down after 120 s without a backlog
    min_replicas: int = 1
    model: str = MODEL
    app: str = APP

    def __post_init__(self) -> None:
        if self.seconds <= 0:
            raise ValueError("backlog: --seconds must be > 0")

    @property
    def model_replica(self) -> str:
        """What a model replica's process title holds."""
        return f"ServeReplica:{self.app}:embed-{self.model}"


QUICK = Settings(seconds=4.0, calm_seconds=2.0, low_connections=8, deadline_connections=24, long_chars=100_000,
                 long_requests=3, settle_seconds=60.0)


@dataclass
class Answer:
    kind: str
    status: int  # 0: the connection failed
    latency_s: float
    error: str | None = None  # the start of a failed answer's body (or of the connection error)
    sent_at: float = 0.0  # when it was sent (time.perf_counter())


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--url", help="a running service (default: start the shipped one)")
    parser.add_argument("--cases", default=",".join(DEFAULT_CASES),
                        help=f"comma-separated, from {', '.join(CASES)} (default {','.join(DEFAULT_CASES)})")
    parser.add_argument("--seconds", type=float, help=f"length of each flood (default {Settings.seconds:g})")
    parser.add_argument("--model", default=MODEL, help=f"the model to embed with (default {MODEL})")
    parser.add_argument("--app", default=APP, help=f"the Serve application serving it (default {APP})")
    parser.add_argument("--api-key", help="sent as `Authorization: Bearer <key>`")
    parser.add_argument("--min-replicas", type=int, default=Settings.min_replicas,
                        help="the model's autoscaling min_replicas, where the scale case starts from (default 1)")


def run(args: argparse.Namespace) -> dict[str, Any]:
    settings = chosen_settings(args, Settings(), QUICK)
    cases = [case.strip() for case in args.cases.split(",") if case.strip()]
    unknown = sorted(set(cases) - set(CASES))
    if unknown:
        raise SystemExit(f"unknown case(s) {', '.join(unknown)}; choose from {', '.join(CASES)}")
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    if args.url:
        return asyncio.run(measure(args.url, settings, cases, getattr(args, "results_dir", None), headers))
    from load.peers.launch import DEFAULT_PEERS_DIR, running

    with running(SERVICE, DEFAULT_PEERS_DIR, packaged_model_path()) as started:
        return asyncio.run(measure(started.url, settings, cases, getattr(args, "results_dir", None), headers))


async def measure(url: str, settings: Settings, cases: Sequence[str], results_dir: Path | None = None,
                  headers: dict[str, str] | None = None) -> dict[str, Any]:
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(url.rstrip("/") + "/", connector=connector, headers=headers,
                                     timeout=aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S)) as session:
        texts = iter(pseudo_sentences(200_000, 120, seed=int(time.time())))
        results = {}
        for case in cases:
            results[case] = await CASE_RUNNERS[case](session, texts, settings)
    data = {"settings": asdict(settings), "url": url, "cases": results}
    return write_report("backlog", "The backlog under floods, at the client", render(data), data, results_dir)


async def post(session: aiohttp.ClientSession, model: str, kind: str, inputs: list[str], answers: list[Answer],
               priority: str = "high", timeout_s: float | None = None) -> Answer:
    """One ``POST /v1/embeddings`` (relative to the session's base URL); its ``Answer`` appended to ``answers``."""
    headers = {"X-Priority": priority}
    if timeout_s is not None:
        headers["X-Request-Timeout"] = f"{timeout_s:g}"
    body = {"model": model, "input": inputs, "encoding_format": "base64"}
    started = time.perf_counter()
    error = None
    try:
        async with session.post("v1/embeddings", json=body, headers=headers) as response:
            content = await response.read()
            status = response.status
            if status >= 400:
                error = content[:300].decode("utf-8", "replace")
    except aiohttp.ClientError as exc:
        status, error = 0, repr(exc)[:300]
    answer = Answer(kind, status, time.perf_counter() - started, error, started)
    answers.append(answer)
    return answer


def _for(seconds: float) -> Until:
    stop_at = time.perf_counter() + seconds
    return lambda: time.perf_counter() >= stop_at


class Load:
    """The requests every case sends, each answer recorded in ``answers``."""

    def __init__(self, session: aiohttp.ClientSession, texts: Iterator[str], settings: Settings) -> None:
        self.session, self.texts, self.settings = session, texts, settings
        self.answers: list[Answer] = []

    def send(self, kind: str, inputs: list[str], priority: str = "high", timeout_s: float | None = None):
        return post(self.session, self.settings.model, kind, inputs, self.answers, priority, timeout_s)

    def high(self) -> Any:
        return self.send("high", [next(self.texts)], timeout_s=DEADLINE_S)

    def low(self) -> Any:
        return self.send("low", [next(self.texts) for _ in range(self.settings.low_inputs)], priority="low")

    async def high_stream(self, within_s: float, until: Until | None = None) -> None:
        """HIGH single texts at Poisson arrivals for ``within_s``, or until ``until()`` holds."""
        offsets = poisson_arrivals(self.settings.high_rate, 1_000_000, within_s, seed=1)
        await send_open_loop(lambda index, at: self.high(), offsets, within_s + REQUEST_TIMEOUT_S, until)

    async def low_flood(self, within_s: float, until: Until | None = None) -> None:
        """The LOW bulk flood beside the HIGH stream, each connection sending back to back."""
        until = until or _for(within_s)
        await asyncio.gather(self.high_stream(within_s, until),
                             send_closed_loop(lambda index: self.low(), self.settings.low_connections, until=until))

    def of(self, kind: str) -> list[Answer]:
        return [a for a in self.answers if a.kind == kind]


async def low_flood(session, texts, settings: Settings) -> dict[str, Any]:
    calm = Load(session, texts, settings)
    await calm.high_stream(settings.calm_seconds)
    flood = Load(session, texts, settings)
    await flood.low_flood(settings.seconds)
    flood_high = flood.of("high")
    on_time = sum(1 for a in flood_high if a.status == 200 and a.latency_s <= ON_TIME_S)
    share = on_time / len(flood_high) if flood_high else 0.0
    return {
        "calm": summary(calm.answers), "high": summary(flood_high), "low": summary(flood.of("low")),
        "high_on_time_share": share, "target_met": share >= 0.99,
        "p99_ratio": _ratio(summary(flood_high)["p99_ms"], summary(calm.answers)["p99_ms"]),
    }


async def deadline_flood(session, texts, settings: Settings) -> dict[str, Any]:
    load = Load(session, texts, settings)
    one = lambda index: load.send("single", [next(texts)], timeout_s=DEADLINE_S)  # noqa: E731
    await send_closed_loop(one, settings.deadline_connections, until=_for(settings.seconds))
    result = summary(load.answers)
    return {**result, "target_met": result["max_ms"] is not None and result["max_ms"] <= ON_TIME_S * 1000}


async def long_input(session, texts, settings: Settings) -> dict[str, Any]:
    rss_before = replica_rss_mb(settings.model_replica)
    load = Load(session, texts, settings)
    done = asyncio.Event()
    long_text = " ".join(next(texts) for _ in range(settings.long_chars // 100))[:settings.long_chars]

    async def longs() -> None:
        for _ in range(settings.long_requests):
            await load.send("long", [long_text])
        done.set()

    async def smalls() -> None:
        while not done.is_set():
            await load.send("small", [next(texts)])

    await asyncio.gather(longs(), *(smalls() for _ in range(settings.small_connections)))
    rss_after = replica_rss_mb(settings.model_replica)
    small = load.of("small")
    growth = None if rss_before is None or rss_after is None else rss_after - rss_before
    non_200 = sum(1 for a in load.answers if a.status != 200)
    slowest_small = max((a.latency_s for a in small), default=0.0)
    return {
        "long": summary(load.of("long")), "small": summary(small),
        "non_200": non_200, "rss_before_mb": rss_before, "rss_after_mb": rss_after, "rss_growth_mb": growth,
        "target_met": non_200 == 0 and slowest_small <= 1.0 and growth is not None and growth < 300,
    }


async def scale(session, texts, settings: Settings) -> dict[str, Any]:
    load = Load(session, texts, settings)
    replicas = lambda: len(replica_pids(settings.model_replica))  # noqa: E731
    await load.high_stream(settings.settle_seconds, lambda: replicas() <= settings.min_replicas)
    started = time.perf_counter()
    replicas_before = replicas()
    seen: dict[str, float | None] = {"up": None, "down": None}

    def replicas_reached(count: int, event: str) -> bool:
        if seen[event] is None and replicas() == count:
            seen[event] = round(time.perf_counter() - started, 1)
        return seen[event] is not None

    def flood_done() -> bool:  # the flood goes on `seconds` past the scale-up (or ends at settle_seconds without it)
        up = replicas_reached(replicas_before + 1, "up")
        elapsed = time.perf_counter() - started
        return elapsed >= settings.settle_seconds or (up and elapsed >= seen["up"] + settings.seconds)

    await load.low_flood(settings.settle_seconds, flood_done)
    flood_ended = round(time.perf_counter() - started, 1)
    await load.high_stream(settings.settle_seconds, lambda: replicas_reached(replicas_before, "down"))
    failed = sum(1 for a in load.answers if a.status >= 500 or a.status == 0)
    return {
        "replicas_before": replicas_before, "scaled_up_after_s": seen["up"], "flood_ended_after_s": flood_ended,
        "scaled_down_after_s": seen["down"], "high": summary(load.of("high")), "low": summary(load.of("low")),
        "failed": failed, "target_met": failed == 0 and None not in seen.values(),
    }


CASE_RUNNERS = {"low-flood": low_flood, "deadline-flood": deadline_flood, "long-input": long_input, "scale": scale}


def summary(answers: Sequence[Answer]) -> dict[str, Any]:
    latencies = [a.latency_s * 1000 for a in answers]
    return {"requests": len(answers), "statuses": dict(Counter(str(a.status) for a in answers)),
            "p50_ms": finite_or_none(percentile(latencies, 50)), "p99_ms": finite_or_none(percentile(latencies, 99)),
            "max_ms": max(latencies, default=None),
            "first_errors": {status: next(a.error for a in answers if str(a.status) == status)
                             for status in sorted({str(a.status) for a in answers if a.error is not None})}}


def replica_pids(title: str) -> list[int]:
    """The processes whose command line holds ``title`` (Ray names a replica's process after it)."""
    pids = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and title in (entry / "cmdline").read_bytes().decode("utf-8", "replace"):
                pids.append(int(entry.name))
        except OSError:
            continue
    return pids


def replica_rss_mb(title: str) -> float | None:
    """Resident memory of the model replica's process (the largest if several), from /proc."""
    sizes = []
    for pid in replica_pids(title):
        try:
            status = Path(f"/proc/{pid}/status").read_text()
        except OSError:
            continue
        kilobytes = next((int(line.split()[1]) for line in status.splitlines() if line.startswith("VmRSS:")), None)
        if kilobytes is not None:
            sizes.append(kilobytes / 1024)
    return max(sizes) if sizes else None


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a and b else None


def render(data: dict[str, Any]) -> str:
    def ms(value: float | None) -> str:
        return "—" if value is None else f"{value:,.0f}"

    rows = []
    for case, result in data["cases"].items():
        for group in ("calm", "high", "low", "long", "small"):
            if group in result:
                s = result[group]
                rows.append([f"{case}: {group}", s["requests"], s["statuses"], ms(s["p50_ms"]), ms(s["p99_ms"]),
                             ms(s["max_ms"])])
        if "statuses" in result:
            rows.append([case, result["requests"], result["statuses"], ms(result["p50_ms"]), ms(result["p99_ms"]),
                         ms(result["max_ms"])])
    table = markdown_table(["case: requests", "count", "statuses", "P50 ms", "P99 ms", "max ms"], rows)
    verdicts = []
    for case, result in data["cases"].items():
        extra = ""
        if case == "low-flood":
            extra = (f" — HIGH 200 within {ON_TIME_S} s: {result['high_on_time_share']:.1%}; HIGH P99 under the "
                     f"flood / calm: {result['p99_ratio']:.2f}×" if result["p99_ratio"] else "")
        if case == "long-input":
            extra = f" — non-200: {result['non_200']}, replica RSS growth: {result['rss_growth_mb']} MB"
        if case == "scale":
            extra = (f" — replicas {result['replicas_before']} → +1 after {result['scaled_up_after_s']} s, flood "
                     f"ended at {result['flood_ended_after_s']} s, back to {result['replicas_before']} after "
                     f"{result['scaled_down_after_s']} s; 5xx or failed connections: {result['failed']}")
        verdicts.append(f"- `{case}`: {'met' if result['target_met'] else '**not met**'}{extra}")
    s = data["settings"]
    return f"""\
Service at `{data['url']}`; load from one client process (aiohttp), statuses and latencies taken there. Floods of \
{s['seconds']:g} s: `low-flood` {s['low_connections']} connections × {s['low_inputs']} LOW inputs beside HIGH \
single texts at {s['high_rate']:g}/s with `X-Request-Timeout: {DEADLINE_S:g}` (calm: the HIGH stream alone for \
{s['calm_seconds']:g} s); `deadline-flood` {s['deadline_connections']} connections of single texts with \
`X-Request-Timeout: {DEADLINE_S:g}`; `long-input` a {s['long_chars']:,}-character text × {s['long_requests']} beside \
{s['small_connections']} connections of small requests; `scale` the `low-flood` load until a replica was added and {s['seconds']:g} s more, then the HIGH stream alone until one was removed. Status 0 = the connection failed.

{table}

{chr(10).join(verdicts)}
"""

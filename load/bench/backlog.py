"""The backlog under floods, measured at the client: priorities, deadlines and long inputs of the shipped service.

The service runs as users run it (``serve run serve_config.yaml`` with ``serve.env``, in its own processes, or
``--url`` of one already running); the load comes from this process, and every request's status and latency are
taken here. Cases (``--cases``, default all):

- ``low-flood``: 100 connections, each sending 64-input LOW requests back to back, beside a HIGH stream of
  single texts (Poisson, 4/s) with ``X-Request-Timeout: 2``; before it, the same HIGH stream alone (calm).
  Target: >= 99% of HIGH answered 200 within 2.25 s.
- ``deadline-flood``: 300 connections sending single texts with ``X-Request-Timeout: 2``, back to back.
  Target: no answer of any status later than 2.25 s.
- ``long-input``: a 500,000-character text sent 20 times, one after another, beside 4 connections of small
  requests. Targets: no answer but 200, no small request slower than 1 s, model replica RSS growth under 300 MB.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import time
from collections import Counter
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, Sequence

import aiohttp

from load.loadgen import censored_percentile
from load.workload import pseudo_sentences

from .report import machine_info, markdown_table, write_results

MODEL = "all-MiniLM-L6-v2"
DEADLINE_S = 2.0
ON_TIME_S = 2.25
MODEL_REPLICA = f"ServeReplica:embeddings:embed-{MODEL}"
CASES = ("low-flood", "deadline-flood", "long-input")


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


QUICK = Settings(seconds=4.0, calm_seconds=2.0, low_connections=8, deadline_connections=24, long_chars=100_000,
                 long_requests=3)


@dataclass
class Answer:
    kind: str
    status: int  # 0: the connection failed
    latency_s: float


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--quick", action="store_true", help="a tiny run for CI smoke tests")
    parser.add_argument("--url", help="a running service (default: start the shipped one)")
    parser.add_argument("--cases", default=",".join(CASES), help=f"comma-separated, from {', '.join(CASES)}")
    parser.add_argument("--seconds", type=float, help=f"length of each flood (default {Settings.seconds:g})")


def run(args: argparse.Namespace) -> dict[str, Any]:
    settings = QUICK if args.quick else Settings()
    if args.seconds:
        settings = replace(settings, seconds=args.seconds)
    cases = [case.strip() for case in args.cases.split(",") if case.strip()]
    if args.url:
        return asyncio.run(measure(args.url, settings, cases, getattr(args, "results_dir", None)))
    from .peers import SERVICE, packaged_model_path
    from load.peers.launch import DEFAULT_PEERS_DIR, running

    with running(SERVICE, DEFAULT_PEERS_DIR, packaged_model_path()) as url:
        return asyncio.run(measure(url, settings, cases, getattr(args, "results_dir", None)))


async def measure(url: str, settings: Settings, cases: Sequence[str], results_dir: Path | None = None) -> dict[str, Any]:
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(f"{url.rstrip('/')}", connector=connector,
                                     timeout=aiohttp.ClientTimeout(total=600)) as session:
        texts = iter(pseudo_sentences(200_000, 120, seed=int(time.time())))
        results = {}
        for case in cases:
            results[case] = await CASE_RUNNERS[case](session, texts, settings)
    data = {"machine": machine_info(), "settings": asdict(settings), "url": url, "cases": results}
    md_path, json_path = write_results("backlog", "The backlog under floods, at the client", render(data), data,
                                       results_dir)
    print(md_path.read_text(encoding="utf-8"))
    return data


async def _post(session: aiohttp.ClientSession, kind: str, inputs: list[str], answers: list[Answer],
                priority: str = "high", timeout_s: float | None = None) -> Answer:
    headers = {"X-Priority": priority}
    if timeout_s is not None:
        headers["X-Request-Timeout"] = f"{timeout_s:g}"
    body = {"model": MODEL, "input": inputs, "encoding_format": "base64"}
    started = time.perf_counter()
    try:
        async with session.post("/v1/embeddings", json=body, headers=headers) as response:
            await response.read()
            status = response.status
    except aiohttp.ClientError:
        status = 0
    answer = Answer(kind, status, time.perf_counter() - started)
    answers.append(answer)
    return answer


async def _back_to_back(stop_at: float, send) -> None:
    while time.perf_counter() < stop_at:
        await send()


async def _poisson(stop_at: float, rate: float, send) -> None:
    calls = []
    rng = random.Random(1)
    while (now := time.perf_counter()) < stop_at:
        calls.append(asyncio.ensure_future(send()))
        await asyncio.sleep(rng.expovariate(rate))
    await asyncio.gather(*calls)


async def low_flood(session, texts, settings: Settings) -> dict[str, Any]:
    calm: list[Answer] = []
    high = lambda answers: lambda: _post(session, "high", [next(texts)], answers, timeout_s=DEADLINE_S)  # noqa: E731
    await _poisson(time.perf_counter() + settings.calm_seconds, settings.high_rate, high(calm))
    answers: list[Answer] = []
    stop_at = time.perf_counter() + settings.seconds
    low = lambda: _post(session, "low", [next(texts) for _ in range(settings.low_inputs)], answers,  # noqa: E731
                        priority="low")
    await asyncio.gather(_poisson(stop_at, settings.high_rate, high(answers)),
                         *(_back_to_back(stop_at, low) for _ in range(settings.low_connections)))
    flood_high = [a for a in answers if a.kind == "high"]
    on_time = sum(1 for a in flood_high if a.status == 200 and a.latency_s <= ON_TIME_S)
    share = on_time / len(flood_high) if flood_high else 0.0
    return {
        "calm": summary(calm), "high": summary(flood_high), "low": summary([a for a in answers if a.kind == "low"]),
        "high_on_time_share": share, "target_met": share >= 0.99,
        "p99_ratio": _ratio(summary(flood_high)["p99_ms"], summary(calm)["p99_ms"]),
    }


async def deadline_flood(session, texts, settings: Settings) -> dict[str, Any]:
    answers: list[Answer] = []
    stop_at = time.perf_counter() + settings.seconds
    one = lambda: _post(session, "single", [next(texts)], answers, timeout_s=DEADLINE_S)  # noqa: E731
    await asyncio.gather(*(_back_to_back(stop_at, one) for _ in range(settings.deadline_connections)))
    result = summary(answers)
    return {**result, "target_met": result["max_ms"] is not None and result["max_ms"] <= ON_TIME_S * 1000}


async def long_input(session, texts, settings: Settings) -> dict[str, Any]:
    rss_before = replica_rss_mb()
    answers: list[Answer] = []
    done = asyncio.Event()
    long_text = " ".join(next(texts) for _ in range(settings.long_chars // 100))[:settings.long_chars]

    async def longs() -> None:
        for _ in range(settings.long_requests):
            await _post(session, "long", [long_text], answers)
        done.set()

    async def smalls() -> None:
        while not done.is_set():
            await _post(session, "small", [next(texts)], answers)

    await asyncio.gather(longs(), *(smalls() for _ in range(settings.small_connections)))
    rss_after = replica_rss_mb()
    small = [a for a in answers if a.kind == "small"]
    growth = None if rss_before is None or rss_after is None else rss_after - rss_before
    non_200 = sum(1 for a in answers if a.status != 200)
    slowest_small = max((a.latency_s for a in small), default=0.0)
    return {
        "long": summary([a for a in answers if a.kind == "long"]), "small": summary(small),
        "non_200": non_200, "rss_before_mb": rss_before, "rss_after_mb": rss_after, "rss_growth_mb": growth,
        "target_met": non_200 == 0 and slowest_small <= 1.0 and growth is not None and growth < 300,
    }


CASE_RUNNERS = {"low-flood": low_flood, "deadline-flood": deadline_flood, "long-input": long_input}


def summary(answers: Sequence[Answer]) -> dict[str, Any]:
    latencies = [a.latency_s * 1000 for a in answers]

    def pct(p: float) -> float | None:
        return censored_percentile(latencies, 0, p) if latencies else None

    return {"requests": len(answers), "statuses": dict(Counter(str(a.status) for a in answers)),
            "p50_ms": pct(50), "p99_ms": pct(99), "max_ms": max(latencies, default=None)}


def replica_rss_mb() -> float | None:
    """Resident memory of the model replica's process (the largest if several), from /proc."""
    sizes = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if MODEL_REPLICA not in (entry / "cmdline").read_bytes().decode("utf-8", "replace"):
                continue
            status = (entry / "status").read_text()
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
        verdicts.append(f"- `{case}`: {'met' if result['target_met'] else '**not met**'}{extra}")
    s = data["settings"]
    return f"""\
Service at `{data['url']}`; load from one client process (aiohttp), statuses and latencies taken there. Floods of \
{s['seconds']:g} s: `low-flood` {s['low_connections']} connections × {s['low_inputs']} LOW inputs beside HIGH \
single texts at {s['high_rate']:g}/s with `X-Request-Timeout: {DEADLINE_S:g}` (calm: the HIGH stream alone for \
{s['calm_seconds']:g} s); `deadline-flood` {s['deadline_connections']} connections of single texts with \
`X-Request-Timeout: {DEADLINE_S:g}`; `long-input` a {s['long_chars']:,}-character text × {s['long_requests']} beside \
{s['small_connections']} connections of small requests. Status 0 = the connection failed.

{table}

{chr(10).join(verdicts)}
"""

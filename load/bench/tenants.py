"""Many tenants, one gateway: one tenant's flood beside another tenant's interactive stream, and their shares.

``serve run`` (``serve.env``) of one ``openai`` entry on the simulated upstream (its own process), two ingress
replicas, and a keys file naming two tenants of equal weight: ``flood`` and ``stream``. From this process:
``stream``'s single texts at Poisson arrivals (``--stream-rate-per-s``), alone for ``--calm-s``, then beside
``flood``'s ``--flood-clients`` clients sending ``--flood-texts`` texts a request back to back (sleeping a 429's
Retry-After), first at HIGH, then at LOW; last, both tenants flood at HIGH with the same clients, and each one's
share of the inputs answered is its share of the model.

Then the bill, on a second entry of the same upstream with a cache: ``stream`` alone, then both tenants at once,
sending texts drawn from a pool of new texts each part (so each repeats its own texts, and both, each other's); after each part, each tenant's tokens,
cached tokens and billed tokens from the usage API (an admin key) beside what the upstream counted it billed.

Targets (issue #43): ``stream``'s P99 beside either flood at most 1.5× its calm P99; when both are busy, each gets
at least its weight's share (half); the tenants' billed tokens equal to the upstream's bill, to the token (``stream``
alone: its own; both: their sum).
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import random
import signal
import tempfile
import time
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import aiohttp

from deployments.usage import FLUSH_S
from load.loadgen import send_open_loop
from load.peers.launch import DEFAULT_PEERS_DIR, Server, running
from load.upstream import UpstreamConfig
from load.upstream_client import UpstreamClient
from load.workload import poisson_arrivals, pseudo_sentences

from .backlog import Answer, post, summary
from .options import add_settings_arguments, chosen_settings
from .report import markdown_table, write_report
from .serving import SIM_BATCHING, SIM_MODEL, sim_model_entry
from .shipped_service import packaged_model_path, serve_run, write_keys_file
from .upstream_process import upstream_process

TARGET_P99_RATIO = 1.5
KEYS = {"flood": "sk-bench-flood", "stream": "sk-bench-stream"}
ADMIN_KEY = "sk-bench-admin"
BILLED_MODEL = "sim-billed"  # the entry with a cache that the bill is measured on
CLIENT_TIMEOUT_S = 60.0


@dataclass(frozen=True)
class Settings:
    stream_rate_per_s: float = 10.0
    calm_s: float = 20.0
    flood_s: float = 30.0
    flood_clients: int = 32
    flood_texts: int = 16
    mean_chars: int = 120
    ingress_replicas: int = 2
    bill_s: float = 10.0  # each part of the bill
    bill_pool: int = 2_000  # the distinct texts the bill's requests draw from
    bill_clients: int = 8  # each tenant's, 4 texts a request


QUICK = Settings(calm_s=4.0, flood_s=6.0, flood_clients=8, bill_s=4.0, bill_pool=500)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_settings_arguments(parser, Settings(), QUICK)


def run(args: argparse.Namespace) -> dict[str, Any]:
    settings = chosen_settings(args, Settings(), QUICK)
    with upstream_process(UpstreamConfig()) as root_url, tempfile.TemporaryDirectory() as work:
        keys = write_keys_file(Path(work) / "keys.yaml", {**{name: (key, "") for name, key in KEYS.items()},
                                                         "finance": (ADMIN_KEY, "admin: true, models: []")})
        server = gateway(root_url, keys, settings, Path(work) / "cache")
        with running(server, DEFAULT_PEERS_DIR, packaged_model_path()) as started:
            data = asyncio.run(_runs(started.url, settings))
            data["bill"] = asyncio.run(_bill(started.url, root_url, settings))
    data["settings"] = asdict(settings)
    return write_report("tenants", "Many tenants, one gateway", render(data), data,
                        getattr(args, "results_dir", None))


def gateway(root_url: str, keys: Path, settings: Settings, cache: Path) -> Server:
    billed = {**sim_model_entry(f"{root_url}/v1"), "name": BILLED_MODEL,
              "cache": {"store": "disk", "directory": str(cache)}}
    args = {"models": [sim_model_entry(f"{root_url}/v1"), billed],
            "ingress": {"num_replicas": settings.ingress_replicas, "env_vars": {"EMBEDDINGS_API_KEYS_FILE": str(keys)}}}
    config = {"proxy_location": "HeadOnly", "http_options": {"host": "127.0.0.1", "port": 8000},
              "applications": [{"name": "tenants", "route_prefix": "/", "import_path": "deployments.app:build_app",
                                "args": args}]}
    return Server("tenants-service", serve_run(config, "tenants"), SIM_BATCHING, health="/healthz",
                  stop_signal=signal.SIGINT, model=SIM_MODEL,
                  probe_headers=(("Authorization", f"Bearer {KEYS['stream']}"),))


async def _runs(url: str, settings: Settings) -> dict[str, Any]:
    texts = itertools.cycle(pseudo_sentences(50_000, settings.mean_chars, seed=5))
    sessions = {name: aiohttp.ClientSession(f"{url}/", headers={"Authorization": f"Bearer {key}"},
                                            timeout=aiohttp.ClientTimeout(total=CLIENT_TIMEOUT_S))
                for name, key in KEYS.items()}
    try:
        await _warm(sessions, texts)
        calm = await _stream(sessions["stream"], texts, settings, settings.calm_s)
        beside = {}
        for priority in ("high", "low"):
            flooding = _flood(sessions["flood"], texts, settings, priority, settings.flood_s)
            stream, flood = await asyncio.gather(_stream(sessions["stream"], texts, settings, settings.flood_s),
                                                 flooding)
            beside[priority] = {"stream": stream, "flood": flood}
        both = await asyncio.gather(*(_flood(sessions[name], texts, settings, "high", settings.flood_s)
                                      for name in KEYS))
    finally:
        for session in sessions.values():
            await session.close()
    answered = {name: run["inputs_answered"] for name, run in zip(KEYS, both)}
    total = sum(answered.values())
    return {"calm": calm, "beside": beside, "both": dict(zip(KEYS, both)),
            "p99_ratio": {priority: _ratio(run["stream"]["p99_ms"], calm["p99_ms"])
                          for priority, run in beside.items()},
            "shares": {name: count / total if total else None for name, count in answered.items()}}


async def _warm(sessions: dict[str, aiohttp.ClientSession], texts: Any) -> None:
    answers: list[Answer] = []
    for session in sessions.values():
        for _ in range(20):
            await post(session, SIM_MODEL, "warm", [next(texts)], answers)


async def _stream(session: aiohttp.ClientSession, texts: Any, settings: Settings, duration_s: float) -> dict[str, Any]:
    answers: list[Answer] = []
    offsets = poisson_arrivals(settings.stream_rate_per_s, 1_000_000, duration_s, seed=9)
    await send_open_loop(lambda index, _: post(session, SIM_MODEL, "stream", [next(texts)], answers, "high"),
                         offsets, duration_s + CLIENT_TIMEOUT_S)
    return summary(answers)


async def _flood(session: aiohttp.ClientSession, texts: Any, settings: Settings, priority: str,
                 duration_s: float) -> dict[str, Any]:
    """``flood_clients`` clients back to back for ``duration_s``; a 429 waits its Retry-After (at most a second)."""
    answers: list[Answer] = []
    stop_at = time.perf_counter() + duration_s

    async def client() -> None:
        while time.perf_counter() < stop_at:
            answer = await post(session, SIM_MODEL, "flood", [next(texts) for _ in range(settings.flood_texts)],
                                answers, priority)
            if answer.status == 429:
                await asyncio.sleep(0.5)

    await asyncio.gather(*(client() for _ in range(settings.flood_clients)))
    statuses = Counter(str(answer.status) for answer in answers)
    return {"requests": len(answers), "statuses": dict(statuses), "priority": priority,
            "inputs_answered": statuses["200"] * settings.flood_texts,
            "inputs_per_s": statuses["200"] * settings.flood_texts / duration_s}


async def _bill(url: str, root_url: str, settings: Settings) -> dict[str, Any]:
    """Each part's usage per tenant (the usage API's counts since the part began) beside the upstream's bill."""
    parts = {}
    async with aiohttp.ClientSession(f"{url}/", timeout=aiohttp.ClientTimeout(total=CLIENT_TIMEOUT_S)) as session, \
            UpstreamClient(root_url) as upstream:
        for number, (part, tenants) in enumerate((("stream alone", ("stream",)), ("both", tuple(KEYS)))):
            pool = pseudo_sentences(settings.bill_pool, settings.mean_chars, seed=11 + number)  # new texts a part
            await asyncio.sleep(2 * FLUSH_S)  # every replica's counts of the last part handed on
            await upstream.wait_idle()  # and its counters zeroed
            before = await _usage(session)
            statuses = await asyncio.gather(*(_draw(session, KEYS[name], pool, settings, seed)
                                              for seed, name in enumerate(tenants)))
            billed = (await upstream.stats())["tokens_billed"]  # every call of the part was answered by now
            await asyncio.sleep(2 * FLUSH_S)
            after = await _usage(session)
            used = {name: [a - b for a, b in zip(after.get(name, [0, 0, 0, 0]), before.get(name, [0, 0, 0, 0]))]
                    for name in tenants}
            parts[part] = {"statuses": dict(zip(tenants, statuses)), "upstream_billed": billed,
                           "tenants": {name: dict(zip(("requests", "tokens", "cached_tokens", "billed_tokens"),
                                                      counts)) for name, counts in used.items()}}
    return parts


async def _draw(session: aiohttp.ClientSession, key: str, pool: list[str], settings: Settings,
                seed: int) -> dict[str, int]:
    """``bill_clients`` clients of one tenant sending 4 texts of ``pool`` a request back to back for ``bill_s``."""
    draw = random.Random(seed)
    statuses: Counter[str] = Counter()
    stop_at = time.perf_counter() + settings.bill_s

    async def client() -> None:
        while time.perf_counter() < stop_at:
            body = {"model": BILLED_MODEL, "input": draw.sample(pool, 4), "encoding_format": "base64"}
            async with session.post("v1/embeddings", json=body, headers={"Authorization": f"Bearer {key}"}) as answer:
                await answer.read()
                statuses[str(answer.status)] += 1

    await asyncio.gather(*(client() for _ in range(settings.bill_clients)))
    return dict(statuses)


async def _usage(session: aiohttp.ClientSession) -> dict[str, list[int]]:
    """The usage API's counts of ``BILLED_MODEL`` today, by tenant: requests, tokens, cached and billed tokens."""
    query = [("start_time", str(int(time.time()) // 86_400 * 86_400)), ("group_by", "project_id"),
             ("group_by", "model")]
    async with session.get("v1/organization/usage/embeddings", params=query,
                           headers={"Authorization": f"Bearer {ADMIN_KEY}"}) as answer:
        answer.raise_for_status()
        page = await answer.json()
    totals: dict[str, list[int]] = {}
    for bucket in page["data"]:
        for result in bucket["results"]:
            if result["model"] == BILLED_MODEL:
                counts = totals.setdefault(result["project_id"], [0, 0, 0, 0])
                for position, field in enumerate(("num_model_requests", "input_tokens", "input_cached_tokens",
                                                  "input_billed_tokens")):
                    counts[position] += result[field]
    return totals


def _ratio(value: float | None, calm: float | None) -> float | None:
    return value / calm if value and calm else None


def render(data: dict[str, Any]) -> str:
    settings = data["settings"]

    def ms(value: float | None) -> str:
        return "—" if value is None else f"{value:,.1f}"

    rows = [["`stream` alone", data["calm"]["requests"], data["calm"]["statuses"], ms(data["calm"]["p50_ms"]),
             ms(data["calm"]["p99_ms"]), "—", "—"]]
    for priority, run in data["beside"].items():
        stream, flood = run["stream"], run["flood"]
        ratio = data["p99_ratio"][priority]
        rows.append([f"`stream` beside `flood` at {priority.upper()}", stream["requests"], stream["statuses"],
                     ms(stream["p50_ms"]), ms(stream["p99_ms"]), "—" if ratio is None else f"{ratio:.2f}×",
                     f"{flood['inputs_per_s']:,.0f} inputs/s, {flood['statuses']}"])
    shares = ", ".join(f"`{name}` {share:.1%}" for name, share in data["shares"].items() if share is not None)
    met = all(ratio is not None and ratio <= TARGET_P99_RATIO for ratio in data["p99_ratio"].values())
    fair = all(share is not None and share >= 0.5 * 0.95 for share in data["shares"].values())
    return f"""\
`serve run` (`serve.env`) of one `openai` entry on the simulated upstream (its own process), \
{settings['ingress_replicas']} ingress replicas, a keys file of two tenants of equal weight. `stream`: single texts \
at {settings['stream_rate_per_s']:g}/s at HIGH ({settings['calm_s']:g} s alone first); `flood`: \
{settings['flood_clients']} clients of {settings['flood_texts']} texts a request back to back for \
{settings['flood_s']:g} s, at HIGH, then at LOW.

{markdown_table(["case", "requests", "statuses", "P50 ms", "P99 ms", "P99 / alone", "the flood"], rows)}

Both tenants flooding at HIGH ({settings['flood_clients']} clients each): shares of the inputs answered {shares} \
(target: at least half each, its weight's share).

`stream` P99 beside a flood / alone ≤ {TARGET_P99_RATIO:g}×: {"met" if met else "**not met**"}; \
shares: {"met" if fair else "**not met**"}.

{_render_bill(data["bill"], settings)}"""


def _render_bill(bill: dict[str, Any], settings: dict[str, Any]) -> str:
    rows = []
    exact = True
    for part, run in bill.items():
        billed = sum(used["billed_tokens"] for used in run["tenants"].values())
        exact = exact and billed == run["upstream_billed"]
        for name, used in run["tenants"].items():
            rows.append([part, f"`{name}`", run["statuses"][name], used["requests"], f"{used['tokens']:,}",
                         f"{used['cached_tokens']:,}", f"{used['billed_tokens']:,}"])
        rows.append([part, "upstream's bill", "—", "—", "—", "—", f"{run['upstream_billed']:,}"])
    return f"""\
The bill, on `{BILLED_MODEL}` (the same upstream, a disk cache): {settings['bill_clients']} clients a tenant sending \
4 texts a request drawn from {settings['bill_pool']:,} for {settings['bill_s']:g} s, `stream` alone, then both; \
the usage API's counts since each part began (an admin key) beside the upstream's own count of what it billed.

{markdown_table(["part", "tenant", "statuses", "requests", "tokens", "cached tokens", "billed tokens"], rows)}

Tenants' billed tokens equal to the upstream's bill: {"met, to the token" if exact else "**not met**"}.
"""

"""A tenant's limits held as one budget across ingress replicas and nodes: requests and tokens granted a minute.

One Ray cluster runs the application: one ``openai`` entry on the simulated upstream (its own process, unlimited)
and two ingress replicas reading one keys file. With ``--nodes 1`` (the default) the cluster is one Ray node started
as ``serve run`` starts it (``serve.env``); with ``--nodes N`` it is ``load.multinode``'s N nodes, an ingress
replica on each and Serve's proxy on every node, each node's proxy sent an equal part of the clients.

Three tenants: ``by-requests`` limited to ``--rpm`` requests a minute, sending single texts; ``by-tokens`` to
``--tpm`` tokens a minute and ``by-day`` to ``--tokens-per-day`` tokens a UTC day, both sending ``--texts`` texts a
request; each from ``--clients`` clients, back to back, and again 100 ms after a 429 (sooner than its
``Retry-After`` asks, so that the limit alone holds them back). A bucket starts full: the first ``--drain-s``
seconds spend it, and over the next ``--window-s`` what is granted is the bucket's refill, the limit a minute.
Counted at the clients: the 200s answered in the window, and their ``usage``; for ``by-day``, every 200 of the run.

Targets (issue #43): each per-minute limit granted within 2% of itself a minute, on one node and across two; the day's
budget never passed by more than one request.
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Iterator

import aiohttp

from load.multinode import local_cluster, wait_for_proxies
from load.upstream import UpstreamConfig
from load.workload import pseudo_sentences

from .options import add_settings_arguments, chosen_settings
from .report import markdown_table, write_report
from .serving import SIM_MODEL, deployed, serve_cluster, sim_model_entry
from .shipped_service import write_keys_file
from .upstream_process import upstream_process

TARGET_SHARE = 0.02
RETRY_S = 0.1
KEYS = {"by-requests": "sk-bench-by-requests", "by-tokens": "sk-bench-by-tokens", "by-day": "sk-bench-by-day"}


@dataclass(frozen=True)
class Settings:
    rpm: int = 600
    tpm: int = 60_000
    tokens_per_day: int = 30_000
    texts: int = 8
    mean_chars: int = 120
    clients: int = 8  # each tenant's, over every node's proxy
    drain_s: float = 15.0
    window_s: float = 60.0
    nodes: int = 1

    def __post_init__(self) -> None:
        if self.nodes < 1:
            raise ValueError("tenant-limits: --nodes must be >= 1")


QUICK = Settings(rpm=120, tpm=12_000, tokens_per_day=3_000, clients=4, drain_s=3.0, window_s=6.0)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_settings_arguments(parser, Settings(), QUICK)


def run(args: argparse.Namespace) -> dict[str, Any]:
    settings = chosen_settings(args, Settings(), QUICK)
    with upstream_process(UpstreamConfig()) as root_url, tempfile.TemporaryDirectory() as work:
        keys = write_keys_file(Path(work) / "keys.yaml", {
            "by-requests": (KEYS["by-requests"], f"rpm: {settings.rpm}"),
            "by-tokens": (KEYS["by-tokens"], f"tpm: {settings.tpm}"),
            "by-day": (KEYS["by-day"], f"tokens_per_day: {settings.tokens_per_day}")})
        with _service(settings, root_url, keys) as urls:
            data = asyncio.run(_measure(urls, settings))
    data["settings"] = asdict(settings)
    name = "tenant_limits" if settings.nodes == 1 else f"tenant_limits_{settings.nodes}_nodes"
    return write_report(name, "A tenant's limits, one budget across replicas and nodes", render(data), data,
                        getattr(args, "results_dir", None))


@contextmanager
def _service(settings: Settings, root_url: str, keys: Path) -> Iterator[list[str]]:
    """The application on a fresh cluster of ``settings.nodes`` nodes; yields each node's URL of it."""
    from ray import serve

    from deployments.app import build_app

    ingress = {"num_replicas": 2, "env_vars": {"EMBEDDINGS_API_KEYS_FILE": str(keys)}}
    if settings.nodes == 1:
        app = build_app({"models": [sim_model_entry(f"{root_url}/v1")], "ingress": ingress})
        with serve_cluster() as proxy, deployed(proxy, {"limits": app}, SIM_MODEL) as (target,):
            yield [target.url]
        return
    ingress.update(num_replicas=settings.nodes, max_replicas_per_node=1)
    with local_cluster(settings.nodes) as cluster:
        serve.run(build_app({"models": [sim_model_entry(f"{root_url}/v1")], "ingress": ingress}), name="limits",
                  route_prefix="/")
        wait_for_proxies(cluster.nodes)
        yield [node.proxy_url for node in cluster.nodes]


async def _measure(urls: list[str], settings: Settings) -> dict[str, Any]:
    texts = pseudo_sentences(20_000, settings.mean_chars, seed=21)
    start = time.perf_counter() + 1.0
    window = (start + settings.drain_s, start + settings.drain_s + settings.window_s)
    sessions = [aiohttp.ClientSession(f"{url}/", timeout=aiohttp.ClientTimeout(total=60)) for url in urls]
    try:
        by_requests, by_tokens, by_day = await asyncio.gather(
            _tenant(sessions, KEYS["by-requests"], texts, 1, settings, start, window),
            _tenant(sessions, KEYS["by-tokens"], texts, settings.texts, settings, start, window),
            _tenant(sessions, KEYS["by-day"], texts, settings.texts, settings, start, (start, window[1])))
    finally:
        for session in sessions:
            await session.close()
    minutes = settings.window_s / 60.0
    return {"by-requests": {**by_requests, "granted_a_minute": by_requests["requests"] / minutes,
                            "limit": settings.rpm},
            "by-tokens": {**by_tokens, "granted_a_minute": by_tokens["tokens"] / minutes, "limit": settings.tpm},
            "by-day": {**by_day, "limit": settings.tokens_per_day}, "nodes": len(urls)}


async def _tenant(sessions: list[aiohttp.ClientSession], key: str, texts: list[str], size: int, settings: Settings,
                  start: float, window: tuple[float, float]) -> dict[str, Any]:
    """The tenant's clients from ``start`` to the window's end: what was granted inside the window."""
    granted = {"requests": 0, "tokens": 0, "refused": 0, "errors": 0, "largest_request_tokens": 0,
               "refusal_codes": {}}
    headers = {"Authorization": f"Bearer {key}"}

    async def client(number: int) -> None:
        session = sessions[number % len(sessions)]
        sent = number
        await asyncio.sleep(max(0.0, start - time.perf_counter()))
        while time.perf_counter() < window[1]:
            sent += settings.clients
            body = {"model": SIM_MODEL, "encoding_format": "base64",
                    "input": [texts[(sent * size + i) % len(texts)] for i in range(size)]}
            async with session.post("v1/embeddings", json=body, headers=headers) as answer:
                content = await answer.json(content_type=None)
                status = answer.status
            inside = window[0] <= time.perf_counter() < window[1]
            if status == 200 and inside:
                granted["requests"] += 1
                granted["tokens"] += content["usage"]["total_tokens"]
                granted["largest_request_tokens"] = max(granted["largest_request_tokens"],
                                                        content["usage"]["total_tokens"])
            elif status == 429:
                granted["refused"] += inside
                code = content["error"]["code"]
                granted["refusal_codes"][code] = granted["refusal_codes"].get(code, 0) + 1
                await asyncio.sleep(RETRY_S)
            elif status != 200:
                granted["errors"] += 1
                granted.setdefault("first_error", f"{status} {str(content)[:200]}")

    await asyncio.gather(*(client(number) for number in range(settings.clients)))
    return granted


def render(data: dict[str, Any]) -> str:
    settings = data["settings"]
    rows = []
    met = True
    for name, unit in (("by-requests", "requests"), ("by-tokens", "tokens")):
        run = data[name]
        share = run["granted_a_minute"] / run["limit"] - 1
        met = met and abs(share) <= TARGET_SHARE and run["errors"] == 0
        rows.append([f"`{name}`", f"{run['limit']:,} {unit}/min", f"{run['granted_a_minute']:,.0f}", f"{share:+.1%}",
                     f"{run['refused']:,}", run["errors"]])
    day = data["by-day"]
    over = day["tokens"] - day["limit"]
    day_met = over <= day["largest_request_tokens"] and day["errors"] == 0
    where = "one node (`serve.env`)" if data["nodes"] == 1 else f"{data['nodes']} nodes, an ingress replica on each"
    return f"""\
{where}; two ingress replicas in all; one `openai` entry on the simulated upstream. {settings['clients']} clients a \
tenant (spread over every node's proxy), back to back, again {RETRY_S * 1000:.0f} ms after a 429; the first \
{settings['drain_s']:g} s spend the full bucket, then {settings['window_s']:g} s are counted.

{markdown_table(["tenant", "limit", "granted a minute", "off the limit", "429s in the window", "errors"], rows)}

Within {TARGET_SHARE:.0%} of the limit: {"met" if met else "**not met**"}.

`by-day` (a budget of {day['limit']:,} tokens a UTC day, from the start of the run): {day['tokens']:,} tokens granted \
in {day['requests']:,} requests ({over:+,} against the budget; its largest request {day['largest_request_tokens']:,} \
tokens), then refused {day['refusal_codes']}. Never past the budget by more than one request: \
{"met" if day_met else "**not met**"}.
"""

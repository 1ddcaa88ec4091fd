"""This service beside peer embedding servers, each alone on the machine: the packaged MiniLM, offline, on CPU.

Servers: ``service`` (this project as shipped: ``serve run serve_config.yaml``, on a free port), ``fastapi-plain`` (FastAPI +
uvicorn encoding inline, no batching), ``infinity-torch`` and ``infinity-onnx`` (infinity-emb, batch size 32),
``mosec`` and ``litserve`` (request batching, 32 per batch, 10 ms wait), and ``service@<git revision>`` (the service as
shipped at that commit: ``service_at.py``, a change's before and after in one run); the peers' launch code is in
``load/peers/``, each peer in its own virtualenv under ``--peers-dir``, installed on first use. One at a time, each
server is started, warmed, measured and stopped before the next starts; with ``--repeats`` the order rotates and the
table shows medians with the range of texts/s.

Load, from one closed-loop generator in this process: single-text requests at concurrency 1, 16 and 64, and 64-text
requests at concurrency 4, unique ~120-character texts. Correctness: the cosine of each server's vectors for a few
probe texts to sentence-transformers' (torch, normalised) computed here.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from load.loadgen import closed_loop
from load.peers.launch import DEFAULT_PEERS_DIR, PEERS, Server, running
from load.proc_cpu import CpuMeter
from load.stats import median
from load.upstream_client import UpstreamClient, UpstreamError
from load.workload import pseudo_sentences

from . import engine_limit
from .harness import code_version, rotated, version_line
from .options import chosen_settings
from .report import markdown_table, write_report
from .service_at import PREFIX, names_a_commit, service_at
from .shipped_service import MODEL, SERVICE, SERVICES_WITH_TENANTS, packaged_model_path

SERVERS: dict[str, Server] = {SERVICE.name: SERVICE, **PEERS, **{server.name: server for server in SERVICES_WITH_TENANTS}}


@dataclass(frozen=True)
class Level:
    """One load level: ``requests`` requests of ``texts`` texts each, from ``concurrency`` closed-loop callers."""

    concurrency: int
    requests: int
    texts: int = 1

    @property
    def name(self) -> str:
        return f"c{self.concurrency}" if self.texts == 1 else f"{self.texts}×c{self.concurrency}"


@dataclass(frozen=True)
class Settings:
    levels: tuple[Level, ...] = (Level(1, 200), Level(16, 1000), Level(64, 2000), Level(4, 60, 64))
    warmup_requests: int = 48  # single texts at concurrency 4, then one multi-text request
    probes: int = 8
    repeats: int = 1
    mean_chars: int = 120
    engine_texts: int = 1536  # texts the engine alone embeds in each arrangement

    def __post_init__(self) -> None:
        if self.repeats < 1 or self.probes < 2 or any(level.requests < 1 for level in self.levels):
            raise ValueError("repeats and every level's requests must be >= 1, probes >= 2")


QUICK = Settings(levels=(Level(1, 8), Level(16, 32), Level(64, 64), Level(4, 4, 64)), warmup_requests=8, probes=4,
                 engine_texts=64)


@dataclass(frozen=True)
class Target:
    """A running server: its base URL, its embeddings route, the encoding to ask for, extra headers (a key), and its
    processes (None: their CPU is not measured)."""

    name: str
    url: str
    route: str = "/v1/embeddings"
    encoding: str = "base64"
    headers: Mapping[str, str] = field(default_factory=dict)
    pids: Callable[[], list[int]] | None = None


class TargetClient(UpstreamClient):
    """``UpstreamClient`` (one aiohttp session) aimed at any server's embeddings route, in either encoding."""

    def __init__(self, target: Target) -> None:
        super().__init__(target.url, model=MODEL, headers=target.headers)
        self.target = target

    async def embed(self, texts: list[str]) -> list[np.ndarray]:
        body = json.dumps({"model": self.model, "input": texts, "encoding_format": self.target.encoding})
        async with self._require_session().post(f"{self.root_url}{self.target.route}", data=body,
                                                headers=self._headers) as response:
            raw = await response.read()
            if response.status != 200:
                raise UpstreamError(response.status, raw.decode("utf-8", "replace")[:300])
        data = sorted(json.loads(raw)["data"], key=lambda entry: entry["index"])
        if len(data) != len(texts):
            raise ValueError(f"{len(data)} vectors for {len(texts)} texts")
        return [np.frombuffer(base64.b64decode(e), dtype="<f4") if isinstance(e, str) else np.asarray(e, "f4")
                for e in (entry["embedding"] for entry in data)]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--repeats", type=int, help="interleaved repeats, rotating the order (default 1)")
    parser.add_argument("--servers", default=",".join(SERVERS),
                        help=f"comma-separated servers to run (default all: {','.join(SERVERS)}), and "
                             f"{PREFIX}<git revision> for the service at another commit")
    parser.add_argument("--peers-dir", type=Path, default=DEFAULT_PEERS_DIR,
                        help=f"where the peers' virtualenvs live (default {DEFAULT_PEERS_DIR})")


def run(args: argparse.Namespace) -> dict[str, Any]:
    names = [name.strip() for name in args.servers.split(",") if name.strip()]
    if unknown := [name for name in names if name not in SERVERS and not names_a_commit(name)]:
        raise SystemExit(f"unknown servers {unknown}; choose from {list(SERVERS)} or {PREFIX}<git revision>")
    with contextlib.ExitStack() as commits:
        servers = [commits.enter_context(service_at(name)) if names_a_commit(name) else SERVERS[name]
                   for name in names]
        return _run(args, servers)


def _run(args: argparse.Namespace, servers: Sequence[Server]) -> dict[str, Any]:
    settings = chosen_settings(args, Settings(), QUICK)
    model = packaged_model_path()
    about = {s.name: {"versions": s.prepare(args.peers_dir), "batching": dict(s.batching), "encoding": s.encoding,
                      "route": s.route} for s in servers}
    reference = reference_vectors(model, probe_texts(settings))
    runs: dict[str, list[dict[str, Any]]] = {s.name: [] for s in servers}
    limits = []
    for repeat in range(settings.repeats):
        print(f"[{repeat + 1}/{settings.repeats}] the engine alone ...", flush=True)
        limits.append(engine_limit.measure(pseudo_sentences(settings.engine_texts, settings.mean_chars, seed=3)))
        for server in rotated(servers, repeat):
            print(f"[{repeat + 1}/{settings.repeats}] {server.name} ...", flush=True)
            with running(server, args.peers_dir, model) as started:
                target = Target(server.name, started.url, server.route, server.encoding,
                                headers=dict(server.probe_headers), pids=started.pids)
                runs[server.name] += measure([target], settings, reference)[server.name]
    return report(runs, about, settings, getattr(args, "results_dir", None), limits)


def probe_texts(settings: Settings) -> list[str]:
    """Probe texts unlike the load's: a few words, a sentence, one past the model's 256-token window."""
    return ["Hi.", *pseudo_sentences(settings.probes - 2, settings.mean_chars, seed=7), " ".join(
        pseudo_sentences(30, settings.mean_chars, seed=8))][-settings.probes:]


def reference_vectors(model: Path, texts: Sequence[str]) -> np.ndarray:
    """sentence-transformers' (torch) normalised embeddings of ``texts``, computed in this process."""
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(str(model), device="cpu").encode(list(texts), normalize_embeddings=True)


def measure(targets: Sequence[Target], settings: Settings,
            reference: np.ndarray | None = None) -> dict[str, list[dict[str, Any]]]:
    """Warm up and measure each running target in turn; returns name -> [one record]."""
    probes = probe_texts(settings)
    if reference is None:
        reference = reference_vectors(packaged_model_path(), probes)
    return {target.name: [asyncio.run(_measure_one(target, settings, probes, reference))] for target in targets}


async def _measure_one(target: Target, settings: Settings, probes: list[str],
                       reference: np.ndarray) -> dict[str, Any]:
    needed = settings.warmup_requests + sum(level.requests * level.texts for level in settings.levels)
    texts = iter(pseudo_sentences(needed, settings.mean_chars))

    def take(count: int) -> list[str]:  # every text is sent once
        return [next(texts) for _ in range(count)]

    async with TargetClient(target) as client:
        warm = take(settings.warmup_requests)
        warmup = await closed_loop(client.embed_one, warm, 4)
        await client.embed(warm)
        vectors = np.stack(await client.embed(probes))
        cosines = np.sum(vectors * reference, axis=1) / np.linalg.norm(vectors, axis=1)
        levels = {}
        meter = CpuMeter(target.pids)
        for level in settings.levels:
            batches = {chunk[0]: chunk for chunk in (take(level.texts) for _ in range(level.requests))}
            cpu_before = meter.start()
            result = await closed_loop(lambda first: client.embed(batches[first]), list(batches), level.concurrency)
            texts_done = result.completed * level.texts
            cpu_ms = meter.ms_each(cpu_before, texts_done)
            summary = result.summary()
            levels[level.name] = {"texts_per_s": result.throughput * level.texts, "requests_per_s": result.throughput,
                                  **{key: summary[key] for key in ("p50_ms", "p99_ms", "errors", "error_sample",
                                                                   "completed", "elapsed_s")},
                                  "cpu_ms_per_text": {**cpu_ms,
                                                      "load generator": 1e3 * result.cpu_s / max(1, texts_done)}}
    return {"levels": levels, "min_cosine": float(cosines.min()), "cosines": cosines.tolist(),
            "warmup_errors": warmup.errors, "encoding": target.encoding}


def service_about() -> dict[str, Any]:
    """The service's versions and batching settings, as ``run`` records them for every server."""
    return {"versions": SERVICE.prepare(DEFAULT_PEERS_DIR), "batching": dict(SERVICE.batching),
            "encoding": SERVICE.encoding, "route": SERVICE.route}


def report(runs: Mapping[str, list[dict[str, Any]]], about: Mapping[str, dict[str, Any]], settings: Settings,
           results_dir: Path | None = None, limits: Sequence[dict[str, Any]] = ()) -> dict[str, Any]:
    """Write ``peers.md`` and ``peers.json`` (medians over the repeats) and return the JSON's data; ``limits``: the
    engine alone (``engine_limit.measure``), once a repeat."""
    rows = {name: summarise(records) for name, records in runs.items()}
    engine = summarise_limits(limits) if limits else None
    data = {"code": code_version(), "settings": asdict(settings), "servers": about, "rows": rows, "runs": runs,
            "engine_alone": engine}
    return write_report("peers", "This service beside peer embedding servers",
                        render(settings, about, rows, data["code"], engine), data, results_dir)


def summarise_limits(limits: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The engine alone over the repeats: each arrangement's median texts/s and CPU a text, and the best median."""
    names = list(limits[0]["arrangements"])
    arrangements = {name: {key: median([limit["arrangements"][name][key] for limit in limits])
                           for key in ("texts_per_s", "cpu_ms_per_text")} for name in names}
    return {"cores": limits[0]["cores"], "arrangements": arrangements,
            "best_texts_per_s": max(row["texts_per_s"] for row in arrangements.values()), "runs": list(limits)}


def summarise(records: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Per level the median texts/s, P50 and P99 over the repeats, the range of texts/s, and all errors."""
    levels = {}
    for name in records[0]["levels"]:
        cells = [record["levels"][name] for record in records]
        rates = [cell["texts_per_s"] for cell in cells]
        levels[name] = {"texts_per_s": median(rates), "texts_per_s_range": [min(rates), max(rates)],
                        "p50_ms": median([cell["p50_ms"] for cell in cells]),
                        "p99_ms": median([cell["p99_ms"] for cell in cells]),
                        "errors": sum(cell["errors"] for cell in cells)}
    for name, level in levels.items():
        cpu = [record["levels"][name].get("cpu_ms_per_text", {}) for record in records]
        groups = dict.fromkeys(group for per_group in cpu for group in per_group)
        level["cpu_ms_per_text"] = {group: median([per_group.get(group, 0.0) for per_group in cpu]) for group in groups}
    return {"levels": levels, "min_cosine": min(record["min_cosine"] for record in records),
            "cosines": [min(values) for values in zip(*(record["cosines"] for record in records))],
            "errors": sum(level["errors"] for level in levels.values()), "repeats": len(records)}


def render(settings: Settings, about: Mapping[str, dict[str, Any]], rows: Mapping[str, dict[str, Any]],
           code: dict[str, Any], engine: dict[str, Any] | None = None) -> str:
    def cell(level: dict[str, Any], p99: bool = True) -> str:
        rate, (low, high) = level["texts_per_s"], level["texts_per_s_range"]
        spread = f" [{low:,.0f}–{high:,.0f}]" if high > low else ""
        latency = f"{_ms(level['p50_ms'])} / {_ms(level['p99_ms'])}" if p99 else _ms(level["p50_ms"])
        return f"{rate:,.0f}{spread} ({latency} ms)"

    names = [level.name for level in settings.levels]
    table = markdown_table(
        ["server", *(f"{name} texts/s (P50{'' if i == 0 else ' / P99'} ms)" for i, name in enumerate(names)),
         "min cosine", "errors"],
        [[name, *(cell(row["levels"][level], p99=i > 0) for i, level in enumerate(names)),
          f"{row['min_cosine']:.6f}", row["errors"]] for name, row in rows.items()],
    )
    servers = markdown_table(
        ["server", "versions", "batching", "encoding"],
        [[name, ", ".join(f"{k} {v}" for k, v in info["versions"].items()),
          ", ".join(f"{k}={v}" for k, v in info["batching"].items()), info["encoding"]]
         for name, info in about.items()],
    )
    low = [f"{name} {', '.join(f'{c:.4f}' for c in row['cosines'])}" for name, row in rows.items()
           if row["min_cosine"] < 0.999]
    probes = (f"Cosines per probe where one is below 0.999 (the last probe is longer than the model's 256-token "
              f"window, where sentence-transformers truncates): {'; '.join(low)}.") if low else ""
    limit = render_limit(engine, rows, names) if engine else ""
    against = render_against_commits(rows, names)
    cpu = render_cpu(rows, names)
    load = "; ".join(f"{level.name}: {level.requests:,} requests of {level.texts} text(s) from {level.concurrency} "
                     "caller(s)" for level in settings.levels)
    return f"""\
{version_line(code)}

Each server alone on the machine (started, warmed with {settings.warmup_requests} requests, measured, stopped before
the next), the packaged all-MiniLM-L6-v2 on CPU, offline, one process or worker for the model. Closed-loop load from
one aiohttp generator on the same machine (it shares the 2 cores with the server): {load}; unique
~{settings.mean_chars}-character texts. {settings.repeats} repeat(s) in rotating order: medians, [range of texts/s]
when repeated. Min cosine: over {settings.probes} probe texts (one longer than the model's 256-token window), the
lowest cosine of a server's vector to sentence-transformers' (torch) computed in the benchmark's process.

{table}

{against}

{limit}

{cpu}

{probes}

{servers}
"""


def render_against_commits(rows: Mapping[str, dict[str, Any]], names: Sequence[str]) -> str:
    """The service beside itself at other commits (``service@<rev>`` rows): its texts/s and P50 over theirs."""
    if SERVICE.name not in rows:
        return ""
    now = rows[SERVICE.name]["levels"]
    before = {name: row["levels"] for name, row in rows.items() if names_a_commit(name)}
    if not before:
        return ""
    table = markdown_table(
        ["service over", *(f"{name} texts/s (P50)" for name in names)],
        [[name, *(f"{now[level]['texts_per_s'] / levels[level]['texts_per_s']:.3f}× "
                  f"({_ratio(now[level]['p50_ms'], levels[level]['p50_ms'])})" for level in names)]
         for name, levels in before.items()])
    return f"The service against itself at another commit (medians over the repeats: above 1× it serves more, " \
           f"below 1× its P50 is lower):\n\n{table}"


def _ratio(now: float | None, before: float | None) -> str:
    return "—" if not now or not before else f"{now / before:.3f}×"


def render_limit(engine: dict[str, Any], rows: Mapping[str, dict[str, Any]], names: Sequence[str]) -> str:
    """The engine alone, each arrangement, and each server's texts/s as a fraction of its best."""
    best = engine["best_texts_per_s"]
    arrangements = markdown_table(
        ["the engine alone, " + f"{engine['cores']} cores", "texts/s", "CPU ms a text"],
        [[name, f"{row['texts_per_s']:,.0f}", f"{row['cpu_ms_per_text']:.2f}"]
         for name, row in engine["arrangements"].items()])
    fractions = markdown_table(
        ["server", *(f"{name} / engine alone" for name in names)],
        [[server, *(f"{row['levels'][name]['texts_per_s'] / best:.2f}" for name in names)]
         for server, row in rows.items()])
    return f"""\
The model's engine alone on every core (``load/bench/engine_limit.py``: the same kind of texts, tokenized ahead, in
the service's engine calls), measured in each repeat (medians); its best arrangement is the limit a server reaches.

{arrangements}

{fractions}"""


def render_cpu(rows: Mapping[str, dict[str, Any]], names: Sequence[str]) -> str:
    """Each server's CPU a text by process group, at each level (medians over the repeats)."""
    lines = []
    for server, row in rows.items():
        groups = dict.fromkeys(group for name in names for group, ms in row["levels"][name]["cpu_ms_per_text"].items()
                               if ms >= 0.01)  # Ray's idle daemons apart
        if len(groups) <= 1:  # the load generator's alone: the server's processes were not measured
            continue
        lines.append(markdown_table(
            [f"{server}: CPU ms a text", *names],
            [[group, *(f"{row['levels'][name]['cpu_ms_per_text'].get(group, 0.0):.2f}" for name in names)]
             for group in groups]
            + [["all of the server's", *(f"{_server_cpu(row['levels'][name]):.2f}" for name in names)]]))
    if not lines:
        return ""
    return ("Where the CPU goes: each process's CPU time over a level (from /proc), by what the process is, "
            "divided by the texts served; the load generator is the benchmark's own process.\n\n"
            + "\n\n".join(lines))


def _server_cpu(level: dict[str, Any]) -> float:
    return sum(ms for group, ms in level["cpu_ms_per_text"].items() if group != "load generator")


def _ms(value: float | None) -> str:
    return "—" if value is None else f"{value:,.1f}"


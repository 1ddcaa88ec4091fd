"""The local MiniLM through the full service: batched vs unbatched, single-text requests at concurrency 1, 16, 64.

Two copies of the application from ``serve_config.yaml`` run side by side on one Ray cluster, each with one model
replica: ``batched`` with the configured batching, ``unbatched`` with ``max_batch_size`` 1 and no wait (every
request is one model call). At each concurrency the two run one after the other, in a rotating order, repeated;
the table shows medians. Target: at concurrency 64, batched ≥ 3× the unbatched texts/s.

Before the service is loaded, the model alone: the milliseconds per text of its engine in this process, on one
thread (what each replica here computes on), over the same texts at batch sizes from 1 to the configured maximum.
Their ratio is what batching can gain at the model itself; the rest of a gain through the service is the request
path's cost, paid once a batch instead of once a text.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from dataclasses import asdict, dataclass
from typing import Any, Sequence

from load.stats import median_of
from load.workload import pseudo_sentences

from .options import chosen_settings
from .report import markdown_table, write_report
from .serving import UNBATCHED, compare_over_http, default_models, deployed, one_replica, serve_cluster

TARGET_SPEEDUP_AT_64 = 3.0


@dataclass(frozen=True)
class Settings:
    levels: tuple[tuple[int, int], ...] = ((1, 64), (16, 384), (64, 768))  # (concurrency, requests)
    repeats: int = 2
    mean_chars: int = 120
    model_batch_sizes: tuple[int, ...] = (1, 4, 16, 64)  # single texts, and the batches compared with them
    model_texts: int = 512  # texts timed at each batch size (at least 4 calls)

    def __post_init__(self) -> None:
        if self.repeats < 1:
            raise ValueError("local: --repeats must be >= 1")
        if 1 not in self.model_batch_sizes:
            raise ValueError("local: the model alone is timed on single texts too (batch size 1)")


QUICK = Settings(levels=((1, 4), (4, 16)), repeats=1, model_batch_sizes=(1, 4), model_texts=8)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--repeats", type=int, help=f"interleaved repeats (default {Settings.repeats})")


def run(args: argparse.Namespace) -> dict[str, Any]:
    settings = chosen_settings(args, Settings(), QUICK)
    with serve_cluster() as proxy:
        return measure(proxy, settings, getattr(args, "results_dir", None))


def measure(proxy: str, settings: Settings, results_dir: Any = None) -> dict[str, Any]:
    """The scenario on a running Serve instance whose HTTP proxy is at ``proxy``."""
    from deployments.app import build_app

    model = default_models()[0]
    name = model["name"]
    texts = pseudo_sentences(max(count for _, count in settings.levels), settings.mean_chars)
    alone = model_alone(model, texts, settings.model_batch_sizes, settings.model_texts)
    apps = {"batched": build_app({"models": [one_replica(model)]}),
            "unbatched": build_app({"models": [one_replica(model, **UNBATCHED)]})}
    with deployed(proxy, apps, name) as targets:
        runs = asyncio.run(compare_over_http(targets, name, texts, settings.levels, settings.repeats))
    rows = summarise(runs)
    speedup = rows["64"]["speedup"] if "64" in rows else None
    data = {
        "settings": asdict(settings),
        "model": model,
        "model_alone_ms_per_text": alone,
        "rows": rows,
        "target": {"speedup_at_64": speedup, "needed": TARGET_SPEEDUP_AT_64,
                   "met": speedup is not None and speedup >= TARGET_SPEEDUP_AT_64},
        "runs": runs,
    }
    return write_report("local", "Local MiniLM through the full service",
                        render(settings, model, alone, rows, data["target"]), data, results_dir)


def model_alone(model: dict[str, Any], texts: Sequence[str], batch_sizes: Sequence[int], count: int) -> dict[str, float]:
    """Batch size -> median milliseconds per text of the model's engine alone, on one thread, over ``texts``."""
    from deployments.model.backends import make_backend
    from deployments.model.backends.engines import embed_sequences
    from deployments.config import ModelConfig

    backend = make_backend(ModelConfig(**{**one_replica(model), "threads": 1}))
    try:
        sequences = backend.wordpieces.encode_many(texts)
        alone = {}
        for size in batch_sizes:
            per_text = []
            for call in range(max(4, count // size)):
                start = call * size % max(1, len(sequences) - size)
                began = time.perf_counter()
                embed_sequences(backend.engine, sequences[start : start + size], backend.wordpieces.pad_id)
                per_text.append((time.perf_counter() - began) * 1000 / size)
            alone[str(size)] = statistics.median(per_text)
        return alone
    finally:
        asyncio.run(backend.aclose())


def summarise(runs: dict[str, dict[int, list[dict[str, Any]]]]) -> dict[str, dict[str, Any]]:
    rows = {}
    for concurrency in runs["batched"]:
        cells = {label: {key: median_of(runs[label][concurrency], key)
                         for key in ("items_per_s", "p50_ms", "p99_ms", "mean_batch_size")}
                 for label in runs}
        errors = sum(r["errors"] for label in runs for r in runs[label][concurrency])
        batched, unbatched = cells["batched"]["items_per_s"], cells["unbatched"]["items_per_s"]
        rows[str(concurrency)] = {**cells, "errors": errors,
                                  "speedup": batched / unbatched if batched and unbatched else None}
    return rows


def render(settings: Settings, model: dict[str, Any], alone: dict[str, float], rows: dict[str, dict[str, Any]],
           target: dict[str, Any]) -> str:
    def fmt(value: float | None, digits: int = 1) -> str:
        return "—" if value is None else f"{value:.{digits}f}"

    table = markdown_table(
        ["concurrency", "batched texts/s", "P50 ms", "P99 ms", "mean batch", "unbatched texts/s", "P50 ms", "P99 ms",
         "batched / unbatched", "errors"],
        [[c, fmt(r["batched"]["items_per_s"]), fmt(r["batched"]["p50_ms"]), fmt(r["batched"]["p99_ms"]),
          fmt(r["batched"]["mean_batch_size"]), fmt(r["unbatched"]["items_per_s"]), fmt(r["unbatched"]["p50_ms"]),
          fmt(r["unbatched"]["p99_ms"]), fmt(r["speedup"], 2) + "×" if r["speedup"] else "—", r["errors"]]
         for c, r in rows.items()],
    )
    verdict = "met" if target["met"] else "**not met**"
    best = min(alone, key=alone.__getitem__)
    alone_table = markdown_table(["batch size", *alone], [["ms per text", *(fmt(ms, 2) for ms in alone.values())]])
    return f"""\
Single-text `POST /v1/embeddings` requests (base64), closed loop; requests per level: \
{", ".join(f"{n} at concurrency {c}" for c, n in settings.levels)}; {settings.repeats} interleaved repeat(s), medians.
Model `{model['name']}` (backend `{model['backend']}`), one replica each; batched settings: `{model.get('batching')}`.

{table}

The model alone (its engine in this process, one thread, the same texts, before the service was loaded):

{alone_table}

Batching makes the model itself at most {fmt(alone["1"] / alone[best], 2)}× faster per text here (batches of \
{best} against single texts); what a batched service gains beyond that is the request path's cost per text.

Target: at concurrency 64, batched ≥ {TARGET_SPEEDUP_AT_64:g}× unbatched texts/s: {verdict} \
({fmt(target['speedup_at_64'], 2)}×).
"""

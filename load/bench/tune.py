"""A change to the shipped model entry against the entry as shipped, side by side in one Serve instance.

``python -m load.bench tune --set batching.scale_factor=10 [--set KEY=VALUE ...]`` deploys the first model entry of
``serve_config.yaml`` twice on one Ray cluster (``serve.env``, HAProxy in front): ``shipped`` as it is, ``changed``
with each ``KEY`` (a dotted path into the entry) set to ``VALUE`` (read as YAML). Both keep the entry's own replicas
and CPUs (the cluster reserves enough for the two), so each computes as the shipped service does. Single-text
requests, closed loop at concurrency 1, 16 and 64; at every repeat and level the two run one right after the other,
in a rotating order, after one warm-up run each.

``--against REV`` measures this checkout's code and entry (with any ``--set``) against the code and entry of the
commit ``REV`` names (``HEAD~1``, a branch, a hash), from a git worktree of it, the two side by side in the same way:
a change to the code measured as a change to a setting is. Both are deployed as ``serve run`` deploys a config's
application (built in Serve's controller), each with its own checkout first on ``PYTHONPATH`` for its build and
replicas, on a Ray started from outside this checkout (``serve_cluster``'s ``checkout_first``). Both run this
checkout's virtualenv, and the commit's answers reach this checkout's code: a commit whose config or wire types
differ from this checkout's is not one this can compare.

Runs of one configuration in separate ``serve run``s, minutes apart, differ by more than most settings move them on
a shared machine; alternated level by level in one instance, the two meet the same machine. The report gives both
sides' medians, the changed one over the shipped one, and that ratio's range over the repeats' pairs: a change
counts only where the range stays on one side of 1x.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import copy
import math
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, Mapping, Sequence

import yaml

from deployments.config import ConfigError, ModelConfig, parse_app_config
from deployments.sizing import max_replicas, model_actor_options
from load.loadgen import closed_loop
from load.peers.launch import ROOT
from load.proc_cpu import descendants
from load.stats import median_of
from load.upstream_client import UpstreamClient
from load.workload import pseudo_sentences

from .e2e import service_cpu
from .options import chosen_settings
from .report import markdown_table, write_report
from .service_at import checkout
from .serving import SentTotals, compare_over_http, default_models, deployed_as_configured, serve_cluster

VARIANTS = ("shipped", "changed")
_ABSENT = object()  # a setting the entry leaves to its default (unlike one set to null)


@dataclass(frozen=True)
class Settings:
    levels: tuple[tuple[int, int], ...] = ((1, 200), (16, 1600), (64, 3200))  # (concurrency, requests)
    repeats: int = 6
    mean_chars: int = 120  # ~28 word pieces, as the peers benchmark's texts
    warm_up: int = 64  # requests each variant serves, at concurrency 16, before the repeats

    def __post_init__(self) -> None:
        if self.repeats < 1:
            raise ValueError("tune: --repeats must be >= 1")


QUICK = Settings(levels=((1, 4), (4, 16)), repeats=1, warm_up=4)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--set", dest="changes", action="append", default=[], metavar="KEY=VALUE",
                        help="a setting of the shipped model entry, by dotted path (batching.scale_factor=10); "
                             "repeat it for several")
    parser.add_argument("--against", metavar="REV",
                        help="measure this checkout (code and entry) against the commit REV names (HEAD~1, a hash)")
    parser.add_argument("--repeats", type=int, help=f"alternated repeats (default {Settings.repeats})")


def run(args: argparse.Namespace) -> dict[str, Any]:
    settings = chosen_settings(args, Settings(), QUICK)
    if not args.changes and args.against is None:
        raise SystemExit("tune: name a change (--set KEY=VALUE) or a commit to measure this checkout against "
                         "(--against REV)")
    (entry, *_) = default_models()
    with contextlib.ExitStack() as stack:
        against = None if args.against is None else stack.enter_context(checkout(args.against, "tune --against"))
        try:
            shipped = entry if against is None else default_models(against[1] / "serve_config.yaml")[0]
            changed = changed_entry(entry, args.changes) if args.changes else copy.deepcopy(entry)
            cpus = cpus_reserved(shipped) + cpus_reserved(changed)
        except (ConfigError, ValueError) as exc:
            raise SystemExit(f"tune: {exc}") from None
        with serve_cluster(num_cpus=cpus, checkout_first=against is None) as proxy:
            return measure(proxy, shipped, changed, settings, getattr(args, "results_dir", None), against)


def changed_entry(entry: Mapping[str, Any], changes: Sequence[str]) -> dict[str, Any]:
    """``entry`` with each ``KEY=VALUE`` of ``changes`` set (``KEY`` a dotted path, ``VALUE`` YAML), checked as the
    service checks its config: a ``ConfigError`` names a setting it does not know or a value it refuses."""
    changed = copy.deepcopy(dict(entry))
    for change in changes:
        path, sep, raw = change.partition("=")
        if not sep or not path:
            raise ValueError(f"{change!r} is not KEY=VALUE")
        *parents, leaf = path.split(".")
        section = changed
        for key in parents:
            section = section.setdefault(key, {})
            if not isinstance(section, dict):
                raise ValueError(f"{path!r}: {key!r} is not a section of the model entry")
        section[leaf] = yaml.safe_load(raw)
    if changed == entry:
        raise ValueError("the changes leave the shipped entry as it is")
    _parsed(changed)
    return changed


def cpus_reserved(entry: Mapping[str, Any]) -> int:
    """The CPUs the entry's replicas reserve at most, as the service sizes them, rounded up to whole ones for the
    cluster."""
    model = _parsed(entry)
    return math.ceil(max_replicas(model) * model_actor_options(model)["num_cpus"])


def _parsed(entry: Mapping[str, Any]) -> ModelConfig:
    (model,) = parse_app_config({"models": [entry]}).models
    return model


def measure(proxy: str, shipped: Mapping[str, Any], changed: Mapping[str, Any], settings: Settings,
            results_dir: Any = None, against: tuple[str, Path] | None = None) -> dict[str, Any]:
    """The scenario on a running Serve instance whose HTTP proxy is at ``proxy``, this process's own cluster (its
    processes' CPU is measured); ``against``: the commit (short hash, checkout) whose code runs ``shipped``."""
    name = shipped["name"]
    texts = pseudo_sentences(max(count for _, count in settings.levels), settings.mean_chars)
    # Against a commit, both run their code from their checkout's path (workers started alike), this one's from here.
    trees = (None, None) if against is None else (against[1], ROOT)
    apps = {label: ({"models": [entry]}, tree) for label, entry, tree in zip(VARIANTS, (shipped, changed), trees)}
    with deployed_as_configured(proxy, apps, name) as deployed_targets:
        # A handle call reads one replica's counters: an entry of several replicas has no mean batch here.
        targets = [target if max_replicas(_parsed(entry)) == 1 else replace(target, batch_totals=_no_totals)
                   for target, entry in zip(deployed_targets, (shipped, changed))]
        asyncio.run(_warm_up([target.url for target in targets], name, texts[:settings.warm_up]))
        runs = asyncio.run(compare_over_http(targets, name, texts, settings.levels, settings.repeats,
                                             pids=descendants))
    rows = summarise(runs)
    data = {"settings": asdict(settings), "against": None if against is None else against[0],
            "shipped": dict(shipped), "changed": dict(changed), "changes": changes_between(shipped, changed),
            "rows": rows, "runs": runs}
    title = ("A change to the shipped model entry, beside the entry as shipped" if against is None else
             f"This checkout beside commit {against[0]}")
    return write_report("tune", title, render(settings, data), data, results_dir)


async def _no_totals() -> SentTotals:
    return SentTotals(0, 0)


async def _warm_up(urls: Sequence[str], model: str, texts: Sequence[str]) -> None:
    for url in urls:
        async with UpstreamClient(url, model=model) as client:
            await closed_loop(client.embed_one, texts, 16)


def summarise(runs: Mapping[str, Mapping[int, list[dict[str, Any]]]]) -> dict[str, dict[str, Any]]:
    """Per level: each variant's medians and CPU a request, and the changed one over the shipped one (of the medians,
    and the range of the repeats' pairs)."""
    rows = {}
    for concurrency, shipped_runs in runs["shipped"].items():
        changed_runs = runs["changed"][concurrency]
        cells = {label: {**{key: median_of(runs[label][concurrency], key)
                            for key in ("items_per_s", "p50_ms", "p99_ms", "mean_batch_size")},
                         "cpu_ms": service_cpu(label, runs[label][concurrency]),
                         "errors": sum(run["errors"] for run in runs[label][concurrency])}
                 for label in VARIANTS}
        pairs = [b["items_per_s"] / a["items_per_s"] for a, b in zip(shipped_runs, changed_runs) if a["items_per_s"]]
        rows[str(concurrency)] = {
            **cells,
            "texts_ratio": _ratio(cells["changed"]["items_per_s"], cells["shipped"]["items_per_s"]),
            "p50_ratio": _ratio(cells["changed"]["p50_ms"], cells["shipped"]["p50_ms"]),
            "texts_ratio_range": [min(pairs), max(pairs)] if pairs else None,
        }
    return rows


def changes_between(shipped: Mapping[str, Any], changed: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """The dotted paths whose values differ, with the changed values."""
    found: dict[str, Any] = {}
    for key in sorted(set(shipped) | set(changed), key=str):
        before, after = shipped.get(key, _ABSENT), changed.get(key, _ABSENT)
        if isinstance(before, dict) and isinstance(after, dict):
            found.update(changes_between(before, after, f"{prefix}{key}."))
        elif before != after:
            found[f"{prefix}{key}"] = after
    return found


def _ratio(numerator: float | None, denominator: float | None) -> float | None:
    return numerator / denominator if numerator is not None and denominator else None


def render(settings: Settings, data: dict[str, Any]) -> str:
    def fmt(value: float | None, digits: int = 1) -> str:
        return "—" if value is None else f"{value:,.{digits}f}"

    def side(cell: dict[str, Any]) -> str:
        return f"{fmt(cell['items_per_s'])} ({fmt(cell['p50_ms'])} / {fmt(cell['p99_ms'])} ms)"

    def cpu(cell: dict[str, Any]) -> str:
        parts = cell["cpu_ms"]
        return " / ".join(fmt(parts.get(key), 2) for key in ("model replica", "ingress", "the rest")) if parts else "—"

    rows = data["rows"]
    table = markdown_table(
        ["concurrency", "shipped texts/s (P50 / P99)", "changed texts/s (P50 / P99)", "changed / shipped texts/s",
         "over the repeats", "P50 changed / shipped", "mean batch", "CPU ms a request: model / ingress / rest",
         "errors"],
        [[concurrency, side(row["shipped"]), side(row["changed"]), f"{fmt(row['texts_ratio'], 3)}×",
          "—" if row["texts_ratio_range"] is None else
          f"{row['texts_ratio_range'][0]:.3f}–{row['texts_ratio_range'][1]:.3f}×",
          f"{fmt(row['p50_ratio'], 3)}×",
          f"{fmt(row['shipped']['mean_batch_size'])} / {fmt(row['changed']['mean_batch_size'])}",
          f"{cpu(row['shipped'])} vs {cpu(row['changed'])}",
          row["shipped"]["errors"] + row["changed"]["errors"]]
         for concurrency, row in rows.items()],
    )
    changes = ", ".join(f"`{key}: {value!r}`" for key, value in data["changes"].items())
    if data.get("against") is None:
        sides = (f"The first model entry of `serve_config.yaml` (`{data['shipped']['name']}`) as shipped, and "
                 f"changed: {changes}.")
    else:
        differing = f", its entry differing in {changes}" if changes else " (the same entry)"
        sides = (f"`shipped`: the code and first model entry of commit {data['against']}; `changed`: this "
                 f"checkout's{differing}.")
    levels = ", ".join(f"{count} at concurrency {concurrency}" for concurrency, count in settings.levels)
    spread = [abs(row["texts_ratio_range"][1] - row["texts_ratio_range"][0]) for row in rows.values()
              if row["texts_ratio_range"]]
    return f"""{sides} Both in one Serve instance (`serve.env`), each with the entry's own replicas and CPUs; single-text \
requests (base64), closed loop: {levels}; {settings.repeats} alternated repeat(s), medians. `mean batch`: texts a \
batch the model formed (— for an entry of several replicas). CPU: each process's CPU time over a variant's runs, \
from /proc, by the texts it served (the rest: HAProxy, Ray's own processes, the idle variant).

{table}

A change counts where the repeats' range stays on one side of 1×; the widest range here spans \
{fmt(100 * max(spread) if spread else None)} points.
"""

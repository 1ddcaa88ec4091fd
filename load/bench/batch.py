"""The Batch API as a user runs it: a corpus through ``/v1/files`` and ``/v1/batches`` beside interactive traffic.

The service as shipped (``serve run serve_config.yaml`` with ``serve.env``, the local all-MiniLM-L6-v2), the load
from this process with the official ``openai`` client: the corpus (``--documents`` ~120-character texts) is cut into
input files of at most ``--lines-per-batch`` lines (OpenAI's 50,000), uploaded, and submitted as batches at once. A
HIGH stream of single texts (Poisson, ``--high-rate-per-s``) runs alone for ``--calm-s`` first, then beside the
batches until they finish, with a LOW one (``X-Priority: low``) beside it, then alone for ``--calm-s`` again (its
calm P99 is over both times alone). Each input file has ``--bad-lines`` bad lines planted in place of documents (in
turn: not JSON, an unknown model, an empty input). Every output line is checked: one per document but the planted
ones, in order; the error files hold the planted lines and nothing else; a sample's vectors equal (cosine) to
``/v1/embeddings`` for the same text.

With ``--relayed``, the model is an ``openai`` entry relaying batches to the simulated provider's Batch API
(``provider_batches``, a disk cache; the provider in its own process, its batches done ``--provider-delay-s`` after
they are made, ``--provider-error-rate`` of their lines failing): the same flow, then a second night with
``--changed-share`` of the documents changed, no streams beside it. The provider's counters say what each night sent
in real time and in batches.

Targets: HIGH P99 while the batches run ≤ 1.5× calm; every LOW request answered; no line lost, failed or repeated.
Relayed: no real-time input for batch work; batch inputs billed = the distinct uncached documents, each night.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import io
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Sequence

import aiohttp
import numpy as np
import openai
import orjson
import yaml

from embeddings_wire import decode_embeddings
from load.loadgen import send_open_loop
from load.peers.launch import DEFAULT_PEERS_DIR, Server, running
from load.upstream import UpstreamConfig
from load.workload import poisson_arrivals, pseudo_sentences

from .backlog import Answer, post, summary
from .options import add_settings_arguments, chosen_settings
from .report import markdown_table, write_report
from .serving import SERVE_CONFIG, SIM_MODEL, sim_model_entry
from .shipped_service import MODEL, SERVICE, packaged_model_path, serve_run
from .upstream_process import upstream_process

TARGET_HIGH_P99_RATIO = 1.5
SAMPLE = 500  # output lines compared with /v1/embeddings
BAD_KINDS = ("not JSON", "unknown model", "empty input")  # the bad lines planted, in turn
POLL_S = 0.5


@dataclass(frozen=True)
class Settings:
    documents: int = 100_000
    lines_per_batch: int = 50_000
    mean_chars: int = 120
    high_rate_per_s: float = 5.0
    low_rate_per_s: float = 2.0
    calm_s: float = 30.0
    bad_lines: int = 3  # planted in each input file, in place of documents
    relayed: bool = False
    changed_share: float = 0.07  # relayed: the documents changed for the second night
    provider_delay_s: float = 10.0  # relayed: the provider's batch is done this long after it was made
    provider_error_rate: float = 0.001  # relayed: its lines that fail (sent again by the service)
    poll_s: float = 2.0  # relayed: the entry's provider_batches.poll_s

    def __post_init__(self) -> None:
        if min(self.documents, self.lines_per_batch) < 1:
            raise ValueError("batch: --documents and --lines-per-batch must be >= 1")
        if not 0 <= self.bad_lines < min(self.documents, self.lines_per_batch):
            raise ValueError("batch: --bad-lines must be >= 0 and fewer than a file's lines")
        if not 0 <= self.changed_share <= 1:
            raise ValueError("batch: --changed-share must be within [0, 1]")


QUICK = Settings(documents=2_000, lines_per_batch=1_000, calm_s=3.0, provider_delay_s=2.0)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_settings_arguments(parser, Settings(), QUICK)


def run(args: argparse.Namespace) -> dict[str, Any]:
    settings = chosen_settings(args, Settings(), QUICK)
    results_dir = getattr(args, "results_dir", None)
    if not settings.relayed:
        with running(SERVICE, DEFAULT_PEERS_DIR, packaged_model_path()) as started:
            return measure(started.url, settings, results_dir)
    provider = dataclasses.replace(UpstreamConfig(), batch_delay_s=settings.provider_delay_s,
                                   batch_error_rate=settings.provider_error_rate)
    with upstream_process(provider) as root_url, tempfile.TemporaryDirectory() as state:
        service = relayed_service(root_url, Path(state), settings.poll_s)
        with running(service, DEFAULT_PEERS_DIR, packaged_model_path()) as started:
            return measure(started.url, settings, results_dir, provider_url=root_url)


def relayed_service(root_url: str, state: Path, poll_s: float) -> Server:
    """The shipped ``serve_config.yaml`` serving one ``openai`` entry on the simulated provider at ``root_url``,
    relaying batches to its Batch API, its cache and batch files under ``state``."""
    config = yaml.safe_load(SERVE_CONFIG.read_text())
    entry = {**sim_model_entry(f"{root_url}/v1"), "cache": {"store": "disk", "directory": str(state / "vectors")},
             "provider_batches": {"poll_s": poll_s}}
    config["applications"][0]["args"] = {"models": [entry], "batch": {"directory": str(state / "batch")}}
    return dataclasses.replace(SERVICE, name="service-relayed", launch=serve_run(config, "relayed"), model=SIM_MODEL)


def measure(url: str, settings: Settings, results_dir: Any = None, api_key: str = "unused",
            provider_url: str | None = None) -> dict[str, Any]:
    """The scenario against the service at ``url`` (``api_key`` sent where it asks for one); relayed to the
    simulated provider at ``provider_url``, with its second night."""
    documents = pseudo_sentences(settings.documents, settings.mean_chars, seed=7)
    stream_texts = pseudo_sentences(int(max(settings.high_rate_per_s, settings.low_rate_per_s) * 7200) + 100,
                                    settings.mean_chars, seed=8)
    data = asyncio.run(_runs(url, documents, stream_texts, settings, api_key, provider_url))
    data["settings"] = asdict(settings)
    title = "The Batch API beside interactive traffic" + (", relayed to the provider" if provider_url else "")
    return write_report("batch_relayed" if provider_url else "batch", title, render(data), data, results_dir)


async def _runs(url: str, documents: list[str], stream_texts: list[str], settings: Settings, api_key: str,
                provider_url: str | None) -> dict[str, Any]:
    model = SIM_MODEL if provider_url else MODEL
    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=api_key, max_retries=0, timeout=600)
    provider = aiohttp.ClientSession(provider_url) if provider_url else None
    async with aiohttp.ClientSession(url, headers={"Authorization": f"Bearer {api_key}"}) as session:
        calm = await _stream(session, model, stream_texts, "high", settings.high_rate_per_s, settings.calm_s, None)
        if provider is not None:
            await _provider_stats(provider, reset=True)
        started, started_wall = time.perf_counter(), time.time()
        batch_ids, uploaded = await _submit(client, model, documents, settings.lines_per_batch, settings.bad_lines)
        submitted_s = time.perf_counter() - started
        done = asyncio.Event()
        streams = asyncio.gather(
            _stream(session, model, stream_texts, "high", settings.high_rate_per_s, 7200.0, done),
            _stream(session, model, stream_texts[::-1], "low", settings.low_rate_per_s, 7200.0, done))
        batches = await _wait(client, batch_ids)
        done.set()
        wall_s = time.perf_counter() - started
        high, low = await streams
        # HIGH alone again, on texts neither stream sent: calm is both, so a slow start or a drift moves it less
        calm_after = await _stream(session, model, stream_texts[len(stream_texts) // 2:], "high",
                                   settings.high_rate_per_s, settings.calm_s, None)
        slowest = _slowest(high, started)
        calm, high, low = summary(calm + calm_after), summary(high), summary(low)
    data = {"calm_high": calm, "high": high, "low": low, "wall_s": wall_s, "submitted_s": submitted_s,
            "batches": [{"id": b.id, "status": b.status, "request_counts": b.request_counts.model_dump(),
                         "phases_s": _phases(b, started_wall)} for b in batches],
            "high_slowest": slowest,
            "high_p99_ratio": high["p99_ms"] / calm["p99_ms"] if calm["p99_ms"] and high["p99_ms"] else None}
    if provider is not None:
        sent = _sent(documents, settings.lines_per_batch, settings.bad_lines)
        data["night_1"] = {**await _provider_stats(provider, reset=True), "distinct_documents": len(sent),
                           "stream_texts_answered": high["statuses"].get("200", 0) + low["statuses"].get("200", 0)
                           + sum(answer.status == 200 for answer in calm_after)}
        changed = _changed(documents, settings.changed_share)
        started = time.perf_counter()
        again, again_files = await _submit(client, model, changed, settings.lines_per_batch, settings.bad_lines)
        second = await _wait(client, again)
        data["night_2"] = {**await _provider_stats(provider, reset=False), "wall_s": time.perf_counter() - started,
                           "changed_documents": len(_sent(changed, settings.lines_per_batch, settings.bad_lines)
                                                    - sent),
                           "statuses": [b.status for b in second]}
        await _delete(client, again_files, second)
        await provider.close()
    data["check"] = await _check(client, model, documents, batches, settings.lines_per_batch, settings.bad_lines)
    await _delete(client, uploaded, batches)
    return data


def _planted(documents: int, lines_per_batch: int, bad_lines: int) -> dict[int, str]:
    """The bad lines planted in place of documents, ``bad_lines`` spread evenly over each input file: position ->
    kind."""
    planted = {}
    for first in range(0, documents, lines_per_batch):
        size = min(lines_per_batch, documents - first)
        for k in range(bad_lines):
            planted[first + (k + 1) * size // (bad_lines + 1)] = BAD_KINDS[k % len(BAD_KINDS)]
    return planted


def _sent(documents: list[str], lines_per_batch: int, bad_lines: int) -> set[str]:
    """The distinct documents sent in good lines."""
    planted = _planted(len(documents), lines_per_batch, bad_lines)
    return {text for i, text in enumerate(documents) if i not in planted}


def _line(model: str, documents: list[str], index: int, bad: str | None) -> bytes:
    if bad == "not JSON":
        return b'{"custom_id": "doc-%d", "method": "POST", "url": "/v1/embeddings", "body": {' % index
    body = {"model": "no-such-model" if bad == "unknown model" else model,
            "input": "" if bad == "empty input" else documents[index]}
    return orjson.dumps({"custom_id": f"doc-{index}", "method": "POST", "url": "/v1/embeddings", "body": body})


async def _submit(client: openai.AsyncOpenAI, model: str, documents: list[str], lines_per_batch: int,
                  bad_lines: int) -> tuple[list[str], list[str]]:
    """The documents' input files, ``bad_lines`` planted in each, uploaded and submitted as batches: the batches'
    ids and the files'."""
    batch_ids, uploaded = [], []
    planted = _planted(len(documents), lines_per_batch, bad_lines)
    for first in range(0, len(documents), lines_per_batch):
        end = min(first + lines_per_batch, len(documents))
        lines = b"".join(_line(model, documents, i, planted.get(i)) + b"\n" for i in range(first, end))
        file = await client.files.create(file=(f"part-{first}.jsonl", io.BytesIO(lines)), purpose="batch")
        uploaded.append(file.id)
        batch = await client.batches.create(input_file_id=file.id, endpoint="/v1/embeddings",
                                            completion_window="24h")
        batch_ids.append(batch.id)
    return batch_ids, uploaded


async def _delete(client: openai.AsyncOpenAI, uploaded: list[str], batches: list[Any]) -> None:
    for file_id in uploaded + [b.output_file_id for b in batches] + [b.error_file_id for b in batches]:
        if file_id:
            await client.files.delete(file_id)


def _changed(documents: list[str], share: float) -> list[str]:
    """The next night's corpus: every ``1 / share``-th document edited."""
    step = max(1, round(1 / share)) if share > 0 else len(documents) + 1
    return [f"{text} (edited)" if i % step == 0 else text for i, text in enumerate(documents)]


async def _provider_stats(provider: aiohttp.ClientSession, reset: bool) -> dict[str, Any]:
    """What the simulated provider took since its last reset: real-time inputs and calls, and its Batch API's."""
    async with provider.get("/stats") as response:
        stats = await response.json()
    if reset:
        async with provider.post("/stats/reset") as response:
            response.raise_for_status()
    return {"realtime_calls": stats["calls"], "realtime_inputs_billed": stats["items_billed"],
            "batch_inputs_billed": stats["batch"]["items_billed"], "provider_batches": stats["batch"]["batches"],
            "batch_lines_failed": stats["batch"]["lines_failed"]}


def _slowest(answers: Sequence[Answer], started: float, count: int = 20) -> list[tuple[float, float]]:
    """The ``count`` slowest answers as (seconds from the batches' submission to the request, its latency ms): where
    in the batches' run HIGH's tail sits (``phases_s`` says when each batch changed status)."""
    chosen = sorted(answers, key=lambda answer: answer.latency_s)[-count:]
    return sorted((round(a.sent_at - started, 2), round(a.latency_s * 1000, 1)) for a in chosen)


def _phases(batch: Any, started_wall: float) -> dict[str, float]:
    """When the batch entered each status, in seconds from the submission (the store's clock is whole seconds)."""
    stamps = {"in_progress": batch.in_progress_at, "finalizing": batch.finalizing_at,
              "completed": batch.completed_at}
    return {status: round(stamp - started_wall, 1) for status, stamp in stamps.items() if stamp}


async def _wait(client: openai.AsyncOpenAI, batch_ids: Sequence[str]) -> list[Any]:
    while True:
        batches = [await client.batches.retrieve(batch_id) for batch_id in batch_ids]
        if all(b.status in ("completed", "failed", "expired", "cancelled") for b in batches):
            return batches
        await asyncio.sleep(POLL_S)


async def _stream(session: aiohttp.ClientSession, model: str, texts: Sequence[str], priority: str,
                  rate_per_s: float, duration_s: float, done: asyncio.Event | None) -> list[Answer]:
    """Single texts at Poisson arrivals (backlog's requests), each answer's status and latency at this client."""
    answers: list[Answer] = []
    offsets = poisson_arrivals(rate_per_s, 10**6, duration_s, seed=3 if priority == "high" else 4)
    await send_open_loop(lambda index, _: post(session, model, priority, [texts[index % len(texts)]], answers,
                                                priority),
                         offsets, duration_s + 120.0, until=done.is_set if done is not None else None)
    return answers


async def _check(client: openai.AsyncOpenAI, model: str, documents: list[str], batches: list[Any],
                 lines_per_batch: int, bad_lines: int) -> dict[str, Any]:
    """Every document's line once and in order in the outputs, the planted lines (and only those) in the error
    files; a sample's vectors against /v1/embeddings."""
    outputs: list[dict[str, Any]] = []
    errors: list[dict[str, Any]] = []
    for batch in batches:
        if batch.output_file_id:
            content = (await client.files.content(batch.output_file_id)).content
            outputs += [orjson.loads(raw) for raw in content.splitlines()]
        if batch.error_file_id:
            errors += [orjson.loads(raw) for raw in (await client.files.content(batch.error_file_id)).content.splitlines()]
    planted = _planted(len(documents), lines_per_batch, bad_lines)
    in_order = [line["custom_id"] for line in outputs] == [f"doc-{i}" for i in range(len(documents))
                                                           if i not in planted]
    # a line that is not JSON has no custom_id to give back
    planted_only = [line["custom_id"] for line in errors] == [None if kind == "not JSON" else f"doc-{i}"
                                                              for i, kind in sorted(planted.items())]
    sample = list(range(0, len(outputs), max(1, len(outputs) // SAMPLE)))[:SAMPLE]
    texts = [documents[int(outputs[i]["custom_id"].removeprefix("doc-"))] for i in sample]
    direct = await client.embeddings.create(model=model, input=texts)
    direct_vectors = np.array([entry.embedding for entry in direct.data], dtype=np.float32)
    batched = np.array([decode_embeddings(outputs[i]["response"]["body"], 1)[0] for i in sample], dtype=np.float32)
    cosines = (batched * direct_vectors).sum(axis=1) if len(sample) else np.array([])
    return {"lines": len(outputs), "in_order_once_each": in_order, "error_lines": len(errors),
            "planted": len(planted), "error_lines_the_planted_ones": planted_only,
            "min_cosine": float(cosines.min()) if len(cosines) else None, "sampled": len(sample)}


def render(data: dict[str, Any]) -> str:
    settings, check = data["settings"], data["check"]

    def fmt(value: float | None, digits: int = 1) -> str:
        return "—" if value is None else f"{value:,.{digits}f}"

    ratio = data["high_p99_ratio"]
    met = ratio is not None and ratio <= TARGET_HIGH_P99_RATIO
    streams = markdown_table(
        ["stream", "requests", "statuses", "P50 ms", "P99 ms"],
        [[label, run["requests"], ", ".join(f"{n}× {s}" for s, n in sorted(run["statuses"].items())),
          fmt(run["p50_ms"]), fmt(run["p99_ms"])]
         for label, run in (("HIGH alone", data["calm_high"]), ("HIGH beside the batches", data["high"]),
                            ("LOW beside the batches", data["low"]))])
    batches = ", ".join(f"{b['status']} ({b['request_counts']['completed']:,} of {b['request_counts']['total']:,})"
                        for b in data["batches"])
    slowest = ", ".join(f"{at:g}: {ms:g}" for at, ms in data["high_slowest"])
    finalized = ", ".join(f"{b['phases_s'].get('finalizing', '—')}" for b in data["batches"])
    served = ("The service as shipped (`serve run serve_config.yaml`, `serve.env`), the local all-MiniLM-L6-v2 on this "
              "machine's CPUs.")
    relayed = ""
    if "night_1" in data:
        one, two = data["night_1"], data["night_2"]
        served = ("`serve run` (`serve.env`) of the shipped config with one `openai` entry on the simulated provider "
                  f"(its own process), relaying batches to its Batch API (`provider_batches`, poll "
                  f"{settings['poll_s']:g} s; the provider's batches done {settings['provider_delay_s']:g} s after "
                  f"they are made, {settings['provider_error_rate']:.1%} of their lines failing), a disk cache.")
        relayed = f"""
| night | documents new to the cache | inputs billed in provider batches | provider batches | lines they failed \
| real-time calls | real-time inputs billed |
|---|---:|---:|---:|---:|---:|---:|
| 1 (streams beside) | {one['distinct_documents']:,} | {one['batch_inputs_billed']:,} | {one['provider_batches']} \
| {one['batch_lines_failed']} | {one['realtime_calls']:,} | {one['realtime_inputs_billed']:,} \
(the streams answered {one['stream_texts_answered']:,}) |
| 2 ({settings['changed_share']:.0%} changed, alone; {fmt(two['wall_s'])} s) | {two['changed_documents']:,} \
| {two['batch_inputs_billed']:,} | {two['provider_batches']} | {two['batch_lines_failed']} | {two['realtime_calls']:,} \
| {two['realtime_inputs_billed']:,} |
"""
    return f"""\
{served} {settings['documents']:,} documents (~{settings['mean_chars']} characters) in input files of at most \
{settings['lines_per_batch']:,} lines, uploaded and submitted with the `openai` client ({fmt(data['submitted_s'])} s), \
all at once; HIGH single texts at {settings['high_rate_per_s']:g}/s ({settings['calm_s']:g} s alone before and \
{settings['calm_s']:g} s after: "HIGH alone") and LOW ones at {settings['low_rate_per_s']:g}/s beside them.

Batches: {batches}. Wall time from the first upload to the last batch's end: {fmt(data['wall_s'])} s, \
{settings['documents'] / data['wall_s']:,.0f} documents/s. Output: {check['lines']:,} lines, each document once and \
in order (but the {check['planted']} bad lines planted): {check['in_order_once_each']}; error lines \
{check['error_lines']}, the planted ones and only those: {check['error_lines_the_planted_ones']}; min cosine to `/v1/embeddings` over \
{check['sampled']} sampled documents {fmt(check['min_cosine'], 6)}.

{streams}
{relayed}
HIGH P99 beside the batches / alone: {fmt(ratio, 2)}× (target ≤ {TARGET_HIGH_P99_RATIO:g}×): \
{"met" if met else "**not met**"}. The {len(data['high_slowest'])} slowest HIGH answers beside the batches (seconds \
from the submission: ms): {slowest}; the batches finalized at {finalized} s.
"""

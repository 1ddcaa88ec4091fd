"""The bulk indexing client (`python -m embed_bulk`) against a fake OpenAI-compatible embeddings API.

Most tests inject the fake through `httpx2.MockTransport` (the HTTP library of `openai.AsyncOpenAI`); the command-line and kill -9 tests serve the same fake
with uvicorn on loopback. Every embedding is derived from its text, so each output row can be traced to its input.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import hashlib
import io
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx2
import numpy as np
import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from embed_bulk import BulkJob, BulkSettings, Summary, main
from embed_bulk.api import failing_index
from embed_bulk.documents import Document, InputError, read_documents
from embed_bulk.lock import OutputBusy, output_lock

DIM = 8
Reply = tuple[int, dict[str, Any], dict[str, str]]  # status, JSON body, headers
POISON = "POISON"
REPO = Path(__file__).resolve().parents[2]


def vector_of(text: str) -> np.ndarray:
    seed = int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little")
    return np.random.default_rng(seed).standard_normal(DIM).astype(np.float32)


def openai_error(
    message: str, error_type: str = "invalid_request_error", param: str | None = None
) -> dict[str, Any]:
    return {"error": {"message": message, "type": error_type, "param": param, "code": None}}


class FakeEmbeddingsAPI:
    """`POST /embeddings` with scripted trouble; counts every input it embedded (`inputs`)."""

    def __init__(
        self,
        *,
        rate_limited_calls: int = 0,
        failing_calls: int = 0,
        failing_status: int = 500,
        hang_after_served: int | None = None,
        delays_s: tuple[float, ...] = (0.0,),
    ) -> None:
        self.rate_limited_calls = rate_limited_calls
        self.failing_calls = failing_calls
        self.failing_status = failing_status
        self.hang_after_served = hang_after_served
        self.delays_s = delays_s
        self.calls = 0
        self.served = 0
        self.inputs: Counter[str] = Counter()
        self.headers: list[dict[str, str]] = []
        self.hung = asyncio.Event() if hang_after_served is not None else None

    async def respond(self, body: dict[str, Any], headers: dict[str, str]) -> Reply:
        self.calls += 1
        self.headers.append(headers)
        if self.calls <= self.rate_limited_calls:
            return 429, openai_error("slow down", "rate_limit_error"), {"Retry-After": "2"}
        if self.calls <= self.rate_limited_calls + self.failing_calls:
            return self.failing_status, openai_error("upstream trouble", "server_error"), {}
        if self.hung is not None and self.served >= self.hang_after_served:
            self.hung.set()
            await asyncio.Event().wait()  # the process is "killed" while this call is in flight
        texts: list[str] = body["input"]
        for index, text in enumerate(texts):
            if POISON in text:
                message = f"Invalid 'input[{index}]': the provider rejected this input."
                return 400, openai_error(message, param=f"input[{index}]"), {}
        await asyncio.sleep(self.delays_s[self.calls % len(self.delays_s)])
        self.served += 1
        self.inputs.update(texts)
        data = [{"index": i, "embedding": encode(vector_of(t), body)} for i, t in enumerate(texts)]
        usage = {"prompt_tokens": len(texts), "total_tokens": len(texts)}
        return 200, {"object": "list", "data": data, "model": body["model"], "usage": usage}, {}

    def transport(self, sent_at: list[float] | None = None) -> httpx2.MockTransport:
        """Serves the fake; `sent_at` collects the loop time of every request (the SDK's waits between retries)."""

        async def handle(request: httpx2.Request) -> httpx2.Response:
            assert request.url.path == "/v1/embeddings"
            if sent_at is not None:
                sent_at.append(asyncio.get_running_loop().time())
            status, payload, headers = await self.respond(json.loads(request.content), dict(request.headers))
            return httpx2.Response(status, json=payload, headers=headers)

        return httpx2.MockTransport(handle)


def encode(vector: np.ndarray, body: dict[str, Any]) -> str | list[float]:
    if body.get("encoding_format") == "base64":
        return base64.b64encode(vector.astype("<f4").tobytes()).decode()
    return vector.tolist()


class Served:
    """The fake behind a real HTTP server on loopback; `api` can be swapped between tests."""

    def __init__(self) -> None:
        self.api = FakeEmbeddingsAPI()
        self.app = FastAPI()

        @self.app.post("/v1/embeddings")
        async def embeddings(request: Request) -> JSONResponse:
            status, payload, headers = await self.api.respond(await request.json(), dict(request.headers))
            return JSONResponse(payload, status_code=status, headers=headers)

        @self.app.get("/stats")
        async def stats() -> dict[str, int]:
            return {"calls": self.api.calls}


@pytest.fixture(scope="module")
def served() -> Iterator[tuple[Served, str]]:
    fake = Served()
    server = uvicorn.Server(uvicorn.Config(fake.app, lifespan="off", log_level="warning", access_log=False))
    with socket.create_server(("127.0.0.1", 0)) as listener:
        thread = threading.Thread(target=server.run, kwargs={"sockets": [listener]}, daemon=True)
        thread.start()
        while not server.started:
            time.sleep(0.01)
        host, port = listener.getsockname()[:2]
        try:
            yield fake, f"http://{host}:{port}"
        finally:
            server.should_exit = True
            thread.join(5)


def write_jsonl(path: Path, texts: list[str]) -> list[str]:
    ids = [f"doc-{i}" for i in range(len(texts))]
    path.write_text("".join(json.dumps({"id": i, "text": t}) + "\n" for i, t in zip(ids, texts, strict=True)))
    return ids


def texts(count: int) -> list[str]:
    return [f"document number {i}" for i in range(count)]


def settings(tmp_path: Path, output: str = "out.jsonl", **overrides: Any) -> BulkSettings:
    values: dict[str, Any] = {
        "input_path": tmp_path / "docs.jsonl",
        "output_path": tmp_path / output,
        "base_url": "http://fake/v1",
        "concurrency": 4,
        "batch_size": 5,
        "progress": "never",
    }
    return BulkSettings(**{**values, **overrides})


async def run(
    config: BulkSettings, api: FakeEmbeddingsAPI, sent_at: list[float] | None = None, **job_options: Any
) -> Summary:
    job_options.setdefault("stderr", io.StringIO())
    return await BulkJob(config, transport=api.transport(sent_at), **job_options).run()


def gaps(times: list[float]) -> list[float]:
    return [round(later - earlier, 6) for earlier, later in zip(times, times[1:])]


def jsonl_rows(path: Path) -> list[dict[str, Any]]:
    """The complete rows of a JSONL file (a torn last line is not one)."""
    rows = []
    for line in path.read_bytes().splitlines(keepends=True):
        if line.endswith(b"\n"):
            with contextlib.suppress(ValueError):
                rows.append(json.loads(line))
    return rows


def text_of(doc_id: str) -> str:
    return f"document number {doc_id.removeprefix('doc-')}"


async def test_jsonl_output_holds_every_row_once_with_its_own_vector(tmp_path: Path) -> None:
    ids = write_jsonl(tmp_path / "docs.jsonl", texts(48))
    api = FakeEmbeddingsAPI(delays_s=(0.004, 0.0, 0.002, 0.006, 0.001))

    summary = await run(settings(tmp_path, api_key="sk-test"), api)

    rows = jsonl_rows(tmp_path / "out.jsonl")
    assert sorted(row["id"] for row in rows) == sorted(ids)
    assert [row["id"] for row in rows] != ids, "batches should finish out of order for this test to mean anything"
    for row in rows:
        assert np.array_equal(np.asarray(row["embedding"], dtype=np.float32), vector_of(text_of(row["id"])))
    assert (summary.total, summary.embedded, summary.skipped, summary.failures) == (48, 48, 0, [])
    assert summary.exit_code == 0 and summary.calls.tokens == 48
    assert not (tmp_path / "out.jsonl.failures.jsonl").exists()
    assert {h["x-priority"] for h in api.headers} == {"low"}
    assert {h["authorization"] for h in api.headers} == {"Bearer sk-test"}


async def test_npy_output_is_in_input_order_with_an_ids_sidecar(tmp_path: Path) -> None:
    ids = write_jsonl(tmp_path / "docs.jsonl", texts(37))
    api = FakeEmbeddingsAPI(delays_s=(0.004, 0.0, 0.002, 0.006))

    summary = await run(settings(tmp_path, "vectors.npy", encoding_format="float"), api)

    matrix = np.load(tmp_path / "vectors.npy")
    assert matrix.dtype == np.float32 and matrix.shape == (37, DIM)
    sidecar_ids = [json.loads(line) for line in (tmp_path / "vectors.npy.ids.jsonl").read_text().splitlines()]
    assert sidecar_ids == ids
    assert np.array_equal(matrix, np.stack([vector_of(text) for text in texts(37)]))
    assert not (tmp_path / "vectors.npy.partial.jsonl").exists(), "the work log goes once the matrix is complete"
    assert summary.exit_code == 0


async def test_plain_text_input_uses_line_numbers_as_ids_and_skips_blank_lines(tmp_path: Path) -> None:
    (tmp_path / "docs.txt").write_text("alpha\n\nbeta\ngamma\n")

    await run(settings(tmp_path, "out.npy", input_path=tmp_path / "docs.txt"), FakeEmbeddingsAPI())

    assert (tmp_path / "out.npy.ids.jsonl").read_text().split() == ["1", "3", "4"]
    assert np.array_equal(np.load(tmp_path / "out.npy"), np.stack([vector_of(t) for t in ("alpha", "beta", "gamma")]))


async def test_rerun_after_cancel_embeds_only_the_missing_rows_and_cuts_a_torn_tail(tmp_path: Path) -> None:
    ids = write_jsonl(tmp_path / "docs.jsonl", texts(40))
    config = settings(tmp_path, concurrency=1)
    first = FakeEmbeddingsAPI(hang_after_served=3)
    job = BulkJob(config, transport=first.transport(), stderr=io.StringIO())
    task = asyncio.create_task(job.run())
    await asyncio.wait_for(first.hung.wait(), 5)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert job.summary.interrupted and job.summary.embedded == 15
    with (tmp_path / "out.jsonl").open("ab") as output:
        output.write(b'{"id": "doc-39", "embedding": [0.1, 0.')  # what a kill in the middle of a write leaves

    second = FakeEmbeddingsAPI()
    stderr = io.StringIO()
    summary = await run(config, second, stderr=stderr)

    assert (summary.skipped, summary.embedded) == (15, 25)
    assert "incomplete last write" in stderr.getvalue()
    assert first.inputs + second.inputs == Counter(texts(40)), "every row embedded exactly once over both runs"
    rows = jsonl_rows(tmp_path / "out.jsonl")
    assert sorted(row["id"] for row in rows) == sorted(ids) and len(rows) == 40


async def test_npy_rerun_after_cancel_with_concurrent_batches_completes_in_input_order(tmp_path: Path) -> None:
    ids = write_jsonl(tmp_path / "docs.jsonl", texts(60))
    config = settings(tmp_path, "out.npy", concurrency=4)
    first = FakeEmbeddingsAPI(hang_after_served=5, delays_s=(0.003, 0.0, 0.001))
    task = asyncio.create_task(run(config, first))
    await asyncio.wait_for(first.hung.wait(), 5)
    await asyncio.sleep(0.01)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    saved = {doc_id for batch in jsonl_rows(tmp_path / "out.npy.partial.jsonl") for doc_id in batch["ids"]}
    assert 25 <= len(saved) < 60 and not (tmp_path / "out.npy").exists()

    second = FakeEmbeddingsAPI()
    summary = await run(config, second)

    assert set(second.inputs) == {text_of(doc_id) for doc_id in ids if doc_id not in saved}
    assert max(second.inputs.values()) == 1 and summary.skipped == len(saved)
    assert (tmp_path / "out.npy.ids.jsonl").read_text().split() == [json.dumps(doc_id) for doc_id in ids]
    assert np.array_equal(np.load(tmp_path / "out.npy"), np.stack([vector_of(text) for text in texts(60)]))


async def test_an_npy_work_log_of_single_rows_from_an_earlier_version_is_continued(tmp_path: Path) -> None:
    ids = write_jsonl(tmp_path / "docs.jsonl", texts(10))
    old_rows = [{"id": doc_id, "b64": base64.b64encode(vector_of(text_of(doc_id)).tobytes()).decode()}
                for doc_id in ids[:4]]
    (tmp_path / "out.npy.partial.jsonl").write_text("".join(json.dumps(row) + "\n" for row in old_rows))
    api = FakeEmbeddingsAPI()

    summary = await run(settings(tmp_path, "out.npy"), api)

    assert summary.skipped == 4 and sorted(api.inputs) == sorted(text_of(doc_id) for doc_id in ids[4:])
    assert np.array_equal(np.load(tmp_path / "out.npy"), np.stack([vector_of(text) for text in texts(10)]))


async def test_a_finished_npy_run_rerun_sends_nothing(tmp_path: Path) -> None:
    write_jsonl(tmp_path / "docs.jsonl", texts(12))
    config = settings(tmp_path, "out.npy")
    await run(config, FakeEmbeddingsAPI())
    before = (tmp_path / "out.npy").read_bytes()

    again = FakeEmbeddingsAPI()
    summary = await run(config, again)

    assert again.calls == 0 and (summary.skipped, summary.embedded) == (12, 0)
    assert (tmp_path / "out.npy").read_bytes() == before


async def test_documents_added_to_a_finished_npy_input_are_embedded_alone_and_join_it_in_order(tmp_path: Path) -> None:
    write_jsonl(tmp_path / "docs.jsonl", texts(12))
    config = settings(tmp_path, "out.npy", batch_size=5)
    await run(config, FakeEmbeddingsAPI())
    ids = write_jsonl(tmp_path / "docs.jsonl", texts(20))

    grown = FakeEmbeddingsAPI()
    summary = await run(config, grown)

    assert sorted(grown.inputs) == sorted(texts(20)[12:]) and (summary.skipped, summary.embedded) == (12, 8)
    assert (tmp_path / "out.npy.ids.jsonl").read_text().split() == [json.dumps(doc_id) for doc_id in ids]
    assert np.array_equal(np.load(tmp_path / "out.npy"), np.stack([vector_of(text) for text in texts(20)]))
    assert not (tmp_path / "out.npy.partial.jsonl").exists() and not (tmp_path / "out.npy.draft").exists()


async def test_a_bad_document_fails_alone_is_listed_and_retried_by_the_next_run(tmp_path: Path) -> None:
    docs = texts(20)
    docs[3] += f" {POISON}"
    docs[7] += f" {POISON}"
    ids = write_jsonl(tmp_path / "docs.jsonl", docs)
    config = settings(tmp_path, "out.npy", batch_size=10)

    summary = await run(config, FakeEmbeddingsAPI())

    assert summary.exit_code == 1 and summary.embedded == 18
    assert [(f.id, f.status) for f in summary.failures] == [("doc-3", 400), ("doc-7", 400)]
    listed = [json.loads(line) for line in (tmp_path / "out.npy.failures.jsonl").read_text().splitlines()]
    assert [row["id"] for row in listed] == ["doc-3", "doc-7"]
    assert all("rejected this input" in row["error"] for row in listed)
    kept = [doc_id for doc_id in ids if doc_id not in ("doc-3", "doc-7")]
    assert (tmp_path / "out.npy.ids.jsonl").read_text().split() == [json.dumps(doc_id) for doc_id in kept]
    kept_texts = [text for i, text in enumerate(texts(20)) if i not in (3, 7)]
    assert np.array_equal(np.load(tmp_path / "out.npy"), np.stack([vector_of(text) for text in kept_texts]))
    assert (tmp_path / "out.npy.partial.jsonl").exists(), "the work log stays while rows are missing"
    assert not (tmp_path / "out.npy.draft").exists()

    write_jsonl(tmp_path / "docs.jsonl", texts(20))  # the documents are fixed
    fixed = FakeEmbeddingsAPI()
    rerun = await run(config, fixed)

    assert sorted(fixed.inputs) == sorted(["document number 3", "document number 7"])
    assert rerun.exit_code == 0 and not (tmp_path / "out.npy.failures.jsonl").exists()
    assert np.array_equal(np.load(tmp_path / "out.npy"), np.stack([vector_of(text) for text in texts(20)]))
    assert not (tmp_path / "out.npy.partial.jsonl").exists()


async def test_a_row_without_text_fails_and_repeated_ids_are_refused(tmp_path: Path) -> None:
    (tmp_path / "docs.jsonl").write_text('{"id": 1, "text": "fine"}\n{"id": 2, "body": "no text"}\n')
    summary = await run(settings(tmp_path), FakeEmbeddingsAPI())
    assert [f.id for f in summary.failures] == [2] and "'text' is missing" in summary.failures[0].message

    (tmp_path / "docs.jsonl").write_text('{"id": 1, "text": "a"}\n{"id": 1, "text": "b"}\n')
    with pytest.raises(ValueError, match="more than once"):
        await run(settings(tmp_path), FakeEmbeddingsAPI())


def test_jsonl_rows_read_wide_integer_ids_skip_blank_lines_and_name_the_line_that_is_not_json(tmp_path: Path) -> None:
    path = tmp_path / "docs.jsonl"
    wide = 2**70  # past orjson's 64 bits: json reads it
    path.write_bytes(b'{"id": %d, "text": "wide"}\n\n \xc2\xa0\n{"id": "b", "text": "caf\xc3\xa9"}\r\n' % wide)
    assert list(read_documents(path, jsonl=True)) == [Document(wide, "wide"), Document("b", "caf\u00e9")]

    for bad, error in ((b'{"id": 1, "text": "a"}\n{"id": 2,\n', r"line 2: not valid JSON \(Expecting"),
                       (b'{"id": 1, "text": "\xff"}\n', r"line 1: not valid JSON \(not UTF-8\)")):
        path.write_bytes(bad)
        with pytest.raises(InputError, match=error):
            list(read_documents(path, jsonl=True, strict=True))


@pytest.mark.looptime
async def test_rate_limited_batch_waits_retry_after_then_succeeds(tmp_path: Path) -> None:
    write_jsonl(tmp_path / "docs.jsonl", texts(5))
    api, sent_at = FakeEmbeddingsAPI(rate_limited_calls=2), []

    summary = await run(settings(tmp_path, max_retries=2), api, sent_at)

    assert gaps(sent_at) == [2.0, 2.0]
    assert summary.exit_code == 0 and summary.embedded == 5
    assert (summary.calls.requests, summary.calls.rate_limited, summary.calls.retries) == (3, 2, 2)


@pytest.mark.looptime
async def test_rate_limited_past_max_retries_fails_the_batch_for_the_next_run(tmp_path: Path) -> None:
    write_jsonl(tmp_path / "docs.jsonl", texts(5))
    api = FakeEmbeddingsAPI(rate_limited_calls=100)

    summary = await run(settings(tmp_path, max_retries=1), api)

    assert api.calls == 2 and summary.exit_code == 1
    assert [f.id for f in summary.failures] == [f"doc-{i}" for i in range(5)]
    assert "gave up after 2 attempts: HTTP 429: slow down" in summary.failures[0].message


@pytest.mark.looptime
async def test_transient_errors_back_off_and_retry_then_give_up_after_max_retries(tmp_path: Path) -> None:
    write_jsonl(tmp_path / "docs.jsonl", texts(5))
    sent_at: list[float] = []
    recovered = await run(settings(tmp_path, max_retries=3), FakeEmbeddingsAPI(failing_calls=2), sent_at)
    assert recovered.exit_code == 0 and recovered.calls.retries == 2
    first, second = gaps(sent_at)
    assert 0.375 <= first <= 0.5 and 0.75 <= second <= 1.0, "exponential, with jitter"

    (tmp_path / "out.jsonl").unlink()
    down = FakeEmbeddingsAPI(failing_calls=100, failing_status=502)
    given_up = await run(settings(tmp_path, max_retries=2), down)
    assert down.calls == 3 and given_up.exit_code == 1
    assert [f.id for f in given_up.failures] == [f"doc-{i}" for i in range(5)]
    assert "gave up after 3 attempts: HTTP 502" in given_up.failures[0].message


async def test_other_client_errors_fail_the_whole_batch_without_retrying(tmp_path: Path) -> None:
    write_jsonl(tmp_path / "docs.jsonl", texts(7))
    api = FakeEmbeddingsAPI(failing_calls=100, failing_status=401)

    summary = await run(settings(tmp_path), api)

    assert api.calls == 2 and len(summary.failures) == 7
    assert {f.status for f in summary.failures} == {401}


@pytest.mark.looptime
async def test_connection_errors_are_retried(tmp_path: Path) -> None:
    write_jsonl(tmp_path / "docs.jsonl", texts(3))
    api, attempts = FakeEmbeddingsAPI(), []

    async def flaky(request: httpx2.Request) -> httpx2.Response:
        attempts.append(request)
        if len(attempts) == 1:
            raise httpx2.ConnectError("connection refused", request=request)
        status, payload, headers = await api.respond(json.loads(request.content), dict(request.headers))
        return httpx2.Response(status, json=payload, headers=headers)

    job = BulkJob(settings(tmp_path), transport=httpx2.MockTransport(flaky), stderr=io.StringIO())
    summary = await job.run()

    assert summary.exit_code == 0 and len(attempts) == 2 and summary.calls.retries == 1


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.mark.parametrize(
    ("mode", "stream", "shown"),
    [("auto", Terminal, True), ("always", io.StringIO, True), ("auto", io.StringIO, False), ("never", Terminal, False)],
)
async def test_progress_bar_only_on_a_terminal_unless_forced(
    tmp_path: Path, mode: str, stream: type[io.StringIO], shown: bool
) -> None:
    write_jsonl(tmp_path / "docs.jsonl", texts(20))
    stderr = stream()

    await run(settings(tmp_path, progress=mode), FakeEmbeddingsAPI(), stderr=stderr)

    if shown:
        assert "20/20" in stderr.getvalue() and "row/s" in stderr.getvalue()
    else:
        assert stderr.getvalue() == ""


def test_command_line_prints_a_summary_and_exits_nonzero_on_failures(
    tmp_path: Path, served: tuple[Served, str], capsys: pytest.CaptureFixture[str]
) -> None:
    fake, root = served
    docs = texts(30)
    docs[11] += f" {POISON}"
    write_jsonl(tmp_path / "docs.jsonl", docs)
    fake.api = FakeEmbeddingsAPI()
    argv = [
        str(tmp_path / "docs.jsonl"),
        str(tmp_path / "out.jsonl"),
        "--base-url",
        f"{root}/v1",
        "--batch-size",
        "8",
        "--stats-url",
        f"{root}/stats",
    ]

    assert main(argv) == 1

    report = capsys.readouterr().err
    assert "30 rows in input: 29 embedded, 0 skipped as already done, 1 failed" in report
    assert "'doc-11': Invalid 'input[3]': the provider rejected this input." in report
    assert "upstream calls: 5" in report and "rows/s" in report
    assert "\r" not in report, "no progress bar when stderr is not a terminal"

    assert main(argv) == 1
    assert "0 embedded, 29 skipped as already done, 1 failed" in capsys.readouterr().err


def test_kill_9_mid_run_then_rerun_embeds_each_missing_row_once(tmp_path: Path, served: tuple[Served, str]) -> None:
    fake, root = served
    ids = write_jsonl(tmp_path / "docs.jsonl", texts(400))
    fake.api = FakeEmbeddingsAPI(delays_s=(0.02,))
    output = tmp_path / "out.jsonl"
    argv = [
        str(tmp_path / "docs.jsonl"),
        str(output),
        "--base-url",
        f"{root}/v1",
        "--batch-size",
        "5",
        "--concurrency",
        "2",
    ]
    process = subprocess.Popen([sys.executable, "-m", "embed_bulk", *argv], cwd=REPO, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 10
        while len(jsonl_rows(output) if output.exists() else []) < 50:
            assert process.poll() is None and time.monotonic() < deadline, "the client should still be running"
            time.sleep(0.005)
        os.kill(process.pid, signal.SIGKILL)
    finally:
        process.wait()
    saved = {row["id"] for row in jsonl_rows(output)}
    assert 50 <= len(saved) < 400

    fake.api = FakeEmbeddingsAPI()
    assert main([*argv, "--concurrency", "8", "--batch-size", "64"]) == 0

    assert fake.api.inputs == Counter(text_of(doc_id) for doc_id in ids if doc_id not in saved)
    rows = jsonl_rows(output)
    assert len(rows) == 400 and {row["id"] for row in rows} == set(ids)
    assert all(np.array_equal(np.float32(row["embedding"]), vector_of(text_of(row["id"]))) for row in rows)


@pytest.mark.parametrize(
    ("param", "index"),
    [
        ("input[3]", 3),
        ("input[12]", 12),
        ("input[0]", 0),
        ("input[9]", None),  # not one of the inputs sent
        ("input", None),
        ("input[-1]", None),
        ("model", None),
        (None, None),
    ],
)
def test_failing_index_is_read_from_the_error_param(param: str | None, index: int | None) -> None:
    assert failing_index(param, count=5 if index is None else 20) == index


async def test_a_400_naming_no_input_fails_the_whole_batch(tmp_path: Path) -> None:
    write_jsonl(tmp_path / "docs.jsonl", texts(3))
    api = FakeEmbeddingsAPI(failing_calls=100, failing_status=400)

    summary = await run(settings(tmp_path), api)

    assert api.calls == 1 and [f.status for f in summary.failures] == [400, 400, 400]
    assert summary.failures[0].message == "HTTP 400: upstream trouble"


@pytest.mark.looptime
async def test_max_rate_spaces_the_batches_sent(tmp_path: Path) -> None:
    write_jsonl(tmp_path / "docs.jsonl", texts(20))
    api, sent_at = FakeEmbeddingsAPI(), []

    start = asyncio.get_running_loop().time()
    summary = await run(settings(tmp_path, max_rate=10.0), api, sent_at)

    assert summary.exit_code == 0 and summary.embedded == 20
    assert [round(at - start, 6) for at in sent_at] == [0.0, 0.5, 1.0, 1.5]  # 4 workers, batches of 5, 10 docs/s


async def test_a_stopped_run_saves_the_batches_in_flight_takes_no_more_and_a_rerun_completes_it(tmp_path: Path) -> None:
    write_jsonl(tmp_path / "docs.jsonl", texts(60))
    config = settings(tmp_path, "out.npy", concurrency=3)
    first = FakeEmbeddingsAPI(delays_s=(0.01,))
    job = BulkJob(config, transport=first.transport(), stderr=io.StringIO())
    task = asyncio.create_task(job.run())
    while first.served < 2:
        await asyncio.sleep(0.001)

    job.stop()
    summary = await task

    assert summary.interrupted and summary.exit_code == 130
    assert first.served == first.calls and summary.embedded == 5 * first.served < 60, "the ones in flight finished"
    assert not (tmp_path / "out.npy").exists() and (tmp_path / "out.npy.partial.jsonl").exists()
    second = FakeEmbeddingsAPI()
    assert (await run(config, second)).exit_code == 0
    assert sum(second.inputs.values()) == 60 - summary.embedded
    assert np.array_equal(np.load(tmp_path / "out.npy"), np.stack([vector_of(text) for text in texts(60)]))


async def test_a_run_on_an_output_another_run_holds_is_refused_naming_its_pid(tmp_path: Path) -> None:
    write_jsonl(tmp_path / "docs.jsonl", texts(5))
    config = settings(tmp_path)
    api = FakeEmbeddingsAPI()
    with output_lock(config.output_path):
        assert (tmp_path / "out.jsonl.lock").read_text() == f"{os.getpid()}\n"
        with pytest.raises(OutputBusy, match=f"another embed-bulk run \\(pid {os.getpid()}\\)"):
            await run(config, api)
    assert api.calls == 0 and not (tmp_path / "out.jsonl").exists()

    assert (await run(config, api)).exit_code == 0
    assert not (tmp_path / "out.jsonl.lock").exists(), "a run that finishes removes its lock file"


async def test_malformed_lines_fail_alone_with_their_line_numbers_unless_strict(tmp_path: Path) -> None:
    (tmp_path / "docs.txt").write_bytes(b"alpha\n\xff bad byte\nbeta\n")
    summary = await run(settings(tmp_path, input_path=tmp_path / "docs.txt"), FakeEmbeddingsAPI())
    assert summary.exit_code == 1 and summary.embedded == 2
    assert [(f.id, f.line, f.message) for f in summary.failures] == [(2, 2, "line 2: not UTF-8")]

    (tmp_path / "docs.jsonl").write_text('{"id": 1, "text": "a"}\n{"id": 2, "text": \n{"id": true, "text": "b"}\n')
    summary = await run(settings(tmp_path, "out.npy"), FakeEmbeddingsAPI())
    assert (summary.total, summary.embedded) == (3, 1)
    listed = [json.loads(line) for line in (tmp_path / "out.npy.failures.jsonl").read_text().splitlines()]
    assert [(row["id"], row["line"]) for row in listed] == [(None, 2), (None, 3)]
    assert listed[0]["error"].startswith("line 2: not valid JSON") and "'id' must be" in listed[1]["error"]
    assert not (tmp_path / "out.npy.partial.jsonl").exists(), "a line holding no document is no missing row"

    with pytest.raises(InputError, match="line 2: not valid JSON"):
        await run(settings(tmp_path, "strict.npy", strict=True), FakeEmbeddingsAPI())
    assert not (tmp_path / "strict.npy.partial.jsonl").exists()

"""OpenAI's Batch API on the ingress (deployments/ingress/batch/): the ``openai`` client's file and batch flow, bad
lines in the error file, resuming after a crash without sending a finished line again, cancelling, and every refusal
in OpenAI's error shape. The model is a fake handle; its vectors say which text they are for."""

from __future__ import annotations

import asyncio
import io
import os
import time
from pathlib import Path
from typing import Any

import openai
import orjson
import pytest
from starlette.testclient import TestClient

from batching import Priority
from deployments.config import BatchConfig
from deployments.ingress.api import create_api
from deployments.ingress.batch import runner as runner_module
from deployments.ingress.batch.runner import BatchMetrics, BatchRunner
from deployments.ingress.batch import store as store_module
from deployments.ingress.batch.store import BatchStore

from .batch_fakes import MODEL, FakeModel, HeldModel, vector_of


def line(custom_id: str, text: Any, *, model: str = MODEL, url: str = "/v1/embeddings") -> bytes:
    return orjson.dumps({"custom_id": custom_id, "method": "POST", "url": url,
                         "body": {"model": model, "input": text, "encoding_format": "float"}}) + b"\n"


def wait_for(client: openai.OpenAI, batch_id: str, until: tuple[str, ...] = ("completed", "failed", "cancelled")):
    deadline = time.monotonic() + 30  # a bound, not a timing check: a batch of a few lines takes milliseconds
    while (batch := client.batches.retrieve(batch_id)).status not in until:
        assert time.monotonic() < deadline, f"batch still {batch.status}"
        time.sleep(0.02)
    return batch


class Recorded(BatchMetrics):
    def __init__(self) -> None:
        self.lines: list[bool] = []
        self.by_status: dict[str, int] = {}

    def line_finished(self, ok: bool) -> None:
        self.lines.append(ok)

    def batches(self, by_status: dict[str, int]) -> None:
        self.by_status = by_status


@pytest.fixture
def service(tmp_path: Path):
    model = FakeModel()
    metrics = Recorded()
    api = create_api({MODEL: model}, batch=BatchConfig(directory=str(tmp_path), max_lines=20,
                                                      max_file_bytes=64 * 1024), batch_metrics=metrics)
    with TestClient(api) as http:
        yield model, openai.OpenAI(base_url=f"{http.base_url}/v1", api_key="unused", http_client=http,
                                   max_retries=0), http, metrics


def test_the_openai_clients_batch_flow_embeds_every_line_and_puts_each_bad_one_in_the_error_file(service) -> None:
    model, client, _, metrics = service
    good = ["alpha", "beta gamma", "delta"]
    content = (line("a", good[0]) + b"{not json\n" + line("b", [good[1]]) + line("c", "x", model="nope")
               + line("d", "") + line("e", "y", url="/v1/chat/completions") + line("a", "again") + b"\n"
               + line("f", good[2]))
    uploaded = client.files.create(file=("nightly.jsonl", io.BytesIO(content)), purpose="batch")
    assert (uploaded.purpose, uploaded.bytes, uploaded.filename) == ("batch", len(content), "nightly.jsonl")
    created = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/embeddings", completion_window="24h",
                                    metadata={"night": "1"})
    assert created.status == "validating" and created.metadata == {"night": "1"}
    batch = wait_for(client, created.id)
    assert batch.status == "completed"
    assert batch.request_counts.model_dump() == {"total": 8, "completed": 3, "failed": 5}
    assert batch.completed_at >= batch.finalizing_at >= batch.in_progress_at >= batch.created_at

    outputs = [orjson.loads(raw) for raw in client.files.content(batch.output_file_id).content.splitlines()]
    assert [out["custom_id"] for out in outputs] == ["a", "b", "f"]  # the input's order
    for out, text in zip(outputs, good):
        assert out["error"] is None and out["response"]["status_code"] == 200
        assert out["response"]["body"]["data"][0]["embedding"] == pytest.approx(vector_of(text))
    errors = {orjson.loads(raw)["custom_id"]: orjson.loads(raw)
              for raw in client.files.content(batch.error_file_id).content.splitlines()}
    assert set(errors) == {None, "c", "d", "e", "a"}
    assert errors[None]["error"]["code"] == "invalid_json_line" and errors[None]["response"] is None
    assert errors["c"]["response"]["status_code"] == 404  # as /v1/embeddings answers an unknown model
    assert errors["c"]["response"]["body"]["error"]["code"] == "model_not_found"
    assert errors["d"]["response"]["status_code"] == 400
    assert errors["e"]["error"]["code"] == "invalid_url"
    assert errors["a"]["error"]["code"] == "duplicate_custom_id"
    assert sorted(texts for texts, _ in model.requests) == sorted([[t] for t in good])  # each good line once
    assert {priority for _, priority in model.requests} == {Priority.LOW}
    assert [b.id for b in client.batches.list().data] == [created.id]
    assert sorted(metrics.lines) == [False] * 5 + [True] * 3
    client.batches.list()  # a moment for the next poll
    deadline = time.monotonic() + 30
    while metrics.by_status.get("completed") != 1:
        assert time.monotonic() < deadline
        time.sleep(0.02)
    assert sum(metrics.by_status.values()) == 1 and len(metrics.by_status) == 8
    assert {f.id for f in client.files.list().data} == {uploaded.id, batch.output_file_id, batch.error_file_id}


def test_a_line_refused_for_now_is_sent_again_not_failed(tmp_path: Path) -> None:
    model = FakeModel(overloaded={"busy text": 2})
    api = create_api({MODEL: model}, batch=BatchConfig(directory=str(tmp_path)))
    with TestClient(api) as http:
        client = openai.OpenAI(base_url=f"{http.base_url}/v1", api_key="unused", http_client=http, max_retries=0)
        uploaded = client.files.create(file=("in.jsonl", io.BytesIO(line("x", "busy text"))), purpose="batch")
        batch = wait_for(client, client.batches.create(input_file_id=uploaded.id, endpoint="/v1/embeddings",
                                                       completion_window="24h").id)
    assert batch.request_counts.model_dump() == {"total": 1, "completed": 1, "failed": 0}
    assert model.requests == [(["busy text"], Priority.LOW)]


def test_lines_of_one_text_travel_together_and_each_is_answered_as_its_own_request(service) -> None:
    model, client, _, _ = service
    texts = [f"text number {i}" for i in range(12)]
    content = b"".join(line(f"id{i}", [t] if i % 2 else t) for i, t in enumerate(texts))  # "x" and ["x"] alike
    content += orjson.dumps({"custom_id": "other", "method": "POST", "url": "/v1/embeddings",
                             "body": {"model": MODEL, "input": "text number 3", "encoding_format": "base64"}}) + b"\n"
    uploaded = client.files.create(file=("in.jsonl", io.BytesIO(content)), purpose="batch")
    batch = wait_for(client, client.batches.create(input_file_id=uploaded.id, endpoint="/v1/embeddings",
                                                   completion_window="24h").id)
    assert batch.request_counts.model_dump() == {"total": 13, "completed": 13, "failed": 0}
    # one call for the twelve lines alike, one for the line asking for another encoding
    assert sorted(model.requests) == sorted([(texts, Priority.LOW), (["text number 3"], Priority.LOW)])
    outputs = [orjson.loads(raw) for raw in client.files.content(batch.output_file_id).content.splitlines()]
    for out, text in zip(outputs, texts):  # each line's body is what /v1/embeddings answers for it alone
        body = out["response"]["body"]
        assert [entry["index"] for entry in body["data"]] == [0]
        assert body["data"][0]["embedding"] == pytest.approx(vector_of(text))
        assert body["usage"] == {"prompt_tokens": 1, "total_tokens": 1}
    assert isinstance(outputs[-1]["response"]["body"]["data"][0]["embedding"], str)  # base64


def test_a_group_refused_for_now_is_sent_again_together(tmp_path: Path) -> None:
    model = FakeModel(overloaded={"first": 1})
    api = create_api({MODEL: model}, batch=BatchConfig(directory=str(tmp_path)))
    with TestClient(api) as http:
        client = openai.OpenAI(base_url=f"{http.base_url}/v1", api_key="unused", http_client=http, max_retries=0)
        content = line("a", "first") + line("b", "second") + line("c", "third")
        uploaded = client.files.create(file=("in.jsonl", io.BytesIO(content)), purpose="batch")
        batch = wait_for(client, client.batches.create(input_file_id=uploaded.id, endpoint="/v1/embeddings",
                                                       completion_window="24h").id)
    assert batch.request_counts.model_dump() == {"total": 3, "completed": 3, "failed": 0}
    assert model.requests == [(["first", "second", "third"], Priority.LOW)]


async def test_a_batch_resumes_after_its_journal_and_never_sends_a_finished_line_again(tmp_path: Path) -> None:
    texts = [f"text {i}" for i in range(10)]
    store = BatchStore(tmp_path)
    uploaded = store.add_file("in.jsonl", "batch", io.BytesIO(b"".join(line(f"id{i}", t) for i, t in
                                                                        enumerate(texts))), 1 << 20)
    store.save_batch({"id": "batch_1", "status": "validating", "input_file_id": uploaded["id"], "created_at": 0,
                      "expires_at": 2**40, "request_counts": {"total": 0, "completed": 0, "failed": 0}})
    sent: list[list[str]] = []
    never = asyncio.Event()

    async def first_process(body: bytes, cached_only: bool, tenant: str) -> bytes:  # answers the first four lines, then its process ends
        text = orjson.loads(body)["input"]
        sent.append(text)
        if text in texts[4:]:
            await never.wait()
        return orjson.dumps({"data": [{"embedding": vector_of(text)}]})

    config = BatchConfig(directory=str(tmp_path))
    first = BatchRunner(store, first_process, config)
    running = asyncio.ensure_future(first.run_forever())
    while len(await store.journal("batch_1")) < 4:
        await asyncio.sleep(0.01)
    running.cancel()
    await first.aclose()  # as if killed: the lock goes with its process, the journal stays
    resent: list[str] = []

    async def second_process(body: bytes, cached_only: bool, tenant: str) -> bytes:
        text = orjson.loads(body)["input"]
        resent.append(text)
        return orjson.dumps({"data": [{"embedding": vector_of(text)}]})

    second = BatchRunner(BatchStore(tmp_path), second_process, config)  # a new replica on the same directory
    running = asyncio.ensure_future(second.run_forever())
    while store.batch("batch_1")["status"] != "completed":
        await asyncio.sleep(0.01)
    running.cancel()
    await second.aclose()
    assert sorted(resent) == sorted(texts[4:])  # the four finished before were not sent again
    output = store.file_path(store.batch("batch_1")["output_file_id"]).read_bytes().splitlines()
    assert [orjson.loads(raw)["custom_id"] for raw in output] == [f"id{i}" for i in range(10)]


def test_a_cancelled_batch_stops_sending_and_keeps_what_finished(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(runner_module, "LINES_IN_FLIGHT", 1)  # one line at a time: the cancel comes between two
    model = HeldModel("two")
    api = create_api({MODEL: model}, batch=BatchConfig(directory=str(tmp_path)))
    with TestClient(api) as http:
        client = openai.OpenAI(base_url=f"{http.base_url}/v1", api_key="unused", http_client=http, max_retries=0)
        content = line("1", "one") + line("2", "two") + line("3", "three")
        uploaded = client.files.create(file=("in.jsonl", io.BytesIO(content)), purpose="batch")
        created = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/embeddings", completion_window="24h")
        while [texts for texts, _ in model.requests] != [["one"]]:
            time.sleep(0.005)
        assert client.batches.cancel(created.id).status == "cancelling"
        model.release.set()  # the line in flight finishes; the next is never sent
        batch = wait_for(client, created.id)
        assert batch.status == "cancelled" and batch.cancelled_at >= batch.cancelling_at
        assert batch.request_counts.model_dump() == {"total": 3, "completed": 2, "failed": 0}
        assert [texts for texts, _ in model.requests] == [["one"], ["two"]]
        kept = client.files.content(batch.output_file_id).content.splitlines()
        assert [orjson.loads(raw)["custom_id"] for raw in kept] == ["1", "2"]
        refused = http.post(f"/v1/batches/{created.id}/cancel")
        assert refused.status_code == 400 and refused.json()["error"]["type"] == "invalid_request_error"


def test_a_batchs_disk_work_that_takes_as_long_as_the_disk_runs_off_the_event_loop(service, monkeypatch) -> None:
    """An upload copied, a journal synced, an output synced, a journal and a file freed: on the event loop, each would
    hold every interactive request of the replica for as long as the disk takes (a batch's output is hundreds of
    megabytes)."""
    monkeypatch.setattr(store_module, "SYNC_EVERY_S", 0.0)  # the journal synced at every line
    done: list[tuple[str, str, bool]] = []  # (what, the file, whether it ran on an event loop)
    real_fsync, real_unlink = os.fsync, Path.unlink

    def on_loop() -> bool:
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            return False
        return True

    def fsync(descriptor: int) -> None:
        done.append(("fsync", os.readlink(f"/proc/self/fd/{descriptor}"), on_loop()))
        real_fsync(descriptor)

    def unlink(path: Path, missing_ok: bool = False) -> None:
        done.append(("unlink", str(path), on_loop()))
        real_unlink(path, missing_ok=missing_ok)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(Path, "unlink", unlink)
    _, client, _, _ = service
    uploaded = client.files.create(file=("in.jsonl", io.BytesIO(line("a", "one") + line("b", "two"))), purpose="batch")
    batch = wait_for(client, client.batches.create(input_file_id=uploaded.id, endpoint="/v1/embeddings",
                                                   completion_window="24h").id)
    client.files.delete(batch.output_file_id)
    big = [(what, path) for what, path, _ in done if ".data" in path or ".journal" in path]
    assert {(what, kind) for what, path in big for kind in (".data", ".journal") if kind in path} == {
        ("fsync", ".data"), ("fsync", ".journal"), ("unlink", ".data"), ("unlink", ".journal")}
    assert not [(what, path) for what, path, looped in done if looped and (".data" in path or ".journal" in path)]


def test_every_refusal_is_a_4xx_in_openais_error_shape(service) -> None:
    _, client, http, _ = service

    def error(response: Any, status: int, param: str | None = None) -> None:
        assert response.status_code == status, response.text
        body = response.json()["error"]
        assert set(body) == {"message", "type", "param", "code"} and body["param"] == param

    error(http.get("/v1/batches/batch_missing"), 404, "batch_id")
    error(http.get("/v1/files/file-missing"), 404, "file_id")
    error(http.delete("/v1/files/file-missing"), 404, "file_id")
    error(http.post("/v1/files", files={"file": ("a.jsonl", b"{}\n")}, data={"purpose": "fine-tune"}), 400, "purpose")
    error(http.post("/v1/files", files={"file": ("a.jsonl", b"x" * (65 * 1024))}, data={"purpose": "batch"}),
          413, "file")
    error(http.post("/v1/files", json={"purpose": "batch"}), 400)
    uploaded = client.files.create(file=("in.jsonl", io.BytesIO(line("a", "b"))), purpose="batch")
    valid = {"input_file_id": uploaded.id, "endpoint": "/v1/embeddings", "completion_window": "24h"}
    error(http.post("/v1/batches", json={**valid, "endpoint": "/v1/chat/completions"}), 400, "endpoint")
    error(http.post("/v1/batches", json={**valid, "completion_window": "1h"}), 400, "completion_window")
    error(http.post("/v1/batches", json={**valid, "input_file_id": "file-missing"}), 400, "input_file_id")
    error(http.post("/v1/batches", json={**valid, "metadata": {"k": 1}}), 400, "metadata")
    error(http.post("/v1/batches", content=b"[1"), 400)
    error(http.get("/v1/batches?limit=0"), 400, "limit")
    assert client.files.delete(uploaded.id).deleted and client.files.list().data == []


def test_a_file_of_more_lines_than_a_batch_takes_fails_the_batch_with_its_reason(service) -> None:
    _, client, _, _ = service
    content = b"".join(line(f"id{i}", "t") for i in range(21))  # the fixture allows 20
    uploaded = client.files.create(file=("big.jsonl", io.BytesIO(content)), purpose="batch")
    batch = wait_for(client, client.batches.create(input_file_id=uploaded.id, endpoint="/v1/embeddings",
                                                   completion_window="24h").id)
    assert batch.status == "failed" and batch.errors.data[0].code == "too_many_requests"


def test_files_and_finished_batches_past_their_retention_are_removed(tmp_path: Path) -> None:
    now = [1_000_000.0]
    store = BatchStore(tmp_path, clock=lambda: now[0])
    old = store.add_file("old.jsonl", "batch", io.BytesIO(b"{}\n"), 1024)
    store.save_batch({"id": "batch_old", "status": "completed", "created_at": store.now()})
    store.save_batch({"id": "batch_running", "status": "in_progress", "created_at": store.now()})
    now[0] += 31 * 86_400
    fresh = store.add_file("new.jsonl", "batch", io.BytesIO(b"{}\n"), 1024)
    BatchRunner(store, None, BatchConfig(retention_days=30))._sweep()  # type: ignore[arg-type]
    assert [f["id"] for f in store.files()] == [fresh["id"]] and store.file(old["id"]) is None
    assert [b["id"] for b in store.batches()] == ["batch_running"]
    assert store.file_path("../../etc/passwd").parent == tmp_path / "files"  # an id is never a path out of it


async def test_a_journal_line_cut_short_by_a_crash_is_not_a_line_and_the_resuming_runner_cuts_it_off(
        tmp_path: Path) -> None:
    store = BatchStore(tmp_path)
    store.record("batch_1", 0, True, b'{"a":1}')
    store.record("batch_1", 2, False, b'{"b":2}')
    store.close_journal("batch_1")
    with (tmp_path / "batches" / "batch_1.journal").open("ab") as journal:
        journal.write(b'1 1 {"half')  # the process ended mid-write
    done = await store.journal("batch_1")
    assert {index: entry.ok for index, entry in done.items()} == {0: True, 2: False}
    assert list(store.journal_lines("batch_1", [done[2], done[0]])) == [b'{"b":2}\n', b'{"a":1}\n']
    await store.journal("batch_1", repair=True)
    store.record("batch_1", 1, True, b'{"c":3}')  # what the resuming runner appends starts a line of its own
    done = await store.journal("batch_1")
    assert sorted(done) == [0, 1, 2] and list(store.journal_lines("batch_1", [done[1]])) == [b'{"c":3}\n']


class CountingModel(HeldModel):
    """Holds ``held`` as ``HeldModel`` does, answers the rest after a moment, and keeps the most requests it had in
    hand at once."""

    def __init__(self, held: str) -> None:
        super().__init__(held)
        self.in_hand = self.most_in_hand = 0

    async def _answers(self, requests: list[Any]):
        self.in_hand += len(requests)
        self.most_in_hand = max(self.most_in_hand, self.in_hand)
        await asyncio.sleep(0.01)
        try:
            async for answers in super()._answers(requests):
                yield answers
        finally:
            self.in_hand -= len(requests)


def test_a_batch_never_has_more_lines_in_flight_than_its_bound_whatever_wakes_the_runner(
        tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(runner_module, "LINES_IN_FLIGHT", 1)
    model = CountingModel("two")
    api = create_api({MODEL: model}, batch=BatchConfig(directory=str(tmp_path)))
    with TestClient(api) as http:
        client = openai.OpenAI(base_url=f"{http.base_url}/v1", api_key="unused", http_client=http, max_retries=0)
        texts = ["one", "two", "three", "four", "five"]
        uploaded = client.files.create(file=("in.jsonl", io.BytesIO(b"".join(line(t, t) for t in texts))),
                                       purpose="batch")
        created = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/embeddings", completion_window="24h")
        while [texts for texts, _ in model.requests] != [["one"]]:
            time.sleep(0.005)
        empty = client.files.create(file=("empty.jsonl", io.BytesIO(b"\n")), purpose="batch")
        client.batches.create(input_file_id=empty.id, endpoint="/v1/embeddings", completion_window="24h")  # a wake
        time.sleep(0.05)  # while "three" waits for "two"'s room
        model.release.set()
        assert wait_for(client, created.id).status == "completed"
    assert model.most_in_hand == 1

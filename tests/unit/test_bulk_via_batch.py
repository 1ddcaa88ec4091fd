"""`embed-bulk --via batch`: the same command through the service's Batch API (the ingress's own /v1/files and
/v1/batches on a fake model, served on loopback), every row saved once, and a stopped run's batches waited for by
the next run instead of being sent again."""

from __future__ import annotations

import asyncio
import io
import json
import socket
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Iterator

import numpy as np
import pytest
import uvicorn

from deployments.config import BatchConfig
from deployments.ingress.api import create_api
from deployments.ingress.batch.store import BatchStore
from embed_bulk import BulkJob, main
from embed_bulk.settings import BulkSettings

from .batch_fakes import MODEL, HeldModel, vector_of


def text_of(index: int) -> str:
    return f"document {index} about batching"


def write_documents(path: Path, count: int) -> Path:
    path.write_text("".join(json.dumps({"id": f"doc-{i}", "text": text_of(i)}) + "\n" for i in range(count)))
    return path


@pytest.fixture
def service(tmp_path: Path) -> Iterator[tuple[HeldModel, str, BatchStore]]:
    """The Batch API on a model that holds the text ``held`` (unless released), served on a free loopback port."""
    model = HeldModel(text_of(13))
    directory = tmp_path / "service"
    api = create_api({MODEL: model}, batch=BatchConfig(directory=str(directory)))
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(api, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "the service did not start"
        time.sleep(0.01)
    try:
        yield model, f"http://127.0.0.1:{port}/v1", BatchStore(directory)
    finally:
        server.should_exit = True
        thread.join(timeout=10)


def test_the_same_command_through_the_batch_api_saves_every_row_once_in_order(tmp_path: Path, service) -> None:
    model, base_url, store = service
    model.release.set()
    write_documents(tmp_path / "docs.jsonl", 30)
    output = tmp_path / "vectors.npy"
    argv = [str(tmp_path / "docs.jsonl"), str(output), "--base-url", base_url, "--model", MODEL, "--via", "batch",
            "--batch-lines", "7", "--progress", "never"]
    assert main(argv) == 0
    ids = [json.loads(line) for line in output.with_name("vectors.npy.ids.jsonl").read_text().splitlines()]
    assert ids == [f"doc-{i}" for i in range(30)]
    assert np.array_equal(np.load(output), np.array([vector_of(text_of(i)) for i in range(30)], dtype=np.float32))
    assert Counter(text for texts, _ in model.requests for text in texts) == Counter(text_of(i) for i in range(30))
    assert not output.with_name("vectors.npy.batches.json").exists()
    assert store.files() == [] and len(store.batches()) == 5  # its files deleted once saved; 30 lines in files of 7


async def test_a_stopped_runs_batches_are_waited_for_by_the_next_run_not_sent_again(tmp_path: Path, service) -> None:
    model, base_url, store = service
    write_documents(tmp_path / "docs.jsonl", 20)
    settings = BulkSettings(tmp_path / "docs.jsonl", tmp_path / "out.jsonl", base_url=base_url, model=MODEL,
                            via="batch", batch_lines=10, progress="never")
    sidecar = tmp_path / "out.jsonl.batches.json"
    first = BulkJob(settings, stderr=io.StringIO())
    running = asyncio.ensure_future(first.run())
    while len(store.batches()) < 2:  # both files submitted
        await asyncio.sleep(0.01)
    first.stop()  # e.g. SIGINT: the batches go on running on the service
    summary = await running
    assert summary.interrupted and summary.exit_code == 130
    submitted = json.loads(sidecar.read_text())
    assert len(submitted) >= 1  # the batch holding document 13 cannot have finished

    model.release.set()
    summary = await BulkJob(settings, stderr=io.StringIO()).run()
    assert summary.exit_code == 0 and not sidecar.exists()
    rows = [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert sorted(row["id"] for row in rows) == sorted(f"doc-{i}" for i in range(20))
    assert all(np.allclose(row["embedding"], vector_of(text_of(int(row["id"][4:])))) for row in rows)
    sent = Counter(text for texts, _ in model.requests for text in texts)
    assert sent == Counter(text_of(i) for i in range(20))  # each document sent to the model once: none submitted twice
    assert len(store.batches()) == 2

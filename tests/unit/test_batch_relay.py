"""A Batch API batch for an ``openai`` entry with ``provider_batches`` is relayed to the provider's own Batch API
(deployments/ingress/batch/relay.py, deployments/model/relay.py): the real ingress app and a real ``EmbeddingModel``
with a disk cache, against the simulated provider (``load.upstream``, its Batch API included) in this process.

What a user is promised: no real-time call for batch work; the provider bills each distinct uncached input once (a
line it failed goes again, alone); each vector is the provider's for its input; a bad line is one error line; the
next night pays only for what changed; a runner resuming a batch never makes a second provider batch."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import numpy as np
import openai
import orjson
import pytest
from hypothesis import given
from hypothesis import strategies as st
from starlette.testclient import TestClient

from batching import BatcherConfig, BatcherMetrics
from deployments.config import BatchConfig, CacheConfig, ModelConfig, ProviderBatchConfig
from deployments.ingress.api import create_api
from deployments.ingress.batch.store import BatchStore
from deployments.model.backends import provider_batches as provider_batches_module
from deployments.model.backends.provider_batches import ProviderBatches
from deployments.model.embedder import EmbeddingModel
from load.hashvec import hash_embedding
from load.upstream import UpstreamConfig, run_upstream

from .batch_fakes import LocalHandle
from .cache_fakes import RecordingMetrics

MODEL = "relayed"
DIM = 64


def relay_settings(**changes: Any) -> ProviderBatchConfig:
    return ProviderBatchConfig(**{"poll_s": 0.05, "inputs_per_line": 4, "max_lines": 3, **changes})


def model_config(upstream_url: str, cache_dir: Path, relay: ProviderBatchConfig) -> ModelConfig:
    return ModelConfig(name=MODEL, backend="openai", base_url=upstream_url, upstream_model="text-embedding-3-small",
                       batching=BatcherConfig(max_batch_size=16, max_wait_ms=1.0),
                       cache=CacheConfig(store="disk", directory=str(cache_dir)), provider_batches=relay)


def local_model(upstream_url: str, cache_dir: Path, relay: ProviderBatchConfig) -> LocalHandle:
    config = model_config(upstream_url, cache_dir, relay)
    return LocalHandle(lambda: EmbeddingModel(config, metrics=BatcherMetrics(), cache_metrics=RecordingMetrics()))


def line(custom_id: str, text: Any) -> bytes:
    return orjson.dumps({"custom_id": custom_id, "method": "POST", "url": "/v1/embeddings",
                         "body": {"model": MODEL, "input": text, "encoding_format": "float"}}) + b"\n"


def run_batch(client: openai.OpenAI, content: bytes) -> Any:
    uploaded = client.files.create(file=("in.jsonl", content), purpose="batch")
    batch = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/embeddings", completion_window="24h")
    deadline = time.monotonic() + 60
    while batch.status not in ("completed", "failed", "cancelled", "expired"):
        assert time.monotonic() < deadline, f"the batch is still {batch.status}"
        time.sleep(0.05)
        batch = client.batches.retrieve(batch.id)
    return batch


def lines_of(client: openai.OpenAI, file_id: str | None) -> dict[str, Any]:
    if file_id is None:
        return {}
    return {line["custom_id"]: line for line in map(orjson.loads, client.files.content(file_id).content.splitlines())}


def assert_each_vector_is_its_inputs(output: dict[str, Any], texts: dict[str, Any]) -> None:
    for custom_id, text in texts.items():
        data = output[custom_id]["response"]["body"]["data"]
        inputs = text if isinstance(text, list) else [text]
        assert len(data) == len(inputs)
        for item, expected in zip(data, inputs):
            got = np.asarray(item["embedding"], dtype=np.float32)
            assert float(got @ hash_embedding(expected, DIM)) > 0.99999


@pytest.fixture
def gateway(tmp_path: Path):
    """The ingress app over the relaying model, the simulated provider (a line in ten fails, as provider batches'
    lines sometimes do), and the ``openai`` client pointed at the app."""
    with run_upstream(UpstreamConfig(dim=DIM, base_latency_ms=1, jitter=0, batch_delay_s=0.1,
                                     batch_error_rate=0.1)) as upstream:
        handle = local_model(upstream.base_url, tmp_path / "vectors", relay_settings())
        api = create_api({MODEL: handle}, batch=BatchConfig(directory=str(tmp_path / "batch")),
                         relayed={MODEL: relay_settings()})
        with TestClient(api) as http:
            yield upstream, openai.OpenAI(base_url=f"{http.base_url}/v1", api_key="unused", http_client=http,
                                          max_retries=0)
            close(handle, http)


def close(handle: LocalHandle, http: TestClient) -> None:
    """End the model made in the app's loop (its disk cache's writer process with it)."""
    if handle.model is not None:
        http.portal.call(handle.model.aclose)


def test_a_relayed_batch_is_embedded_by_the_providers_batch_api_once_per_distinct_uncached_input(gateway) -> None:
    upstream, client = gateway
    client.embeddings.create(model=MODEL, input=["cached already"])  # a real-time request, before the batch
    upstream.reset()
    texts: dict[str, Any] = {f"doc{i}": f"document number {i % 40}" for i in range(60)}  # 40 distinct
    texts["several"] = ["cached already", "document number 3", "a text of its own"]
    content = b"".join(line(custom_id, text) for custom_id, text in texts.items()) + line("bad", "")
    batch = run_batch(client, content)

    assert batch.status == "completed"
    assert batch.request_counts.model_dump() == {"total": 62, "completed": 61, "failed": 1}
    output, errors = lines_of(client, batch.output_file_id), lines_of(client, batch.error_file_id)
    assert_each_vector_is_its_inputs(output, texts)
    assert list(errors) == ["bad"] and errors["bad"]["response"]["status_code"] == 400
    stats = upstream.stats()
    assert stats["calls"] == 0  # nothing the caller sent as a batch went in real time
    assert stats["batch"]["items_billed"] == 41  # 40 documents and "a text of its own"; "cached already" was cached
    assert stats["batch"]["lines_failed"] > 0 and stats["batch"]["batches"] > 1  # what failed went again


def test_the_next_night_sends_only_what_changed(gateway) -> None:
    upstream, client = gateway
    night = {f"doc{i}": f"document {i}, first version" for i in range(100)}
    assert run_batch(client, b"".join(line(c, t) for c, t in night.items())).status == "completed"
    for i in range(0, 98, 14):  # 7 of 100 documents changed
        night[f"doc{i}"] = f"document {i}, second version"
    upstream.reset()
    batch = run_batch(client, b"".join(line(c, t) for c, t in night.items()))

    assert batch.status == "completed" and batch.request_counts.completed == 100
    assert_each_vector_is_its_inputs(lines_of(client, batch.output_file_id), night)
    stats = upstream.stats()
    assert (stats["calls"], stats["batch"]["items_billed"]) == (0, 7)


def test_a_runner_resuming_a_relayed_batch_polls_the_provider_batch_made_before_and_makes_no_other(
        tmp_path: Path) -> None:
    settings = relay_settings(inputs_per_line=8, max_lines=100)
    texts = {f"id{i}": f"text {i}" for i in range(10)}
    with run_upstream(UpstreamConfig(dim=DIM, base_latency_ms=1, jitter=0, batch_delay_s=1.0)) as upstream:

        def replica() -> tuple[LocalHandle, TestClient]:  # an ingress replica with its own model, same directories
            handle = local_model(upstream.base_url, tmp_path / "vectors", settings)
            return handle, TestClient(create_api({MODEL: handle}, relayed={MODEL: settings},
                                                 batch=BatchConfig(directory=str(tmp_path / "batch"))))

        store = BatchStore(tmp_path / "batch")
        handle, app = replica()
        with app as http:
            client = openai.OpenAI(base_url=f"{http.base_url}/v1", api_key="unused", http_client=http)
            uploaded = client.files.create(file=("in.jsonl", b"".join(line(c, t) for c, t in texts.items())),
                                           purpose="batch")
            batch_id = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/embeddings",
                                             completion_window="24h").id
            while not ((store.relay_state(batch_id) or {}).get("parts") or [{}])[0].get("provider_batch_id"):
                time.sleep(0.01)
            close(handle, http)
        # that replica ended while the provider's batch ran; another takes the batch over
        handle, app = replica()
        with app as http:
            client = openai.OpenAI(base_url=f"{http.base_url}/v1", api_key="unused", http_client=http)
            while (batch := client.batches.retrieve(batch_id)).status != "completed":
                time.sleep(0.05)
            assert_each_vector_is_its_inputs(lines_of(client, batch.output_file_id), texts)
            close(handle, http)
        stats = upstream.stats()
        assert (stats["calls"], stats["batch"]["batches"], stats["batch"]["items_billed"]) == (0, 1, 10)


async def test_a_part_submitted_again_under_its_tag_gets_the_provider_batch_made_before() -> None:
    """A runner that crashed after the provider took a part but before the part's state said so submits it again:
    the provider makes no second batch, and bills nothing twice."""
    with run_upstream(UpstreamConfig(dim=DIM, batch_delay_s=0.0)) as upstream:
        client = openai.AsyncOpenAI(base_url=upstream.base_url, api_key="unused", max_retries=0)
        batches = ProviderBatches(client, "text-embedding-3-small")
        first = await batches.submit("batch_x-1-0", ["a", "b", "c"], None, 2)
        again = await batches.submit("batch_x-1-0", ["a", "b", "c"], None, 2)
        other = await batches.submit("batch_x-1-1", ["d"], None, 2)
        polled = await batches.poll(first, 3, 2)
        await client.close()
        made = upstream.stats()["batch"]["batches"]
    assert first == again != other
    assert polled.done and polled.status == "completed"
    assert [float(vector @ hash_embedding(text, DIM)) > 0.99999 for vector, text in zip(polled.vectors, "abc")] \
        == [True] * 3
    assert made == 2


@given(lines=st.lists(st.binary(max_size=40).map(lambda raw: raw.replace(b"\n", b"")), max_size=12),
       cuts=st.lists(st.integers(min_value=0, max_value=600), max_size=10), ends_with_newline=st.booleans())
def test_a_provider_output_downloaded_in_chunks_reads_as_the_same_lines_wherever_the_chunks_cut(
        lines: list[bytes], cuts: list[int], ends_with_newline: bool) -> None:
    content = b"\n".join(lines) + (b"\n" if ends_with_newline and lines else b"")
    bounds = sorted({0, len(content), *(cut for cut in cuts if cut < len(content))})
    chunks = [content[start:end] for start, end in zip(bounds, bounds[1:])]
    assert [line for line in provider_batches_module._lines(chunks) if line] == [line for line in lines if line]

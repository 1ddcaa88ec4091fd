"""Each tenant's bill (deployments/usage.py): the tokens its requests were answered with, of those the ones the cache
answered, and the ones the provider billed for its inputs, counted where each happens (the ingress, the model's
cache, its paced calls) into one ledger that the usage API reads; and the Batch API's files and batches as their
tenant's: seen only by its keys, their lines run (and counted) as that tenant.

The real ingress app and a real ``EmbeddingModel`` (an ``openai`` entry with a disk cache) against the simulated
provider in this process, whose own count of billed tokens is the truth the bill is held to."""

from __future__ import annotations

import io
import time
from pathlib import Path
from typing import Any

import openai
import orjson
import pytest
from starlette.testclient import TestClient

from batching import BatcherConfig, BatcherMetrics
from deployments.config import BatchConfig, CacheConfig, ModelConfig
from deployments.ingress.api import create_api
from deployments.ingress.auth import ApiKeys, key_hash
from deployments.model.embedder import EmbeddingModel
from deployments.model.tokens import count
from deployments.usage import TenantUsage, UsageLedger
from load.upstream import UpstreamConfig, run_upstream

from .batch_fakes import MODEL as FAKE_MODEL
from .batch_fakes import FakeModel, LocalHandle
from .cache_fakes import RecordingMetrics

MODEL = "billed"
KEYS = {"search": "sk-search-1", "indexer": "sk-indexer-2", "finance": "sk-finance-3"}


def keys_file(path: Path, indexer_models: str = "") -> Path:
    path.write_text("tenants:\n"
                    f"  search: {{keys: [{key_hash(KEYS['search'])}]}}\n"
                    f"  indexer: {{keys: [{key_hash(KEYS['indexer'])}]{indexer_models}}}\n"
                    f"  finance: {{keys: [{key_hash(KEYS['finance'])}], admin: true}}\n")
    return path


def tokens(*texts: str) -> int:
    return sum(count(text) for text in texts)


def test_each_tenants_billed_tokens_add_up_to_the_providers_bill_and_its_cached_tokens_to_the_rest(
        tmp_path: Path) -> None:
    ledger = UsageLedger()
    model_usage = TenantUsage(ledger)
    with run_upstream(UpstreamConfig(dim=8, base_latency_ms=1.0, jitter=0.0)) as upstream:
        config = ModelConfig(name=MODEL, backend="openai", base_url=upstream.base_url,
                             upstream_model="text-embedding-3-small",
                             batching=BatcherConfig(max_batch_size=16, max_wait_ms=1.0),
                             cache=CacheConfig(store="disk", directory=str(tmp_path / "cache")))
        handle = LocalHandle(lambda: EmbeddingModel(config, metrics=BatcherMetrics(),
                                                    cache_metrics=RecordingMetrics(), usage=model_usage))
        api = create_api({MODEL: handle}, api_keys=ApiKeys([], path=keys_file(tmp_path / "keys.yaml")),
                         usage=TenantUsage(ledger))
        with TestClient(api) as http:
            def embed(tenant: str, texts: list[str]) -> None:
                answer = http.post("/v1/embeddings", json={"model": MODEL, "input": texts},
                                   headers={"Authorization": f"Bearer {KEYS[tenant]}"})
                assert answer.status_code == 200 and answer.json()["usage"]["prompt_tokens"] == tokens(*texts)

            search_texts = [f"the search query number {i}" for i in range(5)]
            embed("search", search_texts)
            embed("search", ["said twice", "said twice"])  # the repeat is not sent again
            embed("indexer", ["a document of the indexer", search_texts[0]])  # the second is the cache's
            http.portal.call(handle.model.cache_written)
            embed("search", search_texts)  # all the cache's
            http.portal.call(model_usage.flush_now)
            usage = http.get("/v1/organization/usage/embeddings",
                             params={"start_time": int(time.time()) // 86_400 * 86_400, "group_by": "project_id"},
                             headers={"Authorization": f"Bearer {KEYS['finance']}"}).json()
            http.portal.call(handle.model.aclose)  # its disk cache's writer process ends with it
        billed_upstream = upstream.stats()["tokens_billed"]
    bill = {result["project_id"]: result for bucket in usage["data"] for result in bucket["results"]}
    assert set(bill) == {"search", "indexer"}
    search, indexer = bill["search"], bill["indexer"]
    assert search["input_billed_tokens"] == tokens(*search_texts, "said twice")
    assert search["input_cached_tokens"] == tokens("said twice", *search_texts)
    assert search["input_tokens"] == 2 * tokens(*search_texts) + 2 * tokens("said twice")
    assert indexer["input_billed_tokens"] == tokens("a document of the indexer")
    assert indexer["input_cached_tokens"] == tokens(search_texts[0])
    assert search["input_billed_tokens"] + indexer["input_billed_tokens"] == billed_upstream  # to the token


def line(custom_id: str, text: str, model: str = FAKE_MODEL) -> bytes:
    return orjson.dumps({"custom_id": custom_id, "method": "POST", "url": "/v1/embeddings",
                         "body": {"model": model, "input": text}}) + b"\n"


@pytest.fixture
def batch_service(tmp_path: Path):
    usage_ledger = UsageLedger()
    usage = TenantUsage(usage_ledger)
    api = create_api({FAKE_MODEL: FakeModel(), "other": FakeModel()},
                     api_keys=ApiKeys([], path=keys_file(tmp_path / "keys.yaml", f", models: [{FAKE_MODEL}]")),
                     batch=BatchConfig(directory=str(tmp_path / "batches")), usage=usage)
    with TestClient(api) as http:
        def client(tenant: str) -> openai.OpenAI:
            return openai.OpenAI(base_url=f"{http.base_url}/v1", api_key=KEYS[tenant], http_client=http,
                                 max_retries=0)

        yield client, http, usage


def finished(client: openai.OpenAI, batch_id: str) -> Any:
    deadline = time.monotonic() + 30  # a bound, not a timing check
    while (batch := client.batches.retrieve(batch_id)).status != "completed":
        assert time.monotonic() < deadline, f"batch still {batch.status}"
        time.sleep(0.02)
    return batch


def test_a_tenants_files_and_batches_are_its_own_and_its_lines_run_as_it(batch_service) -> None:
    client, http, usage = batch_service
    indexer, search = client("indexer"), client("search")
    content = line("ok", "an allowed model") + line("no", "a model the indexer may not use", model="other")
    uploaded = indexer.files.create(file=("in.jsonl", io.BytesIO(content)), purpose="batch")
    assert "owner" not in indexer.files.retrieve(uploaded.id).model_dump()
    with pytest.raises(openai.NotFoundError):
        search.files.retrieve(uploaded.id)
    with pytest.raises(openai.NotFoundError):
        search.files.content(uploaded.id)
    with pytest.raises(openai.NotFoundError):
        search.files.delete(uploaded.id)
    with pytest.raises(openai.BadRequestError):  # another tenant's file is no input for its batch
        search.batches.create(input_file_id=uploaded.id, endpoint="/v1/embeddings", completion_window="24h")
    created = indexer.batches.create(input_file_id=uploaded.id, endpoint="/v1/embeddings", completion_window="24h")
    with pytest.raises(openai.NotFoundError):
        search.batches.retrieve(created.id)
    with pytest.raises(openai.NotFoundError):
        search.batches.cancel(created.id)
    batch = finished(indexer, created.id)
    assert [b.id for b in search.batches.list().data] == [] and search.files.list().data == []
    assert {f.id for f in indexer.files.list().data} == {uploaded.id, batch.output_file_id, batch.error_file_id}
    assert batch.request_counts.model_dump() == {"total": 2, "completed": 1, "failed": 1}
    (error,) = map(orjson.loads, indexer.files.content(batch.error_file_id).content.splitlines())
    assert error["response"]["status_code"] == 403
    assert error["response"]["body"]["error"]["code"] == "permission_denied"
    http.portal.call(usage.flush_now)
    rows = http.portal.call(usage.store.usage, 0, int(time.time()) + 3600)
    assert [(tenant, model, requests) for _, tenant, model, requests, *_ in rows] == [("indexer", FAKE_MODEL, 1)]

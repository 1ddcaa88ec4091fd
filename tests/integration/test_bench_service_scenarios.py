"""Smoke runs of the full-service benchmarks on a tiny workload: every variant answers every request correctly.
No timing is asserted; the figures come from `python -m load.bench e2e|local|bulk`."""

from __future__ import annotations

import pytest

from load.bench import bulk, e2e, local, tune
from load.bench.service_at import checkout
from load.bench.serving import SIM_MODEL, default_models, deployed, deployed_as_configured, one_replica
from load.upstream import UpstreamConfig
from load.bench.upstream_process import upstream_process

pytestmark = pytest.mark.integration


def test_e2e_scenario_serves_every_variant_with_vectors_matching_their_texts(serve_instance, tmp_path):
    upstream = UpstreamConfig(base_latency_ms=1, per_token_ms=0, jitter=0)
    with upstream_process(upstream) as root_url, e2e.limited_upstream(upstream) as limited_url, \
            deployed(serve_instance.url, e2e.built_applications(root_url, limited_url), SIM_MODEL):
        data = e2e.measure(serve_instance.url, root_url, limited_url, upstream, e2e.QUICK, tmp_path)
    assert (tmp_path / "e2e.md").exists() and (tmp_path / "e2e.json").exists()
    for row in data["rows"].values():
        assert set(row) == {"adaptive", "adaptive-limits", "serve-batch", "unbatched", *e2e.FLOORS, "direct"}
        for cell in row.values():
            assert cell["errors"] == 0 and cell["mismatches"] == 0 and cell["items_per_s"] > 0
        assert row["unbatched"]["mean_batch_size"] == 1.0  # counted at the upstream: one call a text
        assert row["adaptive"]["upstream_call_ms"] >= upstream.base_latency_ms  # timed at the upstream
        assert row["serve-floor-http"]["upstream_call_ms"] is None  # it calls no upstream
    top_concurrency, _ = e2e.QUICK.levels[-1]
    ceiling = data["gateway_ceiling"]
    top = data["rows"][str(top_concurrency)]
    assert ceiling["texts_per_s"] == pytest.approx(top_concurrency * 1000 / top["adaptive"]["upstream_call_ms"])
    assert ceiling["target_share"] == pytest.approx(
        e2e.TARGET_GAIN_OVER_DIRECT * top["direct"]["items_per_s"] / ceiling["texts_per_s"])


def test_local_scenario_serves_batched_and_unbatched(serve_instance, tmp_path):
    data = local.measure(serve_instance.url, local.QUICK, tmp_path)
    assert (tmp_path / "local.md").exists()
    assert set(data["model_alone_ms_per_text"]) == {"1", "4"} and min(data["model_alone_ms_per_text"].values()) > 0
    for row in data["rows"].values():
        assert row["errors"] == 0
        assert row["batched"]["items_per_s"] > 0 and row["unbatched"]["items_per_s"] > 0
    assert data["rows"]["1"]["unbatched"]["mean_batch_size"] == 1.0


def test_tune_scenario_serves_the_entry_as_shipped_and_changed_side_by_side(serve_instance, tmp_path):
    shipped = one_replica(default_models()[0])  # reserving no CPU: both fit the tests' cluster
    changed = tune.changed_entry(shipped, ["batching.max_wait_ms=5"])
    data = tune.measure(serve_instance.url, shipped, changed, tune.QUICK, tmp_path)
    assert (tmp_path / "tune.md").exists() and (tmp_path / "tune.json").exists()
    assert data["changes"] == {"batching.max_wait_ms": 5}
    for row in data["rows"].values():
        for label in tune.VARIANTS:
            assert row[label]["errors"] == 0 and row[label]["items_per_s"] > 0
            assert row[label]["mean_batch_size"] >= 1 and row[label]["cpu_ms"]["model replica"] > 0
        assert row["texts_ratio_range"][0] <= row["texts_ratio"] <= row["texts_ratio_range"][1]


def test_another_checkouts_code_is_refused_where_this_checkouts_comes_first_on_the_workers_path(serve_instance):
    # The tests' Ray starts from this checkout, as every benchmark's but `tune --against`'s (serve_cluster's
    # checkout_first=False, which only a Ray of its own can take): its workers would run this checkout's code.
    entry = one_replica(default_models()[0])
    with checkout("HEAD") as (_, tree):
        with pytest.raises(RuntimeError, match="not the checkout at"):
            with deployed_as_configured(serve_instance.url, {"shipped": ({"models": [entry]}, tree)}, entry["name"]):
                pass


def test_bulk_scenario_embeds_every_document_in_place_and_streams_high_requests(serve_instance, tmp_path):
    upstream = UpstreamConfig(base_latency_ms=1, per_token_ms=0, jitter=0)
    with upstream_process(upstream) as root_url:
        data = bulk.measure(serve_instance.url, root_url, upstream, bulk.QUICK, tmp_path)
    assert (tmp_path / "bulk.md").exists() and (tmp_path / "bulk.json").exists()
    runs = data["runs"]
    unbatched = runs["one_request_per_document"]
    assert unbatched["completed"] == unbatched["upstream_calls"] == bulk.QUICK.unbatched_documents
    assert unbatched["errors"] == unbatched["mismatches"] == 0
    for job in (runs["job_alone"], runs["job_with_high"]):
        assert job["rows"] == bulk.QUICK.documents
        assert job["misplaced_ids"] == job["mismatches"] == 0
    assert 0 < runs["job_alone"]["upstream_calls"] < bulk.QUICK.documents
    assert runs["high_alone"]["completed"] > 0 and runs["high_alone"]["errors"] == 0


def test_batch_scenario_runs_the_corpus_through_batches_beside_both_streams(embeddings_app, tmp_path):
    from load.bench import batch

    from .helpers import API_KEYS

    settings = batch.Settings(documents=60, lines_per_batch=25, calm_s=1.0, high_rate_per_s=5.0, low_rate_per_s=5.0)
    data = batch.measure(embeddings_app.url, settings, tmp_path, api_key=API_KEYS[0])
    assert (tmp_path / "batch.md").exists()
    assert [b["status"] for b in data["batches"]] == ["completed"] * 3
    check = data["check"]
    # 3 bad lines planted in each of the 3 files: each becomes one error line, the rest complete
    assert (check["lines"], check["in_order_once_each"], check["planted"]) == (51, True, 9)
    assert check["error_lines"] == 9 and check["error_lines_the_planted_ones"]
    assert check["min_cosine"] >= 0.99999
    for stream in ("calm_high", "high", "low"):
        assert set(data[stream]["statuses"]) <= {"200"}

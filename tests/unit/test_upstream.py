"""The simulated upstream embeddings API speaks OpenAI's protocol and injects the faults it is configured with."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import dataclasses
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

import httpx
import numpy as np
import openai
import pytest

from load.hashvec import hash_embedding, matches
from load.upstream import RunningUpstream, UpstreamConfig, create_app, parse_args, run_upstream

DIM = 32
FAST = UpstreamConfig(dim=DIM, base_latency_ms=1, per_token_ms=0, jitter=0)


def fast(**overrides: Any) -> UpstreamConfig:
    return dataclasses.replace(FAST, **overrides)


@pytest.fixture(scope="module")
def upstream() -> Iterator[RunningUpstream]:
    with run_upstream(FAST) as running:
        yield running


def embed(upstream: RunningUpstream, **body: Any) -> httpx.Response:
    return upstream.client.post("/v1/embeddings", json={"model": "sim-embed", **body})


def error_of(response: httpx.Response) -> dict[str, Any]:
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    return error


def test_string_input_gets_one_embedding_in_openai_shape(upstream: RunningUpstream) -> None:
    response = embed(upstream, input="hello world")

    assert response.status_code == 200
    body = response.json()
    assert set(body) == {"object", "data", "model", "usage"}
    assert body["object"] == "list"
    assert body["model"] == "sim-embed"
    assert body["usage"] == {"prompt_tokens": 2, "total_tokens": 2}
    (item,) = body["data"]
    assert set(item) == {"object", "index", "embedding"}
    assert (item["object"], item["index"]) == ("embedding", 0)
    assert len(item["embedding"]) == DIM
    assert matches("hello world", item["embedding"], DIM)


@pytest.mark.parametrize(
    ("raw_input", "items", "tokens"),
    [
        (["alpha", "beta gamma", "alpha"], ["alpha", "beta gamma", "alpha"], 1 + 2 + 1),
        ([15339, 1917], [[15339, 1917]], 2),
        ([[15339], [1917, 11, 420]], [[15339], [1917, 11, 420]], 1 + 3),
    ],
    ids=["strings", "token-ids", "lists-of-token-ids"],
)
def test_every_input_kind_gets_its_own_embeddings_in_input_order(
    upstream: RunningUpstream, raw_input: Any, items: list[Any], tokens: int
) -> None:
    body = embed(upstream, input=raw_input).json()

    assert [item["index"] for item in body["data"]] == list(range(len(items)))
    assert all(matches(item, result["embedding"], DIM) for item, result in zip(items, body["data"]))
    assert body["usage"] == {"prompt_tokens": tokens, "total_tokens": tokens}


def test_same_text_gets_same_embedding_and_other_texts_do_not_match(upstream: RunningUpstream) -> None:
    first, second, again = embed(upstream, input=["one", "two", "one"]).json()["data"]

    assert first["embedding"] == again["embedding"]
    assert not matches("one", second["embedding"], DIM)


def test_base64_encoding_carries_the_same_little_endian_float32_vectors(upstream: RunningUpstream) -> None:
    texts = ["first text", "second text"]
    as_floats = embed(upstream, input=texts, encoding_format="float").json()["data"]
    as_base64 = embed(upstream, input=texts, encoding_format="base64").json()["data"]

    for floats, encoded in zip(as_floats, as_base64):
        decoded = np.frombuffer(base64.b64decode(encoded["embedding"]), dtype="<f4")
        np.testing.assert_array_equal(decoded, np.asarray(floats["embedding"], dtype=np.float32))


def test_official_openai_client_round_trips_with_its_default_base64(upstream: RunningUpstream) -> None:
    client = openai.OpenAI(base_url=upstream.base_url, api_key="x", max_retries=0)
    texts = ["the quick brown fox", "jumps over the lazy dog"]

    response = client.embeddings.create(model="sim-embed", input=texts)

    assert [item.index for item in response.data] == [0, 1]
    assert all(matches(text, item.embedding, DIM) for text, item in zip(texts, response.data))
    np.testing.assert_allclose(response.data[0].embedding, hash_embedding(texts[0], DIM), rtol=1e-6)
    assert response.usage.total_tokens > 0


def test_dimensions_truncates_and_renormalises(upstream: RunningUpstream) -> None:
    (item,) = embed(upstream, input="shorter please", dimensions=8).json()["data"]

    assert len(item["embedding"]) == 8
    assert np.linalg.norm(item["embedding"]) == pytest.approx(1.0, abs=1e-5)
    assert matches("shorter please", item["embedding"], DIM)


@pytest.mark.parametrize("dimensions", [0, DIM + 1])
def test_dimensions_outside_the_model_width_is_400(upstream: RunningUpstream, dimensions: int) -> None:
    response = embed(upstream, input="x", dimensions=dimensions)

    assert response.status_code == 400
    assert error_of(response)["param"] == "dimensions"


@pytest.mark.parametrize(
    "body",
    [{"input": []}, {"input": ""}, {"input": ["ok", 3]}, {"model": "m"}, {"input": "x", "encoding_format": "hex"}],
    ids=["empty-list", "empty-string", "mixed-list", "no-input", "unknown-format"],
)
def test_malformed_request_is_400_in_openai_shape(upstream: RunningUpstream, body: dict[str, Any]) -> None:
    response = upstream.client.post("/v1/embeddings", json={"model": "m", **body})

    assert response.status_code == 400
    assert error_of(response)["type"] == "invalid_request_error"


def test_too_long_input_fails_the_call_with_400_naming_its_index() -> None:
    with run_upstream(fast(max_input_tokens=5)) as upstream:
        response = embed(upstream, input=["short", "this input is much longer than five tokens"])

        assert response.status_code == 400
        error = error_of(response)
        assert "input[1]" in error["message"]
        assert error["code"] == "context_length_exceeded"
        assert upstream.stats()["items_billed"] == 0


def test_input_with_fail_marker_fails_the_call_with_400_naming_its_index() -> None:
    with run_upstream(fast(fail_marker="POISON")) as upstream:
        response = embed(upstream, input=["fine", "also fine", "a POISON pill"])

        assert response.status_code == 400
        assert "input[2]" in error_of(response)["message"]
        assert upstream.stats()["failed_400"] == 1


def test_requests_over_rpm_get_429_with_retry_after_headers() -> None:
    with run_upstream(fast(rpm=2)) as upstream:
        assert [embed(upstream, input="x").status_code for _ in range(2)] == [200, 200]

        rejected = embed(upstream, input="x")

        assert rejected.status_code == 429
        assert error_of(rejected)["code"] == "rate_limit_exceeded"
        assert int(rejected.headers["Retry-After"]) >= 1
        assert int(rejected.headers["retry-after-ms"]) > 0
        assert upstream.stats()["rejected_429"] == 1


def test_limited_calls_carry_the_accounts_rate_limit_headers_as_openai_sends_them() -> None:
    with run_upstream(fast(rpm=60, tpm=1_000)) as upstream:
        first = embed(upstream, input=[[1] * 8])
        assert first.status_code == 200
        assert (first.headers["x-ratelimit-limit-requests"], first.headers["x-ratelimit-limit-tokens"]) == (
            "60", "1000")
        assert int(first.headers["x-ratelimit-remaining-requests"]) in (59, 60)  # refilled a little meanwhile
        assert 992 <= int(first.headers["x-ratelimit-remaining-tokens"]) < 1000
        assert first.headers["x-ratelimit-reset-tokens"].endswith("s")
        refused = embed(upstream, input=[[1] * 995])
        assert refused.status_code == 429
        assert int(refused.headers["x-ratelimit-remaining-tokens"]) < 995


def test_unlimited_calls_carry_no_rate_limit_headers(upstream: RunningUpstream) -> None:
    assert not [name for name in embed(upstream, input="x").headers if name.startswith("x-ratelimit")]


def test_official_openai_client_sees_rate_limit_error() -> None:
    with run_upstream(fast(rpm=1)) as upstream:
        client = openai.OpenAI(base_url=upstream.base_url, api_key="x", max_retries=0)
        client.embeddings.create(model="m", input="x")

        with pytest.raises(openai.RateLimitError):
            client.embeddings.create(model="m", input="x")


def test_tokens_over_tpm_get_429_and_a_call_larger_than_tpm_gets_400() -> None:
    with run_upstream(fast(tpm=10)) as upstream:
        assert embed(upstream, input=[[1] * 8]).status_code == 200

        rejected = embed(upstream, input=[[1] * 8])
        too_large = embed(upstream, input=[[1] * 11])

        assert rejected.status_code == 429
        assert error_of(rejected)["type"] == "tokens"
        assert too_large.status_code == 400
        assert error_of(too_large)["code"] == "request_too_large"


def test_error_rate_fails_its_exact_share_of_calls_starting_with_the_first() -> None:
    with run_upstream(fast(error_rate=0.25)) as upstream:
        statuses = [embed(upstream, input=["a"]).status_code for _ in range(8)]
        upstream.set_faults(error_rate=0.5)
        statuses += [embed(upstream, input=["a"]).status_code for _ in range(2)]

    assert statuses == [500, 200, 200, 200, 500, 200, 200, 200, 500, 200]


def test_error_rate_one_answers_every_call_500_in_openai_shape() -> None:
    with run_upstream(fast(error_rate=1.0)) as upstream:
        response = embed(upstream, input=["a", "b"])

        assert response.status_code == 500
        assert error_of(response)["type"] == "server_error"
        assert upstream.stats()["errors_500"] == 1
        assert upstream.stats()["items_billed"] == 0


def test_faults_change_at_run_time() -> None:
    with run_upstream(fast(rpm=1)) as upstream:
        upstream.set_faults(error_rate=1.0, rpm=None)
        assert embed(upstream, input="x").status_code == 500

        faults = upstream.set_faults(error_rate=0.0)

        assert faults["error_rate"] == 0.0 and faults["rpm"] is None
        assert [embed(upstream, input="x").status_code for _ in range(3)] == [200, 200, 200]


def test_invalid_fault_values_are_rejected(upstream: RunningUpstream) -> None:
    response = upstream.client.post("/admin/faults", json={"error_rate": 2.0})

    assert response.status_code == 400
    assert "error_rate" in error_of(response)["message"]


def test_down_for_s_answers_503_then_recovers() -> None:
    with run_upstream(FAST) as upstream:
        upstream.set_faults(down_for_s=1.0)

        unavailable = embed(upstream, input="x")
        assert unavailable.status_code == 503
        assert error_of(unavailable)["type"] == "server_error"
        assert int(unavailable.headers["Retry-After"]) >= 1

        deadline = time.monotonic() + 10
        while (status := embed(upstream, input="x").status_code) == 503 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert status == 200
        assert upstream.stats()["unavailable_503"] >= 1


@contextlib.asynccontextmanager
async def in_process(config: UpstreamConfig) -> AsyncIterator[httpx.AsyncClient]:
    """The simulated upstream's app on this test's loop (looptime's clock: its latencies are loop sleeps)."""
    transport = httpx.ASGITransport(app=create_app(config))
    async with httpx.AsyncClient(transport=transport, base_url="http://upstream") as client:
        yield client


async def embed_in_process(client: httpx.AsyncClient, **body: Any) -> httpx.Response:
    return await client.post("/v1/embeddings", json={"model": "sim-embed", **body})


@pytest.mark.looptime
async def test_slow_marker_adds_slow_ms_to_its_call() -> None:
    async with in_process(fast(slow_marker="SLOW", slow_ms=300)) as client:
        loop = asyncio.get_running_loop()
        for texts, took_s in ((["quick"], 0.001), (["quick", "SLOW one"], 0.301), (["quick"], 0.001)):
            started = loop.time()
            response = await embed_in_process(client, input=texts)
            assert response.status_code == 200
            assert loop.time() - started == pytest.approx(took_s, abs=1e-6)


@pytest.mark.looptime
async def test_calls_beyond_max_concurrency_wait_for_a_slot() -> None:
    async with in_process(fast(base_latency_ms=100, max_concurrency=1)) as client:
        loop = asyncio.get_running_loop()
        started = loop.time()

        async def call(i: int) -> tuple[int, float]:
            response = await embed_in_process(client, input=f"text {i}")
            return response.status_code, loop.time() - started

        answers = await asyncio.gather(*(call(i) for i in range(3)))

        assert answers == [(200, pytest.approx(0.1)), (200, pytest.approx(0.2)), (200, pytest.approx(0.3))]
        stats = (await client.get("/stats")).json()
        assert stats["max_concurrent_seen"] == 3  # it counts the two callers waiting for the slot too


@pytest.mark.looptime
async def test_text_call_ms_sums_each_billed_texts_call_time_without_its_wait_for_a_slot() -> None:
    async with in_process(fast(base_latency_ms=100, max_concurrency=1)) as client:
        answers = await asyncio.gather(embed_in_process(client, input=["a", "b"]), embed_in_process(client, input="c"))

        assert [answer.status_code for answer in answers] == [200, 200]
        stats = (await client.get("/stats")).json()
        # two texts in a call of 100 ms, one in a call of 100 ms that waited 100 ms for the slot first
        assert stats["text_call_ms"] == pytest.approx(300)


def test_stats_count_calls_items_and_tokens_billed_and_reset() -> None:
    with run_upstream(fast(fail_marker="BAD")) as upstream:
        embed(upstream, input=["a", "b", "c"])
        embed(upstream, input="d")
        embed(upstream, input=["BAD"])

        stats = upstream.stats()
        assert stats["calls"] == 3
        assert stats["items_billed"] == 4
        assert stats["tokens_billed"] == 4
        assert stats["failed_400"] == 1
        assert stats["batch_size"] == {"count": 2, "mean": 2.0, "max": 3}

        assert upstream.reset()["calls"] == 0
        assert upstream.stats()["items_billed"] == 0


def test_api_key_is_required_when_configured() -> None:
    with run_upstream(fast(api_key="secret")) as upstream:
        body = {"model": "m", "input": "x"}

        missing = upstream.client.post("/v1/embeddings", json=body)
        wrong = upstream.client.post("/v1/embeddings", json=body, headers={"Authorization": "Bearer nope"})
        right = upstream.client.post("/v1/embeddings", json=body, headers={"Authorization": "Bearer secret"})

        assert (missing.status_code, wrong.status_code, right.status_code) == (401, 401, 200)
        assert error_of(missing)["code"] == "invalid_api_key"


def test_cli_has_a_flag_for_every_config_field() -> None:
    wanted = UpstreamConfig(dim=8, base_latency_ms=5.5, per_token_ms=0.5, jitter=0.1, max_concurrency=3, rpm=600,
                            tpm=1000, error_rate=0.25, max_input_tokens=100, fail_marker="X", slow_marker="S",
                            slow_rate=0.5, slow_ms=20.0, api_key="k", seed=7, batch_delay_s=0.5, batch_error_rate=0.1)
    config_fields = dataclasses.fields(UpstreamConfig)
    assert all(getattr(wanted, f.name) != f.default for f in config_fields)  # every field set away from its default
    argv = [part for f in config_fields for part in (f"--{f.name.replace('_', '-')}", str(getattr(wanted, f.name)))]

    args, config = parse_args(["--port", "9000", *argv])

    assert args.port == 9000 and args.host == "127.0.0.1"
    assert config == wanted
    assert parse_args(["--rpm", "none", "--tpm", "None"])[1] == UpstreamConfig(rpm=None, tpm=None)


@pytest.mark.parametrize(
    "bad", [{"dim": 0}, {"error_rate": 1.5}, {"max_concurrency": 0}, {"rpm": 0}, {"fail_marker": ""}]
)
def test_invalid_config_is_refused(bad: dict[str, Any]) -> None:
    with pytest.raises(ValueError):
        UpstreamConfig(**bad)


def test_hash_embedding_is_deterministic_unit_float32_and_input_specific() -> None:
    vector = hash_embedding("text", 64)

    assert vector.dtype == np.float32 and vector.shape == (64,)
    assert np.linalg.norm(vector) == pytest.approx(1.0, abs=1e-6)
    np.testing.assert_array_equal(vector, hash_embedding("text", 64))
    assert matches("text", vector, 64)
    assert not matches("other text", vector, 64)
    assert not matches([1, 2], hash_embedding([2, 1], 64), 64)

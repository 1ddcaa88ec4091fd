"""Bad input: whatever a client sends, the answer is a result or a 4xx in OpenAI's shape, never a 500.

Fuzzed in process (hypothesis against the ingress's FastAPI app, a real ``EmbeddingModel`` and the simulated
upstream's app, no Ray), then the limits checked once over HTTP through the real Serve proxy.
"""

from __future__ import annotations

import json
from typing import Any, Iterator

import httpx
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from deployments.config import DEFAULT_MAX_BODY_BYTES, MAX_INPUTS
from deployments.model import tokens
from load.hashvec import matches
from load.upstream import UpstreamConfig

from .cluster import DIM, POISON
from .inprocess import InProcessService
from .scale import current_scale
from .scenarios import Target, UPSTREAM_MAX_INPUT_TOKENS
from .traffic import OPENAI_ERROR_FIELDS

MODEL = "fuzz-model"
SMALL_BODY_LIMIT = 64 * 1024
EXAMPLES = current_scale().fuzz_examples
FUZZ = settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                       HealthCheck.function_scoped_fixture])


@pytest.fixture(scope="module")
def service() -> Iterator[InProcessService]:
    entry = {"name": MODEL, "upstream_model": "text-embedding-3-small", "max_input_tokens": UPSTREAM_MAX_INPUT_TOKENS,
             "batching": {"max_batch_size": 64, "max_wait_ms": 1, "max_retries": 1, "max_queue_depth": 4096}}
    upstream = UpstreamConfig(base_latency_ms=0, per_token_ms=0, jitter=0, fail_marker=POISON,
                              max_input_tokens=UPSTREAM_MAX_INPUT_TOKENS)
    with InProcessService(entry, upstream, max_body_bytes=SMALL_BODY_LIMIT) as running:
        yield running


def assert_openai_answer(response: httpx.Response, request_body: Any = None, *,
                         errors: tuple[int, ...] = (400, 401, 404, 405, 413)) -> None:
    """200 with a well-formed result, or an error status from ``errors`` (4xx: the caller's fault, never a 5xx)
    whose body is OpenAI's error shape."""
    assert response.status_code in (200, *errors), (response.status_code, response.text[:500], repr(request_body)[:500])
    if response.status_code == 200:
        body = response.json()
        assert body["object"] == "list" and body["usage"]["prompt_tokens"] == body["usage"]["total_tokens"]
        assert [entry["index"] for entry in body["data"]] == list(range(len(body["data"])))
        return
    assert response.headers["content-type"].startswith("application/json")
    error = response.json()["error"]
    assert set(error) == OPENAI_ERROR_FIELDS and isinstance(error["message"], str) and error["message"]
    assert error["type"] == ("invalid_request_error" if response.status_code < 500 else "timeout_error")


# ---- strategies -----------------------------------------------------------------------------------------------

any_character = st.characters(codec=None, categories=None)  # every code point, lone surrogates included
texts = st.text(max_size=40) | st.text(alphabet=any_character, max_size=40) | st.sampled_from(
    ["", " ", "\x00", "\ud800", "a\udfffb", "😀" * 5, f"bad {POISON}", "word " * (UPSTREAM_MAX_INPUT_TOKENS + 5)])
token_ids = st.integers(min_value=-2**70, max_value=2**70) | st.integers(min_value=0, max_value=200_000)
json_scalars = st.none() | st.booleans() | st.floats(allow_nan=False) | st.integers() | texts
json_values = st.recursive(json_scalars, lambda inner: st.lists(inner, max_size=4)
                           | st.dictionaries(texts, inner, max_size=4), max_leaves=12)
inputs = st.one_of(
    texts,
    st.lists(texts, max_size=6),
    st.lists(token_ids, max_size=8),
    st.lists(st.lists(token_ids, max_size=6), max_size=4),
    json_values,
)
dimensions = st.none() | st.integers(min_value=-5, max_value=2**40) | st.sampled_from([True, 1.5, "384", [], {}])
bodies = st.fixed_dictionaries(
    {"input": inputs},
    optional={
        "model": st.just(MODEL) | texts | json_values,
        "encoding_format": st.sampled_from(["float", "base64", "hex", "", None, 1]),
        "dimensions": dimensions,
        "user": texts | json_values,
        "unknown_field": json_values,
    },
)


# ---- properties -----------------------------------------------------------------------------------------------

@FUZZ
@given(body=bodies)
def test_any_request_body_gets_an_openai_answer(service: InProcessService, body: dict[str, Any]) -> None:
    body.setdefault("model", MODEL)
    response = service.post(content=json.dumps(body).encode("utf-8"), headers={"content-type": "application/json"})
    assert_openai_answer(response, body)
    if response.status_code == 200:  # then every vector is its own input's
        items = body["input"] if isinstance(body["input"], list) and body["input"] and not isinstance(
            body["input"][0], int) else [body["input"]]
        data = response.json()["data"]
        assert len(data) == len(items)
        for item, entry in zip(items, data):
            vector = entry["embedding"]
            if isinstance(vector, str):
                import base64
                vector = np.frombuffer(base64.b64decode(vector), dtype="<f4")
            assert matches(item, vector, DIM)


@FUZZ
@given(value=json_values)
def test_any_json_document_gets_an_openai_answer(service: InProcessService, value: Any) -> None:
    response = service.post(content=json.dumps(value).encode("utf-8"))
    assert_openai_answer(response, value)


@FUZZ
@given(raw=st.binary(max_size=200) | st.builds(lambda b: b'{"model": "fuzz-model", "input": "' + b + b'"}',
                                                   st.binary(max_size=20)))
def test_any_bytes_get_an_openai_answer(service: InProcessService, raw: bytes) -> None:
    assert_openai_answer(service.post(content=raw), raw)


header_values = st.text(alphabet=st.characters(min_codepoint=0x20, max_codepoint=0x7E), max_size=12) | st.sampled_from(
    ["nan", "inf", "-inf", "1e309", "-0", "0", "1e-320", "0x10", " 5 ", "LOW", "High", "1e308"])


@FUZZ
@given(timeout=header_values, priority=header_values)
def test_any_deadline_and_priority_header_gets_an_answer(service: InProcessService, timeout: str,
                                                         priority: str) -> None:
    response = service.post(json={"model": MODEL, "input": "headers"},
                            headers={"X-Request-Timeout": timeout, "X-Priority": priority})
    assert_openai_answer(response, errors=(400, 504))  # 504: a deadline too short to meet


# ---- the limits, pinned -------------------------------------------------------------------------------------

def test_2048_inputs_are_served_and_2049_refused(service: InProcessService) -> None:
    texts_ = [f"item {i}" for i in range(MAX_INPUTS)]
    big_service_limit = service.post(json={"model": MODEL, "input": texts_})
    assert big_service_limit.status_code in (200, 413)  # this instance's body limit is small; see the HTTP test
    ids = [[i % 1000 + 1] for i in range(MAX_INPUTS)]
    ok = service.post(json={"model": MODEL, "input": ids})
    assert ok.status_code == 200 and len(ok.json()["data"]) == MAX_INPUTS
    refused = service.post(json={"model": MODEL, "input": ids + [[1]]})
    assert refused.status_code == 400 and "2048" in refused.json()["error"]["message"]


def test_a_body_over_the_limit_is_a_413_whether_or_not_it_declares_its_length(service: InProcessService) -> None:
    oversized = json.dumps({"model": MODEL, "input": "x" * SMALL_BODY_LIMIT}).encode()
    declared = service.post(content=oversized)

    async def undeclared_chunks():
        for start in range(0, len(oversized), 4096):
            yield oversized[start:start + 4096]

    streamed = service.post(content=undeclared_chunks())
    for response in (declared, streamed):
        assert response.status_code == 413, response.text[:200]
        assert response.json()["error"]["code"] == "request_too_large"
        assert_openai_answer(response)


def test_an_input_over_the_token_limit_fails_alone_naming_its_index(service: InProcessService) -> None:
    long_text = "word " * (UPSTREAM_MAX_INPUT_TOKENS + 1)
    response = service.post(json={"model": MODEL, "input": ["fine", long_text, "fine too"]})
    assert response.status_code == 400
    message = response.json()["error"]["message"]
    assert "input[1]" in message and str(UPSTREAM_MAX_INPUT_TOKENS) in message
    assert service.post(json={"model": MODEL, "input": ["fine", "fine too"]}).status_code == 200


@pytest.mark.parametrize("value, fragment", [
    ("", "empty"), (["ok", ""], "input[1]"), ([[1], []], "input[1]"), ([[5, -1]], "non-negative"),
    ([[2**64]], "input[0]"), ([[tokens.get_encoding().max_token_value + 1]], "input[0]"),
    (["ok", "\ud800"], "JSON"), (["ok", 7], "input"),  # a lone surrogate is not valid JSON text
])
def test_bad_inputs_are_400s_naming_the_input(service: InProcessService, value: Any, fragment: str) -> None:
    response = service.post(content=json.dumps({"model": MODEL, "input": value}).encode())
    assert response.status_code == 400, response.text[:300]
    assert fragment in response.json()["error"]["message"]
    assert_openai_answer(response)


def test_invalid_utf8_and_unknown_fields(service: InProcessService) -> None:
    invalid = service.post(content=b'{"model": "fuzz-model", "input": "caf\xe9"}')
    assert invalid.status_code == 400 and "JSON" in invalid.json()["error"]["message"]
    tolerated = service.post(json={"model": MODEL, "input": "hi", "future_option": {"x": 1}, "user": "u"})
    assert tolerated.status_code == 200


# ---- over HTTP through the Serve proxy ------------------------------------------------------------------------

@pytest.mark.integration
def test_the_limits_hold_through_the_serve_proxy(faults: Target) -> None:
    headers = {"Authorization": f"Bearer {faults.api_key}"}
    with httpx.Client(timeout=120) as client:
        full = client.post(faults.url, json={"model": faults.model, "input": [f"n{i}" for i in range(MAX_INPUTS)]},
                           headers=headers)
        assert full.status_code == 200 and len(full.json()["data"]) == MAX_INPUTS
        too_many = client.post(faults.url, json={"model": faults.model, "input": ["x"] * (MAX_INPUTS + 1)},
                               headers=headers)
        assert too_many.status_code == 400 and too_many.json()["error"]["param"] == "input"
        padding = DEFAULT_MAX_BODY_BYTES
        oversized = b'{"model": "rel-faults", "input": "' + b"x" * padding + b'"}'
        assert len(oversized) > DEFAULT_MAX_BODY_BYTES
        too_big = client.post(faults.url, content=oversized, headers=headers)
        assert too_big.status_code == 413 and too_big.json()["error"]["code"] == "request_too_large"
        invalid = client.post(faults.url, content=b'{"model": "rel-faults", "input": "\xff\xfe"}', headers=headers)
        assert invalid.status_code == 400 and set(invalid.json()["error"]) == OPENAI_ERROR_FIELDS
        surrogate = client.post(faults.url, content=b'{"model": "rel-faults", "input": "\\ud800"}', headers=headers)
        assert surrogate.status_code == 400 and set(surrogate.json()["error"]) == OPENAI_ERROR_FIELDS


# ---- the local model's limit ----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def local_backend():
    from deployments.model.backends.local import LocalBackend

    backend = LocalBackend()
    yield backend
    import asyncio

    asyncio.run(backend.aclose())


def test_the_local_model_truncates_long_inputs_at_256_word_pieces(local_backend) -> None:
    import asyncio

    from transformers import AutoTokenizer

    from deployments.model.backends.model_dir import packaged_model_path

    reference = AutoTokenizer.from_pretrained(packaged_model_path(), local_files_only=True)
    long_text = " ".join(f"token{i % 50} lighthouse" for i in range(300))
    pieces = reference(long_text, add_special_tokens=False)["input_ids"]
    assert len(pieces) > 600
    (prepared,) = asyncio.run(local_backend.prepare_many([long_text]))
    # 256 positions with [CLS] and [SEP]: the first 254 word pieces, and usage counts what was embedded
    assert prepared.content == (reference.cls_token_id, *pieces[:254], reference.sep_token_id)
    assert prepared.tokens == 254
    head = reference.decode(pieces[:254])
    (head_prepared,) = asyncio.run(local_backend.prepare_many([head]))
    long_vector, head_vector = asyncio.run(local_backend.embed([prepared.content, head_prepared.content]))
    assert float(long_vector @ head_vector) > 0.999  # the tail was cut, not an error

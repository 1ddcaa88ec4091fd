"""The OpenAI wire format, API-key auth and the offline token encodings, without Ray."""

from __future__ import annotations

import base64
import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from batching import Priority
from deployments.errors import AuthenticationFailed, InvalidRequest
from deployments.ingress.auth import ApiKeys
from deployments.ingress.openai_errors import error_body, http_error
from deployments.ingress.schemas import (embedding_response, normalize_input, parse_priority, parse_request,
                                         parse_timeout)
from deployments.model import tokens


def request(**body) -> bytes:
    return json.dumps({"model": "m", **body}).encode()


@pytest.mark.parametrize("value, items", [
    ("one text", ["one text"]),
    (["a", "b"], ["a", "b"]),
    ([1, 2, 3], [[1, 2, 3]]),
    ([[1, 2], [3]], [[1, 2], [3]]),
])
def test_every_input_shape_becomes_a_list_of_items(value, items) -> None:
    assert parse_request(request(input=value)).input == items


@pytest.mark.parametrize("value, fragment", [
    ("", "empty or whitespace-only string"),
    (" \n\t", "empty or whitespace-only string"),
    ([], "must be a non-empty string"),
    (["a", ""], "input[1]' must hold text"),
    (["a", "   "], "input[1]' must hold text"),
    ([[1], []], "input[1]' must not be an empty array"),
    (["a", 1], "all be strings"),
    ([[1, -2]], "non-negative integer"),
    ([True, False], "must be"),
    (None, "must be"),
    (["x"] * 2049, "at most 2048"),
])
def test_malformed_input_is_a_400_naming_input(value, fragment) -> None:
    with pytest.raises(InvalidRequest) as caught:
        parse_request(request(input=value))
    assert caught.value.param == "input" and http_error(caught.value).status == 400
    assert fragment in caught.value.message


@pytest.mark.parametrize("value, index", [(["a", ""], 1), (["a", "b", "  "], 2), ([[1], []], 1), ([[3], [1, -2]], 1)])
def test_a_malformed_item_is_named_in_param(value, index) -> None:
    with pytest.raises(InvalidRequest) as caught:
        parse_request(request(input=value))
    assert error_body(caught.value)["error"]["param"] == f"input[{index}]"


def test_2048_inputs_are_accepted() -> None:
    assert len(normalize_input(["x"] * 2048)) == 2048


@pytest.mark.parametrize("body, param", [
    (b"{not json", None),
    (b"[]", None),
    (json.dumps({"input": "x"}).encode(), "model"),
    (request(input="x", encoding_format="hex"), "encoding_format"),
    (request(input="x", dimensions=0), "dimensions"),
    (request(input="x", dimensions="384"), "dimensions"),
])
def test_other_malformed_bodies_are_400s(body, param) -> None:
    with pytest.raises(InvalidRequest) as caught:
        parse_request(body)
    assert caught.value.param == param
    assert error_body(caught.value)["error"] == {"message": caught.value.message, "type": "invalid_request_error",
                                                 "param": param, "code": None}


def test_unknown_fields_are_tolerated() -> None:
    parsed = parse_request(request(input="x", user="u-1", something_new={"a": 1}))
    assert parsed.encoding_format == "float" and parsed.user == "u-1"


@pytest.mark.parametrize("width", [5, 6, 384], ids=["row-by-row", "one-buffer", "minilm"])
def test_base64_is_little_endian_float32_and_agrees_with_float(width: int) -> None:
    vectors = np.random.default_rng(0).standard_normal((3, width)).astype(np.float32)
    as_float = json.loads(embedding_response("m", vectors, [2, 3, 4], "float"))
    as_base64 = json.loads(embedding_response("m", vectors, [2, 3, 4], "base64"))
    for i, (f, b) in enumerate(zip(as_float["data"], as_base64["data"])):
        assert f["index"] == b["index"] == i and f["object"] == "embedding"
        decoded = np.frombuffer(base64.b64decode(b["embedding"]), dtype="<f4")
        np.testing.assert_array_equal(decoded, vectors[i])
        np.testing.assert_array_equal(np.asarray(f["embedding"], dtype=np.float32), vectors[i])
    assert as_float["usage"] == {"prompt_tokens": 9, "total_tokens": 9}
    assert as_float["object"] == "list" and as_float["model"] == "m"


def test_priority_and_timeout_headers() -> None:
    assert parse_priority(None) is None and parse_priority("LOW") is Priority.LOW  # None: the key's highest
    assert parse_timeout(None) is None and parse_timeout("2.5") == 2.5
    for bad in ("urgent", ""):
        with pytest.raises(InvalidRequest):
            parse_priority(bad)
    assert parse_timeout(" 10 ") == 10 and parse_timeout(".5") == 0.5
    for bad in ("0", "-1", "soon", "nan", "inf", "5_0", "1e3", "+2", "0x10"):
        with pytest.raises(InvalidRequest):
            parse_timeout(bad)


def test_error_messages_quote_at_most_a_short_prefix_of_the_callers_text() -> None:
    with pytest.raises(InvalidRequest) as caught:
        parse_priority("x" * 1_000_000)
    assert len(caught.value.message) < 200 and "1,000,000 characters" in caught.value.message


def test_without_configured_keys_no_key_is_needed() -> None:
    ApiKeys.from_env({}).check(None)
    ApiKeys.from_env({"EMBEDDINGS_API_KEYS": " , "}).check(None)


def test_a_configured_key_is_required() -> None:
    keys = ApiKeys.from_env({"EMBEDDINGS_API_KEYS": "first-key, second-key"})
    keys.check("Bearer first-key")
    keys.check("bearer second-key")
    for bad in (None, "", "Bearer", "Bearer wrong", "Basic first-key", "first-key", "Bearer first-keyX", "Bearer ключ"):
        with pytest.raises(AuthenticationFailed) as caught:
            keys.check(bad)
        assert http_error(caught.value).status == 401 and "first-key" not in caught.value.message


def test_token_ids_decode_back_to_their_text() -> None:
    text = "Embeddings, offline: naïve café ☕"
    ids = tokens.encode(text)
    assert tokens.decode(ids) == text
    assert tokens.count(text) == len(ids)
    assert tokens.encode("<|endoftext|>") != [100257]  # special-token text is ordinary text


@settings(max_examples=300, deadline=None)
@given(text=st.text(), encoding=st.sampled_from(["cl100k_base", "o200k_base"]))
def test_counting_tokens_agrees_with_encoding_them(text: str, encoding: str) -> None:
    # any text: special-token text, lone surrogates (replaced before encoding), whitespace runs, emoji
    assert tokens.count(text, encoding) == len(tokens.encode(text, encoding))


@pytest.mark.parametrize("ids", [[100256], [-1], [10**9], [1, "2"], [True]])
def test_ids_that_are_not_cl100k_tokens_are_refused(ids) -> None:
    with pytest.raises(tokens.TokenDecodeError):
        tokens.decode(ids)


def test_newer_openai_models_count_in_o200k() -> None:
    assert tokens.encoding_name_for_model("gpt-4o") == "o200k_base"
    assert tokens.encoding_name_for_model("text-embedding-3-small") == "cl100k_base"
    assert tokens.encoding_name_for_model("some-self-hosted-model") == "cl100k_base"

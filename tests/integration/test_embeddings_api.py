"""The default application (serve_config.yaml, local all-MiniLM-L6-v2) over HTTP with the official openai client."""

from __future__ import annotations

import asyncio
import base64
import io
import time

import numpy as np
import openai
import orjson
import pytest
from ray import serve

from deployments.model import tokens

from .helpers import API_KEYS, APP_NAME, MODEL, Service

pytestmark = pytest.mark.integration


def as_array(response) -> np.ndarray:
    return np.asarray([entry.embedding for entry in response.data], dtype=np.float32)


def test_base64_default_and_float_agree(embeddings_app: Service) -> None:
    client = embeddings_app.client()
    texts = ["The openai client asks for base64 unless told otherwise.", "Floats come back as JSON numbers."]
    default = client.embeddings.create(model=MODEL, input=texts)
    floats = client.embeddings.create(model=MODEL, input=texts, encoding_format="float")
    np.testing.assert_allclose(as_array(default), as_array(floats), atol=1e-6)
    raw = client.embeddings.create(model=MODEL, input=texts, encoding_format="base64")
    decoded = np.stack([np.frombuffer(base64.b64decode(entry.embedding), dtype="<f4") for entry in raw.data])
    np.testing.assert_allclose(decoded, as_array(floats), atol=1e-6)
    assert default.model == MODEL and default.usage.prompt_tokens == default.usage.total_tokens > 0


def test_vectors_are_384_dimensional_unit_length_and_meaningful(embeddings_app: Service) -> None:
    response = embeddings_app.client().embeddings.create(model=MODEL, input=[
        "A man is playing a guitar on stage.",
        "Someone performs music with a guitar in front of an audience.",
        "The quarterly tax report is due next Monday.",
    ])
    vectors = as_array(response)
    assert vectors.shape == (3, 384)
    np.testing.assert_allclose(np.linalg.norm(vectors, axis=1), 1.0, atol=1e-5)
    similar, unrelated = vectors[0] @ vectors[1], vectors[0] @ vectors[2]
    assert similar > unrelated + 0.3


def test_order_is_kept_for_300_inputs(embeddings_app: Service) -> None:
    client = embeddings_app.client()
    texts = [f"Item {i}: a note about {['rivers', 'engines', 'poetry', 'markets', 'birds'][i % 5]} number {i * 7}"
             for i in range(300)]
    forward = client.embeddings.create(model=MODEL, input=texts)
    backward = client.embeddings.create(model=MODEL, input=texts[::-1])
    assert [entry.index for entry in forward.data] == list(range(300))
    np.testing.assert_allclose(as_array(forward), as_array(backward)[::-1], atol=1e-5)
    for i in (0, 123, 299):
        single = client.embeddings.create(model=MODEL, input=texts[i])
        np.testing.assert_allclose(as_array(single)[0], as_array(forward)[i], atol=1e-5)


def test_cl100k_token_ids_embed_like_their_text(embeddings_app: Service) -> None:
    client = embeddings_app.client()
    texts = ["LangChain sends token ids by default.", "Ünïcödé survives the round trip ☕"]
    by_text = client.embeddings.create(model=MODEL, input=texts)
    by_ids = client.embeddings.create(model=MODEL, input=[tokens.encode(text) for text in texts])
    one_id_list = client.embeddings.create(model=MODEL, input=tokens.encode(texts[0]))
    np.testing.assert_allclose(as_array(by_ids), as_array(by_text), atol=1e-5)
    np.testing.assert_allclose(as_array(one_id_list)[0], as_array(by_text)[0], atol=1e-5)


def test_ids_that_are_not_tokens_are_a_400_asking_for_text(embeddings_app: Service) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        embeddings_app.client().embeddings.create(model=MODEL, input=[[15339], [100256]])
    error = caught.value.body
    assert "input[1]" in error["message"] and "text" in error["message"] and caught.value.param == "input[1]"


def test_an_unknown_model_is_a_404_model_not_found(embeddings_app: Service) -> None:
    with pytest.raises(openai.NotFoundError) as caught:
        embeddings_app.client().embeddings.create(model="no-such-model", input="hello")
    assert caught.value.code == "model_not_found"
    with pytest.raises(openai.NotFoundError):
        embeddings_app.client().models.retrieve("no-such-model")


@pytest.mark.parametrize("body, param", [
    (b'{"model": "all-MiniLM-L6-v2", "input": ""}', "input"),
    (b'{"model": "all-MiniLM-L6-v2", "input": []}', "input"),
    (b'{"model": "all-MiniLM-L6-v2", "input": ["ok", 3]}', "input"),
    (b'{"model": "all-MiniLM-L6-v2"}', "input"),
    (b'{"input": "no model"}', "model"),
    (b'{"model": "all-MiniLM-L6-v2", "input": "x", "encoding_format": "hex"}', "encoding_format"),
    (b'{"model": "all-MiniLM-L6-v2", "input": "x", "dimensions": 128}', "dimensions"),
    (b"{this is not json", None),
])
def test_malformed_bodies_are_400s_in_openai_shape(embeddings_app: Service, body: bytes, param) -> None:
    with embeddings_app.http() as http:
        response = http.post("/v1/embeddings", content=body, headers=_auth_headers())
    assert response.status_code == 400
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error" and error["param"] == param and error["message"]


def test_too_many_inputs_are_a_400(embeddings_app: Service) -> None:
    with pytest.raises(openai.BadRequestError, match="2048"):
        embeddings_app.client().embeddings.create(model=MODEL, input=["x"] * 2049)


def test_unknown_routes_and_methods_answer_in_openai_shape(embeddings_app: Service) -> None:
    with embeddings_app.http() as http:
        missing = http.get("/v1/nothing-here", headers=_auth_headers())
        wrong_method = http.get("/v1/embeddings", headers=_auth_headers())
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "not_found"
    assert wrong_method.status_code == 405 and set(wrong_method.json()["error"]) == {"message", "type", "param", "code"}


def test_the_api_key_is_enforced(embeddings_app: Service) -> None:
    with pytest.raises(openai.AuthenticationError) as caught:
        embeddings_app.client(api_key="wrong-key").embeddings.create(model=MODEL, input="hello")
    assert caught.value.code == "invalid_api_key" and "wrong-key" not in str(caught.value.body)
    with embeddings_app.http() as http:
        anonymous = http.post("/v1/embeddings", json={"model": MODEL, "input": "hello"})
        models = http.get("/v1/models")
        health = http.get("/healthz")
    assert anonymous.status_code == 401 and anonymous.json()["error"]["code"] == "invalid_api_key"
    assert models.status_code == 401
    assert health.status_code == 200 and health.json()["status"] == "ok"
    second_key = embeddings_app.client(api_key=API_KEYS[1]).embeddings.create(model=MODEL, input="hello")
    assert len(second_key.data) == 1


def test_models_are_listed(embeddings_app: Service) -> None:
    client = embeddings_app.client()
    assert [model.id for model in client.models.list().data] == [MODEL]
    model = client.models.retrieve(MODEL)
    assert model.id == MODEL and model.object == "model"


def test_low_priority_requests_are_served(embeddings_app: Service) -> None:
    client = embeddings_app.client()
    low = client.embeddings.create(model=MODEL, input=["background work"], extra_headers={"X-Priority": "low"})
    high = client.embeddings.create(model=MODEL, input=["background work"])
    np.testing.assert_allclose(as_array(low), as_array(high), atol=1e-6)
    with pytest.raises(openai.BadRequestError, match="X-Priority"):
        client.embeddings.create(model=MODEL, input="x", extra_headers={"X-Priority": "urgent"})


def test_an_expired_deadline_is_a_504(embeddings_app: Service) -> None:
    with embeddings_app.http() as http:
        response = http.post("/v1/embeddings", json={"model": MODEL, "input": "too late"},
                             headers={**_auth_headers(), "X-Request-Timeout": "0.0001"})
    assert response.status_code == 504 and response.json()["error"]["code"] == "deadline_exceeded"
    with embeddings_app.http() as http:
        bad = http.post("/v1/embeddings", json={"model": MODEL, "input": "x"},
                        headers={**_auth_headers(), "X-Request-Timeout": "soon"})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "X-Request-Timeout"


def test_concurrent_single_text_requests_are_merged(embeddings_app: Service, model_handle) -> None:
    before = _totals(model_handle)

    async def fire() -> list:
        client = embeddings_app.async_client()
        try:
            return await asyncio.gather(*(
                client.embeddings.create(model=MODEL, input=f"concurrent request number {i}") for i in range(64)
            ))
        finally:
            await client.close()

    responses = asyncio.run(fire())
    assert all(len(response.data) == 1 for response in responses)
    items, batches = (after - earlier for after, earlier in zip(_totals(model_handle), before))
    assert items == 64
    assert items / batches > 1, f"{items} inputs travelled in {batches} batches"


def test_another_deployment_can_call_the_model_through_its_handle(embeddings_app: Service) -> None:
    @serve.deployment(ray_actor_options={"num_cpus": 0})
    class Caller:
        def __init__(self) -> None:
            self._model = serve.get_deployment_handle(f"embed-{MODEL}", app_name=APP_NAME)

        async def __call__(self, texts: list[str]) -> tuple[tuple[int, ...], str, list[int]]:
            vectors, token_counts = await self._model.embed.remote(texts, priority="low", timeout_s=60)
            return vectors.shape, str(vectors.dtype), token_counts

    handle = serve.run(Caller.bind(), name="caller", route_prefix=None)
    try:
        shape, dtype, token_counts = handle.remote(["first", "second text"]).result(timeout_s=120)
    finally:
        serve.delete("caller")
    assert shape == (2, 384) and dtype == "float32"
    assert len(token_counts) == 2 and all(count > 0 for count in token_counts)


def _auth_headers() -> dict[str, str]:
    return {"Authorization": f"Bearer {API_KEYS[0]}"}


def _totals(model_handle) -> tuple[int, int]:
    stats = model_handle.stats.remote().result(timeout_s=60)
    return (sum(s.dispatched_items for s in stats.values()), sum(s.batches for s in stats.values()))


def test_the_openai_clients_batch_flow_gives_the_vectors_embeddings_gives(embeddings_app: Service) -> None:
    client = embeddings_app.client()
    texts = [f"document number {i} about ray serve and batching" for i in range(40)]
    lines = b"".join(orjson.dumps({"custom_id": f"doc-{i}", "method": "POST", "url": "/v1/embeddings",
                                   "body": {"model": MODEL, "input": text}}) + b"\n" for i, text in enumerate(texts))
    uploaded = client.files.create(file=("nightly.jsonl", io.BytesIO(lines + b'{"custom_id": "bad"}\n')),
                                   purpose="batch")
    batch = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/embeddings", completion_window="24h")
    deadline = time.monotonic() + 120  # a bound for a stuck batch, not a timing check
    while (batch := client.batches.retrieve(batch.id)).status not in ("completed", "failed", "cancelled"):
        assert time.monotonic() < deadline, batch
        time.sleep(0.2)
    assert batch.status == "completed" and batch.request_counts.failed == 1
    answered = [orjson.loads(raw) for raw in client.files.content(batch.output_file_id).content.splitlines()]
    assert [line["custom_id"] for line in answered] == [f"doc-{i}" for i in range(40)]
    batched = np.array([line["response"]["body"]["data"][0]["embedding"] for line in answered], dtype=np.float32)
    direct = np.array([d.embedding for d in client.embeddings.create(model=MODEL, input=texts).data],
                      dtype=np.float32)
    assert (batched * direct).sum(axis=1).min() >= 0.99999
    (bad,) = client.files.content(batch.error_file_id).content.splitlines()
    assert orjson.loads(bad)["custom_id"] == "bad" and orjson.loads(bad)["error"]["code"] == "invalid_method"
    assert embeddings_app.http().get("/v1/batches/batch_none",
                                      headers={"Authorization": f"Bearer {API_KEYS[0]}"}).status_code == 404

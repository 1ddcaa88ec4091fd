"""The local backend on the model shapes users bring (no Ray): CLS, mean + Dense, max / mean_sqrt_len / weightedmean
concatenated, and a decoder with last-token pooling and left padding; Normalize on and off; prompts; Matryoshka
sizes. Each is a small random-weight directory made here (``load.tiny_encoders``), and the reference is
sentence-transformers' own ``encode`` on the same directory."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import httpx
import numpy as np
import pytest

from batching import BatcherConfig, BatcherMetrics
from deployments.config import ConfigError, ModelConfig, parse_app_config
from deployments.ingress.api import create_api
from deployments.model.backends.local import LocalBackend
from deployments.model.backends.model_dir import ModelDir
from deployments.model.backends.prompts import Prompts, UnknownPrompt
from deployments.model.cache.keys import CacheKeys
from deployments.model.embedder import EmbeddingModel
from load.tiny_encoders import PROBES as TINY_PROBES
from load.tiny_encoders import TINY_ENCODERS, make_all, tokens_embedded
from tests.reliability.inprocess import InProcessHandle

ENGINES = ("torch", "onnx")
SPECS = {spec.name: spec for spec in TINY_ENCODERS}
PROBES = list(TINY_PROBES)


@pytest.fixture(scope="session")
def model_dirs(tmp_path_factory) -> dict[str, Path]:
    return make_all(tmp_path_factory.mktemp("tiny-encoders"))


@pytest.fixture(scope="session")
def onnx_cache(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("tiny-onnx-cache")


@pytest.fixture(scope="module")
def backends(model_dirs, onnx_cache):
    """One backend per directory and engine, made when first asked for."""
    made: dict[tuple[str, str], LocalBackend] = {}

    def backend(name: str, engine: str) -> LocalBackend:
        if (name, engine) not in made:
            made[name, engine] = LocalBackend(str(model_dirs[name]), engine=engine, threads=1,
                                              onnx_cache_dir=onnx_cache, matryoshka_dims=SPECS[name].matryoshka_dims)
        return made[name, engine]

    yield backend
    for made_backend in made.values():
        asyncio.run(made_backend.aclose())


@pytest.fixture(scope="module")
def references(model_dirs):
    from sentence_transformers import SentenceTransformer

    return {name: SentenceTransformer(str(path), device="cpu", local_files_only=True)
            for name, path in model_dirs.items()}


async def embedded(backend: LocalBackend, texts: list[str], prompt: str = "", dimensions: int | None = None):
    prepared = await backend.prepare_many(texts, prompt)
    return np.stack(await backend.embed([p.content for p in prepared], dimensions)), [p.tokens for p in prepared]


def cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return np.sum(a * b, axis=1) / np.linalg.norm(a, axis=1) / np.linalg.norm(b, axis=1)


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("name", SPECS)
async def test_every_pipeline_and_prompt_equals_sentence_transformers_encode(backends, references, name, engine):
    backend, reference, spec = backends(name, engine), references[name], SPECS[name]
    assert (backend.model.pooling, backend.model.normalize) == (
        (spec.pooling,) if isinstance(spec.pooling, str) else spec.pooling, spec.normalize)
    for prompt_name in (None, *spec.prompts):
        expected = reference.encode(PROBES, prompt_name=prompt_name)
        prompt = backend.prompts.choose(prompt_name)
        vectors, counts = await embedded(backend, PROBES, prompt)
        assert vectors.shape == (len(PROBES), spec.dimension)
        assert cosines(vectors, expected).min() >= 0.999, (prompt_name, cosines(vectors, expected))
        assert np.allclose(np.linalg.norm(vectors, axis=1), 1.0, atol=1e-5) == spec.normalize
        assert counts == tokens_embedded(reference, [prompt + text for text in PROBES])
        unit = expected / np.linalg.norm(expected, axis=1, keepdims=True)
        assert (unit @ unit.T).min() < 0.99  # the probes' vectors differ: a wrong pooling could not pass


@pytest.mark.parametrize("engine", ENGINES)
async def test_a_decoder_vector_does_not_depend_on_its_batch_with_left_padding(backends, engine) -> None:
    backend = backends("qwen2-lasttoken-left", engine)
    assert backend.model.left_padding
    alone, _ = await embedded(backend, PROBES[:1])
    with_longer, _ = await embedded(backend, PROBES)
    assert float(np.abs(alone[0] - with_longer[0]).max()) < 1e-5


@pytest.mark.parametrize("name", ["bert-mean-dense", "qwen2-lasttoken-left", "bert-cls-normalize"])
async def test_input_type_gets_what_encode_query_and_encode_document_use(backends, references, name) -> None:
    backend, reference = backends(name, "onnx"), references[name]
    for input_type, encode in (("query", reference.encode_query), ("document", reference.encode_document)):
        vectors, _ = await embedded(backend, PROBES, backend.prompts.choose(input_type=input_type))
        assert cosines(vectors, encode(PROBES)).min() >= 0.999, input_type


def test_a_model_of_query_and_passage_prompts_gets_passage_for_documents_and_no_default_unless_named() -> None:
    e5 = Prompts((("query", "query: "), ("passage", "passage: ")))  # an e5 directory saved before the "document" key
    chosen = [e5.choose(input_type="query"), e5.choose(input_type="document"), e5.choose()]
    assert chosen == ["query: ", "passage: ", ""]
    assert Prompts((("query", "q: "),), default_name="query").choose(input_type="document") == ""
    with pytest.raises(UnknownPrompt, match="prompt_name 'search'; this model's prompts are 'query', 'passage'"):
        e5.choose("search")
    with pytest.raises(UnknownPrompt, match="not both"):
        e5.choose("query", "query")
    with pytest.raises(UnknownPrompt, match="this model has no prompts"):
        Prompts(default_name="query")


async def test_the_default_prompt_is_the_models_unless_the_entry_names_another(model_dirs, references) -> None:
    name = "bert-mean-dense"
    reference = references[name]
    assert reference.default_prompt_name == "passage"
    plain = LocalBackend(str(model_dirs[name]), engine="torch", threads=1, warm_up=False)
    overridden = LocalBackend(str(model_dirs[name]), engine="torch", threads=1, warm_up=False,
                              default_prompt_name="query")
    try:
        assert (plain.prompts.choose(), overridden.prompts.choose()) == ("passage: ", "query: ")
        vectors, _ = await embedded(overridden, PROBES, overridden.prompts.choose())
        assert cosines(vectors, reference.encode(PROBES, prompt_name="query")).min() >= 0.999
    finally:
        await plain.aclose()
        await overridden.aclose()
    with pytest.raises(UnknownPrompt, match="'search'"):
        LocalBackend(str(model_dirs[name]), engine="torch", default_prompt_name="search", warm_up=False)


async def test_one_text_under_two_prompts_is_two_contents_and_two_cache_keys(backends) -> None:
    backend = backends("bert-mean-dense", "onnx")
    (query,), (passage,) = [await backend.prepare_many(["same text"], backend.prompts.text(name))
                            for name in ("query", "passage")]
    keys = CacheKeys("m", "identity", None)
    assert query.content != passage.content and keys.key(query.content) != keys.key(passage.content)


@pytest.mark.parametrize("engine", ENGINES)
async def test_a_matryoshka_size_is_the_vectors_head_normalised_again(backends, engine) -> None:
    backend = backends("bert-cls-normalize", engine)
    full, _ = await embedded(backend, PROBES)
    for size in (16, 8):
        short, _ = await embedded(backend, PROBES, dimensions=size)
        head = full[:, :size] / np.linalg.norm(full[:, :size], axis=1, keepdims=True)
        assert short.shape == (len(PROBES), size) and float(np.abs(short - head).max()) < 1e-6
    assert not backend.supports_dimensions(12) and backend.supports_dimensions(32)


def test_matryoshka_sizes_beyond_the_model_are_a_start_up_error(model_dirs) -> None:
    with pytest.raises(ValueError, match=r"matryoshka_dims \[64\] exceed the model's 32 dimensions"):
        LocalBackend(str(model_dirs["bert-cls-normalize"]), engine="torch", matryoshka_dims=(16, 64), warm_up=False)


@pytest.mark.parametrize(("entry", "problem"), [
    ({"matryoshka_dims": []}, "models[0].matryoshka_dims: must be a non-empty list of integers >= 1"),
    ({"matryoshka_dims": [256, 0]}, "models[0].matryoshka_dims: must be a non-empty list of integers >= 1"),
    ({"default_prompt_name": 3}, "models[0].default_prompt_name: must be a string"),
    ({"backend": "openai", "base_url": "http://127.0.0.1:9/v1", "default_prompt_name": "query"},
     "models[0].default_prompt_name: only the local backend takes this option"),
])
def test_prompt_and_matryoshka_settings_are_checked(entry: dict, problem: str) -> None:
    with pytest.raises(ConfigError, match=problem.replace("[", r"\[").replace("]", r"\]")):
        parse_app_config({"models": [{"name": "m", **entry}]})


def _write(folder: Path, files: dict[str, object]) -> Path:
    for name, content in files.items():
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_text(json.dumps(content))
    return folder


def _copy_with(source: Path, target: Path, changes: dict[str, object]) -> Path:
    import shutil

    shutil.copytree(source, target)
    return _write(target, changes)


@pytest.mark.parametrize(("changes", "refusal"), [
    ({"1_Pooling/config.json": {"embedding_dimension": 32, "pooling_mode": "cls", "include_prompt": False}},
     "Pooling include_prompt=False is not served"),
    ({"1_Pooling/config.json": {"embedding_dimension": 32, "pooling_mode": "median"}},
     "Pooling pooling_mode median is not served"),
    ({"modules.json": [{"path": "", "type": "sentence_transformers.models.Transformer"},
                       {"path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
                       {"path": "2_LayerNorm", "type": "sentence_transformers.models.LayerNorm"}]},
     r"module 2 \(LayerNorm\) is not served"),
    ({"modules.json": [{"path": "", "type": "sentence_transformers.models.Transformer"},
                       {"path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
                       {"path": "3_Normalize", "type": "sentence_transformers.models.Normalize"},
                       {"path": "2_Dense", "type": "sentence_transformers.models.Dense"}]},
     r"module 2 \(Normalize\) is not served"),
])
def test_what_the_backend_cannot_serve_is_refused_naming_the_module_and_setting(
    model_dirs, tmp_path, changes, refusal
) -> None:
    with pytest.raises(ValueError, match=refusal):
        ModelDir.read(_copy_with(model_dirs["bert-cls-normalize"], tmp_path / "model", changes))


def test_a_dense_layer_with_an_activation_from_outside_torch_is_refused(model_dirs, tmp_path) -> None:
    dense = {"in_features": 32, "out_features": 24, "bias": True, "activation_function": "mypackage.Swish"}
    with pytest.raises(ValueError, match=r"Dense activation_function='mypackage.Swish' is not served"):
        ModelDir.read(_copy_with(model_dirs["bert-mean-dense"], tmp_path / "model", {"2_Dense/config.json": dense}))


def served(model_dirs, onnx_cache, name: str) -> EmbeddingModel:
    """An ``EmbeddingModel`` of its own (closing it closes its backend) on the cached export."""
    backend = LocalBackend(str(model_dirs[name]), threads=1, onnx_cache_dir=onnx_cache, warm_up=False)
    return EmbeddingModel(ModelConfig(name=name, batcher=BatcherConfig(max_wait_ms=1.0)), backend=backend,
                          metrics=BatcherMetrics())


async def test_the_http_api_takes_prompt_name_and_input_type_and_counts_the_prompts_tokens(
    model_dirs, onnx_cache, references
) -> None:
    name = "bert-mean-dense"
    model = served(model_dirs, onnx_cache, name)
    api = create_api({name: InProcessHandle(model)})
    texts = PROBES[:3]
    try:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=api), base_url="http://service") as client:
            async def post(**extra):
                return await client.post("/v1/embeddings", json={"model": name, "input": texts, **extra})

            for extra, prompt_name in (({}, "passage"), ({"prompt_name": "query"}, "query"),
                                       ({"input_type": "query"}, "query")):
                response = await post(**extra)
                assert response.status_code == 200, response.text
                body = response.json()
                vectors = np.array([entry["embedding"] for entry in body["data"]], dtype=np.float32)
                reference = references[name]
                assert cosines(vectors, reference.encode(texts, prompt_name=prompt_name)).min() >= 0.999
                prompt = reference.prompts[prompt_name]
                assert body["usage"]["prompt_tokens"] == sum(tokens_embedded(reference, [prompt + t for t in texts]))
            unknown = await post(prompt_name="search")
            assert unknown.status_code == 400 and unknown.json()["error"]["param"] == "prompt_name"
            message = unknown.json()["error"]["message"]
            assert "unknown prompt_name 'search'" in message and all(f"'{n}'" in message for n in reference.prompts)
            wrong_type = await post(input_type="question")
            assert wrong_type.status_code == 400 and wrong_type.json()["error"]["param"] == "input_type"
    finally:
        await model.aclose()


async def test_the_handle_call_takes_prompt_name(model_dirs, onnx_cache, references) -> None:
    name = "qwen2-lasttoken-left"
    model = served(model_dirs, onnx_cache, name)
    try:
        vectors, counts = await model.embed(PROBES[:2], prompt_name="query")
    finally:
        await model.aclose()
    reference = references[name]
    assert cosines(vectors, reference.encode(PROBES[:2], prompt_name="query")).min() >= 0.999
    assert counts == tokens_embedded(reference, [reference.prompts["query"] + text for text in PROBES[:2]])

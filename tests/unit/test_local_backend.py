"""The local backend on the packaged all-MiniLM-L6-v2 (no Ray): tokenized once, truncated as sentence-transformers
truncates, and the torch and onnx engines equal to ``SentenceTransformer.encode``."""

from __future__ import annotations

import asyncio
import os
import random
import threading
from pathlib import Path

import numpy as np
import pytest

from deployments.config import ConfigError, parse_app_config
from deployments.model import tokens
from deployments.model.backends import ItemRejected, Prepared
from deployments.model.backends.engines import EngineInterrupted, default_threads
from deployments.model.backends.local import LocalBackend
from deployments.model.backends.model_dir import ModelDir, packaged_model_path
from deployments.model.backends.onnx_engine import cached_export
from deployments.model.backends.wordpieces import BoundedTokenizer
from load.workload import pseudo_sentences

MAX_SEQ_LENGTH = 256
HUGE = " ".join(pseudo_sentences(4_000, 124, seed=7))[:500_000]
PROBES = [
    "hello", "", "The lighthouse keeper counted the ships.", "Ünïcödé, accents and 東京タワー",
    "a " * 400, "numbers 3.14159 and e-mail@example.com!", *pseudo_sentences(26, 150, seed=3),
]


@pytest.fixture(scope="module")
def sentence_transformer():
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(packaged_model_path(), device="cpu", local_files_only=True)


@pytest.fixture(scope="module")
def onnx_cache(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("onnx-cache")


@pytest.fixture(scope="module")
def torch_backend():
    backend = LocalBackend(engine="torch")
    yield backend
    asyncio.run(backend.aclose())


@pytest.fixture(scope="module")
def onnx_backend(onnx_cache):
    backend = LocalBackend(engine="onnx", onnx_cache_dir=onnx_cache)
    yield backend
    asyncio.run(backend.aclose())


def reference_ids(sentence_transformer, texts: list[str]) -> list[list[int]]:
    return sentence_transformer.tokenizer(texts, truncation=True, max_length=MAX_SEQ_LENGTH)["input_ids"]


async def vectors_of(backend: LocalBackend, texts: list[str]) -> np.ndarray:
    prepared = await backend.prepare_many(texts)
    return np.stack(await backend.embed([p.content for p in prepared]))


def min_cosine(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.min(np.sum(a * b, axis=1) / np.linalg.norm(a, axis=1) / np.linalg.norm(b, axis=1)))


async def test_a_huge_text_is_prepared_from_its_head_and_truncated_to_max_seq_length(
    onnx_backend, sentence_transformer
) -> None:
    assert onnx_backend.model.max_seq_length == MAX_SEQ_LENGTH == sentence_transformer.max_seq_length
    read_before = onnx_backend.wordpieces.chars_tokenized
    (prepared,) = await onnx_backend.prepare_many([HUGE])
    assert len(HUGE) == 500_000
    assert onnx_backend.wordpieces.chars_tokenized - read_before <= onnx_backend.wordpieces.head_chars < 5_000
    assert list(prepared.content) == reference_ids(sentence_transformer, [HUGE])[0]
    assert len(prepared.content) == MAX_SEQ_LENGTH and prepared.tokens == MAX_SEQ_LENGTH - 2  # [CLS], [SEP] free


async def test_embed_uses_the_prepared_ids_without_tokenizing_again(onnx_backend, sentence_transformer) -> None:
    prepared = await onnx_backend.prepare_many(PROBES)
    assert [list(p.content) for p in prepared] == reference_ids(sentence_transformer, PROBES)
    assert [p.tokens for p in prepared] == [len(ids) - 2 for ids in reference_ids(sentence_transformer, PROBES)]
    read_before = onnx_backend.wordpieces.chars_tokenized
    vectors = await onnx_backend.embed([p.content for p in prepared])
    assert onnx_backend.wordpieces.chars_tokenized == read_before
    assert len(vectors) == len(PROBES) and all(v.shape == (384,) and v.dtype == np.float32 for v in vectors)


def test_reading_only_a_head_never_changes_the_ids(sentence_transformer) -> None:
    """Texts built to trip the head cut: whitespace runs, a control character BERT deletes, combining marks,
    CJK, over-long words, text without spaces."""
    model = ModelDir.read(packaged_model_path())
    wordpieces = BoundedTokenizer(model.tokenizer_file, model.max_seq_length)
    rng = random.Random(1)
    pieces = list("abcdefgh ,.;!?\n\t\r\x1c\u00e9\u0301\u6771\u4eac\u0130") + ["   ", "supercalifragilistic", "x" * 120]
    texts = ["".join(rng.choice(pieces) for _ in range(rng.randint(0, 9_000))) for _ in range(150)]
    texts += ["a" + " " * 20_000 + "b c d", "東京" * 5_000, "x" * 10_000 + " y", "word " * 3_000]
    assert [list(ids) for ids in wordpieces.encode_many(texts)] == reference_ids(sentence_transformer, texts)
    assert wordpieces.chars_tokenized < sum(map(len, texts))  # the cut did apply


async def test_a_huge_text_prepared_while_a_batch_runs_leaves_the_batch_right(
    torch_backend, sentence_transformer
) -> None:
    """The old backend shared the tokenizer's truncation between counting and encoding, so this failed the batch
    (``The size of tensor a (500002) must match the size of tensor b (512)``) or returned wrong vectors."""
    small = [f"a short request number {i}" for i in range(24)]
    contents = [p.content for p in await torch_backend.prepare_many(small)]
    outcomes = await asyncio.gather(
        *(torch_backend.embed(contents) for _ in range(3)),
        *(torch_backend.prepare_many([HUGE, *small]) for _ in range(3)),
    )
    expected = sentence_transformer.encode(small, normalize_embeddings=True)
    for vectors in outcomes[:3]:
        assert min_cosine(np.stack(vectors), expected) > 0.9999
    for prepared in outcomes[3:]:
        assert prepared[0].tokens == MAX_SEQ_LENGTH - 2 and [p.content for p in prepared[1:]] == contents


async def test_the_torch_engine_equals_sentence_transformers_encode(torch_backend, sentence_transformer) -> None:
    expected = sentence_transformer.encode(PROBES, normalize_embeddings=True)
    assert min_cosine(await vectors_of(torch_backend, PROBES), expected) >= 0.9999


@pytest.mark.parametrize("optimize", [False, True], ids=["exported", "ort-optimised"])
async def test_the_onnx_engine_equals_the_torch_engine(torch_backend, onnx_cache, optimize: bool) -> None:
    backend = LocalBackend(engine="onnx", onnx_cache_dir=onnx_cache, onnx_optimize=optimize)
    try:
        onnx, torch = await vectors_of(backend, PROBES), await vectors_of(torch_backend, PROBES)
    finally:
        await backend.aclose()
    assert min_cosine(onnx, torch) >= 0.999 and float(np.abs(onnx - torch).max()) < 1e-4
    assert np.allclose(np.linalg.norm(onnx, axis=1), 1.0, atol=1e-5)


def test_the_export_is_cached_once_and_leftovers_of_a_dead_writer_are_removed(onnx_backend, onnx_cache) -> None:
    exported = onnx_backend.engine.model_file
    assert exported.parent.parent == onnx_cache and exported.name == "model.onnx"
    written = exported.stat().st_mtime_ns
    leftover = exported.with_name(".model.12345.deadbeef.tmp.onnx")
    leftover.write_bytes(b"half a model")
    assert cached_export(onnx_backend.model, onnx_cache) == exported
    assert exported.stat().st_mtime_ns == written and not leftover.exists()


async def test_token_ids_are_decoded_and_prepared_as_their_text(onnx_backend) -> None:
    text = "LangChain sends cl100k_base token ids"
    from_ids, from_text = await onnx_backend.prepare_many([tokens.encode(text), text])
    assert from_ids == from_text


async def test_ids_that_are_not_cl100k_tokens_are_rejected_in_place(onnx_backend) -> None:
    bad, good, too_large, huge = await onnx_backend.prepare_many(
        [[-1], "fine", [tokens.get_encoding().max_token_value + 1], [2**63]])
    assert all(isinstance(outcome, ItemRejected) for outcome in (bad, too_large, huge)) and "token ids" in str(bad)
    assert isinstance(good, Prepared) and good.tokens == 1


async def test_a_high_request_is_tokenized_while_low_ones_wait_for_their_thread(onnx_backend) -> None:
    # LOW's thread held busy, as by a flood of LOW requests arriving together
    busy, release = threading.Event(), threading.Event()
    loop = asyncio.get_running_loop()
    holding = loop.run_in_executor(onnx_backend._tokenizer_threads[True], lambda: busy.set() or release.wait(10))
    assert await asyncio.to_thread(busy.wait, 10)
    low = asyncio.ensure_future(onnx_backend.prepare_many(["a low text"], background=True))
    await asyncio.sleep(0)  # the LOW request is handed to its thread first
    (high,) = await onnx_backend.prepare_many(["a high text"])
    assert isinstance(high, Prepared) and not low.done()
    release.set()
    await holding
    (prepared,) = await low
    assert prepared.content == onnx_backend.wordpieces.encode_many(["a low text"])[0]


def test_the_onnx_engine_stops_a_running_call_when_interrupted_and_runs_the_next(onnx_backend) -> None:
    engine = onnx_backend.engine
    ids = np.full((64, MAX_SEQ_LENGTH), 1000, dtype=np.int64)  # seconds on one core: it is running when stopped
    outcome: list[BaseException | np.ndarray] = []

    def run() -> None:
        try:
            outcome.append(engine.run(ids, np.ones_like(ids)))
        except BaseException as exc:  # noqa: BLE001 - the test reads it
            outcome.append(exc)

    thread = threading.Thread(target=run)
    thread.start()
    while engine._running is None and thread.is_alive():
        thread.join(0.001)
    engine.interrupt()
    thread.join()
    assert len(outcome) == 1 and isinstance(outcome[0], EngineInterrupted)
    engine.interrupt()  # nothing running: the next call is the one stopped, before it starts
    with pytest.raises(EngineInterrupted):
        engine.run(ids[:2, :8], np.ones_like(ids[:2, :8]))
    assert engine.run(ids[:2, :8], np.ones_like(ids[:2, :8])).shape == (2, onnx_backend.dimension)


async def test_a_high_batch_beside_a_low_one_leaves_every_vector_right(onnx_backend) -> None:
    low_texts, high_texts = pseudo_sentences(300, 120, seed=11), pseudo_sentences(3, 120, seed=12)
    low, high = [[p.content for p in await onnx_backend.prepare_many(texts)] for texts in (low_texts, high_texts)]
    alone = np.stack(await onnx_backend.embed(low))
    bulk = asyncio.ensure_future(onnx_backend.embed(low, background=True))
    await asyncio.sleep(0.05)  # its calls run on both cores: the HIGH ones stop them
    interactive = [np.stack(await onnx_backend.embed(high)) for _ in range(3)]
    assert not bulk.done()
    np.testing.assert_allclose(np.stack(await bulk), alone, atol=1e-6)
    for vectors in interactive:
        np.testing.assert_allclose(vectors, interactive[0], atol=1e-6)


async def test_embed_refuses_other_dimensions_and_fails_foreign_contents_in_place(onnx_backend) -> None:
    (prepared,) = await onnx_backend.prepare_many(["fine"])
    with pytest.raises(ItemRejected, match="384"):
        await onnx_backend.embed([prepared.content], dimensions=128)
    vector, foreign = await onnx_backend.embed([prepared.content, "raw text"])
    assert vector.shape == (384,) and isinstance(foreign, TypeError)


@pytest.mark.parametrize("omp, expected", [("1", 1), (None, "cores"), ("999", "cores"), ("", "cores"), ("two", "cores")])
def test_threads_default_to_the_cpus_ray_reserved_within_the_cores(monkeypatch, omp, expected) -> None:
    cores = len(os.sched_getaffinity(0))
    if omp is None:
        monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    else:
        monkeypatch.setenv("OMP_NUM_THREADS", omp)  # Ray sets it to a replica's num_cpus
    assert default_threads() == (cores if expected == "cores" else expected)


def test_the_engines_compute_on_the_backends_threads(onnx_backend, torch_backend) -> None:
    import torch

    def threads(engine) -> int:
        return engine._session.get_session_options().intra_op_num_threads

    pool = onnx_backend.pool
    assert [threads(engine) for engine in pool.slot_engines] == [1] * onnx_backend.threads  # one engine a core
    if onnx_backend.threads > 1:
        assert threads(pool.wide_engine) == onnx_backend.threads  # and one on all of them, for a call alone
    else:
        assert pool.wide_engine is None
    assert torch.get_num_threads() == torch_backend.threads
    assert len(torch_backend.pool.engines) == 1  # torch's threads are the process's: one engine on all of them


@pytest.mark.parametrize(("entry", "problem"), [
    ({"engine": "tensorrt"}, "models[0].engine: must be one of onnx, torch, not 'tensorrt'"),
    ({"threads": 0}, "models[0].threads: must be an integer >= 1"),
    ({"threads": "2"}, "models[0].threads: must be an integer >= 1"),
    ({"onnx_optimize": "yes"}, "models[0].onnx_optimize: must be true or false"),
    ({"onnx_cache_dir": 3}, "models[0].onnx_cache_dir: must be a directory path"),
    ({"engine": "torch", "onnx_optimize": True}, "models[0].onnx_optimize: only the onnx engine takes this option"),
    ({"backend": "openai", "base_url": "http://127.0.0.1:9/v1", "threads": 2},
     "models[0].threads: only the local backend takes this option"),
])
def test_engine_options_are_checked(entry: dict, problem: str) -> None:
    with pytest.raises(ConfigError, match=problem.replace("[", r"\[").replace("]", r"\]")):
        parse_app_config({"models": [{"name": "m", **entry}]})


def test_engine_options_reach_the_model_config() -> None:
    (default,) = parse_app_config({"models": [{"name": "m"}]}).models
    assert (default.engine, default.threads, default.onnx_cache_dir, default.onnx_optimize) == (
        "onnx", None, None, False)
    entry = {"name": "m", "engine": "onnx", "threads": 1, "onnx_cache_dir": "/tmp/c", "onnx_optimize": True}
    (model,) = parse_app_config({"models": [entry]}).models
    assert (model.engine, model.threads, model.onnx_cache_dir, model.onnx_optimize) == ("onnx", 1, "/tmp/c", True)

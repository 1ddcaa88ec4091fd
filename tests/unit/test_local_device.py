"""The local model's ``device``, ``precision`` and ``num_gpus`` (no Ray, no GPU): checked at start-up naming the
field, the GPU reserved for the replica, a clear refusal where torch sees no GPU, the length bucketing with a GPU's
call budget, and the device-aware torch engine equal to the plain one on the CPU in fp32."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from deployments.config import ConfigError, parse_app_config
from deployments.model.backends import make_backend
from deployments.model.backends.engines import (CHUNK_TOKENS, CUDA_CHUNK_TOKENS, embed_sequences, length_buckets,
                                                make_engine, max_call_tokens)
from deployments.model.backends.model_dir import ModelDir, packaged_model_path
from deployments.model.backends.torch_engine import TorchEngine, load_embedder
from deployments.model.backends.wordpieces import BoundedTokenizer
from deployments.model.cache.build import vector_identity
from deployments.sizing import model_deployment_options

OPENAI = {"backend": "openai", "base_url": "http://127.0.0.1:9/v1"}
NO_GPU = pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU: nothing is refused")


def entry(**settings):
    (model,) = parse_app_config({"models": [{"name": "m", **settings}]}).models
    return model


@pytest.mark.parametrize(("settings", "problem"), [
    ({"device": "gpu"}, "models[0].device: must be one of cpu, cuda, not 'gpu'"),
    ({"device": "cuda", "precision": "fp64"}, "models[0].precision: must be one of fp32, fp16, bf16, not 'fp64'"),
    ({"precision": "fp16"}, "models[0].precision: only device cuda takes this option"),
    ({"device": "cpu", "precision": "bf16"}, "models[0].precision: only device cuda takes this option"),
    ({"num_gpus": 1}, "models[0].num_gpus: only device cuda takes this option"),
    ({"device": "cuda", "num_gpus": 0}, "models[0].num_gpus: must be a number > 0 and <= 1"),
    ({"device": "cuda", "num_gpus": 1.5}, "models[0].num_gpus: must be a number > 0 and <= 1 (a share of one GPU) "
                                          "or a whole number >= 1, not 1.5"),
    ({"device": "cuda", "num_gpus": "1"}, "models[0].num_gpus: must be a number"),
    ({"device": "cuda", "num_gpus": True}, "models[0].num_gpus: must be a number"),
    ({"device": "cuda", "engine": "onnx"}, "models[0].engine: the onnx engine runs on the CPU only; device cuda takes "
                                           "engine torch"),
    ({**OPENAI, "device": "cuda"}, "models[0].device: only the local backend takes this option"),
    ({**OPENAI, "precision": "fp16"}, "models[0].precision: only the local backend takes this option"),
    ({**OPENAI, "num_gpus": 0.5}, "models[0].num_gpus: only the local backend takes this option"),
])
def test_bad_device_settings_are_start_up_errors_naming_the_field(settings: dict, problem: str) -> None:
    with pytest.raises(ConfigError) as caught:
        entry(**settings)
    assert problem in str(caught.value)


def test_the_defaults_are_the_cpu_in_fp32_reserving_no_gpu() -> None:
    model = entry()
    assert (model.device, model.precision, model.num_gpus, model.engine) == ("cpu", "fp32", None, "onnx")
    assert model_deployment_options(model)["ray_actor_options"] == {"num_cpus": 1}
    assert model_deployment_options(entry(**OPENAI))["ray_actor_options"] == {"num_cpus": 0}


@pytest.mark.parametrize(("settings", "num_gpus"), [
    ({"device": "cuda"}, 1),
    ({"device": "cuda", "engine": "torch", "precision": "fp16", "num_gpus": 0.5}, 0.5),
    ({"device": "cuda", "precision": "bf16", "num_gpus": 0.25}, 0.25),
    ({"device": "cuda", "num_gpus": 2}, 2),
    ({"device": "cuda", "num_gpus": 1.0}, 1.0),
])
def test_a_cuda_entry_runs_torch_and_its_replica_reserves_its_gpus(settings: dict, num_gpus: float) -> None:
    model = entry(**settings)
    assert (model.device, model.engine) == ("cuda", "torch")
    options = model_deployment_options(model)
    assert options["ray_actor_options"] == {"num_cpus": 1, "num_gpus": num_gpus}
    assert options["max_surge_percent"] == 0  # a surge replica might find no free GPU
    again = parse_app_config({"models": [model.model_dump(by_alias=True)]}).models[0]
    assert again == model  # a config passed back in as it came out is valid


def test_ray_actor_options_may_still_override_the_reservation() -> None:
    model = entry(device="cuda", num_gpus=0.5, ray_actor_options={"num_gpus": 1, "num_cpus": 2})
    assert model_deployment_options(model)["ray_actor_options"] == {"num_cpus": 2, "num_gpus": 1}


def test_cached_vectors_are_keyed_by_device_and_precision_off_the_cpu() -> None:
    cpu = vector_identity(entry(engine="torch"))
    assert cpu.endswith("torch optimize=False")  # CPU entries keep the keys they always had
    fp32, bf16 = vector_identity(entry(device="cuda")), vector_identity(entry(device="cuda", precision="bf16"))
    assert len({cpu, fp32, bf16}) == 3 and fp32.endswith("cuda fp32") and bf16.endswith("cuda bf16")


@NO_GPU
def test_device_cuda_without_a_gpu_is_refused_naming_what_was_looked_for(monkeypatch) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    with pytest.raises(RuntimeError) as caught:
        make_backend(entry(device="cuda", precision="fp16"))
    message = str(caught.value)
    assert "torch.cuda.is_available() is False" in message and "CUDA_VISIBLE_DEVICES=0" in message
    assert f"torch.version.cuda={torch.version.cuda}" in message
    if torch.version.cuda is None:
        assert "the CPU build: install the CUDA build" in message


def test_the_onnx_engine_refuses_any_device_but_the_cpu() -> None:
    model = ModelDir.read(packaged_model_path())
    with pytest.raises(ValueError, match="the onnx engine computes on the CPU in fp32 only, not on cuda in fp32"):
        make_engine("onnx", model, threads=1, device="cuda")


def test_a_gpu_call_holds_far_more_padded_positions() -> None:
    assert (max_call_tokens("cpu"), max_call_tokens("cuda")) == (CHUNK_TOKENS, CUDA_CHUNK_TOKENS)
    full = [[1] * 256] * 65
    assert [len(b) for b in length_buckets(list(range(65)), full, CUDA_CHUNK_TOKENS)] == [64, 1]
    assert [len(b) for b in length_buckets(list(range(65)), full, CHUNK_TOKENS)] == [1] * 65
    lengths = [3, 5, 5, 9, 40, 41, 100, 250, 300]  # ascending, as embed_sequences sorts them
    sequences = [[1] * n for n in lengths]
    for budget in (64, 256, 1024, 16384):
        buckets = length_buckets(list(range(len(lengths))), sequences, budget)
        assert sum(buckets, []) == list(range(len(lengths)))  # every sequence once, in order
        assert all(len(b) * lengths[b[-1]] <= budget or len(b) == 1 for b in buckets)
    assert length_buckets(list(range(len(lengths))), sequences, 16384) == [list(range(len(lengths)))]


class RecordingEngine:
    def __init__(self) -> None:
        self.shapes: list[tuple[int, int]] = []

    def run(self, input_ids: np.ndarray, attention_mask: np.ndarray) -> np.ndarray:
        self.shapes.append(input_ids.shape)
        return np.stack([attention_mask.sum(axis=1), input_ids[:, 0]], axis=1).astype(np.float32)


def test_embed_sequences_calls_the_engine_within_the_budget_and_keeps_the_order() -> None:
    sequences = [[7] * n for n in (120, 4, 60, 4, 200, 30)] * 8
    for budget, calls in ((CHUNK_TOKENS, None), (CUDA_CHUNK_TOKENS, 1)):
        engine = RecordingEngine()
        vectors = embed_sequences(engine, sequences, pad_id=0, max_tokens=budget)
        assert vectors[:, 0].tolist() == [len(s) for s in sequences]  # row i is sequence i's
        assert all(rows * length <= budget or rows == 1 for rows, length in engine.shapes)
        assert calls is None or len(engine.shapes) == calls


class PlainEngine:
    """The torch engine as it was before it took a device and a precision: the module on the CPU, called as is."""

    def __init__(self, model: ModelDir) -> None:
        self.module = load_embedder(model)

    def run(self, input_ids: np.ndarray, attention_mask: np.ndarray) -> np.ndarray:
        with torch.inference_mode():
            return self.module(torch.from_numpy(input_ids), torch.from_numpy(attention_mask)).numpy()


@pytest.fixture(scope="module")
def minilm() -> tuple[ModelDir, BoundedTokenizer]:
    model = ModelDir.read(packaged_model_path())
    return model, BoundedTokenizer(model.tokenizer_file, model.max_seq_length, lowercase=model.do_lower_case)


def test_the_device_aware_engine_in_fp32_on_the_cpu_is_the_plain_module(minilm) -> None:
    model, wordpieces = minilm
    ids = wordpieces.encode_many(["a short text", "a somewhat longer text about batching " * 5, "x"])
    engine, plain = TorchEngine(model, threads=1, device="cpu", precision="fp32"), PlainEngine(model)
    for budget in (CHUNK_TOKENS, CUDA_CHUNK_TOKENS):
        ours = embed_sequences(engine, ids, wordpieces.pad_id, max_tokens=budget)
        assert ours.dtype == np.float32
        assert np.array_equal(ours, embed_sequences(plain, ids, wordpieces.pad_id, max_tokens=budget))


def test_a_reduced_precision_engine_returns_float32_vectors_close_to_fp32(minilm) -> None:
    model, wordpieces = minilm
    ids = wordpieces.encode_many(["the lighthouse keeper counted the ships", "hello"])
    fp32 = embed_sequences(TorchEngine(model, threads=1), ids, wordpieces.pad_id)
    bf16 = embed_sequences(TorchEngine(model, threads=1, precision="bf16"), ids, wordpieces.pad_id)
    assert bf16.dtype == np.float32 and bf16.shape == fp32.shape
    assert float(np.min(np.sum(fp32 * bf16, axis=1))) > 0.99  # unit vectors: their dot product is the cosine

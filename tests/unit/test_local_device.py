"""The local model's ``device``, ``precision`` and ``num_gpus`` (no Ray, no GPU): checked at start-up naming the
field, the GPU reserved for the replica, a clear refusal where torch sees no GPU, the engine calls cut by length on a
CPU and a GPU, and the device-aware torch engine equal to the plain one on the CPU in fp32."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from deployments.config import ConfigError, parse_app_config
from deployments.model.backends import make_backend
from deployments.model.backends.engines import (CHUNK_TOKENS, CUDA_CHUNK_TOKENS, CallShape, call_shape,
                                                embed_sequences, engine_calls, make_engine)
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
    cpu, cuda = call_shape("cpu"), call_shape("cuda")
    assert (cpu.max_tokens, cuda.max_tokens) == (CHUNK_TOKENS, CUDA_CHUNK_TOKENS)
    full = [[1] * 256] * 65
    assert [len(call) for call in engine_calls(full, cuda)] == [64, 1]
    assert [len(call) for call in engine_calls(full, cpu)] == [1] * 65


def test_a_cpu_cuts_a_batch_of_mixed_lengths_into_calls_of_like_lengths() -> None:
    sequences = [[1] * n for n in (40, 10, 40, 10, 40, 10, 40, 10)]
    # As few calls as the chunk allows would pad four short texts to 40 beside two long ones: 6 x 40 + 2 x 40.
    assert engine_calls(sequences, call_shape("cpu")) == [[1, 3, 5, 7], [0, 2, 4, 6]]  # 4 x 10 + 4 x 40
    assert engine_calls(sequences, call_shape("cuda")) == [[1, 3, 5, 7, 0, 2, 4, 6]]  # a GPU call's launch costs more
    assert engine_calls([[1] * 30] * 8, call_shape("cpu")) == [list(range(8))]  # nothing to save: one call


def _cost(calls: list[list[int]], lengths: list[int], shape: CallShape) -> int:
    return sum(shape.overhead_tokens + len(call) * max(lengths[i] for i in call) for call in calls)


@settings(max_examples=300, deadline=None)
@given(lengths=st.lists(st.integers(1, 120), min_size=1, max_size=9),
       shape=st.builds(CallShape, st.sampled_from([64, 256, 1024, 16384]), st.integers(0, 300)))
def test_engine_calls_are_the_cheapest_cut_of_the_sorted_batch(lengths: list[int], shape: CallShape) -> None:
    sequences = [[1] * n for n in lengths]
    calls = engine_calls(sequences, shape)
    assert sorted(sum(calls, [])) == list(range(len(lengths)))  # every sequence once
    assert all(len(call) * lengths[call[-1]] <= shape.max_tokens or len(call) == 1 for call in calls)
    assert all(lengths[a] <= lengths[b] for call in calls for a, b in zip(call, call[1:]))  # longest last
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    every_cut = (
        [order[a:b] for a, b in zip((0, *ends), (*ends, len(order)))]
        for count in range(len(order))
        for ends in itertools.combinations(range(1, len(order)), count))
    allowed = [cut for cut in every_cut
               if all(len(call) * lengths[call[-1]] <= shape.max_tokens or len(call) == 1 for call in cut)]
    assert _cost(calls, lengths, shape) == min(_cost(cut, lengths, shape) for cut in allowed)


class RecordingEngine:
    def __init__(self) -> None:
        self.shapes: list[tuple[int, int]] = []

    def run(self, input_ids: np.ndarray, attention_mask: np.ndarray) -> np.ndarray:
        self.shapes.append(input_ids.shape)
        return np.stack([attention_mask.sum(axis=1), input_ids[:, 0]], axis=1).astype(np.float32)


def test_embed_sequences_calls_the_engine_within_the_budget_and_keeps_the_order() -> None:
    sequences = [[7] * n for n in (120, 4, 60, 4, 200, 30)] * 8
    for shape, calls in ((call_shape("cpu"), None), (call_shape("cuda"), 1)):
        engine = RecordingEngine()
        vectors = embed_sequences(engine, sequences, pad_id=0, shape=shape)
        assert vectors[:, 0].tolist() == [len(s) for s in sequences]  # row i is sequence i's
        assert all(rows * length <= shape.max_tokens or rows == 1 for rows, length in engine.shapes)
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
    for shape in (call_shape("cpu"), call_shape("cuda")):
        ours = embed_sequences(engine, ids, wordpieces.pad_id, shape=shape)
        assert ours.dtype == np.float32
        assert np.array_equal(ours, embed_sequences(plain, ids, wordpieces.pad_id, shape=shape))


def test_a_reduced_precision_engine_returns_float32_vectors_close_to_fp32(minilm) -> None:
    model, wordpieces = minilm
    ids = wordpieces.encode_many(["the lighthouse keeper counted the ships", "hello"])
    fp32 = embed_sequences(TorchEngine(model, threads=1), ids, wordpieces.pad_id)
    bf16 = embed_sequences(TorchEngine(model, threads=1, precision="bf16"), ids, wordpieces.pad_id)
    assert bf16.dtype == np.float32 and bf16.shape == fp32.shape
    assert float(np.min(np.sum(fp32 * bf16, axis=1))) > 0.99  # unit vectors: their dot product is the cosine

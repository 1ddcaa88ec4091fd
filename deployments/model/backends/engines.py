"""The engines that run the local model: ids in, vectors out. ``torch`` or ``onnx`` (ONNX Runtime), chosen per model
entry; both compute the model directory's pipeline (``torch_engine.SentenceEmbedder``).

``embed_sequences`` pads ids into batches for an engine: sorted by length, so texts of like length share a call and
padding stays small, then put back in order. Padding goes on the side the model's tokenizer pads (the left for
decoder embedders, whose last token is their vector).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import NamedTuple, Protocol, Sequence

import numpy as np

from deployments.model.backends.model_dir import ModelDir

# Padded positions in one model call (about 10 inputs of 25 word pieces, 1 of 256). Small calls keep the activations
# in the core's cache (2 MB of L2 here); a larger chunk or one call per batch costs more per text. Packing several
# texts into one row with a block-diagonal attention mask pads nothing, but the mask makes each row's attention as
# wide as the whole row, which costs more than the padding it saves.
CHUNK_TOKENS = 256
# On a GPU one call's rows run in parallel and each call costs a fixed launch and copy overhead, so a call should hold
# as many texts as the batch brings: 16384 positions are 64 texts of 256 word pieces (MiniLM's longest), a few
# hundred MB of activations for a MiniLM-sized model, far below any GPU's memory. load/gpu_bench.py --max-call-tokens
# tries others.
CUDA_CHUNK_TOKENS = 16384
# What a call costs beyond its padded positions, counted in positions: what cutting a call in two must save in padding
# to pay. On a CPU a position costs about the same in a call of any size, and a call's own work (starting its
# operators, handing it to a core's thread and back) costs what a few positions do, so a batch of mixed lengths is
# cheapest cut into several calls of like lengths rather than as few calls as the chunk allows
# (``load/bench/engine_limit.py`` measures both on the benchmark's texts). On a GPU a call's positions cost next to
# nothing beside its launch: it is cut only where the chunk forces it.
CALL_OVERHEAD_TOKENS = 8
CUDA_CALL_OVERHEAD_TOKENS = CUDA_CHUNK_TOKENS


class CallShape(NamedTuple):
    """How a device's engine calls are cut from a batch: at most ``max_tokens`` padded positions a call (or one
    sequence), each call costing ``overhead_tokens`` positions beyond its own."""

    max_tokens: int = CHUNK_TOKENS
    overhead_tokens: int = CALL_OVERHEAD_TOKENS


class EngineInterrupted(Exception):
    """The call was stopped by ``Engine.interrupt`` before it finished: nothing is wrong with it, run it again."""


class Engine(Protocol):
    def run(self, input_ids: np.ndarray, attention_mask: np.ndarray) -> np.ndarray:
        """int64 ``[n, length]`` ids and mask to float32 ``[n, dimension]`` rows (of unit length if the model
        normalises)."""

    def interrupt(self) -> None:
        """Ask the call running (or about to run) to stop at its next operator and raise ``EngineInterrupted``
        (called from another thread; asked just as a call returns, the next call may be the one stopped); an engine
        that cannot stop a call lets it finish."""


def default_threads() -> int:
    """The CPUs this process reserved, as Ray tells it through ``OMP_NUM_THREADS`` (a replica's ``num_cpus``), so the
    replicas on a node never compute on more cores than they reserved together: replicas whose threads outnumber the
    cores contend for them and serve less, while one thread a reserved core lets each replica run its own batch
    without stepping on another's. Without it (outside Ray), every core this process may run on."""
    cores = len(os.sched_getaffinity(0))
    reserved = os.environ.get("OMP_NUM_THREADS", "")
    return min(int(reserved), cores) if reserved.isdigit() and int(reserved) >= 1 else cores


def call_shape(device: str) -> CallShape:
    """How the engine calls on ``device`` (cpu, cuda) are cut."""
    return CallShape(CUDA_CHUNK_TOKENS, CUDA_CALL_OVERHEAD_TOKENS) if device == "cuda" else CallShape()


def make_engine(
    name: str, model: ModelDir, *, threads: int, device: str = "cpu", precision: str = "fp32",
    onnx_cache_dir: str | Path | None = None, onnx_optimize: bool = False
) -> Engine:
    """The engine ``name`` (torch, onnx) computing with ``threads`` intra-op threads, torch on ``device`` in
    ``precision``; torch is imported only if needed (the onnx engine needs it once, to export the model into its
    cache)."""
    if name == "torch":
        from deployments.model.backends.torch_engine import TorchEngine

        return TorchEngine(model, threads=threads, device=device, precision=precision)
    if (device, precision) != ("cpu", "fp32"):
        raise ValueError(f"the {name} engine computes on the CPU in fp32 only, not on {device} in {precision}")
    if name == "onnx":
        from deployments.model.backends.onnx_engine import OnnxEngine

        return OnnxEngine(model, threads=threads, cache_dir=onnx_cache_dir, optimize=onnx_optimize)
    raise ValueError(f"unknown engine {name!r}; choose onnx or torch")


def embed_sequences(engine: Engine, sequences: Sequence[Sequence[int]], pad_id: int,
                    left_padding: bool = False, shape: CallShape = CallShape()) -> np.ndarray:
    """float32 ``[len(sequences), dimension]``: row i is the vector of ``sequences[i]``, in engine calls cut as
    ``shape`` says."""
    rows: list[np.ndarray] = [np.empty(0, np.float32)] * len(sequences)
    for call in engine_calls(sequences, shape):
        for i, vector in zip(call, embed_call(engine, sequences, call, pad_id, left_padding)):
            rows[i] = vector
    return np.stack(rows).astype(np.float32, copy=False) if rows else np.empty((0, 0), np.float32)


def embed_call(engine: Engine, sequences: Sequence[Sequence[int]], call: list[int], pad_id: int,
               left_padding: bool) -> np.ndarray:
    """One engine call: the vectors of ``sequences[i]`` for i in ``call`` (ascending length), in that order."""
    length = len(sequences[call[-1]])
    input_ids = np.full((len(call), length), pad_id, dtype=np.int64)
    attention_mask = np.zeros((len(call), length), dtype=np.int64)
    for row, i in enumerate(call):
        place = slice(length - len(sequences[i]), length) if left_padding else slice(0, len(sequences[i]))
        input_ids[row, place] = sequences[i]
        attention_mask[row, place] = 1
    return engine.run(input_ids, attention_mask)


def engine_calls(sequences: Sequence[Sequence[int]], shape: CallShape) -> list[list[int]]:
    """The engine calls that embed ``sequences`` at the least cost: each call's indices, of ascending length, padded to
    its longest, within ``shape.max_tokens`` positions (or one sequence), each call costing its padded positions plus
    ``shape.overhead_tokens``. Sorted by length, the cheapest cut is found exactly (each prefix's cheapest cut is the
    cheapest over where its last call starts), in at most as many steps as the batch's sequences times the most a
    call holds."""
    order = sorted(range(len(sequences)), key=lambda i: len(sequences[i]))
    lengths = [len(sequences[i]) for i in order]
    cheapest = [0] * (len(order) + 1)  # of the first n sequences
    last_start = [0] * (len(order) + 1)  # where the last call of that cheapest cut starts
    for end in range(1, len(order) + 1):
        width = lengths[end - 1]
        best, best_start = cheapest[end - 1] + shape.overhead_tokens + width, end - 1
        for start in range(end - 2, -1, -1):
            size = end - start
            if size * width > shape.max_tokens:
                break
            cost = cheapest[start] + shape.overhead_tokens + size * width
            if cost < best:
                best, best_start = cost, start
        cheapest[end], last_start[end] = best, best_start
    calls: list[list[int]] = []
    end = len(order)
    while end:
        calls.append(order[last_start[end]:end])
        end = last_start[end]
    return calls[::-1]

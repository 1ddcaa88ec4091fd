"""The local model in ONNX Runtime, fp32: ``SentenceEmbedder`` (transformer, pooling, Dense layers, normalisation, as
the model directory says) exported once.

The export is cached in ``<cache dir>/<model fingerprint>-<recipe>/model.onnx`` (default cache dir
``~/.cache/adaptive-embeddings/onnx``). Replicas starting together take a file lock, so one exports while the
others wait, and every file is written under a temporary name and renamed into place: a replica killed mid-export
leaves no half-written model behind. Once cached, starting this engine imports neither torch nor transformers.

``optimize`` saves ORT's offline graph optimisation of the export (``ORT_ENABLE_EXTENDED``, the portable level)
beside it and runs that. ORT applies the same fusions online when it loads the plain export, so on a model as small
as MiniLM the saved graph gains nothing, to start or to run; it is there for larger models, whose online optimisation
takes longer at every start.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import threading
import uuid
import warnings
from pathlib import Path
from typing import Callable, Iterator

import numpy as np
import onnxruntime as ort

from deployments.model.backends.engines import EngineInterrupted
from deployments.model.backends.model_dir import ModelDir

RECIPE = "st-pipeline-eager-opset17-v2"  # change it whenever the export changes: old caches are then not used
INPUTS, OUTPUT = ("input_ids", "attention_mask"), "embedding"
_CPU = ["CPUExecutionProvider"]


def default_cache_dir() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "adaptive-embeddings" / "onnx"


class OnnxEngine:
    def __init__(self, model: ModelDir, *, threads: int, cache_dir: str | Path | None = None,
                 optimize: bool = False) -> None:
        self.model_file = cached_export(model, Path(cache_dir) if cache_dir else default_cache_dir(), optimize)
        options = ort.SessionOptions()
        options.intra_op_num_threads = threads  # set, never left to ORT's default of every core
        options.inter_op_num_threads = 1
        options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        # Its threads spin between the operators of a call (a hand-over without a wake-up) but not after the call:
        # spinning idle, they would take the cores from the next call, on this engine or another.
        options.add_session_config_entry("session.force_spinning_stop", "1")
        self._session = ort.InferenceSession(str(self.model_file), options, providers=_CPU)
        self._stopping = threading.Lock()
        self._running: ort.RunOptions | None = None  # the running call's options, to stop it with
        self._stop_next = False

    def run(self, input_ids: np.ndarray, attention_mask: np.ndarray) -> np.ndarray:
        options = ort.RunOptions()  # this call's own, to stop it with: the engine runs one call at a time
        with self._stopping:
            if self._stop_next:  # asked to stop before it reached the session
                self._stop_next = False
                raise EngineInterrupted("the call was stopped by interrupt() before it started")
            self._running = options
        try:
            (vectors,) = self._session.run([OUTPUT], {INPUTS[0]: input_ids, INPUTS[1]: attention_mask}, options)
        except Exception:
            if options.terminate:
                raise EngineInterrupted("the call was stopped by interrupt()") from None
            raise
        finally:
            with self._stopping:
                self._running = None
        return vectors

    def interrupt(self) -> None:
        with self._stopping:
            if self._running is not None:
                self._running.terminate = True  # ORT checks it between operators
            else:  # the call is on its way to the session, or has just returned (then the next one stops: harmless)
                self._stop_next = True


def cached_export(model: ModelDir, cache_dir: Path, optimize: bool = False) -> Path:
    """The path of the model's ONNX export (optimised if asked), written first if the cache lacks it."""
    folder = cache_dir / f"{model.fingerprint()}-{RECIPE}"
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise RuntimeError(f"cannot create the ONNX cache {folder} ({exc}): set the model entry's onnx_cache_dir to "
                           "a writable directory, or use engine: torch") from exc
    exported, optimized = folder / "model.onnx", folder / "model.optimized.onnx"
    with _locked(folder / ".lock"):
        for stale in folder.glob(".*.tmp.onnx"):  # left by a writer that died: writers hold the lock
            stale.unlink(missing_ok=True)
        if not exported.exists():
            _write_atomically(exported, lambda target: export(model, target))
        if optimize and not optimized.exists():
            _write_atomically(optimized, lambda target: _optimize(exported, target))
    return optimized if optimize else exported


def export(model: ModelDir, target: Path) -> None:
    """``SentenceEmbedder`` to ONNX with dynamic batch and sequence axes, through torch's TorchScript exporter.
    Eager attention traces to plain MatMul/Softmax, which ORT fuses; the vectors match torch's to ~1e-6. The
    example batch is padded on the model's side, so the trace takes the attention-mask path it will run."""
    import torch

    from deployments.model.backends.torch_engine import load_embedder

    module = load_embedder(model, attn_implementation="eager")
    input_ids = torch.arange(16, dtype=torch.int64).reshape(2, 8)
    attention_mask = torch.ones_like(input_ids)
    if model.left_padding:
        attention_mask[1, :3] = 0
    else:
        attention_mask[1, 5:] = 0
    axes = {0: "batch", 1: "sequence"}
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the exporter's deprecation notice and tracer warnings on constant shapes
        torch.onnx.export(
            module, (input_ids, attention_mask), str(target), dynamo=False, input_names=list(INPUTS),
            output_names=[OUTPUT], dynamic_axes={INPUTS[0]: axes, INPUTS[1]: axes, OUTPUT: {0: "batch"}},
            opset_version=17,
        )


def _optimize(source: Path, target: Path) -> None:
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED
    options.optimized_model_filepath = str(target)
    ort.InferenceSession(str(source), options, providers=_CPU)


def _write_atomically(path: Path, write: Callable[[Path], None]) -> None:
    temporary = path.with_name(f".{path.stem}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp.onnx")
    try:
        write(temporary)
        os.replace(temporary, path)
    finally:
        temporary.unlink(missing_ok=True)


@contextlib.contextmanager
def _locked(lock_file: Path) -> Iterator[None]:
    with lock_file.open("a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)

"""The ONNX graph that infinity's optimum engine serves, exported with ``torch.onnx.export`` and optimised ahead of
time, each checked against torch before use.

Under optimum 2.x infinity cannot do either itself: optimum-onnx's exporter names a sentence-transformers folder's
outputs differently (``KeyError: 'last_hidden_state'``), and infinity's own optimisation call passes a keyword
optimum 2.x no longer has (``optimize_with_onnxruntime_only``), after which it serves the unoptimised graph. So this
module writes ``model.onnx`` beside the model's config and tokenizer files (infinity finds it only when started inside
that folder with ``--model-id .``), and the graph optimised as infinity means to (``OptimizationConfig`` level 99,
transformer fusions, CPU, fp32) where infinity looks for it: ``<hub cache>/infinity_onnx/CPUExecutionProvider/``.

``exported(python, model, root)``, in the benchmark's process, runs ``python -m load.peers.infinity_onnx MODEL
FOLDER OPTIMISED`` with infinity's virtualenv once.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

MAX_DIFFERENCE = 1e-4  # largest |ONNX - torch| allowed in the last hidden state
CHECK_TEXTS = ["A short one.", "The queue grows, the batch waits longer, and the model sees fuller batches " * 4]
INPUTS = ["input_ids", "attention_mask", "token_type_ids"]  # the order of BertModel.forward's parameters


def exported(python: Path, model: Path, root: Path) -> tuple[Path, Path]:
    """The ONNX folder and the hub cache holding its optimised graph, under ``root``; made unless they were."""
    from .launch import OFFLINE_ENV, ROOT

    folder, cache = root / "onnx-model", root / "hf-cache"
    marker = folder / "exported-from.txt"
    made_by = f"{model}\n{hashlib.sha256(Path(__file__).read_bytes()).hexdigest()}"  # redone when this code changes
    if not (marker.exists() and marker.read_text() == made_by):
        optimised = cache / "infinity_onnx" / "CPUExecutionProvider"
        subprocess.run([str(python), "-m", "load.peers.infinity_onnx", str(model), str(folder), str(optimised)],
                       check=True, env={**os.environ, **OFFLINE_ENV, "PYTHONPATH": str(ROOT)})
        marker.write_text(made_by)
    return folder, cache


def export(model_dir: Path, folder: Path, optimised: Path) -> dict[str, float]:
    """Write both graphs; returns each one's largest difference to torch over ``CHECK_TEXTS`` (raises past the
    limit)."""
    import torch
    from optimum.onnxruntime import ORTOptimizer
    from optimum.onnxruntime.configuration import OptimizationConfig
    from transformers import AutoModel, AutoTokenizer

    folder.mkdir(parents=True, exist_ok=True)
    for item in model_dir.iterdir():
        if item.is_file() and item.suffix not in (".safetensors", ".bin", ".md"):
            shutil.copy2(item, folder / item.name)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModel.from_pretrained(model_dir, attn_implementation="eager").eval()
    inputs = tokenizer(CHECK_TEXTS, padding=True, truncation=True, return_tensors="pt")
    axes = {name: {0: "batch", 1: "sequence"} for name in [*INPUTS, "last_hidden_state"]}
    with torch.no_grad():
        torch.onnx.export(model, tuple(inputs[name] for name in INPUTS), str(folder / "model.onnx"),
                          input_names=INPUTS, output_names=["last_hidden_state"], dynamic_axes=axes,
                          opset_version=17, dynamo=False)
        expected = model(**inputs).last_hidden_state.numpy()
    differences = {"exported": _difference(folder / "model.onnx", inputs, expected)}
    ORTOptimizer.from_pretrained(folder, file_names=["model.onnx"]).optimize(
        OptimizationConfig(optimization_level=99, enable_transformers_specific_optimizations=True,
                           optimize_for_gpu=False, fp16=False),
        save_dir=optimised)
    differences["optimised"] = _difference(optimised / "model_optimized.onnx", inputs, expected)
    if max(differences.values()) > MAX_DIFFERENCE:
        raise RuntimeError(f"ONNX differs from torch by {differences} (limit {MAX_DIFFERENCE:g})")
    return differences


def _difference(path: Path, inputs: dict, expected: "np.ndarray") -> float:  # noqa: F821 - numpy is imported late
    import numpy as np
    import onnxruntime

    session = onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    (got,) = session.run(["last_hidden_state"], {name: inputs[name].numpy() for name in INPUTS})
    return float(np.abs(got - expected).max())


if __name__ == "__main__":
    print("largest difference to torch:", export(Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3])))

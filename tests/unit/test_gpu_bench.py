"""``python -m load.gpu_bench`` runs (on the CPU, at a tiny size: this proves it runs and reports, not any speed),
and imports neither Ray nor the service, so it can run on a GPU machine that has neither."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
from safetensors.numpy import load_file

from deployments.model.backends.model_dir import ModelDir, packaged_model_path
from load import gpu_bench

ROOT = Path(__file__).resolve().parents[2]


def test_the_benchmark_runs_on_the_cpu_and_writes_its_report(tmp_path: Path) -> None:
    assert gpu_bench.main(["--device", "cpu", "--precisions", "fp32", "--batch-sizes", "1,2", "--warmup-calls", "0",
                           "--min-calls", "1", "--min-seconds", "0", "--results-dir", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "engine_cpu.json").read_text())
    fp32 = report["results"]["fp32"]
    assert set(fp32["texts_per_s"]) == {"short", "long", "mixed"}
    assert set(fp32["texts_per_s"]["mixed"]) == {"1", "2"}
    assert all(cell[side] > 0 for cells in fp32["texts_per_s"].values() for cell in cells.values()
               for side in ("ours", "ours_from_ids", "sentence_transformers"))
    assert fp32["cosine_to_st_fp32"]["ours"] >= 0.999 and report["verdicts"]["fp32_cosine_met"]
    assert report["weights_dtype"] == "float32" and report["max_call_tokens"] == 256
    assert "## fp32" in (tmp_path / "engine_cpu.md").read_text()


def test_it_imports_neither_ray_nor_the_service() -> None:
    probe = ("import sys, load.gpu_bench, deployments.model.backends.engines, deployments.model.backends.torch_engine, "
             "deployments.model.backends.wordpieces; "
             "print(sorted(m for m in ('ray', 'pydantic', 'deployments.app', 'deployments.config', 'batching') "
             "if m in sys.modules))")
    loaded = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, check=True)
    assert loaded.stdout.strip() == "[]"


def test_pack_fp16_halves_the_weights_and_keeps_the_rest(tmp_path: Path) -> None:
    source = Path(packaged_model_path())
    packed = gpu_bench.pack_fp16(source, tmp_path / "model")
    assert gpu_bench.weights_dtype(packed) == "float16" and gpu_bench.weights_dtype(source) == "float32"
    original, halved = load_file(str(source / "model.safetensors")), load_file(str(packed / "model.safetensors"))
    assert original.keys() == halved.keys()
    assert all(np.array_equal(original[name].astype(np.float16), halved[name]) for name in original)
    assert ModelDir.read(packed).dimension == ModelDir.read(source).dimension
    assert (packed / "tokenizer.json").read_bytes() == (source / "tokenizer.json").read_bytes()

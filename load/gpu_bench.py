"""The local model's engine alone on a GPU: texts/s at batch sizes 1-256 for short, long and mixed-length texts, in
fp32, fp16 and bf16, against sentence-transformers' own ``encode`` on the same device and precision; and each
precision's cosine to sentence-transformers' fp32 vectors, over probe texts.

    python -m load.gpu_bench [--device cuda] [--results-dir DIR] [--model-dir DIR] [--batch-sizes 1,2,4] ...

It imports neither Ray nor the service (``deployments.app``, pydantic), only the engine's pieces
(``deployments.model.backends``: the model directory, the word-piece tokenizer, the torch engine, the length bucketing),
so it runs on a GPU machine that has torch, transformers, tokenizers, sentence-transformers and numpy and nothing
else of the project's. ``--device cpu`` runs it on the CPU (the unit test does, at a tiny size).

What is timed, on both sides: texts in, float32 vectors out, tokenizing included. ``encode(texts, batch_size=n)``
tokenizes, sorts by length and pads each batch of n; ours is the service's word-piece tokenizer then
``engines.embed_sequences``, cut by length into calls as ``call_shape(device)`` says.
Ours is also timed from word-piece ids, which is what a replica's model thread does (its tokenizer thread has
prepared each request as it arrived). A call embeds n texts of the pool, the next call the next n; each cell runs
warm-up calls, then calls until both ``--min-calls`` and ``--min-seconds``, and reports the median call's texts/s.

``--pack-fp16 DIR`` writes the model directory with its weights stored in fp16 (half the bytes, for moving it to a
machine it is otherwise too large to be sent to) and exits. A run on such a copy computes fp32 on the fp16-rounded
weights on both sides, so its fp32 comparison is exact; its reference for the reduced precisions then lacks the
rounding of the weights, which the report says.
"""

from __future__ import annotations

import argparse
import gc
import os
import random
import shutil
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Sequence

import numpy as np

from load.bench.report import add_results_dir_argument, markdown_table, write_report
from load.workload import pseudo_sentences

if TYPE_CHECKING:  # imported where used: this module runs without the service's own imports
    from deployments.model.backends.engines import CallShape

PRECISIONS = ("fp32", "fp16", "bf16")
# Mean characters of a text: about 10, 50 and 200 words of the workload's vocabulary (5.5 characters a word).
SHORT_CHARS, MIDDLE_CHARS, LONG_CHARS = 55, 275, 1100
TARGET_FP32_COSINE = 0.999
TARGET_SMALL_BATCH_SPEEDUP = 1.5  # ours over encode, mixed lengths, batches up to SMALL_BATCH
SMALL_BATCH = 16
PROBES = (
    "hello", "The lighthouse keeper counted the ships.", "Ünïcödé, accents and 東京タワー",
    "numbers 3.14159 and e-mail@example.com!", "a " * 400,
)


@dataclass(frozen=True)
class Settings:
    device: str = "cuda"
    precisions: tuple[str, ...] = PRECISIONS
    batch_sizes: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64, 128, 256)
    warmup_calls: int = 3
    min_calls: int = 10
    min_seconds: float = 0.3
    max_call_tokens: int | None = None  # None: engines.call_shape(device)'s


def length_mixes(count: int) -> dict[str, list[str]]:
    """``count`` texts of each kind: short (~10 words), long (~200 words, often past the model's 256 word pieces),
    and mixed (a third each of ~10, ~50 and ~200 words, shuffled)."""
    third = max(1, count // 3)
    mixed = (pseudo_sentences(third, SHORT_CHARS, seed=3) + pseudo_sentences(third, MIDDLE_CHARS, seed=4)
             + pseudo_sentences(count - 2 * third, LONG_CHARS, seed=5))
    random.Random(6).shuffle(mixed)
    return {"short": pseudo_sentences(count, SHORT_CHARS, seed=1), "long": pseudo_sentences(count, LONG_CHARS, seed=2),
            "mixed": mixed}


def probe_texts() -> list[str]:
    return [*PROBES, *pseudo_sentences(8, SHORT_CHARS, seed=7), *pseudo_sentences(8, LONG_CHARS, seed=8)]


def texts_per_second(call: Callable[[Sequence[Any]], Any], pool: Sequence[Any], size: int,
                     settings: Settings) -> float:
    """The median call's texts/s, each call embedding the next ``size`` items of ``pool``."""
    def batch(k: int) -> Sequence[Any]:
        start = k * size % max(1, len(pool) - size + 1)
        return pool[start : start + size]

    for k in range(settings.warmup_calls):
        call(batch(k))
    seconds: list[float] = []
    began = time.perf_counter()
    while len(seconds) < settings.min_calls or time.perf_counter() - began < settings.min_seconds:
        items = batch(settings.warmup_calls + len(seconds))
        start = time.perf_counter()
        call(items)
        seconds.append(time.perf_counter() - start)
    return size / statistics.median(seconds)


def min_cosine(a: np.ndarray, b: np.ndarray) -> float:
    a, b = a.astype(np.float64), b.astype(np.float64)
    return float(np.min(np.sum(a * b, axis=1) / np.linalg.norm(a, axis=1) / np.linalg.norm(b, axis=1)))


def weights_dtype(model_dir: Path) -> str:
    """The stored type of the transformer's first weight (float32, or float16 in a ``--pack-fp16`` copy)."""
    from safetensors import safe_open

    with safe_open(str(model_dir / "model.safetensors"), "np") as weights:
        return str(weights.get_tensor(next(iter(weights.keys()))).dtype)


def pack_fp16(model_dir: Path, target: Path) -> Path:
    """A copy of ``model_dir`` whose ``model.safetensors`` holds fp16 weights."""
    from safetensors.numpy import load_file, save_file

    shutil.copytree(model_dir, target, ignore=shutil.ignore_patterns("model.safetensors"), dirs_exist_ok=True)
    weights = load_file(str(model_dir / "model.safetensors"))
    save_file({name: w.astype(np.float16) if w.dtype == np.float32 else w for name, w in weights.items()},
              str(target / "model.safetensors"), metadata={"format": "pt"})
    return target


def call_shape_of(settings: Settings) -> CallShape:
    """How ours cuts its engine calls on the device: the device's way, with ``max_call_tokens`` if set."""
    from deployments.model.backends.engines import call_shape

    shape = call_shape(settings.device)
    return shape._replace(max_tokens=settings.max_call_tokens) if settings.max_call_tokens else shape


class Sides:
    """Ours and sentence-transformers', one precision, on one device; each turns a list of texts into vectors."""

    def __init__(self, model_dir: Path, precision: str, settings: Settings) -> None:
        from deployments.model.backends.engines import default_threads, make_engine
        from deployments.model.backends.model_dir import ModelDir
        from deployments.model.backends.wordpieces import BoundedTokenizer

        self.model = ModelDir.read(model_dir)
        self.wordpieces = BoundedTokenizer(self.model.tokenizer_file, self.model.max_seq_length,
                                           lowercase=self.model.do_lower_case)
        self.engine = make_engine("torch", self.model, threads=default_threads(), device=settings.device,
                                  precision=precision)
        self.call_shape = call_shape_of(settings)
        self.reference = sentence_transformer(model_dir, settings.device, precision)

    def ours_from_ids(self, sequences: Sequence[Sequence[int]]) -> np.ndarray:
        from deployments.model.backends.engines import embed_sequences

        return embed_sequences(self.engine, sequences, self.wordpieces.pad_id, self.model.left_padding,
                               self.call_shape)

    def ours(self, texts: Sequence[str]) -> np.ndarray:
        return self.ours_from_ids(self.wordpieces.encode_many(list(texts)))

    def encode(self, texts: Sequence[str], batch_size: int = 32) -> np.ndarray:
        return self.reference.encode(list(texts), batch_size=batch_size, show_progress_bar=False)


def sentence_transformer(model_dir: Path, device: str, precision: str = "fp32") -> Any:
    """sentence-transformers' model computing in ``precision``: cast explicitly, since it loads weights stored in
    fp16 (a ``--pack-fp16`` copy) as fp16."""
    from sentence_transformers import SentenceTransformer

    from deployments.model.backends.torch_engine import DTYPES

    return SentenceTransformer(str(model_dir), device=device, local_files_only=True).to(DTYPES[precision])


def measure(model_dir: Path, settings: Settings) -> dict[str, Any]:
    """Precision -> its cosines to sentence-transformers' fp32 and its texts/s per length mix and batch size."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # the model is on disk: never reach for a hub
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    import torch

    pools = length_mixes(4 * max(settings.batch_sizes))
    probes = probe_texts()
    reference = sentence_transformer(model_dir, settings.device).encode(probes, show_progress_bar=False)
    results: dict[str, Any] = {}
    for precision in settings.precisions:
        results[precision] = measure_sides(Sides(model_dir, precision, settings), pools, probes, reference, settings)
        gc.collect()  # the last precision's models, before the next one loads
        if settings.device == "cuda":
            torch.cuda.empty_cache()
    return results


def measure_sides(sides: Sides, pools: dict[str, list[str]], probes: list[str], reference: np.ndarray,
                  settings: Settings) -> dict[str, Any]:
    row: dict[str, Any] = {
        "cosine_to_st_fp32": {"ours": min_cosine(sides.ours(probes), reference),
                              "sentence_transformers": min_cosine(sides.encode(probes), reference)},
        "texts_per_s": {},
        "mean_word_pieces": {},
    }
    for mix, texts in pools.items():
        ids = sides.wordpieces.encode_many(texts)
        row["mean_word_pieces"][mix] = statistics.mean(map(len, ids))
        row["texts_per_s"][mix] = {
            str(size): {
                "ours": texts_per_second(sides.ours, texts, size, settings),
                "ours_from_ids": texts_per_second(sides.ours_from_ids, ids, size, settings),
                "sentence_transformers": texts_per_second(lambda batch, n=size: sides.encode(batch, n), texts, size,
                                                          settings),
            }
            for size in settings.batch_sizes
        }
    return row


def verdicts(results: dict[str, Any]) -> dict[str, Any]:
    """The issue's targets, per precision measured: fp32 cosine, never slower than encode, faster at small batches."""
    out: dict[str, Any] = {}
    for precision, row in results.items():
        ratios = {mix: {size: cell["ours"] / cell["sentence_transformers"] for size, cell in cells.items()}
                  for mix, cells in row["texts_per_s"].items()}
        small = [ratio for size, ratio in ratios.get("mixed", {}).items() if int(size) <= SMALL_BATCH]
        out[precision] = {
            "ours_over_encode": ratios,
            "never_slower": all(r >= 1.0 for cells in ratios.values() for r in cells.values()),
            "min_small_batch_mixed_speedup": min(small) if small else None,
            "small_batch_mixed_met": bool(small) and min(small) >= TARGET_SMALL_BATCH_SPEEDUP,
        }
    if "fp32" in results:
        out["fp32_cosine_met"] = results["fp32"]["cosine_to_st_fp32"]["ours"] >= TARGET_FP32_COSINE
    return out


def device_info(device: str) -> dict[str, Any]:
    import sentence_transformers
    import torch
    import transformers

    info = {"torch": torch.__version__, "torch_cuda": torch.version.cuda, "transformers": transformers.__version__,
            "sentence_transformers": sentence_transformers.__version__, "device": device}
    if device == "cuda":
        info["gpu"] = torch.cuda.get_device_name(0)
    return info


def render(settings: Settings, data: dict[str, Any]) -> str:
    info, results, met = data["device"], data["results"], data["verdicts"]
    lines = [
        f"Device `{settings.device}`{' (' + info['gpu'] + ')' if 'gpu' in info else ''}; torch {info['torch']} "
        f"(CUDA {info['torch_cuda']}), transformers {info['transformers']}, sentence-transformers "
        f"{info['sentence_transformers']}. Model `{data['model_dir']}`, weights stored in {data['weights_dtype']}"
        + (" (a --pack-fp16 copy: the fp32 reference computes on fp16-rounded weights)"
           if data["weights_dtype"] != "float32" else "") + f"; ours calls at most {data['max_call_tokens']} padded "
        f"positions. Texts/s, median call; ours and `encode` tokenize; 'ids' is ours from word-piece ids.",
        "",
    ]
    for precision, row in results.items():
        cosine = row["cosine_to_st_fp32"]
        lines += [f"## {precision}", "",
                  f"Min cosine over {len(probe_texts())} probes to sentence-transformers fp32: ours "
                  f"{cosine['ours']:.6f}, sentence-transformers {precision} {cosine['sentence_transformers']:.6f}.", ""]
        for mix, cells in row["texts_per_s"].items():
            lines += [f"{mix} texts (mean {row['mean_word_pieces'][mix]:.0f} word pieces):", "", markdown_table(
                ["batch", "ours", "ours (ids)", "encode", "ours / encode"],
                [[size, _rate(c["ours"]), _rate(c["ours_from_ids"]), _rate(c["sentence_transformers"]),
                  f"{c['ours'] / c['sentence_transformers']:.2f}×"] for size, c in cells.items()]), ""]
        verdict = met[precision]
        small = verdict["min_small_batch_mixed_speedup"]
        lines += [f"Never slower than `encode`: {_yes(verdict['never_slower'])}; ours / encode with mixed lengths at "
                  f"batch 1-{SMALL_BATCH}: at least {'—' if small is None else f'{small:.2f}×'} (target "
                  f"{TARGET_SMALL_BATCH_SPEEDUP}×: {_yes(verdict['small_batch_mixed_met'])}).", ""]
    if "fp32_cosine_met" in met:
        lines.append(f"fp32 cosine ≥ {TARGET_FP32_COSINE} for every probe: {_yes(met['fp32_cosine_met'])}.")
    return "\n".join(lines)


def _rate(texts_per_s: float) -> str:
    return f"{texts_per_s:.0f}" if texts_per_s >= 100 else f"{texts_per_s:.3g}"


def _yes(met: bool) -> str:
    return "yes" if met else "**no**"


def run(model_dir: Path, settings: Settings, out: Path) -> dict[str, Any]:
    results = measure(model_dir, settings)
    data = {"settings": asdict(settings), "model_dir": str(model_dir), "weights_dtype": weights_dtype(model_dir),
            "max_call_tokens": call_shape_of(settings).max_tokens,
            "device": device_info(settings.device), "results": results,
            "verdicts": verdicts(results)}
    return write_report(f"engine_{settings.device}", "The local model's engine alone against sentence-transformers",
                        render(settings, data), data, out)


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in text.split(","))


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m load.gpu_bench", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    defaults = Settings()
    parser.add_argument("--device", choices=("cuda", "cpu"), default=defaults.device)
    parser.add_argument("--precisions", default=",".join(defaults.precisions), help="of fp32, fp16, bf16")
    parser.add_argument("--batch-sizes", type=_ints, default=defaults.batch_sizes)
    parser.add_argument("--warmup-calls", type=int, default=defaults.warmup_calls)
    parser.add_argument("--min-calls", type=int, default=defaults.min_calls)
    parser.add_argument("--min-seconds", type=float, default=defaults.min_seconds)
    parser.add_argument("--max-call-tokens", type=int, help="padded positions per call (default: the device's)")
    parser.add_argument("--model-dir", type=Path, help="default: the packaged all-MiniLM-L6-v2")
    add_results_dir_argument(parser)
    parser.add_argument("--pack-fp16", type=Path, metavar="DIR", help="write the model with fp16 weights there; exit")
    args = parser.parse_args(argv)
    if args.model_dir is None:
        from deployments.model.backends.model_dir import packaged_model_path

        args.model_dir = Path(packaged_model_path())
    if args.pack_fp16 is not None:
        print(pack_fp16(args.model_dir, args.pack_fp16))
        return 0
    precisions = tuple(args.precisions.split(","))
    unknown = sorted(set(precisions) - set(PRECISIONS))
    if unknown or min(args.batch_sizes) < 1:
        parser.error(f"--precisions of {', '.join(PRECISIONS)} (not {', '.join(unknown)}); --batch-sizes >= 1")
    settings = Settings(device=args.device, precisions=precisions, batch_sizes=args.batch_sizes,
                        warmup_calls=args.warmup_calls, min_calls=args.min_calls, min_seconds=args.min_seconds,
                        max_call_tokens=args.max_call_tokens)
    run(args.model_dir, settings, args.results_dir)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

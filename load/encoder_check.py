"""The local backend on the encoder shapes users bring, measured from outside: ``serve run`` serving the tiny
random-weight directories of ``load.tiny_encoders`` (CLS + Normalize with Matryoshka sizes, mean + Dense, max /
mean_sqrt_len / weightedmean, a Qwen2 decoder with last-token pooling and left padding), each on both engines, and
this process comparing what ``POST /v1/embeddings`` answers with sentence-transformers' ``encode`` on the same
directory: for every prompt choice (none: the default; each ``prompt_name``; ``input_type`` query and document) the
least cosine over the probe texts and whether ``usage`` equals the tokens embedded; an unknown prompt's 400; each
Matryoshka size against the full vector's head, normalised again.

    flock /tmp/ray.lock .venv/bin/python -m load.encoder_check [--work-dir DIR] [--results-dir DIR]

Starts its own Ray instance (``serve run``, one replica a model entry, no CPU reserved) and stops it. The rows go
to ``encoder_check.json`` under ``--results-dir``.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
from pathlib import Path
from typing import Any, Iterator

import httpx
import numpy as np

from load.bench.report import add_results_dir_argument
from load.bench.shipped_service import serve_run
from load.peers.launch import Server, running
from load.tiny_encoders import PROBES, TINY_ENCODERS, TinyEncoder, make_all, tokens_embedded

ENGINES = ("onnx", "torch")
DEFAULT_WORK_DIR = Path("/tmp/encoder-check")


def serve_config(dirs: dict[str, Path], onnx_cache: Path) -> dict[str, Any]:
    models = [{"name": f"{spec.name}-{engine}", "model_path": str(dirs[spec.name]), "engine": engine, "threads": 1,
               "num_replicas": 1, "ray_actor_options": {"num_cpus": 0},
               "batching": {"max_batch_size": 32, "max_wait_ms": 5},
               **({"onnx_cache_dir": str(onnx_cache)} if engine == "onnx" else {}),
               **({"matryoshka_dims": list(spec.matryoshka_dims)} if spec.matryoshka_dims else {})}
              for spec in TINY_ENCODERS for engine in ENGINES]
    return {"proxy_location": "HeadOnly", "http_options": {"host": "127.0.0.1", "port": 8000},
            "applications": [{"name": "embeddings", "route_prefix": "/", "import_path": "deployments.app:build_app",
                              "args": {"models": models}}]}


def prompt_choices(reference: Any) -> Iterator[tuple[str, dict[str, str], np.ndarray, str]]:
    """(label, the request's extension fields, sentence-transformers' vectors, the prompt text it used)."""
    texts = list(PROBES)
    default = reference.prompts.get(reference.default_prompt_name, "") if reference.default_prompt_name else ""
    yield "default", {}, reference.encode(texts), default
    for name, text in reference.prompts.items():
        yield f"prompt_name={name}", {"prompt_name": name}, reference.encode(texts, prompt_name=name), text
    query = reference.prompts.get("query", "")
    yield "input_type=query", {"input_type": "query"}, reference.encode_query(texts), query
    document = next((reference.prompts[n] for n in ("document", "passage", "corpus") if n in reference.prompts), "")
    yield "input_type=document", {"input_type": "document"}, reference.encode_document(texts), document


def check_model(client: httpx.Client, spec: TinyEncoder, engine: str, reference: Any) -> list[dict[str, Any]]:
    model = f"{spec.name}-{engine}"

    def post(**extra: Any) -> httpx.Response:
        return client.post("/v1/embeddings", json={"model": model, "input": list(PROBES), **extra})

    rows = []
    for label, extra, expected, prompt in prompt_choices(reference):
        response = post(**extra)
        response.raise_for_status()
        body = response.json()
        vectors = np.array([entry["embedding"] for entry in body["data"]], dtype=np.float32)
        norms = np.linalg.norm(vectors, axis=1)
        cosine = np.sum(vectors * expected, axis=1) / norms / np.linalg.norm(expected, axis=1)
        tokens = sum(tokens_embedded(reference, [prompt + text for text in PROBES]))
        unit = bool(np.allclose(norms, 1.0, atol=1e-5))
        rows.append({"model": model, "check": label, "min_cosine": round(float(cosine.min()), 6),
                     "usage": body["usage"]["prompt_tokens"], "tokens_embedded": tokens,
                     "unit_length": unit, "normalize": spec.normalize})
    unknown = post(prompt_name="no-such-prompt")
    rows.append({"model": model, "check": "unknown prompt_name", "status": unknown.status_code,
                 "param": unknown.json()["error"].get("param"), "message": unknown.json()["error"]["message"]})
    full = np.array([e["embedding"] for e in post().json()["data"]], dtype=np.float32)
    for size in spec.matryoshka_dims:
        short = np.array([e["embedding"] for e in post(dimensions=size).json()["data"]], dtype=np.float32)
        head = full[:, :size] / np.linalg.norm(full[:, :size], axis=1, keepdims=True)
        rows.append({"model": model, "check": f"dimensions={size}",
                     "max_abs_diff_to_head": float(np.abs(short - head).max())})
    if spec.matryoshka_dims:
        other = spec.matryoshka_dims[-1] + 1
        rows.append({"model": model, "check": f"dimensions={other}", "status": post(dimensions=other).status_code})
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--work-dir", type=Path, default=DEFAULT_WORK_DIR, help="where the directories, the ONNX "
                        f"cache and the service's log go (default {DEFAULT_WORK_DIR})")
    add_results_dir_argument(parser)
    args = parser.parse_args(argv)
    from sentence_transformers import SentenceTransformer

    args.work_dir.mkdir(parents=True, exist_ok=True)
    dirs = make_all(args.work_dir / "models")
    references = {name: SentenceTransformer(str(path), device="cpu", local_files_only=True)
                  for name, path in dirs.items()}
    config = serve_config(dirs, args.work_dir / "onnx-cache")
    first = config["applications"][0]["args"]["models"][0]["name"]
    server = Server("encoder-check", serve_run(config, "encoder_check"), {}, health="/healthz",
                    stop_signal=signal.SIGINT, model=first)
    rows: list[dict[str, Any]] = []
    with running(server, args.work_dir, Path()) as started, httpx.Client(base_url=started.url, timeout=120) as client:
        for spec in TINY_ENCODERS:
            for engine in ENGINES:
                rows += check_model(client, spec, engine, references[spec.name])
    for row in rows:
        print(json.dumps(row, ensure_ascii=False))
    args.results_dir.mkdir(parents=True, exist_ok=True)
    out = args.results_dir / "encoder_check.json"
    out.write_text(json.dumps(rows, indent=1, ensure_ascii=False))
    print(f"wrote {out}", file=sys.stderr)
    failed = [row for row in rows if not passed(row)]
    print(f"{len(rows) - len(failed)}/{len(rows)} checks passed", file=sys.stderr)
    return 1 if failed else 0


def passed(row: dict[str, Any]) -> bool:
    if "min_cosine" in row:
        return row["min_cosine"] >= 0.999 and row["usage"] == row["tokens_embedded"] and (
            row["unit_length"] == row["normalize"])
    if "max_abs_diff_to_head" in row:
        return row["max_abs_diff_to_head"] < 1e-5
    if row["check"] == "unknown prompt_name":
        return row["status"] == 400 and row["param"] == "prompt_name"
    return row["status"] == 400


if __name__ == "__main__":
    sys.exit(main())

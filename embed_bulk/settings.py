"""What a bulk run is asked to do: the typed settings and the command line that builds them."""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

MAX_BATCH_SIZE = 2048  # the most inputs the service takes in one request
MAX_BATCH_LINES = 50_000  # the most lines a Batch API input file may hold (OpenAI's, and the service's default)
API_KEY_ENV = "EMBEDDINGS_API_KEY"

InputFormat = Literal["auto", "jsonl", "text"]
OutputKind = Literal["jsonl", "npy"]
ProgressMode = Literal["auto", "always", "never"]
Via = Literal["embeddings", "batch"]

OUTPUT_KINDS: dict[str, OutputKind] = {".jsonl": "jsonl", ".ndjson": "jsonl", ".npy": "npy"}
JSONL_INPUT_SUFFIXES = (".jsonl", ".ndjson")


@dataclass(frozen=True)
class BulkSettings:
    """One bulk run. Rerunning with equal settings resumes where an interrupted run stopped."""

    input_path: Path
    output_path: Path
    base_url: str = "http://127.0.0.1:8000/v1"
    model: str = "all-MiniLM-L6-v2"
    api_key: str | None = None
    priority: str = "low"
    concurrency: int = 16  # enough in flight that a cached re-run is not bound by each request's latency
    batch_size: int = 256  # (see "Nightly bulk indexing" in the README for the measurements)
    max_rate: float | None = None  # documents a second at most
    max_retries: int = 5
    timeout_s: float = 120.0
    connect_timeout_s: float = 10.0
    input_format: InputFormat = "auto"
    id_field: str = "id"
    text_field: str = "text"
    encoding_format: Literal["base64", "float"] = "base64"
    dimensions: int | None = None
    progress: ProgressMode = "auto"
    stats_url: str | None = None
    grace_s: float = 5.0  # after SIGINT/SIGTERM: how long the requests in flight may take to finish and be saved
    strict: bool = False  # a malformed input line ends the run before it starts, instead of failing alone
    via: Via = "embeddings"  # batch: through the service's Batch API (embed_bulk.via_batch)
    batch_lines: int = MAX_BATCH_LINES  # --via batch: documents an input file

    def __post_init__(self) -> None:
        checks = {
            f"batch_size must be within [1, {MAX_BATCH_SIZE}]": 1 <= self.batch_size <= MAX_BATCH_SIZE,
            "concurrency must be >= 1": self.concurrency >= 1,
            "max_rate must be None or > 0": self.max_rate is None or self.max_rate > 0,
            "max_retries must be >= 0": self.max_retries >= 0,
            "timeouts must be > 0": min(self.timeout_s, self.connect_timeout_s) > 0,
            "grace must be >= 0": self.grace_s >= 0,
            "dimensions must be None or >= 1": self.dimensions is None or self.dimensions >= 1,
            f"output must end in one of {', '.join(OUTPUT_KINDS)}": self.output_path.suffix.lower() in OUTPUT_KINDS,
            "input and output must be different files": self.input_path.resolve() != self.output_path.resolve(),
            "priority must be 'low' or 'high'": self.priority in ("low", "high"),
            f"batch_lines must be within [1, {MAX_BATCH_LINES}]": 1 <= self.batch_lines <= MAX_BATCH_LINES,
        }
        problems = [problem for problem, ok in checks.items() if not ok]
        if problems:
            raise ValueError("invalid BulkSettings: " + "; ".join(problems))

    @property
    def output_kind(self) -> OutputKind:
        return OUTPUT_KINDS[self.output_path.suffix.lower()]

    @property
    def reads_jsonl(self) -> bool:
        if self.input_format == "auto":
            return self.input_path.suffix.lower() in JSONL_INPUT_SUFFIXES
        return self.input_format == "jsonl"

    @property
    def failures_path(self) -> Path:
        return sidecar(self.output_path, "failures.jsonl")


def sidecar(output_path: Path, name: str) -> Path:
    """`<out>.<name>`: a file kept next to the output, e.g. `vectors.npy.ids.jsonl`."""
    return output_path.with_name(f"{output_path.name}.{name}")


def build_parser() -> argparse.ArgumentParser:
    defaults = BulkSettings(Path("in.txt"), Path("out.jsonl"))
    parser = argparse.ArgumentParser(
        prog="embed-bulk",
        description="Embed every document of a file through the embeddings API; rerun the same command to resume.",
    )
    parser.add_argument("input", type=Path, help="JSONL with id and text fields, or plain text: one document a line")
    parser.add_argument("output", type=Path, help="*.jsonl (id, embedding rows) or *.npy (+ <out>.ids.jsonl)")
    parser.add_argument("--base-url", default=defaults.base_url, help="the API root (default: %(default)s)")
    parser.add_argument("--model", default=defaults.model, help="model name (default: %(default)s)")
    parser.add_argument("--api-key", default=os.environ.get(API_KEY_ENV), help=f"bearer key (default: ${API_KEY_ENV})")
    parser.add_argument("--priority", choices=("low", "high"), default=defaults.priority, help="X-Priority header")
    parser.add_argument("--concurrency", type=int, default=defaults.concurrency, help="requests in flight at once")
    parser.add_argument(
        "--batch-size", type=int, default=defaults.batch_size, help=f"inputs a request (<= {MAX_BATCH_SIZE})"
    )
    parser.add_argument(
        "--max-rate", type=float, default=None,
        help="documents a second at most (default: no limit); leaves headroom for interactive users of the service",
    )
    parser.add_argument(
        "--max-retries",
        type=int,
        default=defaults.max_retries,
        help="retries of a request answered 429, 408, 409 or 5xx, or lost (waits Retry-After, else backs off)",
    )
    parser.add_argument("--timeout", dest="timeout_s", type=float, default=defaults.timeout_s, help="seconds a request")
    parser.add_argument(
        "--input-format",
        choices=("auto", "jsonl", "text"),
        default=defaults.input_format,
        help="auto: JSONL for *.jsonl / *.ndjson, plain text otherwise",
    )
    parser.add_argument("--id-field", default=defaults.id_field, help="JSONL field holding the id")
    parser.add_argument("--text-field", default=defaults.text_field, help="JSONL field holding the text")
    parser.add_argument("--encoding-format", choices=("base64", "float"), default=defaults.encoding_format)
    parser.add_argument("--dimensions", type=int, default=None, help="ask for shorter embeddings")
    parser.add_argument(
        "--progress",
        choices=("auto", "always", "never"),
        default=defaults.progress,
        help="progress bar; auto: only when stderr is a terminal",
    )
    parser.add_argument(
        "--stats-url", default=None, help="a JSON endpoint counting upstream 'calls' (e.g. load.upstream's /stats)"
    )
    parser.add_argument(
        "--grace", dest="grace_s", type=float, default=defaults.grace_s,
        help="seconds the requests in flight get to finish after SIGINT/SIGTERM (default: %(default)s)",
    )
    parser.add_argument(
        "--via", choices=("embeddings", "batch"), default=defaults.via,
        help="embeddings: /v1/embeddings requests; batch: the service's Batch API, in files of --batch-lines "
             "documents (batches left running by a stopped run are waited for by the next)",
    )
    parser.add_argument("--batch-lines", type=int, default=defaults.batch_lines,
                        help=f"--via batch: documents an input file (<= {MAX_BATCH_LINES})")
    parser.add_argument(
        "--strict", action="store_true",
        help="exit 2 at the first malformed input line, before embedding anything (default: it fails alone)",
    )
    return parser


def parse_args(argv: list[str] | None = None) -> BulkSettings:
    parser = build_parser()
    args = parser.parse_args(argv)
    fields = {name: value for name, value in vars(args).items() if name not in ("input", "output")}
    try:
        return BulkSettings(input_path=args.input, output_path=args.output, **fields)
    except ValueError as error:
        parser.error(str(error))

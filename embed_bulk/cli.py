"""`python -m embed_bulk` / `embed-bulk`: run a bulk job and print what it did."""

from __future__ import annotations

import asyncio
import sys
from typing import IO

from embed_bulk.api import Failure
from embed_bulk.documents import InputError
from embed_bulk.interrupt import Interruption
from embed_bulk.job import BulkJob, Summary
from embed_bulk.lock import OutputBusy
from embed_bulk.settings import BulkSettings, parse_args, sidecar
from embed_bulk.store import StoreError

FAILURES_LISTED = 20
EXIT_BUSY = 75  # EX_TEMPFAIL (sysexits.h): another run holds the output; a later try will do


def main(argv: list[str] | None = None) -> int:
    """Exit status: 0 all rows embedded, 1 some rows failed, 2 unusable input or output, 75 another run is writing
    the output, 130 / 143 stopped by SIGINT / SIGTERM (`embed_bulk.interrupt`)."""
    settings = parse_args(argv)
    job = BulkJob(settings)
    interruption = Interruption(settings.grace_s, job.stop)
    try:
        summary = interruption.run(job.run())
    except asyncio.CancelledError:  # the grace ran out with requests still in flight
        summary = job.summary
    except OutputBusy as error:
        print(f"embed-bulk: {error}", file=sys.stderr)
        return EXIT_BUSY
    except (InputError, StoreError, OSError) as error:
        print(f"embed-bulk: {error}", file=sys.stderr)
        return 2
    print_summary(summary, settings, sys.stderr)
    if summary.interrupted and interruption.exit_status is not None:
        return interruption.exit_status
    return summary.exit_code


def print_summary(summary: Summary, settings: BulkSettings, stream: IO[str]) -> None:
    stream.write("\n".join(summary_lines(summary, settings)) + "\n")
    stream.flush()


def summary_lines(summary: Summary, settings: BulkSettings) -> list[str]:
    calls = summary.calls
    lines = [
        f"embed-bulk: {summary.total} rows in input: {summary.embedded} embedded, "
        f"{summary.skipped} skipped as already done, {len(summary.failures)} failed",
        f"  wall time {summary.wall_s:.1f} s, {summary.rows_per_s:.1f} rows/s; {calls.requests} requests "
        f"({calls.retries} retries; {calls.rate_limited} answered 429), {calls.tokens} tokens",
    ]
    if summary.upstream_calls is not None:
        lines.append(f"  upstream calls: {summary.upstream_calls}")
    if summary.failures:
        lines.append(f"  failed rows (all in {settings.failures_path}):")
        lines.extend(f"    {_failed_row(failure)}" for failure in summary.failures[:FAILURES_LISTED])
        if len(summary.failures) > FAILURES_LISTED:
            lines.append(f"    ... and {len(summary.failures) - FAILURES_LISTED} more")
    if summary.interrupted:
        lines.append("  interrupted: finished batches are saved; rerun the same command to embed the rest")
    else:
        lines.append(f"  output: {_output_names(settings)}")
    return lines


def _failed_row(failure: Failure) -> str:
    """A failed row by its id; a line that held no document by its message, which names the line."""
    return failure.message if failure.id is None else f"{failure.id!r}: {failure.message}"


def _output_names(settings: BulkSettings) -> str:
    if settings.output_kind == "npy":
        return f"{settings.output_path} (+ ids in {sidecar(settings.output_path, 'ids.jsonl')})"
    return str(settings.output_path)

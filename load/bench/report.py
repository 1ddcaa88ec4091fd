"""Writing benchmark results: a Markdown report and a JSON twin, with the machine noted.

Every benchmark writes under ``--results-dir`` (``add_results_dir_argument``), by default ``DEFAULT_RESULTS_DIR``
outside the source tree, so that a run leaves the committed results alone; ``--results-dir load/results``
regenerates those (``load/results/README.md`` lists each scenario's command).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
import tempfile
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

DEFAULT_RESULTS_DIR = Path(tempfile.gettempdir()) / "embedding-bench"


def add_results_dir_argument(parser: argparse.ArgumentParser) -> None:
    """The one ``--results-dir`` option every benchmark takes (``args.results_dir``)."""
    parser.add_argument(
        "--results-dir", type=Path, default=DEFAULT_RESULTS_DIR,
        help=f"where Markdown, JSON and plots go (default {DEFAULT_RESULTS_DIR}; "
             "load/results to regenerate the committed ones)",
    )


def machine_info() -> dict[str, Any]:
    """What a reader needs to judge the numbers: cores, Python, platform, when."""
    return {
        "cpu_count": os.cpu_count(),
        "python": platform.python_version(),
        "implementation": sys.implementation.name,
        "platform": platform.platform(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }


def machine_line(info: Mapping[str, Any]) -> str:
    return (
        f"{info['cpu_count']} cores, Python {info['python']} ({info['implementation']}), "
        f"{info['platform']}, {info['date']}"
    )


def markdown_table(headers: Sequence[str], rows: Iterable[Sequence[object]]) -> str:
    """A GitHub-flavoured table; the first column is left-aligned, the others right-aligned (numbers)."""
    lines = [
        "| " + " | ".join(headers) + " |",
        "|" + "|".join([":---"] + ["---:"] * (len(headers) - 1)) + "|",
    ]
    lines += ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]
    return "\n".join(lines)


def write_report(
    name: str, title: str, body: str, data: Mapping[str, Any], results_dir: Path | None = None,
    also_written: Sequence[Path] = (),
) -> dict[str, Any]:
    """Write ``<name>.md`` (title, machine line, body) and ``<name>.json`` (scenario, machine, data), and print the
    Markdown and where it went (with ``also_written``, the files the scenario wrote beside them).

    Returns ``data`` with the machine first: ``data["machine"]`` when present, else the machine described now.
    """
    directory = Path(results_dir) if results_dir is not None else DEFAULT_RESULTS_DIR
    directory.mkdir(parents=True, exist_ok=True)
    data = {"machine": data.get("machine") or machine_info(), **data}
    markdown = f"# {title}\n\nMachine: {machine_line(data['machine'])}\n\n{body.rstrip()}\n"
    md_path, json_path = directory / f"{name}.md", directory / f"{name}.json"
    md_path.write_text(markdown, encoding="utf-8")
    json_path.write_text(json.dumps({"scenario": name, **data}, indent=2, default=str) + "\n", encoding="utf-8")
    print(markdown)
    written = [md_path, json_path, *also_written]
    print(f"wrote {', '.join(str(path) for path in written[:-1])} and {written[-1]}")
    return data

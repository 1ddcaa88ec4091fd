"""Writing benchmark results: a Markdown report and a JSON twin under ``load/results/``, with the machine noted."""

from __future__ import annotations

import datetime
import json
import os
import platform
import sys
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

RESULTS_DIR = Path(__file__).resolve().parents[1] / "results"


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
    directory = Path(results_dir) if results_dir is not None else RESULTS_DIR
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

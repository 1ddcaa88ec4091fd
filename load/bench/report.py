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


def write_results(
    name: str, title: str, body: str, data: Mapping[str, Any], results_dir: Path | None = None
) -> tuple[Path, Path]:
    """Write ``<name>.md`` (title, machine line, body) and ``<name>.json`` (scenario, machine, data).

    Returns both paths. ``data["machine"]`` is used when present, else the machine is described now.
    """
    directory = Path(results_dir) if results_dir is not None else RESULTS_DIR
    directory.mkdir(parents=True, exist_ok=True)
    machine = data.get("machine") or machine_info()
    markdown = f"# {title}\n\nMachine: {machine_line(machine)}\n\n{body.rstrip()}\n"
    md_path, json_path = directory / f"{name}.md", directory / f"{name}.json"
    md_path.write_text(markdown, encoding="utf-8")
    payload = {"scenario": name, "machine": machine, **{k: v for k, v in data.items() if k != "machine"}}
    json_path.write_text(json.dumps(payload, indent=2, default=str) + "\n", encoding="utf-8")
    return md_path, json_path

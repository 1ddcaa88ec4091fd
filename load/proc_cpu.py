"""CPU time of a server's processes, from ``/proc``: what each kind of process spent while a load ran, so a benchmark
can say where a text's CPU goes (the model's replica, the ingress, HAProxy, Ray's daemons, a peer's workers).

Processes are grouped by what they are: a Ray worker by its title (``ray::ServeReplica:embeddings:EmbeddingsIngress``),
a Python program by its module or script, anything else by its executable's name. A process that started during the
load counts from zero; one that ended during it is missing from the second sample, and its CPU is lost (none of a
server's processes should come and go under a steady load).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Callable, Iterable

CLOCK_TICKS = os.sysconf("SC_CLK_TCK")

Sample = dict[int, tuple[str, float]]  # pid -> (its group, CPU seconds so far)


def process_group(cmdline: list[str]) -> str:
    """What a process is, from its command line."""
    if len(cmdline) == 1:  # a process that rewrote its title as one string
        cmdline = cmdline[0].split()
    if not cmdline:
        return "?"
    if cmdline[0].startswith("ray::"):
        return cmdline[0].split()[0]
    program = os.path.basename(cmdline[0])
    if program.startswith("python"):
        for i, arg in enumerate(cmdline[1:], 1):  # the interpreter's own flags, then what it runs
            if arg == "-c":
                return "python -c"
            if arg == "-m" and i + 1 < len(cmdline):
                return f"python -m {cmdline[i + 1]}"
            if not arg.startswith("-"):
                return f"python {os.path.basename(arg)}"
        return program
    return program


def sample(pids: Iterable[int]) -> Sample:
    """Each live process's group and CPU seconds (user and system, all its threads)."""
    found: Sample = {}
    for pid in pids:
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
            raw = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()
        seconds = (int(fields[11]) + int(fields[12])) / CLOCK_TICKS  # utime, stime
        found[pid] = (process_group([arg for arg in raw.decode("utf-8", "replace").split("\0") if arg]), seconds)
    return found


def descendants(root: int | None = None) -> list[int]:
    """The live processes ``root`` (by default this one) started, and those they started, from ``/proc``: a Ray
    cluster this process started in-process, with its workers and HAProxy."""
    root = os.getpid() if root is None else root
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            state, parent = (entry / "stat").read_text().rsplit(")", 1)[1].split()[:2]
        except OSError:
            continue
        if state != "Z":
            children.setdefault(int(parent), []).append(int(entry.name))
    found, unvisited = [], list(children.get(root, []))
    while unvisited:
        pid = unvisited.pop()
        found.append(pid)
        unvisited.extend(children.get(pid, []))
    return found


def spent(before: Sample, after: Sample) -> dict[str, float]:
    """CPU seconds spent between two samples, by group, largest first."""
    groups: dict[str, float] = {}
    for pid, (group, seconds) in after.items():
        groups[group] = groups.get(group, 0.0) + seconds - before.get(pid, (group, 0.0))[1]
    return dict(sorted(groups.items(), key=lambda item: -item[1]))


class CpuMeter:
    """The CPU of the processes ``pids()`` names (None: none is measured): ``started = meter.start()`` before a load,
    ``meter.ms_each(started, served)`` after it gives each group's CPU milliseconds in between, per item served."""

    def __init__(self, pids: Callable[[], Iterable[int]] | None) -> None:
        self._pids = pids

    def start(self) -> Sample:
        return sample(self._pids()) if self._pids is not None else {}

    def ms_each(self, started: Sample, served: int) -> dict[str, float]:
        if self._pids is None:
            return {}
        return {group: 1e3 * seconds / max(1, served)
                for group, seconds in spent(started, sample(self._pids())).items()}

"""The service as shipped at another commit, a server of ``python -m load.bench peers``: ``--servers
service,service@HEAD~1,infinity-onnx,mosec`` measures a change and the code before it in one run, rotated with the
peers, instead of in two runs that the machine's drift between them can make differ by more than the change.

``service@<rev>`` (any git revision: ``HEAD~1``, a branch, a hash) runs ``serve run`` on that commit's
``serve_config.yaml`` with that commit's ``serve.env``, from a git worktree of it made for the run and removed after,
in this checkout's virtualenv (a commit that needs other packages than it has is not measured as it would run).
Its row is named by the commit's short hash.
"""

from __future__ import annotations

import subprocess
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import yaml

from load.peers.launch import ROOT, Server

from .shipped_service import shipped

PREFIX = "service@"


def names_a_commit(name: str) -> bool:
    return name.startswith(PREFIX) and len(name) > len(PREFIX)


@contextmanager
def service_at(name: str) -> Iterator[Server]:
    """The service at the commit ``name`` names (``service@<rev>``), checked out while the context lasts."""
    with checkout(name[len(PREFIX):], name) as (short, tree):
        config = yaml.safe_load((tree / "serve_config.yaml").read_text())
        yield shipped(f"{PREFIX}{short}", config, tree)


@contextmanager
def checkout(revision: str, asked_as: str | None = None) -> Iterator[tuple[str, Path]]:
    """The commit ``revision`` names (its short hash) and a git worktree of it, removed when the context ends;
    ``SystemExit`` (naming ``asked_as``, or the revision) if it names none."""
    found = _git("rev-parse", "--verify", "--quiet", "--short", f"{revision}^{{commit}}")
    if found.returncode:
        raise SystemExit(f"{asked_as or revision}: {revision!r} names no commit of {ROOT}")
    short = found.stdout.strip()
    with tempfile.TemporaryDirectory(prefix="service-at-") as parent:
        tree = Path(parent) / short
        _git("worktree", "add", "--detach", str(tree), short, check=True)
        try:
            yield short, tree
        finally:
            _git("worktree", "remove", "--force", str(tree))
            _git("worktree", "prune")


def _git(*args: str, check: bool = False) -> subprocess.CompletedProcess:
    return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, check=check, timeout=120)

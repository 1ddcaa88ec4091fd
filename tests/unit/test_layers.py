"""The layers hold: ``lint-imports`` checks the ``[tool.importlinter]`` contracts of ``pyproject.toml`` (batching
imports no framework, the bulk client never imports ``deployments``, nothing but the tests imports ``load``, the
ingress side and the model side of ``deployments`` never import each other), so a
broken layer fails the test suite and with it CI."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LINT_IMPORTS = Path(sys.executable).with_name("lint-imports")  # the test extra installs it beside this Python


def test_every_import_contract_is_kept() -> None:
    assert LINT_IMPORTS.exists(), f"{LINT_IMPORTS} missing: install the test extra (pip install -e '.[test]')"
    # From the repository root: lint-imports reads ./pyproject.toml and finds load/ there (it is not installed).
    run = subprocess.run([str(LINT_IMPORTS), "--no-cache", "--no-logo"], cwd=ROOT, capture_output=True, text=True,
                         timeout=120)
    assert run.returncode == 0 and " 0 broken" in run.stdout, f"lint-imports failed:\n{run.stdout}\n{run.stderr}"

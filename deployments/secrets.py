"""Secrets (API keys) from the environment, or from a file an environment variable names.

``NAME`` holds the secret itself; ``NAME_FILE`` holds the path of a file that does (the convention of Docker and
Kubernetes secrets). Prefer the file, or set ``NAME`` in the environment of the process that starts Ray: Ray writes
a replica's ``runtime_env`` (its ``env_vars`` included) to ``runtime_env_agent.log``, so a secret passed there
ends up in the logs. A path is no secret.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Mapping

FILE_SUFFIX = "_FILE"


class SecretFileError(RuntimeError):
    """``NAME_FILE`` names a file that cannot be read; the message names the variable and the path, never content."""


def read_secret(name: str, environ: Mapping[str, str] = os.environ) -> str:
    """``NAME``'s value if set, else the stripped content of the file ``NAME_FILE`` names, else ``""``."""
    value = environ.get(name, "")
    if value.strip():
        return value
    path = environ.get(name + FILE_SUFFIX, "").strip()
    if not path:
        return ""
    try:
        return Path(path).read_text(encoding="utf-8").strip()
    except (OSError, UnicodeDecodeError) as exc:
        raise SecretFileError(f"{name}{FILE_SUFFIX}={path!r} cannot be read: {type(exc).__name__}") from None

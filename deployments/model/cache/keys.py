"""Cache keys: a hash of everything a vector depends on, so an entry can only ever be found by its own input.

A key hashes the namespace (schema version, model entry, what the backend says its vectors depend on — the model's
files and engine, or the upstream's URL and model — and the output ``dimensions``), then the input's encoding (text
or token ids) and the input itself as the model receives it (``Prepared.content``: for the local model its ids, the
request's prompt's included, so one text under two prompts has two keys). A changed model, upstream model
or size changes every key, so an old vector is never found again; equal inputs under one namespace share one key.
Keys are hex digests: no text of the input can be read back from a key.
"""

from __future__ import annotations

import hashlib
import json
from typing import Hashable

import numpy as np

SCHEMA = "embedding-cache/1"  # bump when the key or value layout changes
KEY_PREFIX = "emb:"
_TEXT, _TOKEN_IDS = b"t", b"i"


class CacheKeys:
    """The keys of one model entry's inputs at one output size."""

    def __init__(self, model: str, backend_identity: str, dimensions: int | None) -> None:
        namespace = json.dumps([SCHEMA, model, backend_identity, dimensions]).encode()
        self._namespace = hashlib.sha256(namespace).digest()

    def key(self, content: Hashable) -> str:
        """The key of one ``Prepared.content``: a text (``str``) or a sequence of token ids (``tuple[int, ...]``)."""
        digest = hashlib.sha256(self._namespace)
        if isinstance(content, str):
            digest.update(_TEXT)
            digest.update(content.encode("utf-8", "surrogatepass"))
        elif isinstance(content, tuple):
            digest.update(_TOKEN_IDS)
            digest.update(np.asarray(content, dtype="<i8").tobytes())
        else:
            raise TypeError(f"cannot key a {type(content).__name__}: inputs are text or token ids")
        return KEY_PREFIX + digest.hexdigest()

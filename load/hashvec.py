"""Deterministic embeddings derived from a hash of the input, so any result can be traced to its input."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import numpy as np

MATCH_COSINE = 0.999

EmbeddingInput = str | Sequence[int]


def hash_embedding(item: EmbeddingInput, dim: int) -> np.ndarray:
    """A unit-length float32 vector of `dim` values that depends only on `item` (text or token ids)."""
    digest = hashlib.blake2b(_item_bytes(item), digest_size=8).digest()
    vector = np.random.default_rng(int.from_bytes(digest, "little")).standard_normal(dim, dtype=np.float32)
    return vector / np.linalg.norm(vector)


def matches(item: EmbeddingInput, vector: Sequence[float] | np.ndarray, dim: int) -> bool:
    """Whether `vector` is `item`'s embedding of width `dim`, possibly truncated (OpenAI's `dimensions`)."""
    received = np.asarray(vector, dtype=np.float32)
    expected = hash_embedding(item, dim)[: received.shape[0]]
    norms = float(np.linalg.norm(received) * np.linalg.norm(expected))
    return norms > 0 and float(received @ expected) / norms > MATCH_COSINE


def _item_bytes(item: EmbeddingInput) -> bytes:
    if isinstance(item, str):
        return b"text:" + item.encode("utf-8")
    return b"tokens:" + np.asarray(item, dtype="<i8").tobytes()

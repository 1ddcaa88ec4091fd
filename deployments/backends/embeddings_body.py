"""Reading the body of an OpenAI-compatible embeddings response: what the ``openai`` backend and ``embed-bulk`` both
read, as JSON rather than through the SDK's model objects (one per embedding: most of the SDK's cost per call)."""

from __future__ import annotations

import base64
from typing import Any

import numpy as np


def decode_embeddings(body: Any, count: int) -> np.ndarray:
    """The ``[count, d]`` float32 matrix of an embeddings response body, rows in input order. A body that is not one
    embedding per input, all of one width, raises ``ValueError`` (or the ``KeyError``/``TypeError`` of its shape)."""
    data = sorted(body["data"], key=lambda item: item["index"])
    if [item["index"] for item in data] != list(range(count)):
        raise ValueError(f"expected embeddings for indexes 0..{count - 1}, got {len(data)} items")
    vectors = [_vector(item) for item in data]
    if len({vector.shape for vector in vectors}) != 1:
        raise ValueError("embeddings of different widths in one response")
    return np.stack(vectors)


def _vector(item: dict[str, Any]) -> np.ndarray:
    embedding: str | list[float] = item["embedding"]
    if isinstance(embedding, str):  # encoding_format="base64": little-endian float32
        return np.frombuffer(base64.b64decode(embedding), dtype="<f4")
    return np.asarray(embedding, dtype=np.float32)

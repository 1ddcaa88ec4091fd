"""Reading the body of an OpenAI-compatible embeddings response: what the ``openai`` backend and ``embed-bulk`` both
read, as JSON rather than through the SDK's model objects (one per embedding: most of the SDK's cost per call).

A package of its own, beside ``deployments`` and ``embed_bulk``, importing neither: the bulk client reads the wire
format without importing the service (``[tool.importlinter]`` in ``pyproject.toml`` keeps it so)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pybase64


def decode_embeddings(body: Any, count: int) -> np.ndarray:
    """The ``[count, d]`` float32 matrix of an embeddings response body, rows in input order. A body that is not one
    embedding per input, all of one width, raises ``ValueError`` (or the ``KeyError``/``TypeError`` of its shape)."""
    data = sorted(body["data"], key=lambda item: item["index"])
    if [item["index"] for item in data] != list(range(count)):
        raise ValueError(f"expected embeddings for indexes 0..{count - 1}, got {len(data)} items")
    embeddings = [item["embedding"] for item in data]
    if embeddings and all(isinstance(embedding, str) for embedding in embeddings):  # base64: decoded as one buffer
        rows = [pybase64.b64decode(embedding) for embedding in embeddings]
        if len({len(row) for row in rows}) > 1:
            raise ValueError("embeddings of different widths in one response")
        return np.frombuffer(b"".join(rows), dtype="<f4").reshape(count, -1)
    vectors = [_vector(embedding) for embedding in embeddings]
    if len({vector.shape for vector in vectors}) != 1:
        raise ValueError("embeddings of different widths in one response")
    return np.stack(vectors)


def _vector(embedding: str | list[float]) -> np.ndarray:
    if isinstance(embedding, str):
        return np.frombuffer(pybase64.b64decode(embedding), dtype="<f4")
    return np.asarray(embedding, dtype=np.float32)

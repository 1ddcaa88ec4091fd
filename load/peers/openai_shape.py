"""The OpenAI embeddings body the peer apps read and write (stdlib and numpy only: it runs in every peer's virtualenv).

Input: ``{"input": str | [str, ...], "encoding_format": "float" | "base64"}``. Output: ``{"object": "list",
"data": [{"object": "embedding", "index": i, "embedding": [...] | "<base64 of little-endian float32>"}], "model",
"usage"}`` (the peers count no tokens: usage is 0).
"""

from __future__ import annotations

import base64
from typing import Any

import numpy as np


def parse(body: dict[str, Any]) -> tuple[list[str], str]:
    """The texts of one request and the encoding its answer wants."""
    texts = body["input"]
    return ([texts] if isinstance(texts, str) else list(texts)), body.get("encoding_format") or "float"


def answer(vectors: np.ndarray, encoding: str, model: str = "all-MiniLM-L6-v2") -> dict[str, Any]:
    rows = vectors.astype("<f4")
    embeddings = ([base64.b64encode(row.tobytes()).decode("ascii") for row in rows] if encoding == "base64"
                  else rows.tolist())
    return {"object": "list", "model": model, "usage": {"prompt_tokens": 0, "total_tokens": 0},
            "data": [{"object": "embedding", "index": i, "embedding": e} for i, e in enumerate(embeddings)]}


def answer_each(requests: list[tuple[list[str], str]], encode: Any) -> list[dict[str, Any]]:
    """Answers for a batch of requests from one ``encode(all their texts)`` call (what a request-batching server
    does with a batch)."""
    vectors = encode([text for texts, _ in requests for text in texts])
    answers, start = [], 0
    for texts, encoding in requests:
        answers.append(answer(vectors[start:start + len(texts)], encoding))
        start += len(texts)
    return answers

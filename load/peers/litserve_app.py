"""litserve: a plain ``LitAPI`` (its ``OpenAIEmbeddingSpec`` answers 400 to multi-text requests once batching is
on) with OpenAI-shaped JSON; litserve batches requests (up to 32, waiting at most 10 ms) and ``predict`` encodes all
the batch's texts in one call. One worker, CPU.

No ``from __future__ import annotations``: litserve builds its FastAPI route from ``decode_request``'s annotation,
which must be a type, not a string.
"""

import argparse
import os
from typing import Any

import litserve as ls
from sentence_transformers import SentenceTransformer

from load.peers.openai_shape import answer_each, parse

MAX_BATCH_SIZE, BATCH_TIMEOUT_S = 32, 0.01
Request = tuple[list[str], str]


class EmbedAPI(ls.LitAPI):
    def __init__(self, model_path: str) -> None:
        super().__init__(max_batch_size=MAX_BATCH_SIZE, batch_timeout=BATCH_TIMEOUT_S, api_path="/v1/embeddings")
        self.model_path = model_path

    def setup(self, device: str) -> None:
        self.model = SentenceTransformer(self.model_path, device="cpu")

    def decode_request(self, request: dict[str, Any]) -> Request:
        return parse(request)

    def batch(self, inputs: list[Request]) -> list[Request]:
        return inputs

    def predict(self, requests: list[Request]) -> list[dict[str, Any]]:
        return answer_each(requests, lambda texts: self.model.encode(texts, convert_to_numpy=True,
                                                                     normalize_embeddings=True))

    def unbatch(self, output: list[dict[str, Any]]) -> list[dict[str, Any]]:
        return output

    def encode_response(self, output: dict[str, Any]) -> dict[str, Any]:
        return output


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    args = parser.parse_args()
    server = ls.LitServer(EmbedAPI(os.environ["PEER_MODEL"]), accelerator="cpu", workers_per_device=1, timeout=120)
    server.run(host="127.0.0.1", port=args.port, generate_client_file=False)

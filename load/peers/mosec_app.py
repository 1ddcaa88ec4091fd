"""mosec: one ``Worker`` process encoding with sentence-transformers; mosec batches requests (up to 32, waiting at
most 10 ms), and the worker encodes all the batch's texts in one call. Run as mosec's own command line
(``--port``, ``--address``, ``--timeout``, ...); the model folder comes in ``PEER_MODEL``."""

from __future__ import annotations

import os
from typing import Any

from mosec import Server, Worker
from sentence_transformers import SentenceTransformer

from load.peers.openai_shape import answer_each, parse

MAX_BATCH_SIZE, MAX_WAIT_TIME_MS = 32, 10


class Embed(Worker):
    def __init__(self) -> None:
        super().__init__()
        self.model = SentenceTransformer(os.environ["PEER_MODEL"], device="cpu")

    def forward(self, data: list[dict[str, Any]]) -> list[dict[str, Any]]:
        return answer_each([parse(body) for body in data],
                           lambda texts: self.model.encode(texts, convert_to_numpy=True, normalize_embeddings=True))


if __name__ == "__main__":
    server = Server()
    server.append_worker(Embed, num=1, max_batch_size=MAX_BATCH_SIZE, max_wait_time=MAX_WAIT_TIME_MS,
                         route="/v1/embeddings")
    server.run()

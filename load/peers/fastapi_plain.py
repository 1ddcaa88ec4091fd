"""Plain FastAPI + uvicorn, one worker: an ``async def`` route that encodes each request inline with
sentence-transformers. No batching across requests (the event loop is blocked while a request encodes)."""

from __future__ import annotations

import argparse
import os
import json

import uvicorn
from fastapi import FastAPI, Request, Response
from sentence_transformers import SentenceTransformer

from load.peers.openai_shape import answer, parse


def build(model_path: str) -> FastAPI:
    model = SentenceTransformer(model_path, device="cpu")
    app = FastAPI()

    @app.post("/v1/embeddings")
    async def embeddings(request: Request) -> Response:
        texts, encoding = parse(await request.json())
        body = answer(model.encode(texts, convert_to_numpy=True, normalize_embeddings=True), encoding)
        return Response(json.dumps(body), media_type="application/json")

    return app


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    args = parser.parse_args()
    uvicorn.run(build(os.environ["PEER_MODEL"]), host="127.0.0.1", port=args.port, workers=1, log_level="warning")

"""Ray Serve's own cost of the gateway's request path, measured beside the service (``load.bench e2e``): the same
HTTP requests answered by deployments that hold none of this project's code.

- ``serve-floor-http``: the ingress replica answers each request itself (Serve's HTTP path into a replica: HAProxy,
  the replica's uvicorn and Serve's request wrapping, around a bare ASGI callable);
- ``serve-floor-call``: the same, but the vector comes from a second deployment, one handle call a request (Serve's
  handle path: routing, gRPC, the callee's request handling).

Both answer at once, with each text's hash vector (the simulated upstream's, so the clients' checks hold), so their
texts/s is not a gateway's: what they show is the CPU a request costs Serve itself, beside the service's own.
"""

from __future__ import annotations

from typing import Any

import orjson
import pybase64
from ray import serve
from ray.serve.handle import DeploymentHandle
from starlette.types import Receive, Scope, Send

from deployments.sizing import QUIET_LOGS
from load.hashvec import hash_embedding


# Sized as the service's own deployments are (deployments/sizing.py): no CPU reserved, room for every client at once,
# no access log.
FLOOR_OPTIONS: dict[str, Any] = {"ray_actor_options": {"num_cpus": 0}, "max_ongoing_requests": 1024,
                                 "logging_config": QUIET_LOGS}


@serve.deployment(**FLOOR_OPTIONS)
class HashEmbedder:
    """Answers a handle call with its text's hash vector."""

    def __init__(self, dim: int) -> None:
        self._dim = dim

    async def embed(self, text: str) -> bytes:
        return hash_embedding(text, self._dim).tobytes()


class FloorApp:
    """A bare ASGI app: every request is ``POST /v1/embeddings`` of one text (alone or in a list), answered in OpenAI's
    shape (base64), by ``embedder`` (None: by itself)."""

    def __init__(self, embedder: DeploymentHandle | None, dim: int) -> None:
        self._embedder = embedder
        self._dim = dim

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return
        chunks, more = [], True
        while more:
            message = await receive()
            chunks.append(message.get("body", b""))
            more = message.get("more_body", False)
        body = orjson.loads(b"".join(chunks))
        text = body["input"] if isinstance(body["input"], str) else body["input"][0]
        vector = (hash_embedding(text, self._dim).tobytes() if self._embedder is None
                  else await self._embedder.embed.remote(text))
        answer = orjson.dumps({
            "object": "list", "model": body["model"],
            "data": [{"object": "embedding", "index": 0, "embedding": pybase64.b64encode_as_string(vector)}],
            "usage": {"prompt_tokens": 0, "total_tokens": 0},
        })
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"application/json")]})
        await send({"type": "http.response.body", "body": answer})


@serve.deployment(**FLOOR_OPTIONS)
@serve.ingress()  # the app comes from __serve_build_asgi_app__, as the service's own ingress's does
class FloorIngress:
    def __init__(self, embedder: DeploymentHandle | None, dim: int) -> None:
        self._app = FloorApp(embedder, dim)

    def __serve_build_asgi_app__(self) -> FloorApp:
        return self._app


def floor_app(args: dict[str, Any]) -> Any:
    """``args``: ``{"dim": ..., "call": bool}``; with ``call``, the vector comes from a second deployment."""
    embedder = HashEmbedder.bind(args["dim"]) if args["call"] else None
    return FloorIngress.bind(embedder, args["dim"])

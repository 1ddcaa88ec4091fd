"""``python -m tests.reliability.inprocess_server --port N [the simulated upstream's flags]``: the in-process service
(``inprocess.build``: the ingress's app -> a real ``EmbeddingModel`` -> the simulated upstream) on a real port, for
clients that run as processes of their own, such as embed-bulk's fault tests.

The model is served as ``all-MiniLM-L6-v2`` (embed-bulk's default name) by the ``openai`` backend. Beside the API,
the simulated upstream's own routes are served: ``POST /admin/faults`` to change its faults at run time and
``GET /stats`` for its counters.
"""

from __future__ import annotations

import asyncio
from typing import Any

import uvicorn

from load.upstream import SERVER_OPTIONS, create_app, parse_args

from .inprocess import build

MODEL = "all-MiniLM-L6-v2"
_UPSTREAM_PATHS = ("/admin/", "/stats")


def routed(api: Any, upstream: Any) -> Any:
    """One ASGI app: the simulated upstream's admin and counters, and the service's API for everything else."""

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        target = upstream if scope.get("path", "").startswith(_UPSTREAM_PATHS) else api
        await target(scope, receive, send)

    return app


async def serve(host: str, port: int, upstream_app: Any) -> None:
    api, embedder = build({"name": MODEL}, upstream_app)
    server = uvicorn.Server(uvicorn.Config(routed(api, upstream_app), host=host, port=port, lifespan="off",
                                           timeout_graceful_shutdown=1, **SERVER_OPTIONS))
    try:
        await server.serve()
    finally:
        await embedder.aclose()


def main(argv: list[str] | None = None) -> None:
    args, config = parse_args(argv, prog="python -m tests.reliability.inprocess_server")
    asyncio.run(serve(args.host, args.port, create_app(config)))


if __name__ == "__main__":
    main()

"""The whole request path in one process, without Ray or sockets, for fuzzing: the ingress's FastAPI app
(``create_api``) -> a real ``EmbeddingModel`` (batcher, token counting, ``openai`` backend) -> the simulated
upstream's ASGI app.

Everything runs on one event loop in a background thread, so synchronous hypothesis tests can drive it example
after example.
"""

from __future__ import annotations

import asyncio
import threading
from concurrent.futures import Future
from typing import Any, Coroutine, Mapping

import httpx

from batching import BatcherMetrics
from deployments.config import DEFAULT_MAX_BODY_BYTES, parse_app_config
from deployments.ingress.api import create_api
from deployments.ingress.auth import ApiKeys
from deployments.model.backends import make_backend
from deployments.model.embedder import EmbeddingModel
from load.upstream import UpstreamConfig, create_app

UPSTREAM_URL = "http://upstream.invalid/v1"  # never resolved: the ASGI transport answers it


class _Call:
    """What ``handle.method.remote(...)`` returns: awaitable, cancellable."""

    def __init__(self, coroutine: Coroutine[Any, Any, Any]) -> None:
        self._task = asyncio.ensure_future(coroutine)

    def __await__(self):
        return self._task.__await__()

    def cancel(self) -> None:
        self._task.cancel()


class _Stream:
    """What ``handle.options(stream=True).method.remote(...)`` returns: async-iterable, cancellable."""

    def __init__(self, generator: Any) -> None:
        self._generator = generator

    def __aiter__(self):
        return self._generator

    def cancel(self) -> None:
        asyncio.ensure_future(self._generator.aclose())


class InProcessHandle:
    """Stands in for a ``DeploymentHandle`` to an ``EmbeddingModel`` living in this process."""

    def __init__(self, model: EmbeddingModel, method_name: str = "embed", stream: bool = False) -> None:
        self._model = model
        wrap = _Stream if stream else _Call
        self.remote = lambda *args, **kwargs: wrap(getattr(model, method_name)(*args, **kwargs))

    def options(self, *, method_name: str, stream: bool = False) -> "InProcessHandle":
        return InProcessHandle(self._model, method_name, stream)


def build(entry: Mapping[str, Any], upstream_app: Any, *, api_keys: tuple[str, ...] = (),
          max_body_bytes: int = DEFAULT_MAX_BODY_BYTES) -> tuple[Any, EmbeddingModel]:
    """The ingress's app serving the openai-backend model ``entry``, whose upstream is ``upstream_app`` (ASGI), and
    that model; made inside the event loop that will serve them."""
    config = parse_app_config({"models": [{"backend": "openai", "base_url": UPSTREAM_URL, **entry}]}).models[0]
    upstream = httpx.AsyncClient(transport=httpx.ASGITransport(app=upstream_app))
    embedder = EmbeddingModel(config, backend=make_backend(config, http_client=upstream), metrics=BatcherMetrics())
    api = create_api({config.name: InProcessHandle(embedder)}, api_keys=ApiKeys(list(api_keys)),
                     max_body_bytes=max_body_bytes)
    return api, embedder


class InProcessService:
    def __init__(self, model_entry: Mapping[str, Any], upstream: UpstreamConfig, *, api_keys: tuple[str, ...] = (),
                 max_body_bytes: int = DEFAULT_MAX_BODY_BYTES) -> None:
        self._entry = model_entry
        self._upstream = upstream
        self._api_keys = api_keys
        self._max_body_bytes = max_body_bytes
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="in-process-service", daemon=True)

    @property
    def model(self) -> str:
        return self._entry["name"]

    def __enter__(self) -> "InProcessService":
        self._thread.start()
        self.call(self._start())
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.call(self._stop())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join()
        self._loop.close()

    def call(self, coroutine: Coroutine[Any, Any, Any], timeout_s: float = 60.0) -> Any:
        future: Future = asyncio.run_coroutine_threadsafe(coroutine, self._loop)
        return future.result(timeout=timeout_s)

    def post(self, path: str = "/v1/embeddings", **kwargs: Any) -> httpx.Response:
        return self.call(self.client.post(path, **kwargs))

    async def _start(self) -> None:
        api, self.embedder = build(self._entry, create_app(self._upstream), api_keys=self._api_keys,
                                   max_body_bytes=self._max_body_bytes)
        transport = httpx.ASGITransport(app=api, raise_app_exceptions=False)
        self.client = httpx.AsyncClient(transport=transport, base_url="http://service.invalid", timeout=60)

    async def _stop(self) -> None:
        await self.client.aclose()
        await self.embedder.aclose()

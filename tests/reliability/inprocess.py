"""The whole request path in one process, without Ray or sockets, for fuzzing: the ingress's FastAPI app ->
a real ``EmbeddingModel`` (batcher, token counting, ``openai`` backend) -> the simulated upstream's ASGI app.

Serve injects the ingress instance into each route through ``serve.get_replica_context().servable_object``;
here ``ray.serve.get_replica_context`` is replaced for as long as the service is open. Everything runs on one
event loop in a background thread, so synchronous hypothesis tests can drive it example after example.
"""

from __future__ import annotations

import asyncio
import threading
from concurrent.futures import Future
from types import SimpleNamespace
from typing import Any, Coroutine, Mapping

import httpx
import openai

from batching import BatcherMetrics
from deployments import ingress as ingress_module
from deployments.auth import ApiKeys
from deployments.config import parse_app_config
from deployments.embedder import EmbeddingModel
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


class InProcessService:
    def __init__(self, model_entry: Mapping[str, Any], upstream: UpstreamConfig, *, api_keys: tuple[str, ...] = (),
                 max_body_bytes: int | None = None) -> None:
        self._entry = {"backend": "openai", "base_url": UPSTREAM_URL, **model_entry}
        self._upstream = upstream
        self._api_keys = api_keys
        self._max_body_bytes = max_body_bytes
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="in-process-service", daemon=True)
        self._original_context = None

    @property
    def model(self) -> str:
        return self._entry["name"]

    def __enter__(self) -> "InProcessService":
        import ray.serve

        self._thread.start()
        self.call(self._start())
        self._original_context = ray.serve.get_replica_context
        ray.serve.get_replica_context = lambda: SimpleNamespace(servable_object=self._ingress)
        return self

    def __exit__(self, *exc_info: object) -> None:
        import ray.serve

        ray.serve.get_replica_context = self._original_context
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
        config = parse_app_config({"models": [self._entry]}).models[0]
        self.embedder = EmbeddingModel.func_or_class(config, metrics=BatcherMetrics())
        upstream = httpx.AsyncClient(transport=httpx.ASGITransport(app=create_app(self._upstream)))
        self.embedder._backend._client = openai.AsyncOpenAI(
            base_url=UPSTREAM_URL, api_key="unused", max_retries=0, http_client=upstream)
        cls = ingress_module.EmbeddingsIngress.func_or_class.__mro__[1]  # the class under Serve's wrapper
        ingress = cls.__new__(cls)
        options = {} if self._max_body_bytes is None else {"max_body_bytes": self._max_body_bytes}
        cls.__init__(ingress, {self.model: InProcessHandle(self.embedder)}, **options)
        ingress._api_keys = ApiKeys(list(self._api_keys))
        self._ingress = ingress
        transport = httpx.ASGITransport(app=ingress_module.app, raise_app_exceptions=False)
        self.client = httpx.AsyncClient(transport=transport, base_url="http://service.invalid", timeout=60)

    async def _stop(self) -> None:
        await self.client.aclose()
        await self.embedder.aclose()

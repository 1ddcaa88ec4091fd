"""The OpenAI-compatible HTTP API, in front of one ``EmbeddingModel`` deployment per model: ``create_api`` builds it
for a mapping of model names to handles, and ``EmbeddingsIngress`` is the Serve deployment that serves it.

Routes: ``POST /v1/embeddings``, ``GET /v1/models``, ``GET /v1/models/{id}``, ``GET /healthz``. Every error,
including malformed bodies and unknown routes, is answered in OpenAI's shape ``{"error": {...}}``.

``POST /v1/embeddings`` goes straight from the ASGI call to its handler; the other routes go through FastAPI's
routing, middleware and exception handlers. The embeddings handler reads its own body and headers, so FastAPI would
add nothing to it but the CPU of its layers, paid on every request of the path the service's throughput rests on.
"""

import asyncio
import contextlib
import functools
import logging
import time
from typing import Any, AsyncIterator, Awaitable, Callable, Mapping, Sequence

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from ray import serve
from ray.serve.exceptions import BackPressureError
from ray.serve.handle import DeploymentHandle
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import Receive, Scope, Send

from batching import Priority
from deployments.config import DEFAULT_MAX_BODY_BYTES, BatchConfig, ProviderBatchConfig
from deployments.errors import (BodyReadTimeout, InvalidRequest, MethodNotAllowed, ModelNotFound, ModelOverloaded,
                                PayloadTooLarge, PermissionDenied, RequestTimedOut, RouteNotFound, ServiceError,
                                ServiceUnavailable, unwrap)
from deployments.garbage_collection import collect_less_often
from deployments.ingress import schemas
from deployments.ingress.auth import ApiKeys, Tenant
from deployments.ingress.tenant_gate import RayLimiter, TenantGate, TenantLimiter
from deployments.usage import RayTenantUsage, RayUsageLedger, TenantUsage, UsageLedger
from deployments.ingress.usage_routes import UsageRoutes
from deployments.ingress.batch.relay import BatchRelay, RelayedModel
from deployments.ingress.batch.routes import BatchRoutes
from deployments.ingress.batch.runner import BatchMetrics, BatchRunner
from deployments.ingress.batch.store import BatchStore
from deployments.ingress.forwarding import ModelForwarder
from deployments.ingress.metrics import RayBatchMetrics, ResendCounter, ResentRequests
from deployments.ingress.model_health import ModelHealth
from deployments.ingress.openai_errors import error_response, status_response
from deployments.wire import Deadline, EmbedRequest

logger = logging.getLogger("ray.serve")

OWNED_BY = "adaptive-embeddings"
# A client that sends its body slower than this gets a 408 (HAProxy, in front, drops connections idle for longer).
BODY_READ_TIMEOUT_S = 30.0
# A request's time is counted from when its handler starts, but its answer reaches the client only after the moments
# this process cannot see: HAProxy and uvicorn before the handler, the response on its way back. Under a flood those
# grow with the queues in front of the handler, so the service gives up this much before the deadline (as Envoy's
# grpc_timeout_header_offset does), at most a tenth of the timeout: a 504 sent at the deadline would reach the
# client after it.
DEADLINE_MARGIN_S = 0.25
# Serve refuses a call once every replica's queue is full (sizing.py's max_queued_requests), and says nothing of
# when room will come; the model's own refusals carry a Retry-After from its drain rate (batching/admission.py).
REPLICAS_FULL_RETRY_AFTER_S = 1.0
EMBEDDINGS_PATH = "/v1/embeddings"


def create_api(models: Mapping[str, Any], *, api_keys: ApiKeys | None = None,
               max_body_bytes: int = DEFAULT_MAX_BODY_BYTES, on_resend: ResendCounter | None = None,
               unavailable: Callable[[], Awaitable[Mapping[str, str]]] | None = None,
               batch: BatchConfig | None = None, batch_metrics: BatchMetrics | None = None,
               relayed: Mapping[str, ProviderBatchConfig] | None = None,
               usage: TenantUsage | None = None, limiter: TenantLimiter | RayLimiter | None = None) -> "EmbeddingsApi":
    """The API for ``models``: each name to a handle to its ``EmbeddingModel`` (a ``DeploymentHandle``, or anything
    with its ``options(method_name=..., stream=True).remote(...)``). ``api_keys``: the keys a client must send (None:
    none is asked for). ``on_resend(model, cause, count)`` counts requests sent again after their replica's loss.
    ``await unavailable()``: ``{model: reason}`` for the models that cannot serve now (None: every model can).
    ``batch``: the Batch API's store and limits (None: no Batch API); its batches run while the app runs (between
    its ASGI lifespan's startup and shutdown), reporting to ``batch_metrics``; the lines of the models in ``relayed``
    go to their provider's Batch API first, with those settings. ``limiter`` holds tenants to their limits (None: in
    this process alone); ``usage`` counts what they used (None: into a ledger in this process)."""
    api_keys = ApiKeys([]) if api_keys is None else api_keys
    limiter = limiter if limiter is not None else TenantLimiter()
    usage = usage if usage is not None else TenantUsage(UsageLedger())
    routes = _Routes(models, api_keys, max_body_bytes, on_resend, unavailable, usage, TenantGate(limiter))
    runner = None
    if batch is not None:
        store = BatchStore(batch.path)

        def tenant_of(owner: str) -> Tenant:
            tenant = api_keys.tenant(owner)
            if tenant is None:
                raise PermissionDenied(f"the batch's tenant {owner!r} is no longer in the API keys file")
            return tenant

        async def embed_line(body: bytes, cached_only: bool, owner: str) -> bytes:
            return await routes.embed_body(body, tenant_of(owner), Priority.LOW, None, cached_only)

        async def embed_lines(bodies: Sequence[bytes], cached_only: bool, owner: str) -> list[bytes]:
            return await routes.embed_bodies(bodies, tenant_of(owner), Priority.LOW, cached_only)

        relay = BatchRelay(store, {name: RelayedModel(models[name], config)
                                   for name, config in (relayed or {}).items()}) if relayed else None
        runner = BatchRunner(store, embed_line, batch, batch_metrics, relay, embed_lines)
    app = FastAPI(title="Embeddings", docs_url=None, redoc_url=None, openapi_url=None,
                  lifespan=None if runner is None else functools.partial(_running, runner))
    app.add_exception_handler(ServiceError, _service_error)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_exception_handler(Exception, _unexpected_error)
    # named for Serve's route labels, and so another method gets a 405; a POST takes the direct path
    app.add_api_route(EMBEDDINGS_PATH, routes.create_embeddings, methods=["POST"])
    app.add_api_route("/v1/models", routes.list_models, methods=["GET"])
    app.add_api_route("/v1/models/{model_id:path}", routes.get_model, methods=["GET"])
    app.add_api_route("/healthz", routes.healthz, methods=["GET", "HEAD"])
    UsageRoutes(api_keys, usage).add_to(app)
    if batch is not None and runner is not None:
        BatchRoutes(store, batch, api_keys, runner.wake).add_to(app)
    return EmbeddingsApi(app, routes)


@contextlib.asynccontextmanager
async def _running(runner: BatchRunner, app: FastAPI) -> AsyncIterator[None]:
    task = asyncio.ensure_future(runner.run_forever())
    try:
        yield
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await runner.aclose()


class EmbeddingsApi:
    """The API as an ASGI app: ``POST /v1/embeddings`` to its handler directly, everything else to ``app``. Its
    ``routes`` and ``router`` are ``app``'s, so Serve names each request's route as before."""

    def __init__(self, app: FastAPI, routes: "_Routes") -> None:
        self._app = app
        self._routes = routes

    @property
    def routes(self) -> list[Any]:
        return self._app.routes

    @property
    def router(self) -> Any:
        return self._app.router

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] == "POST" and _route_path(scope) == EMBEDDINGS_PATH:
            request = Request(scope, receive)
            try:
                response = await self._routes.create_embeddings(request)
            except ServiceError as exc:
                response = await _service_error(request, exc)
            except Exception as exc:  # noqa: BLE001 - answered as FastAPI's handler for it answers the other routes
                response = await _unexpected_error(request, exc)
            await response(scope, receive, send)
            return
        await self._app(scope, receive, send)


@serve.deployment
@serve.ingress()  # no app yet: Serve asks each replica for it, after __init__, through __serve_build_asgi_app__
class EmbeddingsIngress:
    def __init__(self, models: Mapping[str, DeploymentHandle], max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
                 batch: BatchConfig | None = None, relayed: Mapping[str, ProviderBatchConfig] | None = None) -> None:
        collect_less_often()
        api_keys = ApiKeys.from_env()
        limiter, ledger = RayLimiter(serve.get_replica_context().app_name), RayUsageLedger()
        if api_keys.names_tenants:  # their actors start with the replica, not within its first requests
            limiter.start()
            ledger.start()
        health = ModelHealth(serve.get_replica_context().app_name,
                             {name: handle.deployment_name for name, handle in models.items()})
        self._api = create_api(models, api_keys=api_keys, max_body_bytes=max_body_bytes,
                               on_resend=ResentRequests(), unavailable=health, batch=batch,
                               batch_metrics=RayBatchMetrics(), relayed=relayed, usage=RayTenantUsage(ledger),
                               limiter=limiter)
        logger.info("embeddings ingress serving %s; API keys %s",
                    sorted(models), "required" if api_keys.required else "not required")

    def __serve_build_asgi_app__(self) -> EmbeddingsApi:
        return self._api


class _Routes:
    """The route handlers, bound to the models and limits of one API."""

    def __init__(self, models: Mapping[str, Any], api_keys: ApiKeys, max_body_bytes: int,
                 on_resend: ResendCounter | None, unavailable: Callable[[], Awaitable[Mapping[str, str]]] | None,
                 usage: TenantUsage, gate: TenantGate) -> None:
        self._models = {name: ModelForwarder(handle, None if on_resend is None else functools.partial(on_resend, name))
                        for name, handle in models.items()}
        self._api_keys = api_keys
        self._usage = usage
        self._gate = gate
        self._max_body_bytes = max_body_bytes
        self._created = int(time.time())
        self._unavailable = unavailable

    async def create_embeddings(self, request: Request) -> Response:
        headers = request.headers
        deadline = _answer_by(schemas.parse_timeout(headers.get("x-request-timeout")))  # reading the body counts
        tenant = self._api_keys.check(headers.get("authorization"))
        priority = tenant.priority(schemas.parse_priority(headers.get("x-priority")))
        content = await self.embed_body(await self._read_body(request, deadline), tenant, priority, deadline)
        return Response(content=content, media_type="application/json", headers=self._gate.headers(tenant))

    async def embed_body(self, raw: bytes, tenant: Tenant, priority: Priority, deadline: Deadline | None,
                         cached_only: bool = False) -> bytes:
        """A ``/v1/embeddings`` request body's response body, or the ``ServiceError`` it fails with, for ``tenant``
        (its models checked, its limits held, its usage counted): the route's work, and a batch line's
        (``cached_only``: a relayed batch's, answered from the model's cache alone)."""
        body = schemas.parse_request(raw)
        forwarder = self._model_for(body.model, tenant)
        ticket = await self._gate.admit(tenant, body.model, body.input)
        embed = EmbedRequest(body.input, priority, dimensions=body.dimensions, prompt_name=body.prompt_name,
                             input_type=body.input_type, cached_only=cached_only, share=tenant.share)
        try:
            vectors, token_counts = await self._embed(forwarder, embed, deadline)
        except BaseException:
            self._gate.settle(ticket, 0)  # not answered: its tokens are not spent (its request is)
            raise
        self._gate.settle(ticket, sum(token_counts))
        self._usage.record(tenant.name, body.model, len(token_counts), sum(token_counts))
        return schemas.embedding_response(body.model, vectors, token_counts, body.encoding_format)

    async def embed_bodies(self, raws: Sequence[bytes], tenant: Tenant, priority: Priority,
                           cached_only: bool = False) -> list[bytes]:
        """Request bodies of one input each that differ in nothing else, as one request to their model: each
        body's response body, as ``embed_body`` would answer it alone (each admitted, settled and counted as its
        own request); the ``ServiceError`` of any one of them, or of the call, for all of them (a batch's lines
        travel so: one call for many lines, instead of a call, a response and a turn of both event loops each)."""
        bodies = [schemas.parse_request(raw) for raw in raws]
        first = bodies[0]
        forwarder = self._model_for(first.model, tenant)
        embed = EmbedRequest([body.input[0] for body in bodies], priority, dimensions=first.dimensions,
                             prompt_name=first.prompt_name, input_type=first.input_type, cached_only=cached_only,
                             share=tenant.share)
        tickets = []
        try:
            for body in bodies:
                tickets.append(await self._gate.admit(tenant, first.model, body.input))
            vectors, token_counts = await self._embed(forwarder, embed, None)
        except BaseException:  # one refused, or the call failed: the tokens of those admitted are not spent
            for ticket in tickets:
                self._gate.settle(ticket, 0)
            raise
        answers = []
        for position, (ticket, tokens) in enumerate(zip(tickets, token_counts)):
            self._gate.settle(ticket, tokens)
            self._usage.record(tenant.name, first.model, 1, tokens)
            answers.append(schemas.embedding_response(first.model, vectors[position:position + 1], [tokens],
                                                      first.encoding_format))
        return answers

    async def list_models(self, request: Request) -> dict[str, Any]:
        self._api_keys.check(request.headers.get("authorization"))
        return {"object": "list", "data": [self._card(name) for name in self._models]}

    async def get_model(self, model_id: str, request: Request) -> dict[str, Any]:
        self._api_keys.check(request.headers.get("authorization"))
        if model_id not in self._models:
            raise self._unknown_model(model_id)
        return self._card(model_id)

    async def healthz(self) -> Any:
        """``{"status": "ok", "models": [...]}``; while a model cannot serve, a 503 with ``"status": "degraded"`` and
        ``"unavailable": {model: reason}`` beside the same ``models``."""
        health = {"status": "ok", "models": sorted(self._models)}
        down = dict(await self._unavailable()) if self._unavailable is not None else {}
        if not down:
            return health
        return JSONResponse({**health, "status": "degraded", "unavailable": down}, status_code=503)

    # ---- internals ----------------------------------------------------------------------------------------

    def _model_for(self, model: str, tenant: Tenant) -> ModelForwarder:
        """The model a request names, if there is one and the tenant may use it."""
        forwarder = self._models.get(model)
        if forwarder is None:
            raise self._unknown_model(model, param="model")
        tenant.check_model(model)
        return forwarder

    async def _read_body(self, request: Request, deadline: Deadline | None) -> bytes:
        """The body, refused with a 413 as soon as it is known to exceed ``max_body_bytes`` (from Content-Length
        before reading, or while reading a body sent without one); a 408 if it does not arrive in time, a 504 if the
        request's own deadline passes first."""
        limit = self._max_body_bytes
        too_large = PayloadTooLarge(f"the request body exceeds the {limit}-byte limit; send fewer or shorter inputs")
        declared = request.headers.get("content-length")
        if declared is not None and declared.strip().isdigit() and int(declared) > limit:
            raise too_large
        chunks: list[bytes] = []
        size = 0
        read_by = asyncio.get_running_loop().time() + BODY_READ_TIMEOUT_S
        try:
            async with asyncio.timeout_at(read_by if deadline is None else min(read_by, deadline.at)):
                async for chunk in request.stream():
                    size += len(chunk)
                    if size > limit:
                        raise too_large
                    chunks.append(chunk)
        except TimeoutError:
            if deadline is not None and deadline.at <= read_by:
                raise RequestTimedOut("the deadline passed while the request was read") from None
            raise BodyReadTimeout(f"the request body did not arrive within {BODY_READ_TIMEOUT_S:g} s") from None
        return b"".join(chunks)

    async def _embed(self, forwarder: ModelForwarder, request: EmbedRequest, deadline: Deadline | None) -> Any:
        """The model's answer, or a 504 at the deadline (the model drops what it had not sent by then too)."""
        outcome = forwarder.forward(request, deadline)
        try:
            async with asyncio.timeout_at(None if deadline is None else deadline.at):
                return await outcome
        except TimeoutError:
            if not outcome.done() or outcome.cancelled():  # our timeout, not the model's answer
                raise RequestTimedOut("no result within the time the request allowed") from None
            if outcome.exception() is None:  # the answer came in the same turn as the deadline
                return outcome.result()
            raise self._service_error(outcome.exception()) from None
        except Exception as exc:
            raise self._service_error(exc) from None

    @staticmethod
    def _service_error(exc: BaseException) -> ServiceError:
        cause = unwrap(exc)
        if isinstance(cause, ServiceError):
            return cause
        if isinstance(cause, BackPressureError):
            return ModelOverloaded("the model's replicas are all busy; retry later",
                                   retry_after_s=REPLICAS_FULL_RETRY_AFTER_S)
        logger.error("embedding call failed", exc_info=exc)
        return ServiceUnavailable("the model is unavailable; retry later")

    def _card(self, name: str) -> dict[str, Any]:
        return schemas.model_card(name, self._created, OWNED_BY)

    def _unknown_model(self, name: str, param: str | None = None) -> ModelNotFound:
        known = ", ".join(sorted(self._models))
        return ModelNotFound(f"the model {schemas.shortened(name)!r} does not exist; available: {known}", param=param)


async def _service_error(request: Request, exc: ServiceError) -> JSONResponse:
    return error_response(exc)


async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
    errors = exc.errors()
    first = errors[0] if errors else {}
    location = [str(part) for part in first.get("loc", ()) if part not in ("body", "query", "path", "header")]
    message = str(first.get("msg", "invalid request")).removeprefix("Value error, ")
    param = ".".join(location) or None
    return error_response(InvalidRequest(f"'{param}': {message}" if param else message, param=param))


async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    if exc.status_code == 404:
        return error_response(RouteNotFound(f"no route {request.method} {request.url.path}"))
    if exc.status_code == 405:
        return error_response(MethodNotAllowed(f"method {request.method} is not allowed on {request.url.path}"))
    return status_response(exc.status_code, str(exc.detail))


async def _unexpected_error(request: Request, exc: Exception) -> JSONResponse:
    logger.error("unexpected error on %s %s", request.method, request.url.path, exc_info=exc)
    return error_response(ServiceError("the server failed to process the request"))


def _route_path(scope: Scope) -> str:
    """The request's path below the application's route prefix (Serve sets it as ``root_path``)."""
    path, root = scope["path"], scope.get("root_path", "")
    return path[len(root):] if root and path.startswith(root) else path


def _answer_by(timeout_s: float | None) -> Deadline | None:
    """When a request that arrived now with this timeout must have its answer sent (the margin is for the way back)."""
    if timeout_s is None:
        return None
    return Deadline.after(timeout_s - min(DEADLINE_MARGIN_S, timeout_s / 10))

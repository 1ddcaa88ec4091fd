"""``EmbeddingsIngress``: the OpenAI-compatible HTTP API, in front of one ``EmbeddingModel`` deployment per model.

Routes: ``POST /v1/embeddings``, ``GET /v1/models``, ``GET /v1/models/{id}``, ``GET /healthz``. Every error,
including malformed bodies and unknown routes, is answered in OpenAI's shape ``{"error": {...}}``.
"""

# No `from __future__ import annotations` here: Serve re-signs the route methods, and FastAPI must see real
# annotations (e.g. `Request`) to inject them rather than read them as query or body fields.
import asyncio
import logging
import time
from typing import Any, Mapping

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from ray import serve
from ray.serve.exceptions import BackPressureError
from ray.serve.handle import DeploymentHandle
from starlette.exceptions import HTTPException as StarletteHTTPException

from . import schemas
from .auth import ApiKeys
from .config import DEFAULT_MAX_BODY_BYTES
from .embedder import EmbedRequest
from .errors import (BodyReadTimeout, InvalidRequest, MethodNotAllowed, ModelNotFound, ModelOverloaded,
                     PayloadTooLarge, RequestTimedOut, RouteNotFound, ServiceError, ServiceUnavailable, unwrap)
from .forwarding import ModelForwarder
from .openai_errors import error_response, status_response

logger = logging.getLogger("ray.serve")

OWNED_BY = "adaptive-embeddings"
# A client that sends its body slower than this gets a 408 (HAProxy, in front, drops connections idle for longer).
BODY_READ_TIMEOUT_S = 30.0
# A request's time is counted from when its handler starts, but its answer reaches the client only after the moments
# this process cannot see: HAProxy and uvicorn before the handler, the response on its way back. Under a flood those
# took up to ~0.35 s on 2 cores, so the service gives up this much before the deadline (as Envoy's
# grpc_timeout_header_offset does), at most a tenth of the timeout: a 504 at 2 s + 0.35 s would come too late.
DEADLINE_MARGIN_S = 0.25

app = FastAPI(title="Embeddings", docs_url=None, redoc_url=None, openapi_url=None)


@app.exception_handler(ServiceError)
async def _service_error(request: Request, exc: ServiceError) -> JSONResponse:
    return error_response(exc)


@app.exception_handler(RequestValidationError)
async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
    errors = exc.errors()
    first = errors[0] if errors else {}
    location = [str(part) for part in first.get("loc", ()) if part not in ("body", "query", "path", "header")]
    message = str(first.get("msg", "invalid request")).removeprefix("Value error, ")
    param = ".".join(location) or None
    return error_response(InvalidRequest(f"'{param}': {message}" if param else message, param=param))


@app.exception_handler(StarletteHTTPException)
async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    if exc.status_code == 404:
        return error_response(RouteNotFound(f"no route {request.method} {request.url.path}"))
    if exc.status_code == 405:
        return error_response(MethodNotAllowed(f"method {request.method} is not allowed on {request.url.path}"))
    return status_response(exc.status_code, str(exc.detail))


@app.exception_handler(Exception)
async def _unexpected_error(request: Request, exc: Exception) -> JSONResponse:
    logger.error("unexpected error on %s %s", request.method, request.url.path, exc_info=exc)
    return error_response(ServiceError("the server failed to process the request"))


def _answer_by(timeout_s: float | None) -> float | None:
    """The ``time.monotonic()`` moment by which a request with this timeout must have its answer sent."""
    if timeout_s is None:
        return None
    return time.monotonic() + timeout_s - min(DEADLINE_MARGIN_S, timeout_s / 10)


def _remaining(deadline: float | None) -> float | None:
    return None if deadline is None else deadline - time.monotonic()


def _loop_time(monotonic_at: float) -> float:
    """A ``time.monotonic()`` moment on the running loop's clock."""
    return asyncio.get_running_loop().time() + (monotonic_at - time.monotonic())


@serve.deployment
@serve.ingress(app)
class EmbeddingsIngress:
    def __init__(self, models: Mapping[str, DeploymentHandle], max_body_bytes: int = DEFAULT_MAX_BODY_BYTES) -> None:
        self._models = {name: ModelForwarder(handle) for name, handle in models.items()}
        self._api_keys = ApiKeys.from_env()
        self._max_body_bytes = max_body_bytes
        self._created = int(time.time())
        logger.info("embeddings ingress serving %s; API keys %s",
                    sorted(self._models), "required" if self._api_keys.required else "not required")

    @app.post("/v1/embeddings")
    async def create_embeddings(self, request: Request) -> Response:
        headers = request.headers
        deadline = _answer_by(schemas.parse_timeout(headers.get("x-request-timeout")))  # reading the body counts
        self._api_keys.check(headers.get("authorization"))
        priority = schemas.parse_priority(headers.get("x-priority"))
        body = schemas.parse_request(await self._read_body(request, deadline))
        forwarder = self._models.get(body.model)
        if forwarder is None:
            raise self._unknown_model(body.model, param="model")
        embed = EmbedRequest(body.inputs(), priority.name.lower(), _remaining(deadline), body.dimensions)
        vectors, token_counts = await self._embed(forwarder, embed, deadline)
        content = schemas.embedding_response(body.model, vectors, token_counts, body.encoding_format)
        return Response(content=content, media_type="application/json")

    @app.get("/v1/models")
    async def list_models(self, request: Request) -> dict[str, Any]:
        self._api_keys.check(request.headers.get("authorization"))
        return {"object": "list", "data": [self._card(name) for name in self._models]}

    @app.get("/v1/models/{model_id:path}")
    async def get_model(self, model_id: str, request: Request) -> dict[str, Any]:
        self._api_keys.check(request.headers.get("authorization"))
        if model_id not in self._models:
            raise self._unknown_model(model_id)
        return self._card(model_id)

    @app.api_route("/healthz", methods=["GET", "HEAD"])
    async def healthz(self) -> dict[str, Any]:
        return {"status": "ok", "models": sorted(self._models)}

    # ---- internals ----------------------------------------------------------------------------------------

    async def _read_body(self, request: Request, deadline: float | None) -> bytes:
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
        read_by = time.monotonic() + BODY_READ_TIMEOUT_S
        try:
            async with asyncio.timeout_at(_loop_time(min(read_by, deadline or read_by))):
                async for chunk in request.stream():
                    size += len(chunk)
                    if size > limit:
                        raise too_large
                    chunks.append(chunk)
        except TimeoutError:
            if deadline is not None and deadline <= read_by:
                raise RequestTimedOut("the deadline passed while the request was read") from None
            raise BodyReadTimeout(f"the request body did not arrive within {BODY_READ_TIMEOUT_S:g} s") from None
        return b"".join(chunks)

    async def _embed(self, forwarder: ModelForwarder, request: EmbedRequest, deadline: float | None) -> Any:
        """The model's answer, or a 504 at the deadline (the model drops what it had not sent by then too)."""
        outcome = forwarder.forward(request)
        try:
            async with asyncio.timeout_at(None if deadline is None else _loop_time(deadline)):
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
            return ModelOverloaded("the model's replicas are all busy; retry later", retry_after_s=1.0)
        logger.error("embedding call failed", exc_info=exc)
        return ServiceUnavailable("the model is unavailable; retry later")

    def _card(self, name: str) -> dict[str, Any]:
        return schemas.model_card(name, self._created, OWNED_BY)

    def _unknown_model(self, name: str, param: str | None = None) -> ModelNotFound:
        known = ", ".join(sorted(self._models))
        return ModelNotFound(f"the model {schemas.shortened(name)!r} does not exist; available: {known}", param=param)

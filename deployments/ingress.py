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
from .errors import (InvalidRequest, MethodNotAllowed, ModelNotFound, ModelOverloaded, PayloadTooLarge,
                     RequestTimedOut, RouteNotFound, ServiceError, ServiceUnavailable, unwrap)

logger = logging.getLogger("ray.serve")

OWNED_BY = "adaptive-embeddings"
# How long past the caller's deadline the ingress waits for the model's own DeadlineExceeded before giving up.
_DEADLINE_GRACE_S = 0.25

app = FastAPI(title="Embeddings", docs_url=None, redoc_url=None, openapi_url=None)


def _error_response(error: ServiceError) -> JSONResponse:
    return JSONResponse(error.to_body(), status_code=error.status, headers=error.headers())


@app.exception_handler(ServiceError)
async def _service_error(request: Request, exc: ServiceError) -> JSONResponse:
    return _error_response(exc)


@app.exception_handler(RequestValidationError)
async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
    errors = exc.errors()
    first = errors[0] if errors else {}
    location = [str(part) for part in first.get("loc", ()) if part not in ("body", "query", "path", "header")]
    message = str(first.get("msg", "invalid request")).removeprefix("Value error, ")
    param = ".".join(location) or None
    return _error_response(InvalidRequest(f"'{param}': {message}" if param else message, param=param))


@app.exception_handler(StarletteHTTPException)
async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    if exc.status_code == 404:
        error: ServiceError = RouteNotFound(f"no route {request.method} {request.url.path}")
    elif exc.status_code == 405:
        error = MethodNotAllowed(f"method {request.method} is not allowed on {request.url.path}")
    else:
        error = ServiceError(str(exc.detail))
        error.status = exc.status_code
    return _error_response(error)


@app.exception_handler(Exception)
async def _unexpected_error(request: Request, exc: Exception) -> JSONResponse:
    logger.error("unexpected error on %s %s", request.method, request.url.path, exc_info=exc)
    return _error_response(ServiceError("the server failed to process the request"))


@serve.deployment
@serve.ingress(app)
class EmbeddingsIngress:
    def __init__(self, models: Mapping[str, DeploymentHandle], max_body_bytes: int = DEFAULT_MAX_BODY_BYTES) -> None:
        self._models = dict(models)
        self._api_keys = ApiKeys.from_env()
        self._max_body_bytes = max_body_bytes
        self._created = int(time.time())
        logger.info("embeddings ingress serving %s; API keys %s",
                    sorted(self._models), "required" if self._api_keys.required else "not required")

    @app.post("/v1/embeddings")
    async def create_embeddings(self, request: Request) -> Response:
        arrived = time.monotonic()  # the deadline counts from here, not from when the model gets the request
        self._api_keys.check(request.headers.get("authorization"))
        body = schemas.parse_request(await self._read_body(request))
        handle = self._models.get(body.model)
        if handle is None:
            raise self._unknown_model(body.model, param="model")
        priority = schemas.parse_priority(request.headers.get("x-priority"))
        timeout_s = schemas.parse_timeout(request.headers.get("x-request-timeout"))
        if timeout_s is not None:
            timeout_s -= time.monotonic() - arrived
            if timeout_s <= 0:
                raise RequestTimedOut("the deadline passed while the request was read")
        vectors, token_counts = await self._embed(
            handle, body.inputs(), priority=priority.name.lower(), timeout_s=timeout_s, dimensions=body.dimensions
        )
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

    @app.get("/healthz")
    async def healthz(self) -> dict[str, Any]:
        return {"status": "ok", "models": sorted(self._models)}

    # ---- internals ----------------------------------------------------------------------------------------

    async def _read_body(self, request: Request) -> bytes:
        """The body, refused with a 413 as soon as it is known to exceed ``max_body_bytes`` (from Content-Length
        before reading, or while reading a body sent without one)."""
        limit = self._max_body_bytes
        too_large = PayloadTooLarge(f"the request body exceeds the {limit}-byte limit; send fewer or shorter inputs")
        declared = request.headers.get("content-length")
        if declared is not None and declared.strip().isdigit() and int(declared) > limit:
            raise too_large
        chunks: list[bytes] = []
        size = 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise too_large
            chunks.append(chunk)
        return b"".join(chunks)

    async def _embed(self, handle: DeploymentHandle, inputs: schemas.Inputs, **options: Any) -> tuple[Any, list[int]]:
        timeout_s = options["timeout_s"]
        response = handle.embed.remote(inputs, **options)
        try:
            async with asyncio.timeout(None if timeout_s is None else timeout_s + _DEADLINE_GRACE_S):
                return await response
        except asyncio.CancelledError:
            response.cancel()
            raise
        except Exception as exc:
            cause = unwrap(exc)
            if isinstance(cause, ServiceError):
                raise cause from None
            if isinstance(exc, TimeoutError):
                response.cancel()
                raise RequestTimedOut("no result within the time the request allowed") from None
            if isinstance(cause, BackPressureError):
                raise ModelOverloaded("the model's replicas are all busy; retry later", retry_after_s=1.0) from None
            logger.error("embedding call failed", exc_info=exc)
            raise ServiceUnavailable("the model is unavailable; retry later") from None

    def _card(self, name: str) -> dict[str, Any]:
        return schemas.model_card(name, self._created, OWNED_BY)

    def _unknown_model(self, name: str, param: str | None = None) -> ModelNotFound:
        known = ", ".join(sorted(self._models))
        return ModelNotFound(f"the model {name!r} does not exist; available: {known}", param=param)

"""Every error the API answers, in OpenAI's shape ``{"error": {"message", "type", "param", "code"}}``: the one place
where a ``ServiceError`` gets its HTTP status, OpenAI ``type`` and ``code``, and headers. An error naming the input
at fault says so in ``param`` (``"input[3]"``), so no client has to read it out of the message."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from fastapi.responses import JSONResponse

from deployments.errors import (AuthenticationFailed, BodyReadTimeout, InvalidRequest, MethodNotAllowed, ModelNotFound,
                                ModelOverloaded, PayloadTooLarge, PermissionDenied, RequestTimedOut, ResourceNotFound,
                                RetryLater, ServiceError, ServiceUnavailable, TenantOverBudget, TenantRateLimited,
                                UpstreamFailed, UpstreamRateLimited)


@dataclass(frozen=True)
class HttpError:
    status: int
    type: str
    code: str | None = None


HTTP_ERRORS: dict[type[ServiceError], HttpError] = {
    InvalidRequest: HttpError(400, "invalid_request_error"),
    AuthenticationFailed: HttpError(401, "invalid_request_error", "invalid_api_key"),
    PermissionDenied: HttpError(403, "invalid_request_error", "permission_denied"),
    ModelNotFound: HttpError(404, "invalid_request_error", "model_not_found"),
    ResourceNotFound: HttpError(404, "invalid_request_error", "not_found"),
    MethodNotAllowed: HttpError(405, "invalid_request_error", "method_not_allowed"),
    BodyReadTimeout: HttpError(408, "invalid_request_error", "request_timeout"),
    PayloadTooLarge: HttpError(413, "invalid_request_error", "request_too_large"),
    ModelOverloaded: HttpError(429, "rate_limit_error", "overloaded"),
    TenantRateLimited: HttpError(429, "rate_limit_error", "rate_limit_exceeded"),
    TenantOverBudget: HttpError(429, "insufficient_quota", "insufficient_quota"),
    UpstreamRateLimited: HttpError(429, "rate_limit_error", "upstream_rate_limited"),
    UpstreamFailed: HttpError(502, "upstream_error", "upstream_error"),
    ServiceUnavailable: HttpError(503, "server_error", "unavailable"),
    RequestTimedOut: HttpError(504, "timeout_error", "deadline_exceeded"),
    ServiceError: HttpError(500, "server_error"),
}


def http_error(error: ServiceError) -> HttpError:
    return next(HTTP_ERRORS[cls] for cls in type(error).__mro__ if cls in HTTP_ERRORS)


def error_body(error: ServiceError) -> dict[str, Any]:
    param = f"input[{error.index}]" if error.index is not None else error.param
    mapped = http_error(error)
    return {"error": {"message": error.message, "type": mapped.type, "param": param, "code": mapped.code}}


def error_headers(error: ServiceError) -> dict[str, str]:
    if isinstance(error, RetryLater):
        extra = error.headers if isinstance(error, TenantRateLimited) else {}
        return {"Retry-After": str(max(1, math.ceil(error.retry_after_s))), **extra}  # whole seconds, at least 1
    if isinstance(error, ServiceUnavailable):
        return {"Retry-After": "1"}
    if isinstance(error, AuthenticationFailed):
        return {"WWW-Authenticate": "Bearer"}
    return {}


def error_response(error: ServiceError) -> JSONResponse:
    return JSONResponse(error_body(error), status_code=http_error(error).status, headers=error_headers(error))


def status_response(status: int, message: str) -> JSONResponse:
    """An HTTP error the framework raised with a status of its own (none of the service's errors)."""
    body = {"error": {"message": message, "type": "server_error", "param": None, "code": None}}
    return JSONResponse(body, status_code=status)

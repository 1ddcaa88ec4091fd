"""Errors a request can end in, each carrying its HTTP status and OpenAI error ``type`` / ``code``.

They cross Ray's process boundary (an ``EmbeddingModel`` raises, the ingress or another deployment catches), so
each one pickles from its own fields. The ingress renders any of them as ``{"error": {...}}``.
"""

from __future__ import annotations

import math
from typing import Any

from batching import DeadlineExceeded, Overloaded


class ServiceError(Exception):
    status: int = 500
    type: str = "server_error"
    code: str | None = None

    def __init__(
        self, message: str, *, param: str | None = None, index: int | None = None, code: str | None = None
    ) -> None:
        Exception.__init__(self, message)
        self.message = message
        self.param = param
        self.index = index  # the input that failed, when one did
        if code is not None:
            self.code = code

    def _fields(self) -> dict[str, Any]:
        return {"param": self.param, "index": self.index, "code": self.code}

    def __reduce__(self) -> tuple[Any, ...]:
        return _rebuild, (type(self), self.message, self._fields())

    def to_body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def headers(self) -> dict[str, str]:
        return {}


def _rebuild(cls: type[ServiceError], message: str, fields: dict[str, Any]) -> ServiceError:
    error = cls.__new__(cls)
    Exception.__init__(error, message)
    error.message = message
    for name, value in fields.items():
        setattr(error, name, value)
    return error


class InvalidRequest(ServiceError):
    status, type = 400, "invalid_request_error"


class PayloadTooLarge(ServiceError):
    status, type, code = 413, "invalid_request_error", "request_too_large"


class BodyReadTimeout(ServiceError):
    status, type, code = 408, "invalid_request_error", "request_timeout"


class AuthenticationFailed(ServiceError):
    status, type, code = 401, "invalid_request_error", "invalid_api_key"

    def headers(self) -> dict[str, str]:
        return {"WWW-Authenticate": "Bearer"}


class ModelNotFound(ServiceError):
    status, type, code = 404, "invalid_request_error", "model_not_found"


class RouteNotFound(ServiceError):
    status, type, code = 404, "invalid_request_error", "not_found"


class MethodNotAllowed(ServiceError):
    status, type, code = 405, "invalid_request_error", "method_not_allowed"


class RetryLater(ServiceError):
    """An error that tells the caller when to try again (``Retry-After``, whole seconds, at least 1)."""

    def __init__(self, message: str, *, retry_after_s: float, **fields: Any) -> None:
        ServiceError.__init__(self, message, **fields)
        self.retry_after_s = retry_after_s

    def _fields(self) -> dict[str, Any]:
        return {**super()._fields(), "retry_after_s": self.retry_after_s}

    def headers(self) -> dict[str, str]:
        return {"Retry-After": str(max(1, math.ceil(self.retry_after_s)))}


class ModelOverloaded(RetryLater, Overloaded):
    """The model's queue is full; also an ``Overloaded``, so handle callers may catch either."""

    status, type, code = 429, "rate_limit_error", "overloaded"


class UpstreamRateLimited(RetryLater):
    """The upstream kept answering 429 until the input's retries ran out: the caller should slow down too."""

    status, type, code = 429, "rate_limit_error", "upstream_rate_limited"


class RequestTimedOut(ServiceError, DeadlineExceeded):
    """The caller's deadline passed; also a ``DeadlineExceeded``."""

    status, type, code = 504, "timeout_error", "deadline_exceeded"


class UpstreamFailed(ServiceError):
    status, type, code = 502, "upstream_error", "upstream_error"


class ServiceUnavailable(ServiceError):
    status, type, code = 503, "server_error", "unavailable"

    def headers(self) -> dict[str, str]:
        return {"Retry-After": "1"}


def unwrap(exc: BaseException) -> BaseException:
    """The exception a replica raised, out of the ``RayTaskError`` a handle call wraps it in."""
    cause = getattr(exc, "cause", None)
    return cause if isinstance(cause, BaseException) else exc

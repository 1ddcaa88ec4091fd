"""The errors a request can end in, in the service's own terms: what went wrong, which input, when to retry.

They carry no HTTP status: ``deployments.ingress.openai_errors`` maps each to OpenAI's error shape in one place.
They cross Ray's process boundary (an ``EmbeddingModel`` raises, the ingress or another deployment catches), so each
one pickles from its own fields.
"""

from __future__ import annotations

from typing import Any

from batching import DeadlineExceeded, Overloaded


class ServiceError(Exception):
    """A failed request; ``index`` is the input at fault, when one is, and ``param`` the request field otherwise."""

    def __init__(self, message: str, *, param: str | None = None, index: int | None = None) -> None:
        Exception.__init__(self, message)
        self.message = message
        self.param = param
        self.index = index

    def _fields(self) -> dict[str, Any]:
        return {"param": self.param, "index": self.index}

    def __reduce__(self) -> tuple[Any, ...]:
        return _rebuild, (type(self), self.message, self._fields())


def _rebuild(cls: type[ServiceError], message: str, fields: dict[str, Any]) -> ServiceError:
    error = cls.__new__(cls)
    Exception.__init__(error, message)
    error.message = message
    for name, value in fields.items():
        setattr(error, name, value)
    return error


class InvalidRequest(ServiceError):
    pass


class PayloadTooLarge(ServiceError):
    pass


class BodyReadTimeout(ServiceError):
    pass


class AuthenticationFailed(ServiceError):
    pass


class PermissionDenied(ServiceError):
    """The API key is valid but may not do this (a model or a priority its tenant is not given)."""


class ModelNotFound(ServiceError):
    pass


class ResourceNotFound(ServiceError):
    """No such route, file or batch."""


class RouteNotFound(ResourceNotFound):
    pass


class MethodNotAllowed(ServiceError):
    pass


class RetryLater(ServiceError):
    """An error that tells the caller when to try again."""

    def __init__(self, message: str, *, retry_after_s: float, **fields: Any) -> None:
        ServiceError.__init__(self, message, **fields)
        self.retry_after_s = retry_after_s

    def _fields(self) -> dict[str, Any]:
        return {**super()._fields(), "retry_after_s": self.retry_after_s}


class TenantRateLimited(RetryLater):
    """The API key's tenant is past one of its per-minute limits; ``headers``: its ``x-ratelimit-*`` account."""

    def __init__(self, message: str, *, retry_after_s: float, headers: dict[str, str] | None = None,
                 **fields: Any) -> None:
        RetryLater.__init__(self, message, retry_after_s=retry_after_s, **fields)
        self.headers = headers or {}

    def _fields(self) -> dict[str, Any]:
        return {**super()._fields(), "headers": self.headers}


class TenantOverBudget(TenantRateLimited):
    """The API key's tenant has spent its day's or month's token budget."""


class ModelOverloaded(RetryLater, Overloaded):
    """The model's queue is full; also an ``Overloaded``, so handle callers may catch either."""


class UpstreamRateLimited(RetryLater):
    """The upstream kept answering 429 until the input's retries ran out: the caller should slow down too."""


class RequestTimedOut(ServiceError, DeadlineExceeded):
    """The caller's deadline passed; also a ``DeadlineExceeded``."""


class UpstreamFailed(ServiceError):
    pass


class NotCached(UpstreamFailed):
    """An input a cache-only request (a relayed batch's line) found no vector for: the provider's batch has not
    returned it (yet)."""


class ServiceUnavailable(ServiceError):
    """Shutting down, or no replica answers: retry in a second."""


def unwrap(exc: BaseException) -> BaseException:
    """The exception a replica raised, out of the ``RayTaskError`` a handle call wraps it in."""
    cause = getattr(exc, "cause", None)
    return cause if isinstance(cause, BaseException) else exc

"""Errors an item can end in, and which failures are worth another attempt."""

from __future__ import annotations


class BatcherError(Exception):
    """Base of the errors the batcher itself raises."""


class Overloaded(BatcherError):
    """The queue is full: the item was refused and never queued. Try again after ``retry_after_s``."""

    def __init__(self, retry_after_s: float, message: str = "batcher queue is full") -> None:
        super().__init__(f"{message}; retry after {retry_after_s:.3f}s")
        self.retry_after_s = retry_after_s


class NeverFits(BatcherError, ValueError):
    """One call of more items than ``max_queue_depth``: refused however empty the queue, so no retry helps."""


class DeadlineExceeded(BatcherError, TimeoutError):
    """The caller's ``timeout_s`` passed before its result was ready."""


class BatcherClosed(BatcherError):
    """The batcher is closed (or closed without draining while the item was queued)."""


class ItemTooLarge(BatcherError, RuntimeError):
    """With ``refuse_oversized``, an item that alone costs more than ``max_batch_cost`` (a RuntimeError, as
    ``@serve.batch`` raises for it)."""


class BatchResultMismatch(BatcherError):
    """The process function returned a result list whose length differs from its input."""


class Postponed(Exception):
    """What a process function returns for an item it did not send because it can be sent only after
    ``retry_after_s`` (a quota that will hold it then): the item waits out of the queue until that moment and is
    queued again. Not a failure: it uses none of ``max_retries``, and its deadline still bounds its wait."""

    retryable = True

    def __init__(self, retry_after_s: float, message: str = "not sent yet") -> None:
        super().__init__(f"{message}; again in {retry_after_s:.3f}s")
        self.retry_after_s = retry_after_s


def is_retryable(exc: BaseException) -> bool:
    """Timeouts, connection errors and anything marked ``retryable = True`` are worth another attempt."""
    marked = getattr(exc, "retryable", None)
    if marked is not None:
        return bool(marked)
    return isinstance(exc, (TimeoutError, ConnectionError)) and not isinstance(exc, DeadlineExceeded)


def retry_after_s(exc: BaseException) -> float:
    """Delay an upstream asked for before the item is tried again (e.g. a 429's ``Retry-After``)."""
    value = getattr(exc, "retry_after_s", None)
    return max(0.0, float(value)) if value is not None else 0.0

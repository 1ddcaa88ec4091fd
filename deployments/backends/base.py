"""What an embedding backend is: items in, one vector (or one failure) per item out. No batching here."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Sequence, Union

import numpy as np

Item = Union[str, Sequence[int]]  # a text, or token ids (cl100k_base for the clients that send ids)


class ItemRejected(ValueError):
    """This input cannot be embedded as sent (the caller's fault: HTTP 400)."""


class UpstreamError(Exception):
    """An upstream API failed. ``retryable`` items are queued again by the batcher after ``retry_after_s``."""

    def __init__(self, message: str, *, status: int | None = None, retryable: bool = False,
                 retry_after_s: float | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.retryable = retryable
        self.retry_after_s = retry_after_s

    def __reduce__(self):  # keep the fields when it crosses a process boundary
        return _rebuild_upstream_error, (str(self), self.status, self.retryable, self.retry_after_s)


def _rebuild_upstream_error(message: str, status: int | None, retryable: bool,
                            retry_after_s: float | None) -> UpstreamError:
    return UpstreamError(message, status=status, retryable=retryable, retry_after_s=retry_after_s)


class EmbeddingBackend(ABC):
    """A model behind the service.

    ``embed`` returns, for each item in order, a float32 vector or the exception that failed that item alone.
    Raising instead fails the whole call: the batcher then splits the batch to find the input at fault, so
    raise only for an error that may belong to one input (an upstream 400); report failures of the call
    itself (429, 5xx, connection) in place, so they are retried without splitting.
    """

    @property
    @abstractmethod
    def dimension(self) -> int | None:
        """Length of the vectors it returns by default (None until known)."""

    @abstractmethod
    def supports_dimensions(self, dimensions: int) -> bool:
        """Whether a request may ask for ``dimensions``-long vectors."""

    @abstractmethod
    def count_tokens(self, item: Item) -> int:
        """Tokens the item costs; raises ``ItemRejected`` if it cannot be embedded."""

    async def count_tokens_many(self, items: Sequence[Item]) -> list[int | BaseException]:
        """``count_tokens`` for each item, failures in place."""
        counts: list[int | BaseException] = []
        for item in items:
            try:
                counts.append(self.count_tokens(item))
            except ItemRejected as exc:
                counts.append(exc)
        return counts

    @abstractmethod
    async def embed(self, items: Sequence[Item], dimensions: int | None = None) -> Sequence[np.ndarray | BaseException]:
        ...

    async def aclose(self) -> None:
        """Release what the backend holds (threads, connections)."""

"""What an embedding backend is: items in, one vector (or one failure) per item out. No batching here."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Hashable, NamedTuple, Sequence, Union

import numpy as np

from deployments.model.backends.prompts import Prompts

Item = Union[str, Sequence[int]]  # a text, or token ids (cl100k_base for the clients that send ids)


class Prepared(NamedTuple):
    """One input made ready to embed, by ``EmbeddingBackend.prepare_many``."""

    content: Hashable  # what ``embed`` receives for this input; equal contents give equal vectors (so may be deduped)
    tokens: int  # what it costs: the batch token budget, and the response's usage count


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

    ``prepare_many`` turns each input, with the request's prompt (one of ``prompts``) before it, into a ``Prepared``
    once, when its request arrives; ``embed`` receives the ``content`` of each input of a batch and returns, for
    each in order, a float32 vector or the exception that failed that input alone. Raising instead fails the whole
    call: the batcher then splits the batch to find the input at fault, so raise only for an error that may belong
    to one input (an upstream 400); report failures of the call itself (429, 5xx, connection) in place, so they are
    retried without splitting.
    """

    @property
    @abstractmethod
    def dimension(self) -> int | None:
        """Length of the vectors it returns by default (None until known)."""

    @abstractmethod
    def supports_dimensions(self, dimensions: int) -> bool:
        """Whether a request may ask for ``dimensions``-long vectors."""

    @property
    def prompts(self) -> Prompts:
        """The model's named prompts and its default (none, unless the backend's model has some)."""
        return Prompts()

    @abstractmethod
    async def prepare_many(self, items: Sequence[Item], prompt: str = "",
                           background: bool = False) -> list[Prepared | BaseException]:
        """Each item, ``prompt`` before it (a text ``prompts`` chose), made ready to embed, or the reason it cannot
        be (``ItemRejected``: the caller's fault), in place. Long inputs must not hold the event loop, and a request
        that is not ``background`` work (a LOW request) must not wait behind those that are."""

    @abstractmethod
    async def embed(
        self, contents: Sequence[Hashable], dimensions: int | None = None, background: bool = False
    ) -> Sequence[np.ndarray | BaseException]:
        """One vector (or the failure of that input alone) for each ``Prepared.content``, in order. ``background``:
        a LOW batch's, whose computing may yield to the others' (a backend that computes nothing itself ignores it)."""

    async def aclose(self) -> None:
        """Release what the backend holds (threads, connections)."""

"""What crosses between the ingress and the model replicas: the request the ingress forwards and the one
``Deadline`` type both sides keep.

A deadline is absolute inside a process (a moment on its event loop's clock) and relative only across the process
boundary: ``EmbedRequest.timeout_s`` carries the seconds left when the request is sent, and the receiver makes its
own ``Deadline`` of them on arrival, since two processes' clocks are not comparable.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple, Sequence

if TYPE_CHECKING:  # the engine's pieces import this module (prompts), and they need no batching
    from batching import Priority

INPUT_TYPES = ("query", "document")  # what a request may say its inputs are (deployments/model/backends/prompts.py)


@dataclass(frozen=True, order=True)
class Deadline:
    """The moment, on the running event loop's clock (``loop.time()``), by which a request must be answered."""

    at: float

    @classmethod
    def after(cls, seconds: float) -> Deadline:
        return cls(asyncio.get_running_loop().time() + seconds)

    @classmethod
    def of(cls, timeout_s: float | None) -> Deadline | None:
        """The deadline of a request that arrived now with ``timeout_s`` left (None: it has none)."""
        return None if timeout_s is None else cls.after(timeout_s)

    def remaining(self) -> float:
        """Seconds left (negative once passed)."""
        return self.at - asyncio.get_running_loop().time()

    @staticmethod
    def seconds_left(deadline: Deadline | None) -> float | None:
        """What ``timeout_s`` says of ``deadline`` when the request crosses to another process now."""
        return None if deadline is None else deadline.remaining()


class Share(NamedTuple):
    """Whose a request is, for fair shares of the model between keys (``batching``'s keys): a tenant, and its
    weight."""

    key: str
    weight: float = 1.0


class EmbedRequest(NamedTuple):
    """One request's inputs and how to serve them; what the ingress forwards, many at a time, to ``embed_many``."""

    inputs: Sequence[str] | Sequence[Sequence[int]]
    priority: Priority | str = "high"  # or "low"; the ingress sends a Priority
    timeout_s: float | None = None  # seconds left when it was sent
    dimensions: int | None = None
    prompt_name: str | None = None  # one of the model's prompts; or
    input_type: str | None = None  # "query" | "document" (INPUT_TYPES): the model's prompt for it, if any
    cached_only: bool = False  # answered from the model's cache alone: an input it lacks fails (NotCached)
    share: Share | None = None  # whose it is, where tenants share the model (None: nobody's in particular)

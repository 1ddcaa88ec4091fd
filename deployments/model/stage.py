"""One stage of a model's path, which runs one way: the embedder hands a request's prepared inputs to its first
stage (the cache, when the entry has one), each stage passes on what it cannot answer itself, and the last one
(``batched.BatchedBackend``) batches them into the backend's calls."""

from __future__ import annotations

from typing import Protocol, Sequence

import numpy as np

from batching import Priority
from deployments.model.backends import Prepared
from deployments.wire import Deadline, Share

Outcome = np.ndarray | BaseException  # an input's vector, or what failed it


class EmbeddingStage(Protocol):
    async def embed(self, prepared: Sequence[Prepared], *, dimensions: int | None, priority: Priority,
                    deadline: Deadline | None, share: Share | None = None) -> list[Outcome]:
        """One outcome per input, in order; ``share``: whose they are, for fair shares of the batches. Raises only what refuses the whole request (``Overloaded``,
        ``BatcherClosed``, ``NeverFits``) or cancels it."""
        ...

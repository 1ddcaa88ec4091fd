"""A fake model handle for the Batch API's tests: its vectors say which text they are for."""

from __future__ import annotations

import asyncio
import threading
from typing import Any, AsyncIterator

import numpy as np

from batching import Priority
from deployments.errors import ModelOverloaded

MODEL = "fake-embed"


def vector_of(text: str) -> list[float]:
    return [float(len(text)), float(sum(map(ord, text)) % 1000), 1.0]


class FakeModel:
    """Stands in for an ``EmbeddingModel``'s handle: ``embed_many`` answers each request from its texts, recording
    every request's texts and priority; ``overloaded`` refusals come first for the texts named in it."""

    def __init__(self, overloaded: dict[str, int] | None = None) -> None:
        self.requests: list[tuple[list[str], Priority]] = []
        self.overloaded = dict(overloaded or {})

    def options(self, **_: Any) -> "FakeModel":
        return self

    def remote(self, requests: list[Any]) -> "_Stream":
        return _Stream(self._answers(requests))

    async def _answers(self, requests: list[Any]) -> AsyncIterator[list[tuple[int, Any]]]:
        answers = []
        for index, request in enumerate(requests):
            texts = list(request.inputs)
            if self.overloaded.get(texts[0], 0) > 0:
                self.overloaded[texts[0]] -= 1
                answers.append((index, ModelOverloaded("busy", retry_after_s=0.01)))
                continue
            self.requests.append((texts, request.priority))
            answers.append((index, (np.array([vector_of(t) for t in texts], dtype=np.float32), [1] * len(texts))))
        yield answers


class _Stream:
    def __init__(self, answers: AsyncIterator[Any]) -> None:
        self._answers = answers

    def __aiter__(self) -> AsyncIterator[Any]:
        return self._answers

    def cancel(self) -> None:
        pass


class HeldModel(FakeModel):
    """Answers ``held`` only once ``release`` is set."""

    def __init__(self, held: str) -> None:
        super().__init__()
        self.held = held
        self.release = threading.Event()

    async def _answers(self, requests: list[Any]) -> AsyncIterator[list[tuple[int, Any]]]:
        if any(self.held in request.inputs for request in requests):
            while not self.release.is_set():
                await asyncio.sleep(0.005)
        async for answers in super()._answers(requests):
            yield answers

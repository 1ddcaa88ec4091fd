"""A fake model handle for the Batch API's tests: its vectors say which text they are for."""

from __future__ import annotations

import asyncio
import threading
from typing import Any, AsyncIterator, Callable

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


class LocalHandle:
    """A real ``EmbeddingModel`` behind a handle's calls, made on the first call (in the event loop that serves
    it): ``options(method_name=..., stream=...).remote(...)`` as a ``DeploymentHandle`` answers."""

    def __init__(self, make: Callable[[], Any]) -> None:
        self._make = make
        self.model: Any = None

    def options(self, method_name: str = "__call__", stream: bool = False, **_: Any) -> "_LocalCall":
        return _LocalCall(self, method_name, stream)


class _LocalCall:
    def __init__(self, handle: LocalHandle, method_name: str, stream: bool) -> None:
        self._handle = handle
        self._method_name = method_name
        self._stream = stream

    def remote(self, *args: Any) -> Any:
        if self._handle.model is None:
            self._handle.model = self._handle._make()
        method = getattr(self._handle.model, self._method_name)
        return _Stream(method(*args).__aiter__()) if self._stream else asyncio.ensure_future(method(*args))

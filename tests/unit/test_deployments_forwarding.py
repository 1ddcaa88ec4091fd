"""``ModelForwarder``: requests of one event-loop turn share one streaming call; each answer arrives on its own."""

from __future__ import annotations

import asyncio

import pytest

from deployments.embedder import EmbedRequest
from deployments.forwarding import ModelForwarder

pytestmark = pytest.mark.looptime


class StreamingHandle:
    """A handle to ``embed_many`` that answers each request after ``delay_s[text]`` (its first input)."""

    def __init__(self, delay_s: dict[str, float]) -> None:
        self.delay_s = delay_s
        self.calls: list[list[str]] = []
        self.cancelled = 0

    def options(self, **_: object) -> "StreamingHandle":
        return self

    def remote(self, requests: list[EmbedRequest]) -> "StreamingHandle._Stream":
        self.calls.append([request.inputs[0] for request in requests])
        return self._Stream(self, requests)

    class _Stream:
        def __init__(self, handle: "StreamingHandle", requests: list[EmbedRequest]) -> None:
            self._handle, self._requests = handle, requests

        async def __aiter__(self):
            order = sorted(range(len(self._requests)), key=lambda i: self._handle.delay_s[self._requests[i].inputs[0]])
            started = asyncio.get_running_loop().time()
            for i in order:
                text = self._requests[i].inputs[0]
                await asyncio.sleep(max(0.0, started + self._handle.delay_s[text] - asyncio.get_running_loop().time()))
                yield [(i, f"vectors of {text}")]

        def cancel(self) -> None:
            self._handle.cancelled += 1


async def test_requests_of_one_turn_share_one_call_and_each_answer_arrives_when_ready():
    handle = StreamingHandle({"slow": 1.0, "quick": 0.1, "later": 0.0})
    forwarder = ModelForwarder(handle)
    slow, quick = forwarder.forward(EmbedRequest(["slow"])), forwarder.forward(EmbedRequest(["quick"], "low"))
    assert await quick == "vectors of quick" and not slow.done()  # not held for its slow neighbour
    later = forwarder.forward(EmbedRequest(["later"]))
    assert await later == "vectors of later" and await slow == "vectors of slow"
    assert handle.calls == [["slow", "quick"], ["later"]]


async def test_the_call_is_cancelled_once_every_request_of_it_gave_up():
    handle = StreamingHandle({"a": 5.0, "b": 5.0})
    forwarder = ModelForwarder(handle)
    first, second = forwarder.forward(EmbedRequest(["a"])), forwarder.forward(EmbedRequest(["b"]))
    await asyncio.sleep(0.01)
    first.cancel()
    await asyncio.sleep(0)
    assert handle.cancelled == 0
    second.cancel()
    await asyncio.sleep(0)
    assert handle.cancelled == 1

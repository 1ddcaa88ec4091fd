"""``ModelForwarder``: requests of one event-loop turn share one streaming call; each answer arrives on its own."""

from __future__ import annotations

import asyncio
from typing import Callable

import pytest

from batching import Priority
from deployments.ingress.forwarding import GATHER_FROM, GATHER_S, ModelForwarder
from deployments.wire import Deadline, EmbedRequest

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


async def test_while_many_requests_are_in_flight_the_next_call_waits_for_those_arriving_behind_its_first():
    busy = [f"busy {i}" for i in range(GATHER_FROM)]
    handle = StreamingHandle({**dict.fromkeys(busy, 1.0), "a": 0.0, "b": 0.0, "c": 0.0, "d": 0.0, "e": 0.0})
    forwarder = ModelForwarder(handle)
    in_flight = [forwarder.forward(EmbedRequest([text], Priority.HIGH)) for text in busy]
    await asyncio.sleep(0.1)
    arrivals = {"a": 0.0, "b": GATHER_S / 2, "c": GATHER_S * 0.9, "d": GATHER_S * 1.5}
    answers = {text: asyncio.ensure_future(_forward_after(forwarder, text, at)) for text, at in arrivals.items()}
    await asyncio.gather(*answers.values())
    assert handle.calls[1:] == [["a", "b", "c"], ["d"]]  # d came after the call had left
    assert answers["a"].result() == (GATHER_S, "vectors of a")  # the first waited the whole window, no more
    await asyncio.gather(*in_flight)
    assert (await _forward_after(forwarder, "e", 0.0))[0] == 0.0  # nothing in flight: it leaves in its own turn


async def test_a_high_request_beside_many_low_ones_in_flight_leaves_in_its_own_turn_with_those_gathering():
    busy = [f"busy {i}" for i in range(GATHER_FROM)]
    handle = StreamingHandle({**dict.fromkeys(busy, 1.0), "low": 0.0, "high": 0.0})
    forwarder = ModelForwarder(handle)
    in_flight = [forwarder.forward(EmbedRequest([text], Priority.LOW)) for text in busy]
    await asyncio.sleep(0.1)
    low = asyncio.ensure_future(_forward_after(forwarder, "low", 0.0, Priority.LOW))
    high = asyncio.ensure_future(_forward_after(forwarder, "high", GATHER_S / 4))
    assert (await high)[0] == 0.0 and (await low)[0] == GATHER_S / 4  # the gathering LOW one went along
    assert handle.calls[1:] == [["low", "high"]]
    await asyncio.gather(*in_flight)


async def _forward_after(forwarder: ModelForwarder, text: str, delay_s: float,
                         priority: Priority = Priority.HIGH) -> tuple[float, str]:
    """How long the request waited from its arrival (``delay_s`` from now) for its answer, and the answer."""
    loop = asyncio.get_running_loop()
    await asyncio.sleep(delay_s)
    arrived = loop.time()
    answer = await forwarder.forward(EmbedRequest([text], priority))
    return round(loop.time() - arrived, 6), answer


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


# ---- a replica lost mid-call --------------------------------------------------------------------------------------


class DyingHandle:
    """A handle whose calls answer their requests in order, one every 0.1 s; call k dies with ``deaths[k]`` after
    answering ``answered[k]`` requests (no death for calls past the lists)."""

    def __init__(self, deaths: list[BaseException], answered: list[int]) -> None:
        self.deaths, self.answered = deaths, answered
        self.calls: list[list[tuple[str, float | None]]] = []

    def options(self, **_: object) -> "DyingHandle":
        return self

    def remote(self, requests: list[EmbedRequest]) -> "DyingHandle._Stream":
        call = len(self.calls)
        self.calls.append([(request.inputs[0], request.timeout_s) for request in requests])
        return self._Stream(self, call, requests)

    class _Stream:
        def __init__(self, handle: "DyingHandle", call: int, requests: list[EmbedRequest]) -> None:
            self._handle, self._call, self._requests = handle, call, requests

        async def __aiter__(self):
            handle = self._handle
            dies = self._call < len(handle.deaths)
            for i, request in enumerate(self._requests):
                await asyncio.sleep(0.1)
                if dies and i == handle.answered[self._call]:
                    raise handle.deaths[self._call]
                yield [(i, f"vectors of {request.inputs[0]}")]

        def cancel(self) -> None:
            pass


def resends() -> tuple[list[tuple[str, int]], Callable[[str, int], None]]:
    seen: list[tuple[str, int]] = []
    return seen, lambda cause, count: seen.append((cause, count))


async def test_requests_unanswered_when_their_replica_died_are_sent_again_and_answered():
    from ray.exceptions import ActorDiedError

    handle = DyingHandle([ActorDiedError()], answered=[1])
    seen, on_resend = resends()
    forwarder = ModelForwarder(handle, on_resend)
    futures = [forwarder.forward(EmbedRequest([text])) for text in "abc"]
    assert await asyncio.gather(*futures) == ["vectors of a", "vectors of b", "vectors of c"]
    assert [[text for text, _ in call] for call in handle.calls] == [["a", "b", "c"], ["b", "c"]]  # a: once
    assert seen == [("replica_died", 2)]


async def test_a_cancellation_raised_from_the_replicas_side_is_a_loss_too():
    handle = DyingHandle([asyncio.CancelledError()], answered=[0])
    forwarder = ModelForwarder(handle)
    assert await forwarder.forward(EmbedRequest(["a"])) == "vectors of a"
    assert len(handle.calls) == 2


async def test_after_its_resends_a_request_ends_in_service_unavailable():
    from ray.exceptions import ActorUnavailableError

    from deployments.errors import ServiceUnavailable
    from deployments.ingress.forwarding import RESENDS

    handle = DyingHandle([ActorUnavailableError("gone", None)] * (RESENDS + 1), answered=[0] * (RESENDS + 1))
    forwarder = ModelForwarder(handle)
    with pytest.raises(ServiceUnavailable):
        await forwarder.forward(EmbedRequest(["a"]))
    assert len(handle.calls) == RESENDS + 1


async def test_a_failure_that_is_not_a_replicas_loss_is_not_sent_again():
    handle = DyingHandle([ValueError("bad input")], answered=[0])
    forwarder = ModelForwarder(handle)
    with pytest.raises(ValueError):
        await forwarder.forward(EmbedRequest(["a"]))
    assert len(handle.calls) == 1


async def test_a_request_is_sent_again_with_what_is_left_of_its_time_and_not_at_all_once_it_is_out():
    from ray.exceptions import ActorDiedError

    handle = DyingHandle([ActorDiedError()], answered=[0])
    forwarder = ModelForwarder(handle)
    roomy = forwarder.forward(EmbedRequest(["roomy"]), Deadline.after(5.0))
    tight = forwarder.forward(EmbedRequest(["tight"]), Deadline.after(0.05))
    assert await roomy == "vectors of roomy"
    assert handle.calls[1] == [("roomy", pytest.approx(4.9))]
    assert not tight.done()  # the ingress's own deadline answers it (504)
    tight.cancel()

"""How the ingress reaches a model deployment: the requests for it that arrive in the same event-loop turn travel
together, in one streaming handle call to ``EmbeddingModel.embed_many``, which sends each answer back when it is done.

A handle call costs both replicas about a millisecond of CPU whatever it carries, and on a small machine that, not
the model, caps the requests served per second. Gathering what arrived in one turn adds no wait: a lone request
leaves at the end of the turn it arrived in. Under load the requests come a few at a time (the clients of a batch
just answered send their next ones), each in a turn of its own, so while many requests are in flight to the model
the next call waits ``GATHER_S`` for the ones arriving behind its first. Inside the model every request keeps its
own priority, deadline and outcome, and since each answer streams back on its own, no request waits for another of
its call.

Embedding is a pure function, so a request whose replica was lost before it answered (the actor died, its node
went, it was stopped) is sent again, to whichever replica Serve picks next, with what is left of its deadline:
at most ``RESENDS`` times, and only the requests of the call that had no answer yet, so none is computed (or billed
upstream) twice.
"""

from __future__ import annotations

import asyncio
from typing import Any, Callable

from batching import Priority
from deployments.errors import ServiceUnavailable
from deployments.ingress.replica_loss import loss_cause
from deployments.wire import Deadline, EmbedRequest

RESENDS = 2  # times a request follows its replica's loss to another one
# While this many of the model's requests of a priority from this ingress are unanswered, the model is busy with that
# priority's work: a request of it arriving then would wait in the model's queue (behind the batches running, or for
# its batch to fill) for milliseconds anyway, so its call waits this long for the requests arriving behind it. A
# request of a priority with fewer in flight (a HIGH one beside a LOW flood) leaves in its own turn, and takes along
# whatever was gathering.
GATHER_FROM = 8
GATHER_S = 0.002

_Waiter = tuple[EmbedRequest, Deadline | None, asyncio.Future]
OnResend = Callable[[str, int], None]  # (the cause of the loss, how many requests were sent again)


class ModelForwarder:
    def __init__(self, handle: Any, on_resend: OnResend | None = None) -> None:
        self._handle = handle.options(method_name="embed_many", stream=True)
        self._on_resend = on_resend
        self._pending: list[_Waiter] = []
        self._deliveries: set[asyncio.Task] = set()
        self._unanswered: dict[Priority | str, int] = {}  # by priority
        self._gathering: asyncio.TimerHandle | None = None  # the pending call's wait, while it gathers

    def forward(self, request: EmbedRequest, deadline: Deadline | None = None) -> asyncio.Future:
        """A future of the request's outcome: its ``(vectors, token_counts)``, or the error it failed with. Each time
        the request is sent, its ``timeout_s`` is what is left of ``deadline`` then; once nothing is left it is not
        sent again (its caller's own deadline answers it). Cancelling the future gives up on the request (and on the
        call, once every request of the call gave up)."""
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        priority = request.priority
        unanswered = self._unanswered.get(priority, 0)
        if unanswered >= GATHER_FROM:
            if not self._pending:
                self._gathering = loop.call_later(GATHER_S, self._flush)
        elif not self._pending or self._gathering is not None:  # the call leaves at the end of this turn
            if self._gathering is not None:
                self._gathering.cancel()
                self._gathering = None
            loop.call_soon(self._flush)
        self._pending.append((request, deadline, future))
        self._unanswered[priority] = unanswered + 1
        future.add_done_callback(lambda _: self._answered(priority))
        return future

    def _answered(self, priority: Priority | str) -> None:
        self._unanswered[priority] -= 1

    def _flush(self) -> None:
        self._gathering = None
        group, self._pending = self._pending, []
        live = _live(group)
        if live:
            self._send(live, RESENDS)

    def _send(self, group: list[_Waiter], resends_left: int) -> None:
        response = self._handle.remote([request._replace(timeout_s=Deadline.seconds_left(deadline))
                                        for request, deadline, _ in group])
        delivery = asyncio.ensure_future(self._deliver(response, group, resends_left))
        self._deliveries.add(delivery)
        delivery.add_done_callback(self._deliveries.discard)
        remaining = [len(group)]

        def given_up(future: asyncio.Future) -> None:
            if future.cancelled():
                remaining[0] -= 1
                if remaining[0] == 0:
                    response.cancel()

        for _, _, future in group:
            future.add_done_callback(given_up)

    async def _deliver(self, response: Any, group: list[_Waiter], resends_left: int) -> None:
        try:
            async for finished in response:
                for index, outcome in finished:
                    future = group[index][2]
                    if future.done():
                        continue
                    if isinstance(outcome, BaseException):
                        future.set_exception(outcome)
                    else:
                        future.set_result(outcome)
        except asyncio.CancelledError as exc:
            if asyncio.current_task().cancelling():  # type: ignore[union-attr]  # ours: the ingress is stopping
                for _, _, future in group:
                    future.cancel()
                raise
            self._fail_or_resend(group, exc, resends_left)  # the call's, raised inside: its replica went
        except Exception as exc:  # the call itself failed: every request of it still waiting did
            self._fail_or_resend(group, exc, resends_left)

    def _fail_or_resend(self, group: list[_Waiter], exc: BaseException, resends_left: int) -> None:
        cause = loss_cause(exc)
        if cause is not None and resends_left:
            again = _live(group)
            if again:
                if self._on_resend is not None:
                    self._on_resend(cause, len(again))
                self._send(again, resends_left - 1)
            return  # a request left with no time is answered by the ingress's own deadline
        error = ServiceUnavailable("the model's replica was lost; retry later") if cause is not None else exc
        for _, _, future in group:
            if not future.done():
                future.set_exception(error)


def _live(group: list[_Waiter]) -> list[_Waiter]:
    """The requests still waiting for an answer with time left to get one."""
    return [waiter for waiter in group
            if not waiter[2].done() and (waiter[1] is None or waiter[1].remaining() > 0)]

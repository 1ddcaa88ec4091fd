"""How the ingress reaches a model deployment: the requests for it that arrive in the same event-loop turn travel
together, in one streaming handle call to ``EmbeddingModel.embed_many``, which sends each answer back when it is done.

A handle call costs both replicas about a millisecond of CPU whatever it carries, and on a small machine that, not
the model, caps the requests served per second. Gathering what arrived in one turn adds no wait: a lone request
leaves at the end of the turn it arrived in. Inside the model every request keeps its own priority, deadline and
outcome, and since each answer streams back on its own, no request waits for another of its call.
"""

from __future__ import annotations

import asyncio
from typing import Any

from .embedder import EmbedRequest

_Waiter = tuple[EmbedRequest, asyncio.Future]


class ModelForwarder:
    def __init__(self, handle: Any) -> None:
        self._handle = handle.options(method_name="embed_many", stream=True)
        self._pending: list[_Waiter] = []
        self._deliveries: set[asyncio.Task] = set()

    def forward(self, request: EmbedRequest) -> asyncio.Future:
        """A future of the request's outcome: its ``(vectors, token_counts)``, or the error it failed with.
        Cancelling it gives up on the request (and on the call, once every request of the call gave up)."""
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        if not self._pending:
            loop.call_soon(self._flush)
        self._pending.append((request, future))
        return future

    def _flush(self) -> None:
        group, self._pending = self._pending, []
        live = [(request, future) for request, future in group if not future.done()]
        if not live:
            return
        response = self._handle.remote([request for request, _ in live])
        delivery = asyncio.ensure_future(self._deliver(response, live))
        self._deliveries.add(delivery)
        delivery.add_done_callback(self._deliveries.discard)
        remaining = [len(live)]

        def given_up(future: asyncio.Future) -> None:
            if future.cancelled():
                remaining[0] -= 1
                if remaining[0] == 0:
                    response.cancel()

        for _, future in live:
            future.add_done_callback(given_up)

    @staticmethod
    async def _deliver(response: Any, group: list[_Waiter]) -> None:
        try:
            async for finished in response:
                for index, outcome in finished:
                    future = group[index][1]
                    if future.done():
                        continue
                    if isinstance(outcome, BaseException):
                        future.set_exception(outcome)
                    else:
                        future.set_result(outcome)
        except asyncio.CancelledError:
            for _, future in group:
                future.cancel()
            raise
        except Exception as exc:  # the call itself failed: every request of it still waiting did
            for _, future in group:
                if not future.done():
                    future.set_exception(exc)

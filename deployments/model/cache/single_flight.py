"""Single flight: concurrent requests for one missing vector wait for one computation of it.

The first request to miss a key leads a ``Flight``; later ones join it and wait for its outcome with their own
deadline. A HIGH request joins HIGH flights only (a LOW flight may be queued behind a LOW backlog, and HIGH never
waits behind LOW); a LOW request joins either. A flight its leader could not finish for reasons of the leader's own
(refused, out of time, cancelled) ends in ``FlightAbandoned``, and each joiner then computes the key itself.
"""

from __future__ import annotations

import asyncio
from typing import Generic, Iterable, TypeVar

from batching import Priority

T = TypeVar("T")


class FlightAbandoned(Exception):
    """The computation a request joined ended without an outcome for it; the joiner must compute the key itself."""


class Flight(Generic[T]):
    """One computation of one key; its joiners await ``outcome`` (a result or the exception that failed it)."""

    def __init__(self, table: dict[str, "Flight[T]"], key: str) -> None:
        self.key = key
        self.outcome: asyncio.Future[T | BaseException] = asyncio.get_running_loop().create_future()
        self._table = table
        table[key] = self

    def settle(self, outcome: T | BaseException) -> None:
        """Hand ``outcome`` to the joiners; requests that claim the key until ``land`` join the settled flight."""
        if not self.outcome.done():
            self.outcome.set_result(outcome)

    def abandon(self) -> None:
        self.settle(FlightAbandoned())
        self.land()

    def land(self) -> None:
        """Leave the table: requests that claim the key from now on look it up (or compute it) afresh."""
        if self._table.get(self.key) is self:
            del self._table[self.key]


class Flights(Generic[T]):
    def __init__(self) -> None:
        self._tables: dict[Priority, dict[str, Flight[T]]] = {level: {} for level in Priority}

    def joinable(self, key: str, priority: Priority) -> Flight[T] | None:
        """The flight of ``key`` a request at ``priority`` may wait for, if any."""
        # Two lookups, not a loop over the levels: it is asked twice for every input of every request, where a loop's
        # iterator and enum member reads cost more than the lookups themselves.
        flight = self._tables[Priority.HIGH].get(key)
        if flight is None and priority is not Priority.HIGH:
            flight = self._tables[Priority.LOW].get(key)
        return flight

    def claim(self, keys: Iterable[str], priority: Priority) -> tuple[list[Flight[T]], dict[str, Flight[T]]]:
        """For each key, join its flight, or lead a new one: ``(led, joined by key)``."""
        led: list[Flight[T]] = []
        joined: dict[str, Flight[T]] = {}
        for key in keys:
            flight = self.joinable(key, priority)
            if flight is not None:
                joined[key] = flight
            else:
                led.append(Flight(self._tables[priority], key))
        return led, joined

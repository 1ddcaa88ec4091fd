"""The queue of items waiting for a batch: one lane per priority, oldest first."""

from __future__ import annotations

import asyncio
from collections import deque
from typing import Any

from .config import Priority

QUEUED, DELAYED, IN_FLIGHT, DONE = range(4)


class Item:
    """One submitted payload and the future its caller awaits."""

    __slots__ = ("payload", "future", "priority", "enqueued_at", "cost", "deadline", "timers", "state", "attempts")

    def __init__(
        self, payload: Any, future: asyncio.Future, priority: Priority, enqueued_at: float, cost: float,
        deadline: float | None,
    ) -> None:
        self.payload = payload
        self.future = future
        self.priority = priority
        self.enqueued_at = enqueued_at
        self.cost = cost
        self.deadline = deadline
        self.timers: list[asyncio.TimerHandle] | None = None
        self.state = QUEUED
        self.attempts = 0

    def add_timer(self, timer: asyncio.TimerHandle) -> None:
        if self.timers is None:
            self.timers = [timer]
        else:
            self.timers.append(timer)

    def finish(self) -> None:
        self.state = DONE
        if self.timers is not None:
            for timer in self.timers:
                timer.cancel()
            self.timers = None


class PriorityQueue:
    """Two FIFO lanes. Items leave from the front; a removed item stays in its lane, marked, until it reaches the front."""

    def __init__(self) -> None:
        self._lanes: tuple[deque[Item], deque[Item]] = (deque(), deque())
        self._live = [0, 0]
        self._cost = [0.0, 0.0]

    def __len__(self) -> int:
        return self._live[0] + self._live[1]

    def depth(self, priority: Priority) -> int:
        return self._live[priority]

    def cost(self, priority: Priority) -> float:
        return self._cost[priority]

    def push(self, item: Item) -> None:
        self._lanes[item.priority].append(item)
        self._live[item.priority] += 1
        self._cost[item.priority] += item.cost

    def push_front(self, item: Item) -> None:
        """Put back an item that was dispatched before (a retry): it is older than what queued since."""
        self._lanes[item.priority].appendleft(item)
        self._live[item.priority] += 1
        self._cost[item.priority] += item.cost

    def discard(self, item: Item) -> None:
        """Account for a queued item that left without being dispatched (cancelled, expired, closed)."""
        self._live[item.priority] -= 1
        self._cost[item.priority] -= item.cost

    def head(self, priority: Priority) -> Item | None:
        lane = self._lanes[priority]
        while lane and lane[0].state != QUEUED:
            lane.popleft()
        return lane[0] if lane else None

    def has_urgent(self, aged_before: float) -> bool:
        """Is there a HIGH item, or a LOW one queued since before ``aged_before`` (which counts as HIGH)?"""
        if self._live[Priority.HIGH]:
            return True
        low = self.head(Priority.LOW)
        return low is not None and low.enqueued_at <= aged_before

    def take(self, max_size: int, max_cost: float | None, aged_before: float) -> list[Item]:
        """Pop the next batch: HIGH and aged LOW items oldest first, or, when there are none, other LOW items.
        A batch never mixes the two: an interactive item must not ride in a bulk batch that takes longer to process.

        Stops at ``max_size`` items or before the item that would push the cost past ``max_cost``;
        an item that alone costs more than ``max_cost`` travels alone.
        """
        batch: list[Item] = []
        cost = 0.0
        bulk = not self.has_urgent(aged_before)
        while len(batch) < max_size:
            high, low = self.head(Priority.HIGH), self.head(Priority.LOW)
            low_aged = low is not None and low.enqueued_at <= aged_before
            if high is not None and not (low_aged and low.enqueued_at < high.enqueued_at):
                item = high
            elif low is not None and (low_aged or bulk):
                item = low
            else:
                break
            if max_cost is not None and batch and cost + item.cost > max_cost:
                break
            self._lanes[item.priority].popleft()
            self.discard(item)
            cost += item.cost
            batch.append(item)
            if max_cost is not None and cost >= max_cost:
                break
        return batch

    def drain(self) -> list[Item]:
        """Pop every queued item."""
        items = [item for lane in self._lanes for item in lane if item.state == QUEUED]
        for lane in self._lanes:
            lane.clear()
        self._live = [0, 0]
        self._cost = [0.0, 0.0]
        return items

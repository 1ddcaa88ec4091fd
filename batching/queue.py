"""Items waiting for a batch: one lane per priority, each in order of first arrival.

Items may name a key (a tenant, a client): once a lane has seen one, each batch holds one key's items, and the
batches go to the keys by weighted fair queueing (the key that has had the least of the lane's cost for its weight
goes next; a key that comes back from idle starts level with the others, not ahead of them). One key's flood then
lengthens its own wait, not another key's, and another key's lone item does not ride in (and wait for) the flood's
large batch. Items without a key are one more key among them. A lane that has never seen a key fills its batches in
arrival order, at no cost for the feature.
"""

from __future__ import annotations

import asyncio
import bisect
import itertools
import math
from collections import deque
from enum import Enum
from typing import Any, Callable, Hashable

from .config import HIGH, LOW, Priority

# The stall trigger learns a lane's pace from the gaps between arrivals that join it while it is not empty (the pace
# at which a batch fills; the idle time before a batch's first item would stretch it).
_GAP_EWMA = 1 / 16


class ItemState(Enum):
    QUEUED = "queued"
    DELAYED = "delayed"  # failed, waiting out a Retry-After before it queues again
    IN_FLIGHT = "in flight"
    DONE = "done"


# Every item passes through these states, so they are read as module globals (see config.HIGH).
QUEUED, DELAYED, IN_FLIGHT, DONE = ItemState.QUEUED, ItemState.DELAYED, ItemState.IN_FLIGHT, ItemState.DONE


class Item:
    """One submitted payload, and how its caller learns the outcome: the future it awaits, or (for a caller that does
    not await, such as a stream's reader) ``on_settle``."""

    __slots__ = ("seq", "payload", "future", "priority", "enqueued_at", "cost", "deadline", "state", "attempts",
                 "on_settle", "key")

    def __init__(
        self, seq: int, payload: Any, future: asyncio.Future | None, priority: Priority, enqueued_at: float,
        cost: float, deadline: float | None, key: Hashable = None,
    ) -> None:
        self.seq = seq  # arrival order, which a retried item keeps
        self.payload = payload
        self.future = future
        self.priority = priority
        self.enqueued_at = enqueued_at
        self.cost = cost
        self.deadline = deadline
        self.state = QUEUED
        self.attempts = 0
        # Told the item's error (None: a result) the moment it ends.
        self.on_settle: Callable[[BaseException | None], None] | None = None
        self.key = key  # whose it is, for fair shares between keys (None: nobody's in particular)

    @property
    def waiting(self) -> bool:
        """Queued or delayed: it has not been sent, and is not being sent now."""
        return self.state is QUEUED or self.state is DELAYED

    @property
    def done(self) -> bool:
        """It has its outcome, or its caller stopped waiting (an awaited future is cancelled with the caller's task,
        a moment before the batcher hears of it)."""
        return self.state is DONE or (self.future is not None and self.future.done())

    def enqueue(self) -> None:
        self.state = QUEUED

    def send(self) -> None:
        self.state = IN_FLIGHT

    def delay(self) -> None:
        """Failed retryably: it waits out a Retry-After before it queues again."""
        self.state = DELAYED

    def abandon(self) -> None:
        """Its caller stopped waiting: it never goes out, and a result already on its way is dropped."""
        if self.future is not None:
            self.future.cancel()
        self.state = DONE

    def settle(self, result: Any = None, error: BaseException | None = None) -> bool:
        """Give the caller its outcome; False if it already has one."""
        ended = self.done
        self.state = DONE
        if ended:
            return False
        future = self.future
        if future is not None:
            if error is None:
                future.set_result(result)
            else:
                future.set_exception(error)
        if self.on_settle is not None:
            self.on_settle(error)
        return True


class _HeadBatch:
    """The batch at a lane's head as far as a whole-batch cost function has measured it."""

    __slots__ = ("version", "payloads", "scanned", "full")

    def __init__(self, version: int) -> None:
        self.version = version  # the lane's version it was measured at; pushes alone keep it valid
        self.payloads: list[Any] = []
        self.scanned = 0  # deque positions looked at
        self.full = False


class Lane:
    """One priority's items, oldest first. A removed item stays in the deque, marked, until it reaches the front."""

    def __init__(self, priority: Priority) -> None:
        self.priority = priority
        self.depth = 0
        self.cost = 0.0
        self.last_arrival = -math.inf
        self.mean_gap: float | None = None
        self._items: deque[Item] = deque()
        self._version = 0  # changes whenever anything but a push changes the items or their positions
        self._head_batch: _HeadBatch | None = None
        self._shares: _Shares | None = None  # made when the first item with a key arrives

    def push(self, item: Item, max_gap_s: float, weight: float = 1.0) -> None:
        """A new arrival: it is the youngest item. Gaps count up to ``max_gap_s`` toward the lane's pace. ``weight``:
        its key's share of the lane, relative to the other keys' (the latest given for a key holds)."""
        now = item.enqueued_at
        if self.depth:
            gap = min(now - self.last_arrival, max_gap_s)
            self.mean_gap = gap if self.mean_gap is None else self.mean_gap + (gap - self.mean_gap) * _GAP_EWMA
        self.last_arrival = now
        self._add(item)
        self._items.append(item)
        if item.key is not None and self._shares is None:
            self._shares = _Shares(self._items)
        if self._shares is not None:
            self._shares.push(item, weight)

    def put_back(self, item: Item) -> None:
        """An item queued again (a retry) takes the place its first arrival gave it, so the head stays the oldest."""
        item.enqueue()
        self._add(item)
        self._version += 1
        _insert_in_order(self._items, item)
        if self._shares is not None:
            self._shares.put_back(item)

    def discard(self, item: Item) -> None:
        """Account for a queued item that left without being dispatched (cancelled, expired)."""
        self.depth -= 1
        self.cost -= item.cost
        self._version += 1

    def head(self) -> Item | None:
        items = self._items
        while items and items[0].state is not QUEUED:
            items.popleft()
            self._version += 1
        return items[0] if items else None

    def take(self, max_size: int, max_cost: float | None,
             measure: Callable[[list[Any]], float] | None = None) -> list[Item]:
        """Pop up to ``max_size`` items, stopping before the one that would push the cost past ``max_cost``
        (an item that alone costs more travels alone). The cost is the sum of the items' costs, or ``measure`` of
        the batch's payloads. In arrival order; once keys are seen, the items of the key served least."""
        batch: list[Item] = []
        payloads: list[Any] = []
        cost = taken_cost = 0.0
        shares = self._shares
        items = self._items if shares is None else None
        while len(batch) < max_size:
            if shares is not None:  # a batch is one key's: the first item's key is the one served least
                item = shares.next_item(batch[0].key if batch else _ANY_KEY)
                if item is None:
                    break
            elif not items:
                break
            else:
                item = items[0]
                if item.state is not QUEUED:  # removed while queued: dropped on reaching the front
                    items.popleft()
                    continue
            if max_cost is not None:
                if measure is None:
                    grown = cost + item.cost
                else:
                    payloads.append(item.payload)
                    grown = measure(payloads)
                if batch and grown > max_cost:
                    break
                cost = grown
            if shares is None:
                items.popleft()
            else:  # it stays in the arrival order, marked, until it reaches the front
                shares.taken(item)
            item.send()
            taken_cost += item.cost
            batch.append(item)
            if max_cost is not None and cost >= max_cost:
                break
        # The whole batch accounted for at once: what ``discard`` does for one item, without a call per item.
        self.depth -= len(batch)
        self.cost -= taken_cost
        self._version += 1
        return batch

    def head_full(self, measure: Callable[[list[Any]], float], max_cost: float) -> bool:
        """Under a whole-batch cost: the batch at the head reaches ``max_cost``, or the next item would pass it.
        Measured incrementally: an arrival costs one call of ``measure``, as long as nothing else changed."""
        head_batch = self._head_batch
        if head_batch is None or head_batch.version != self._version:
            self.head()  # drop removed items from the front first, so positions stay put while pushes come
            head_batch = self._head_batch = _HeadBatch(self._version)
        if head_batch.full:
            return True
        payloads = head_batch.payloads
        for item in itertools.islice(self._items, head_batch.scanned, None):
            head_batch.scanned += 1
            if item.state is not QUEUED:
                continue
            payloads.append(item.payload)
            cost = measure(payloads)
            if cost > max_cost and len(payloads) > 1:
                payloads.pop()
                head_batch.full = True
                break
            if cost >= max_cost:
                head_batch.full = True
                break
        return head_batch.full

    def drain(self) -> list[Item]:
        """Pop every queued item."""
        items = [item for item in self._items if item.state is QUEUED]
        self._items.clear()
        if self._shares is not None:
            self._shares = _Shares(self._items)
        self.depth, self.cost = 0, 0.0
        self._version += 1
        return items

    def _add(self, item: Item) -> None:
        """Count a queued item in (a new one is queued from its making)."""
        self.depth += 1
        self.cost += item.cost


def _arrival(item: Item) -> int:
    return item.seq


def _insert_in_order(items: deque[Item], item: Item) -> None:
    if not items or items[-1].seq < item.seq:
        items.append(item)
    else:
        items.insert(bisect.bisect_left(items, item.seq, key=_arrival), item)


_ANY_KEY = object()


class _Shares:
    """A lane's items by key, and each key's service so far: the cost it was sent, divided by its weight."""

    def __init__(self, items: deque[Item]) -> None:
        self._by_key: dict[Hashable, deque[Item]] = {}
        self._weights: dict[Hashable, float] = {}
        self._served: dict[Hashable, float] = {}
        self._level = 0.0  # the service of the key sent last: where a key coming back from idle starts
        for item in items:  # the lane's items from before it saw a key: nobody's
            if item.state is QUEUED:
                self.push(item, 1.0)

    def push(self, item: Item, weight: float) -> None:
        queue = self._by_key.get(item.key)
        if queue is None:
            queue = self._by_key[item.key] = deque()
            self._served[item.key] = max(self._served.get(item.key, 0.0), self._level)
        self._weights[item.key] = weight
        queue.append(item)

    def put_back(self, item: Item) -> None:
        queue = self._by_key.get(item.key)
        if queue is None:
            queue = self._by_key[item.key] = deque()
            self._served[item.key] = max(self._served.get(item.key, 0.0), self._level)
        _insert_in_order(queue, item)

    def next_item(self, key: Hashable = None) -> Item | None:
        """The oldest queued item of ``key``, or with ``_ANY_KEY`` of the key served least for its weight."""
        if key is not _ANY_KEY:
            queue = self._by_key.get(key)
            while queue and queue[0].state is not QUEUED:
                queue.popleft()
            return queue[0] if queue else None
        chosen: Item | None = None
        least = math.inf
        for key, queue in list(self._by_key.items()):
            while queue and queue[0].state is not QUEUED:
                queue.popleft()
            if not queue:
                del self._by_key[key]
                continue
            if self._served[key] < least:
                chosen, least = queue[0], self._served[key]
        return chosen

    def taken(self, item: Item) -> None:
        self._by_key[item.key].popleft()
        self._level = self._served[item.key] = self._served[item.key] + item.cost / self._weights.get(item.key, 1.0)


class Lanes(tuple):
    """The two lanes, indexed by priority: a tuple, so that looking a lane up (several times an item) is no Python
    call. Its length is the items queued in both."""

    def __new__(cls) -> "Lanes":
        return super().__new__(cls, (Lane(HIGH), Lane(LOW)))

    def __len__(self) -> int:
        return self[0].depth + self[1].depth

    def drain(self) -> list[Item]:
        return [item for lane in self for item in lane.drain()]

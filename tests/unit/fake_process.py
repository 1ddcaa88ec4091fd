"""A process function for batcher tests: records every call and answers by a rule you set."""

from __future__ import annotations

import asyncio
from typing import Any, Callable, Sequence


class FakeProcess:
    def __init__(self, delay_s: float = 0.0, answer: Callable[[Any], Any] = lambda p: ("ok", p)) -> None:
        self.delay_s = delay_s
        self.answer = answer
        self.calls: list[list[Any]] = []
        self.started_at: list[float] = []
        self.in_flight = 0
        self.max_in_flight = 0
        self.started = asyncio.Event()

    async def __call__(self, payloads: list[Any]) -> Sequence[Any]:
        self.calls.append(list(payloads))
        self.started_at.append(asyncio.get_running_loop().time())
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        self.started.set()
        try:
            if self.delay_s:
                await asyncio.sleep(self.delay_s)
            return [self.answer(p) for p in payloads]
        finally:
            self.in_flight -= 1

    @property
    def sent(self) -> list[Any]:
        return [p for call in self.calls for p in call]

"""Streaming handlers: a batch's async generator yields one list per step, and each entry goes to its own caller.

A handler ``async def f(self, items: list) -> AsyncIterator[list]`` runs once per batch; every list it yields holds
one entry per item, in the batch's order. ``fan_out`` hands each entry to its caller's ``Stream``; an entry that is
``StopIteration`` or ``StopAsyncIteration`` (the class) ends that caller's stream. A caller that has gone (cancelled,
past its deadline) is skipped, and once every caller has gone the generator is closed. An error raised before the
first step is the batch's failure, for the batcher to retry or split (nothing reached anyone); after it, every open
stream of the batch ends with that error, as ``@serve.batch`` does, and so does a step of the wrong length.
"""

from __future__ import annotations

import asyncio
from typing import Any, AsyncIterator, Callable, Sequence

from .errors import BatchResultMismatch

_END = object()  # a stream's end: no more values, and no error


class Stream:
    """One caller's stream: the values its batch's steps sent, then its end (an error, or none)."""

    __slots__ = ("values", "waiter", "end", "withdraw")

    def __init__(self) -> None:
        self.values: list[Any] = []  # sent, not yet read
        self.waiter: asyncio.Future | None = None  # the reader's, while it waits for a value
        self.end: object = None  # _END, or the error the stream ended with
        self.withdraw: Callable[[], None] | None = None  # takes the caller's item out of the batcher

    def push(self, value: Any) -> None:
        self.values.append(value)
        waiter = self.waiter
        if waiter is not None:  # _wake, inlined: once per caller and step
            self.waiter = None
            if not waiter.done():
                waiter.set_result(None)

    def finish(self, error: BaseException | None = None) -> None:
        if self.end is None:
            self.end = _END if error is None else error
            self._wake()

    def _wake(self) -> None:
        waiter = self.waiter
        if waiter is not None:
            self.waiter = None
            if not waiter.done():
                waiter.set_result(None)


async def fan_out(steps: AsyncIterator[Sequence[Any]], streams: list[Stream]) -> list[None]:
    """Run a batch's generator to its end, sending each step's entries to their streams."""
    started = False
    try:
        async for step in steps:
            if len(step) != len(streams):
                raise BatchResultMismatch(f"the handler yielded {len(step)} results for a batch of {len(streams)}")
            started = True
            callers = 0
            for stream, value in zip(streams, step):
                if stream.end is None:  # the caller is still reading
                    if value is StopIteration or value is StopAsyncIteration:
                        stream.finish()
                    else:
                        stream.push(value)
                        callers += 1
            if not callers:  # every caller has gone: no one is left to compute for
                break
    except Exception as exc:
        if not started and not isinstance(exc, BatchResultMismatch):  # a handler's bug: no split or retry hides it
            raise
        for stream in streams:
            stream.finish(exc)
    finally:
        await steps.aclose()  # type: ignore[attr-defined]
    # The streams still open end as their items settle with these results (the batcher's on_end): ending them here
    # too would be a second call per caller.
    return [None] * len(streams)


async def consume(stream: Stream) -> AsyncIterator[Any]:
    """The caller's side: its values as they come, then its end. Leaving early withdraws its item from the batch."""
    loop = asyncio.get_running_loop()
    try:
        while True:
            values = stream.values
            if values:
                if len(values) == 1:  # the common case: the reader keeps up with the steps
                    yield values.pop()
                else:
                    taken = values.copy()
                    values.clear()
                    for value in taken:
                        yield value
                continue
            end = stream.end
            if end is _END:
                return
            if end is not None:
                raise end  # type: ignore[misc]
            stream.waiter = loop.create_future()
            await stream.waiter
    finally:
        if stream.end is None:
            stream.finish()
            if stream.withdraw is not None:
                stream.withdraw()

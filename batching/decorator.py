"""Decorated handlers: calls of one item (or one set of arguments) in, batches of them out, through AdaptiveBatchers.

Two entry points share this machinery: ``@adaptive_batch`` (one item a call, with ``priority=`` and ``timeout_s=``)
and ``batching.batch``, which takes ``@serve.batch``'s signature and batches every argument column-wise
(``serve_compat.py``). A handler that is an async generator streams: each caller gets an async iterator of its own
entries of the steps (``streams.py``).
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import dataclasses
import functools
import inspect
import weakref
from typing import Any, AsyncIterator, Awaitable, Callable, Iterator, Sequence

from . import serve_context
from .batcher import AdaptiveBatcher, BatchCostFn
from .config import BatcherConfig, Priority
from .errors import BatchResultMismatch
from .metrics import BatcherMetrics
from .policies import WaitPolicy
from .streams import Stream, consume, fan_out

BatchFn = Callable[..., Any]

# (priority, timeout_s) for calls made inside ``batch_options``: how a caller of a handler whose arguments are all
# its own (the ``@serve.batch`` way) chooses them.
_call_options: contextvars.ContextVar[tuple[Priority, float | None]] = contextvars.ContextVar(
    "batching_call_options", default=(Priority.HIGH, None))


@contextlib.contextmanager
def batch_options(*, priority: Priority | str = Priority.HIGH, timeout_s: float | None = None) -> Iterator[None]:
    """Calls of batched handlers made inside the block queue at ``priority`` and end by ``timeout_s``."""
    token = _call_options.set((Priority.parse(priority), timeout_s))
    try:
        yield
    finally:
        _call_options.reset(token)


class Call:
    """The arguments of one call (``self`` aside), the caller's Ray Serve request context (the ``@serve.batch`` way,
    in a replica) and, for a streaming handler, the caller's stream."""

    __slots__ = ("args", "kwargs", "context", "stream")

    def __init__(self, args: tuple, kwargs: dict[str, Any], context: Any = None) -> None:
        self.args = args
        self.kwargs = kwargs
        self.context = context
        self.stream: Stream | None = None


def to_columns(calls: Sequence[Call]) -> tuple[list[list[Any]], dict[str, list[Any]]]:
    """The batch's arguments: each positional argument and each keyword a list, one entry per call."""
    first = calls[0]
    count, names = len(first.args), first.kwargs.keys()
    for call in calls:
        if len(call.args) != count or call.kwargs.keys() != names:
            raise TypeError("calls batched together must pass the same arguments: "
                            f"{count} positional and {sorted(names)} by keyword, not {len(call.args)} and "
                            f"{sorted(call.kwargs)}")
    args = [list(column) for column in zip(*(call.args for call in calls))] if count else []
    return args, {name: [call.kwargs[name] for call in calls] for name in names}


class BatchedHandler:
    """What a decorated handler holds: its settings, the batchers it made (one per instance, or per event loop for a
    plain function), and how a call becomes an item."""

    def __init__(self, fn: BatchFn, config: BatcherConfig, *, columns: bool, wait_policy: WaitPolicy | None,
                 cost_fn: Callable[[Any], float] | None, batch_cost_fn: BatchCostFn | None,
                 metrics: BatcherMetrics | None, name: str | None) -> None:
        self.fn = fn
        self.streaming = inspect.isasyncgenfunction(fn)
        if self.streaming and config.batch_timeout_s is not None:
            # Cut off mid-stream, a batch could be neither split nor retried without sending callers steps twice.
            raise ValueError("batch_timeout_s does not apply to a streaming handler: bound its callers' waits with "
                             "timeout_s instead")
        self.columns = columns  # the @serve.batch way: every argument batched; otherwise one item a call
        self.config = config
        self.wait_policy = wait_policy
        self.name = name or fn.__qualname__
        # Items are Calls except for the one-item, non-streaming handler, whose items are the callers' own
        # payloads (so equal ones can be sent once).
        if cost_fn is not None and self.uses_calls:
            cost_fn = functools.partial(_cost_of_first_argument, cost_fn)
        self.cost_fn = cost_fn
        self.batch_cost_fn = batch_cost_fn
        self.metrics = metrics
        self._attribute = f"__adaptive_batcher_{fn.__name__}"
        self._loose: dict[asyncio.AbstractEventLoop, AdaptiveBatcher] = {}
        self._made: weakref.WeakSet[AdaptiveBatcher] = weakref.WeakSet()  # an instance's goes with the instance

    @property
    def uses_calls(self) -> bool:
        return self.columns or self.streaming

    # ---- batchers -----------------------------------------------------------------------------------------------

    def batcher_for(self, owner: Any = None) -> AdaptiveBatcher:
        if owner is None:
            loop = asyncio.get_running_loop()
            batcher = self._loose.get(loop)
            if batcher is None:
                batcher = self._loose[loop] = self._make(None)
            return batcher
        batcher = owner.__dict__.get(self._attribute)
        if batcher is None:
            batcher = self._make(weakref.ref(owner))
            setattr(owner, self._attribute, batcher)
        return batcher

    def _make(self, owner_ref: weakref.ref | None) -> AdaptiveBatcher:
        batcher = AdaptiveBatcher(self._process_for(owner_ref), self.config, wait_policy=self.wait_policy,
                                  cost_fn=self.cost_fn, batch_cost_fn=self.batch_cost_fn, metrics=self.metrics,
                                  name=self.name)
        self._made.add(batcher)
        return batcher

    def _process_for(self, owner_ref: weakref.ref | None) -> Callable[[list[Any]], Awaitable[Sequence[Any]]]:
        # The owner is held weakly: it holds its batcher, so a strong reference back would make a cycle that only
        # the garbage collector breaks. The callers that wait on the batcher hold the owner while a batch runs.
        fn, columns, streaming = self.fn, self.columns, self.streaming

        def start(items: list[Any]) -> Any:
            if columns:
                args, kwargs = to_columns(items)
            else:
                args, kwargs = [[call.args[0] for call in items] if streaming else items], {}
            return fn(*args, **kwargs) if owner_ref is None else fn(owner_ref(), *args, **kwargs)

        if streaming:
            async def run(calls: list[Call]) -> Sequence[Any]:
                return await fan_out(start(calls), [call.stream for call in calls])  # type: ignore[misc]
        else:
            async def run(items: list[Any]) -> Sequence[Any]:
                return await start(items)
        return _by_serve_model(run) if columns else run

    def reconfigure(self, *, wait_policy: WaitPolicy | None = None, **changes: Any) -> None:
        """New settings for every batcher made and to be made; a batch filling now keeps the ones it started with."""
        self.config = dataclasses.replace(self.config, **changes)
        self.wait_policy = wait_policy or self.wait_policy
        for batcher in list(self._made):
            batcher.reconfigure(wait_policy=wait_policy, from_next_batch=True, **changes)

    async def aclose(self, drain: bool = True, timeout: float | None = None) -> None:
        await asyncio.gather(*(batcher.aclose(drain, timeout) for batcher in list(self._made)))

    # ---- calls --------------------------------------------------------------------------------------------------

    def submit(self, owner: Any, item: Any, priority: Priority, timeout_s: float | None) -> Awaitable[Any]:
        return self.batcher_for(owner).submit(item, priority=priority, timeout_s=timeout_s)

    def open_stream(self, owner: Any, call: Call, priority: Priority, timeout_s: float | None) -> AsyncIterator[Any]:
        """Queue the call now (as ``@serve.batch`` does, before the first step is asked for) and return its stream."""
        stream = call.stream = Stream()
        stream.withdraw = self.batcher_for(owner).submit_nowait(call, stream.finish, priority=priority,
                                                                timeout_s=timeout_s)
        return consume(stream)


def _by_serve_model(run: Callable[[list[Call]], Awaitable[Sequence[Any]]]) -> Callable[[list[Call]], Awaitable[Any]]:
    """``run`` for each multiplexed model's calls of a batch, at once, each in a task of its own so that Serve's batch
    context (set in it) names that model; a batch outside Ray Serve is one group."""

    async def run_in_context(calls: list[Call], contexts: list[Any]) -> Sequence[Any]:
        if contexts[0] is not None:
            serve_context.enter_batch(contexts)
        return await run(calls)

    async def process(calls: list[Call]) -> Sequence[Any]:
        contexts = [call.context for call in calls]
        groups = serve_context.model_groups(contexts)
        if len(groups) == 1:
            return await run_in_context(calls, contexts)
        results: list[Any] = [None] * len(calls)
        runs = [asyncio.ensure_future(run_in_context([calls[i] for i in group], [contexts[i] for i in group]))
                for group in groups]
        for group, outcome in zip(groups, await asyncio.gather(*runs, return_exceptions=True)):
            if not isinstance(outcome, BaseException) and len(outcome) != len(group):
                outcome = BatchResultMismatch(f"the handler returned {len(outcome)} results for {len(group)} calls")
            for position, index in enumerate(group):
                results[index] = outcome if isinstance(outcome, BaseException) else outcome[position]
        return results

    return process


def _cost_of_first_argument(cost_fn: Callable[[Any], float], call: Call) -> float:
    return cost_fn(call.args[0])


def adaptive_batch(
    _fn: BatchFn | None = None,
    *,
    wait_policy: WaitPolicy | None = None,
    cost_fn: Callable[[Any], float] | None = None,
    batch_cost_fn: Callable[[list[Any]], float] | None = None,
    metrics: BatcherMetrics | None = None,
    name: str | None = None,
    **config_fields: Any,
) -> Any:
    """Turn ``async def f([self,] items: list) -> list`` into ``async def f([self,] item) -> result``.

    Keyword arguments are ``BatcherConfig`` fields. Callers may pass ``priority=`` and ``timeout_s=`` (inside a
    ``batch_options`` block, those are the defaults). A handler that is an async generator yielding one list per
    step streams: ``f([self,] item)`` returns an async iterator of that item's entries.
    Each instance (or, for a plain function, each event loop) gets its own batcher, created lazily inside the
    running loop; ``f.batcher(instance)`` returns it, e.g. for ``stats()``. An instance's batcher lives as long as
    the instance and does not keep it alive. ``await f.aclose(drain=True, timeout=None)`` closes every batcher ``f``
    made that is still alive (``AdaptiveBatcher.aclose``); later calls raise ``BatcherClosed``.
    """
    unknown = set(config_fields) - BatcherConfig.field_names()
    if unknown:
        raise TypeError(f"adaptive_batch got unknown settings: {sorted(unknown)}")
    config = BatcherConfig(**config_fields)

    def decorate(fn: BatchFn) -> Any:
        handler = BatchedHandler(fn, config, columns=False, wait_policy=wait_policy, cost_fn=cost_fn,
                                 batch_cost_fn=batch_cost_fn, metrics=metrics, name=name)

        def split(args: tuple) -> tuple[Any, Any]:
            if len(args) not in (1, 2):
                raise TypeError(f"{fn.__qualname__} takes one item (after self), got {len(args)} arguments")
            return (args[0] if len(args) == 2 else None), args[-1]

        if handler.streaming:
            @functools.wraps(fn)
            def call(*args: Any, priority: Priority | str | None = None, timeout_s: float | None = None) -> Any:
                owner, item = split(args)
                priority, timeout_s = _options(priority, timeout_s)
                return handler.open_stream(owner, Call((item,), {}), priority, timeout_s)
        else:
            @functools.wraps(fn)
            async def call(*args: Any, priority: Priority | str | None = None, timeout_s: float | None = None) -> Any:
                owner, item = split(args)
                priority, timeout_s = _options(priority, timeout_s)
                return await handler.submit(owner, item, priority, timeout_s)

        return expose(call, handler)

    return decorate(_fn) if _fn is not None else decorate


def _options(priority: Priority | str | None, timeout_s: float | None) -> tuple[Priority, float | None]:
    default_priority, default_timeout_s = _call_options.get()
    return (default_priority if priority is None else Priority.parse(priority),
            default_timeout_s if timeout_s is None else timeout_s)


def expose(call: Any, handler: BatchedHandler) -> Any:
    """What the decorated function offers besides being called: its batchers and closing them."""
    call.batcher = handler.batcher_for
    call.aclose = handler.aclose
    return call


def call_options() -> tuple[Priority, float | None]:
    """The priority and deadline that ``batch_options`` chose for calls made here."""
    return _call_options.get()

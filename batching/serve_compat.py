"""``batching.batch``: Ray Serve's ``@serve.batch`` (2.60) — its signature, defaults, checks and semantics — on the
adaptive batcher, so a Serve deployment switches by one import.

Called the Serve way it batches every positional and keyword argument column-wise, streams async-generator
handlers to each caller, waits a fixed ``batch_wait_timeout_s`` from the oldest call, runs one batch at a time,
queues without bound, and neither retries nor merges equal calls. One argument away, ``scale_factor=`` turns on the
depth-scaled wait with ``batch_wait_timeout_s`` as its longest wait. Every other ``BatcherConfig`` setting may be
passed by keyword; two of them are where this batcher differs from Serve on purpose, and give Serve's behaviour
when switched: ``split_on_failure=False`` (a raising batch fails every caller instead of being bisected) and
``refuse_oversized=True`` (a call that alone passes the ``batch_size_fn`` budget fails with ``ItemTooLarge``, a
RuntimeError, instead of travelling alone).
"""

from __future__ import annotations

import functools
import inspect
import logging
import sys
from typing import Any, Callable

from . import serve_context
from .config import BatcherConfig
from .decorator import BatchedHandler, Call, call_options, expose
from .metrics import BatcherMetrics
from .policies import FixedWait

logger = logging.getLogger(__name__)

_DERIVED = frozenset({"max_batch_size", "max_batch_cost", "max_wait_ms", "max_concurrent_batches", "scale_factor"})
_UNBOUNDED = sys.maxsize  # @serve.batch's queue has no limit, and with batch_size_fn no count limit either


def batch(
    _func: Callable | None = None,
    /,
    max_batch_size: int = 10,
    batch_wait_timeout_s: float = 0.01,
    max_concurrent_batches: int = 1,
    batch_size_fn: Callable[[list], int] | None = None,
    *,
    scale_factor: float | None = None,
    metrics: BatcherMetrics | None = None,
    name: str | None = None,
    **settings: Any,
) -> Any:
    """``@serve.batch``'s drop-in. The callers of a batched handler choose priority and deadline with
    ``batching.batch_options(priority=..., timeout_s=...)`` around the call."""
    if _func is not None:
        _check_handler(_func)
    _check_max_batch_size(max_batch_size)
    _check_batch_wait_timeout_s(batch_wait_timeout_s)
    if not isinstance(max_concurrent_batches, int) or max_concurrent_batches < 1:
        raise TypeError(f"max_concurrent_batches must be an integer >= 1, got {max_concurrent_batches}")
    if batch_size_fn is not None and not callable(batch_size_fn):
        raise TypeError(f"batch_size_fn must be a callable or None, got {type(batch_size_fn)}")
    unknown = set(settings) - (BatcherConfig.field_names() - _DERIVED)
    if unknown:
        raise TypeError(f"batch got unknown settings: {sorted(unknown)}")
    by_cost = batch_size_fn is not None
    fields: dict[str, Any] = {
        "max_batch_size": _UNBOUNDED if by_cost else int(max_batch_size),
        "max_batch_cost": float(max_batch_size) if by_cost else None,
        "max_wait_ms": batch_wait_timeout_s * 1000.0,
        "max_concurrent_batches": max_concurrent_batches,
        "max_queue_depth": _UNBOUNDED,
        "max_retries": 0,
        "dedupe": False,
        "stall_factor": None,
    }
    if scale_factor is not None:
        fields["scale_factor"] = scale_factor
    config = BatcherConfig(**{**fields, **settings})
    batch_cost_fn = None if batch_size_fn is None else functools.partial(_size_of_batch, batch_size_fn)

    def decorate(fn: Callable) -> Any:
        _check_handler(fn)
        handler = BatchedHandler(fn, config, columns=True,
                                 wait_policy=None if scale_factor is not None else FixedWait(batch_wait_timeout_s),
                                 cost_fn=None, batch_cost_fn=batch_cost_fn, metrics=metrics, name=name)
        signature = inspect.signature(fn)
        bindable: set[int | tuple] = set()  # call shapes (arguments, keywords) already checked against the signature
        replica_checked = False  # the replica's max_ongoing_requests is compared at the first call

        def split(args: tuple, kwargs: dict[str, Any]) -> tuple[Any, Call]:
            nonlocal replica_checked
            shape = (len(args), *kwargs) if kwargs else len(args)
            if shape not in bindable:
                signature.bind(*args, **kwargs)  # a TypeError naming what does not fit, as Serve raises
                bindable.add(shape)
            context = serve_context.current()
            if not replica_checked:
                replica_checked = True
                _warn_if_replica_caps(handler.config)
            if args and getattr(type(args[0]), fn.__name__, None) is wrapper:
                return args[0], Call(args[1:], kwargs, context)
            return None, Call(args, kwargs, context)

        if handler.streaming:
            @functools.wraps(fn)
            def wrapper(*args: Any, **kwargs: Any) -> Any:
                owner, call = split(args, kwargs)
                return handler.open_stream(owner, call, *call_options())
        else:
            @functools.wraps(fn)
            async def wrapper(*args: Any, **kwargs: Any) -> Any:
                owner, call = split(args, kwargs)
                return await handler.submit(owner, call, *call_options())

        def set_max_batch_size(new_max_batch_size: int) -> None:
            _check_max_batch_size(new_max_batch_size)
            if by_cost:
                handler.reconfigure(max_batch_cost=float(new_max_batch_size))
            else:
                handler.reconfigure(max_batch_size=int(new_max_batch_size))
                _warn_if_replica_caps(handler.config)

        def set_batch_wait_timeout_s(new_batch_wait_timeout_s: float) -> None:
            _check_batch_wait_timeout_s(new_batch_wait_timeout_s)
            fixed = None if scale_factor is not None else FixedWait(new_batch_wait_timeout_s)
            handler.reconfigure(wait_policy=fixed, max_wait_ms=new_batch_wait_timeout_s * 1000.0)

        def get_max_batch_size() -> int:
            return int(handler.config.max_batch_cost if by_cost else handler.config.max_batch_size)

        def get_batch_wait_timeout_s() -> float:
            return handler.config.max_wait_ms / 1000.0

        wrapper.set_max_batch_size = set_max_batch_size  # type: ignore[attr-defined]
        wrapper.set_batch_wait_timeout_s = set_batch_wait_timeout_s  # type: ignore[attr-defined]
        wrapper._get_max_batch_size = get_max_batch_size  # type: ignore[attr-defined]
        wrapper._get_batch_wait_timeout_s = get_batch_wait_timeout_s  # type: ignore[attr-defined]
        return expose(wrapper, handler)

    return decorate(_func) if _func is not None else decorate


def _warn_if_replica_caps(config: BatcherConfig) -> None:
    """Serve's warning: a replica taking fewer requests at once than full batches need never fills them."""
    max_ongoing = serve_context.replica_max_ongoing_requests()
    wanted = config.max_batch_size * config.max_concurrent_batches
    if max_ongoing is not None and max_ongoing < wanted <= _UNBOUNDED:
        logger.warning("max_batch_size (%d) * max_concurrent_batches (%d) is larger than the replica's "
                       "max_ongoing_requests (%d): its batches can never fill; set max_ongoing_requests >= %d",
                       config.max_batch_size, config.max_concurrent_batches, max_ongoing, wanted)


def _size_of_batch(batch_size_fn: Callable[[list], int], calls: list[Call]) -> float:
    """``batch_size_fn`` is given each call's first positional argument, as Serve gives it."""
    return batch_size_fn([call.args[0] for call in calls])


def _check_handler(fn: Any) -> None:
    if not callable(fn):
        raise TypeError("@batch can only be used to decorate functions or methods.")
    if not (inspect.iscoroutinefunction(fn) or inspect.isasyncgenfunction(fn)):
        raise TypeError("Functions decorated with @batch must be 'async def'")


def _check_max_batch_size(max_batch_size: Any) -> None:
    if not isinstance(max_batch_size, int) and not (isinstance(max_batch_size, float) and max_batch_size.is_integer()):
        raise TypeError(f"max_batch_size must be integer >= 1, got {max_batch_size}")
    if max_batch_size < 1:
        raise ValueError(f"max_batch_size must be an integer >= 1, got {max_batch_size}")


def _check_batch_wait_timeout_s(batch_wait_timeout_s: Any) -> None:
    if not isinstance(batch_wait_timeout_s, (float, int)):
        raise TypeError(f"batch_wait_timeout_s must be a float >= 0, got {batch_wait_timeout_s}")
    if batch_wait_timeout_s < 0:
        raise ValueError(f"batch_wait_timeout_s must be a float >= 0, got {batch_wait_timeout_s}")

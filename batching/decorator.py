"""``@adaptive_batch``: the drop-in for Ray Serve's ``@serve.batch``, batching through an AdaptiveBatcher."""

from __future__ import annotations

import asyncio
import functools
import weakref
from typing import Any, Awaitable, Callable, Sequence

from .batcher import AdaptiveBatcher
from .config import BatcherConfig, Priority
from .metrics import BatcherMetrics
from .policies import WaitPolicy

BatchFn = Callable[..., Awaitable[Sequence[Any]]]


def adaptive_batch(
    _fn: BatchFn | None = None,
    *,
    wait_policy: WaitPolicy | None = None,
    cost_fn: Callable[[Any], float] | None = None,
    metrics: BatcherMetrics | None = None,
    name: str | None = None,
    **config_fields: Any,
) -> Any:
    """Turn ``async def f([self,] items: list) -> list`` into ``async def f([self,] item) -> result``.

    Keyword arguments are ``BatcherConfig`` fields. Callers may pass ``priority=`` and ``timeout_s=``.
    Each instance (or, for a plain function, each event loop) gets its own batcher, created lazily
    inside the running loop; ``f.batcher(instance)`` returns it, e.g. for ``stats()``. An instance's batcher
    lives as long as the instance and does not keep it alive. ``await f.aclose(drain=True, timeout=None)``
    closes every batcher ``f`` made that is still alive (``AdaptiveBatcher.aclose``); later calls raise
    ``BatcherClosed``.
    """
    unknown = set(config_fields) - BatcherConfig.field_names()
    if unknown:
        raise TypeError(f"adaptive_batch got unknown settings: {sorted(unknown)}")
    config = BatcherConfig(**config_fields)

    def decorate(fn: BatchFn) -> Any:
        attribute = f"__adaptive_batcher_{fn.__name__}"
        batch_name = name or fn.__qualname__
        loose: dict[asyncio.AbstractEventLoop, AdaptiveBatcher] = {}
        made: weakref.WeakSet[AdaptiveBatcher] = weakref.WeakSet()  # an instance's goes when the instance does

        def make(process: BatchFn) -> AdaptiveBatcher:
            batcher = AdaptiveBatcher(
                process, config, wait_policy=wait_policy, cost_fn=cost_fn, metrics=metrics, name=batch_name
            )
            made.add(batcher)
            return batcher

        def bound_to(owner: Any) -> BatchFn:
            # Weakly: the owner holds its batcher, so a strong reference back would make a cycle that only the
            # garbage collector breaks. The callers that wait on the batcher hold the owner while a batch runs.
            owner_ref = weakref.ref(owner)

            async def process(items: list[Any]) -> Sequence[Any]:
                return await fn(owner_ref(), items)

            return process

        def batcher_for(owner: Any = None) -> AdaptiveBatcher:
            if owner is None:
                loop = asyncio.get_running_loop()
                if loop not in loose:
                    loose[loop] = make(fn)
                return loose[loop]
            batcher = owner.__dict__.get(attribute)
            if batcher is None:
                batcher = make(bound_to(owner))
                setattr(owner, attribute, batcher)
            return batcher

        async def aclose(drain: bool = True, timeout: float | None = None) -> None:
            await asyncio.gather(*(batcher.aclose(drain, timeout) for batcher in list(made)))

        @functools.wraps(fn)
        async def call(*args: Any, priority: Priority | str = Priority.HIGH, timeout_s: float | None = None) -> Any:
            if len(args) not in (1, 2):
                raise TypeError(f"{fn.__qualname__} takes one item (after self), got {len(args)} arguments")
            owner = args[0] if len(args) == 2 else None
            return await batcher_for(owner).submit(args[-1], priority=Priority.parse(priority), timeout_s=timeout_s)

        call.batcher = batcher_for  # type: ignore[attr-defined]
        call.aclose = aclose  # type: ignore[attr-defined]
        return call

    return decorate(_fn) if _fn is not None else decorate

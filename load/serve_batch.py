"""Ray Serve's real ``@serve.batch``, run outside a Serve replica so benchmarks can set it beside our batcher."""

from __future__ import annotations

import asyncio
import contextlib
from contextlib import contextmanager
from typing import Any, Awaitable, Callable, Iterator

BatchFn = Callable[[list[Any]], Awaitable[list[Any]]]
Submit = Callable[[Any], Awaitable[Any]]


@contextmanager
def serve_batch_outside_replica() -> Iterator[None]:
    """Let ``@serve.batch`` run outside a Serve replica.

    The only thing in ``ray/serve/batching.py`` that needs a replica is the warning that reads
    ``serve.get_replica_context()._deployment_config.max_ongoing_requests`` when the batch queue is created
    (``_BatchQueue._warn_if_max_batch_size_exceeds_max_ongoing_requests``); that method, and nothing else, is stubbed.
    The queue is created at the first call, so that call must happen inside this block.
    """
    from unittest import mock

    from ray.serve import batching as serve_batching

    with mock.patch.object(
        serve_batching._BatchQueue, "_warn_if_max_batch_size_exceeds_max_ongoing_requests", new=lambda self: None
    ):
        yield


def serve_batched(
    batch_fn: BatchFn, *, max_batch_size: int, batch_wait_timeout_s: float, max_concurrent_batches: int
) -> Submit:
    """One-item-in, one-result-out calls batched by ``@serve.batch`` over ``batch_fn``.

    The method is decorated afresh on every call, so its queue belongs to the event loop that first uses it.
    """
    from ray import serve

    class Model:
        @serve.batch(
            max_batch_size=max_batch_size,
            batch_wait_timeout_s=batch_wait_timeout_s,
            max_concurrent_batches=max_concurrent_batches,
        )
        async def handle(self, payloads: list[Any]) -> list[Any]:
            return await batch_fn(payloads)

    return Model().handle


async def close_serve_batched(submit: Submit) -> None:
    """Stop the background task ``@serve.batch`` started for ``submit`` (Ray cancels it only when garbage-collected)."""
    function = getattr(submit, "__func__", submit)
    lazy_queue = function._get_max_batch_size.__self__  # the decorator's _LazyBatchQueueWrapper
    queue = lazy_queue._queue
    task = queue._handle_batch_task if queue is not None else None
    if task is not None and not task.done():
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task

"""Ray Serve's request context, for handlers batched the ``@serve.batch`` way inside a Serve replica.

Read through the module Serve has already loaded (``batching`` imports no framework): outside Ray Serve there is no
context and nothing here does anything. Inside a replica each call keeps its caller's context, a batch holds the
calls of one multiplexed model only (as ``@serve.batch`` splits them), and while the handler runs, Serve's batch
context lists the batch's requests, so ``serve.get_multiplexed_model_id()`` there names the batch's model.
"""

from __future__ import annotations

import sys
from typing import Any, Sequence

_CONTEXT_MODULE = "ray.serve.context"


def current() -> Any:
    """The caller's Serve request context, or None outside a Serve request (read without making one)."""
    module = sys.modules.get(_CONTEXT_MODULE)
    return None if module is None else module._serve_request_context.get()


def model_groups(contexts: Sequence[Any]) -> list[list[int]]:
    """The positions of the calls of each multiplexed model, in order of first appearance."""
    models = [getattr(context, "multiplexed_model_id", "") for context in contexts]
    if models.count(models[0]) == len(models):  # the common case: one model (or none) for the whole batch
        return [list(range(len(models)))]
    groups: dict[str, list[int]] = {}
    for index, model in enumerate(models):
        groups.setdefault(model, []).append(index)
    return list(groups.values())


def enter_batch(contexts: list[Any]) -> None:
    """Make the batch's request contexts (a list Serve may keep) Serve's batch context in the running task."""
    module = sys.modules.get(_CONTEXT_MODULE)
    if module is not None:
        module._set_batch_request_context(contexts)


def replica_max_ongoing_requests() -> int | None:
    """The running Serve replica's ``max_ongoing_requests``, or None outside a replica."""
    serve = sys.modules.get("ray.serve")
    if serve is None:
        return None
    try:
        return serve.get_replica_context()._deployment_config.max_ongoing_requests
    except Exception:  # not in a replica: Serve raises its own error type
        return None

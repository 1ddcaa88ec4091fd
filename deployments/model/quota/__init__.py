"""The provider's quota, one budget per model deployment: ``limits:`` of an ``openai`` model entry, and what its
responses' ``x-ratelimit-*`` headers say. See ``budget`` (the arithmetic), ``limiter`` (the shared actor), ``pacer``
(a replica's side)."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Callable

from deployments.model.quota.budget import Limits
from deployments.model.quota.pacer import PacedInput, QuotaPacer, RemoteLedger

if TYPE_CHECKING:
    from deployments.config import ModelConfig
    from deployments.model.quota.metrics import QuotaMetrics

__all__ = ["Limits", "PacedInput", "QuotaPacer", "make_pacer"]


def make_pacer(model: "ModelConfig", metrics: "QuotaMetrics | None" = None,
               clock: Callable[[], float] = time.monotonic) -> QuotaPacer | None:
    """The pacer of an ``openai`` model (with no ``limits:``, it paces only once the provider reports a limit);
    None for a local model. ``clock``: the event loop's (a test's controlled one)."""
    if model.backend != "openai":
        return None
    from deployments.model.quota.limiter import limiter_name
    from deployments.sizing import max_replicas

    quota = model.limits
    limits = (Limits(None, None) if quota is None
              else Limits(quota.rpm, quota.tpm, headroom=quota.headroom, low_share=quota.low_share))
    name = limiter_name(_application(), model.deployment_name, limits)
    return QuotaPacer(limits, RemoteLedger(name, limits), replicas=max_replicas(model), metrics=metrics,
                      max_wait_s=model.batcher.batch_timeout_s, clock=clock)


def _application() -> str:
    try:
        from ray import serve

        return serve.get_replica_context().app_name
    except Exception:  # noqa: BLE001 - not in a replica (a test builds the model as it is)
        return "local"

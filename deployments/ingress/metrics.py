"""The ingress's own metric: requests sent again after the model replica serving them was lost."""

from __future__ import annotations

from typing import Callable

from ray.serve import metrics as serve_metrics

ResendCounter = Callable[[str, str, int], None]  # (model, cause, requests)


class ResentRequests:
    """Requests the ingress sent again after the replica serving them was lost, by model and cause
    (``ray_embedding_requests_resent_total``; causes in ``deployments.ingress.replica_loss``)."""

    def __init__(self) -> None:
        self._counter = serve_metrics.Counter(
            "embedding_requests_resent_total", "Requests sent again after their replica was lost",
            tag_keys=("model", "cause"))

    def __call__(self, model: str, cause: str, count: int) -> None:
        self._counter.inc(count, tags={"model": model, "cause": cause})

"""The ingress's own metrics: requests sent again after the model replica serving them was lost, the Batch API's
progress (each tenant's usage: ``deployments.usage``)."""

from __future__ import annotations

from typing import Callable

from ray.serve import metrics as serve_metrics

from deployments.ingress.batch.runner import BatchMetrics

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


class RayBatchMetrics(BatchMetrics):
    """The Batch API's lines finished by outcome (``ray_embedding_batch_lines_total``, ``outcome`` = completed |
    failed) and its batches by status (``ray_embedding_batches``; every ingress replica of a node reads the same
    store, so take the max over replicas, not the sum)."""

    def __init__(self) -> None:
        self._lines = serve_metrics.Counter("embedding_batch_lines_total", "Batch API request lines finished",
                                            tag_keys=("outcome",))
        self._batches = serve_metrics.Gauge("embedding_batches", "Batch API batches in the store",
                                            tag_keys=("status",))

    def line_finished(self, ok: bool) -> None:
        self._lines.inc(1, tags={"outcome": "completed" if ok else "failed"})

    def batches(self, by_status: dict[str, int]) -> None:
        for status, count in by_status.items():
            self._batches.set(count, tags={"status": status})

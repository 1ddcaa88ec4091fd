"""Adaptive batching for asyncio: merge concurrent calls into batches whose wait grows with queue depth."""

from .batcher import AdaptiveBatcher, batch_priority
from .config import BatcherConfig, Priority
from .decorator import adaptive_batch, batch_options
from .errors import (BatcherClosed, BatcherError, BatchResultMismatch, DeadlineExceeded, ItemTooLarge, NeverFits,
                     Overloaded, Postponed, is_retryable)
from .metrics import BatcherMetrics
from .policies import DepthScaledWait, FixedWait, WaitPolicy
from .serve_compat import batch
from .stats import BatcherStats

__all__ = [
    "AdaptiveBatcher",
    "BatcherClosed",
    "BatcherConfig",
    "BatcherError",
    "BatcherMetrics",
    "BatcherStats",
    "BatchResultMismatch",
    "DeadlineExceeded",
    "DepthScaledWait",
    "FixedWait",
    "ItemTooLarge",
    "NeverFits",
    "Overloaded",
    "Postponed",
    "Priority",
    "WaitPolicy",
    "adaptive_batch",
    "batch",
    "batch_options",
    "batch_priority",
    "is_retryable",
]

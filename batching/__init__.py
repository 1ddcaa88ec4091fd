"""Adaptive batching for asyncio: merge concurrent calls into batches whose wait grows with queue depth."""

from .batcher import AdaptiveBatcher
from .config import BatcherConfig, Priority
from .decorator import adaptive_batch
from .errors import BatcherClosed, BatcherError, BatchResultMismatch, DeadlineExceeded, Overloaded, is_retryable
from .metrics import BatcherMetrics
from .policies import DepthScaledWait, FixedWait, WaitPolicy
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
    "Overloaded",
    "Priority",
    "WaitPolicy",
    "adaptive_batch",
    "is_retryable",
]

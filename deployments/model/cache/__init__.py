"""A content-addressed embedding cache in front of each model deployment's batchers.

``keys`` (what an entry is found by), ``store`` (the store protocol and the guard every call passes), ``disk_store``
and ``redis_store`` (the two stores), ``single_flight`` (one computation per missing key), ``front`` (the cache
itself), ``metrics``, ``build`` (the cache a model entry names).
"""

from deployments.model.cache.build import make_cache
from deployments.model.cache.front import EmbeddingCache
from deployments.model.cache.metrics import CacheMetrics, RayServeCacheMetrics

__all__ = ["CacheMetrics", "EmbeddingCache", "RayServeCacheMetrics", "make_cache"]

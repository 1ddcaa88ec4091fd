"""The cache's metrics hooks (no-ops here) and their sink on ``ray.serve.metrics``.

Ray exports them with the ``ray_`` prefix and the Serve tags (deployment, replica, application); ``cache`` is the
model entry's name. Counts are of distinct inputs of a request (one text sent twice in a request counts once).
"""

from __future__ import annotations

LOOKUPS_TOTAL = "embedding_cache_lookups_total"  # outcome = hit | joined | miss
SAVED_INPUTS_TOTAL = "embedding_cache_saved_inputs_total"  # inputs served without a model/upstream computation
SAVED_TOKENS_TOTAL = "embedding_cache_saved_tokens_total"  # their tokens: what the upstream did not bill
STORE_ERRORS_TOTAL = "embedding_cache_store_errors_total"  # store, op = get | set, reason = timeout | error | skipped
BYTES_TOTAL = "embedding_cache_bytes_total"  # op = read | written


class CacheMetrics:
    """Hooks the cache calls; this base records nothing."""

    def looked_up(self, cache: str, outcome: str, count: int) -> None:
        """``count`` inputs found in the store (``hit``), joined to a computation in flight (``joined``), or
        computed (``miss``)."""

    def saved(self, cache: str, inputs: int, tokens: int) -> None:
        """Inputs (and their tokens) answered without computing them: hits and joins."""

    def store_failed(self, cache: str, store: str, op: str, reason: str) -> None:
        """One store call that failed, timed out, or was skipped while the store was failing."""

    def bytes_moved(self, cache: str, op: str, count: int) -> None:
        """Bytes of vectors read from (``read``) or written to (``written``) the store."""


class RayServeCacheMetrics(CacheMetrics):
    def __init__(self) -> None:
        from ray.serve import metrics as serve_metrics

        self._lookups = serve_metrics.Counter(LOOKUPS_TOTAL, "Inputs looked up in the embedding cache, by outcome",
                                              tag_keys=("cache", "outcome"))
        self._saved_inputs = serve_metrics.Counter(
            SAVED_INPUTS_TOTAL, "Inputs answered from the cache without a model or upstream computation",
            tag_keys=("cache",))
        self._saved_tokens = serve_metrics.Counter(
            SAVED_TOKENS_TOTAL, "Tokens of the inputs answered from the cache (not billed)", tag_keys=("cache",))
        self._store_errors = serve_metrics.Counter(
            STORE_ERRORS_TOTAL, "Cache store calls that failed, timed out or were skipped (served as misses)",
            tag_keys=("cache", "store", "op", "reason"))
        self._bytes = serve_metrics.Counter(BYTES_TOTAL, "Bytes of vectors read from or written to the cache store",
                                            tag_keys=("cache", "op"))

    def looked_up(self, cache: str, outcome: str, count: int) -> None:
        if count:
            self._lookups.inc(count, tags={"cache": cache, "outcome": outcome})

    def saved(self, cache: str, inputs: int, tokens: int) -> None:
        if inputs:
            self._saved_inputs.inc(inputs, tags={"cache": cache})
        if tokens:
            self._saved_tokens.inc(tokens, tags={"cache": cache})

    def store_failed(self, cache: str, store: str, op: str, reason: str) -> None:
        self._store_errors.inc(tags={"cache": cache, "store": store, "op": op, "reason": reason})

    def bytes_moved(self, cache: str, op: str, count: int) -> None:
        if count:
            self._bytes.inc(count, tags={"cache": cache, "op": op})

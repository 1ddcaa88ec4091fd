"""What the quota did, per replica: ``QuotaMetrics`` (no-op) and its ``ray.serve.metrics`` sink.

Ray exports them with the ``ray_`` prefix and the Serve tags (deployment, replica, application)."""

from __future__ import annotations

from batching import Priority

USED_TOTAL = "quota_used_total"
REMAINING = "quota_remaining"
WAIT_MS = "quota_wait_ms"
REFUSED_TOTAL = "quota_refused_total"
UPSTREAM_RATE_LIMITED_TOTAL = "upstream_rate_limited_total"
FALLBACK = "quota_limiter_fallback"
WAIT_MS_BUCKETS = (1, 5, 10, 25, 50, 100, 250, 500, 1000, 2500, 5000, 10000, 30000, 60000)


class QuotaMetrics:
    def used(self, priority: Priority, requests: int, tokens: int) -> None:
        """A claim granted: one upstream call's requests and tokens."""

    def remaining(self, priority: Priority, kind: str, amount: float) -> None:
        """What a claim of ``priority`` could take now, of the ``kind`` limit (as the budget last said)."""

    def waited(self, priority: Priority, seconds: float) -> None:
        """How long a call waited for its claim."""

    def refused(self, priority: Priority, count: int) -> None:
        """Inputs answered 429: the budget would not hold them within their deadline."""

    def upstream_rate_limited(self) -> None:
        """The provider answered 429."""

    def fallback(self, active: bool) -> None:
        """The shared budget could not be reached (True) and this replica paces on its own share, or is back."""


class RayQuotaMetrics(QuotaMetrics):
    def __init__(self) -> None:
        from ray.serve import metrics

        self._used = metrics.Counter(USED_TOTAL, "Quota claimed for upstream calls", tag_keys=("priority", "kind"))
        self._remaining = metrics.Gauge(REMAINING, "Quota a claim could take now", tag_keys=("priority", "kind"))
        self._wait = metrics.Histogram(WAIT_MS, "Time an upstream call waited for quota (ms)",
                                       boundaries=list(WAIT_MS_BUCKETS), tag_keys=("priority",))
        self._refused = metrics.Counter(REFUSED_TOTAL, "Inputs answered 429 for want of quota within their deadline",
                                        tag_keys=("priority",))
        self._upstream = metrics.Counter(UPSTREAM_RATE_LIMITED_TOTAL, "Upstream calls the provider answered 429")
        self._fallback = metrics.Gauge(FALLBACK, "1 while the shared budget is unreachable and the replica paces alone")

    def used(self, priority: Priority, requests: int, tokens: int) -> None:
        name = priority.name.lower()
        self._used.inc(requests, tags={"priority": name, "kind": "requests"})
        if tokens:
            self._used.inc(tokens, tags={"priority": name, "kind": "tokens"})

    def remaining(self, priority: Priority, kind: str, amount: float) -> None:
        self._remaining.set(amount, tags={"priority": priority.name.lower(), "kind": kind})

    def waited(self, priority: Priority, seconds: float) -> None:
        self._wait.observe(seconds * 1000.0, tags={"priority": priority.name.lower()})

    def refused(self, priority: Priority, count: int) -> None:
        self._refused.inc(count, tags={"priority": priority.name.lower()})

    def upstream_rate_limited(self) -> None:
        self._upstream.inc()

    def fallback(self, active: bool) -> None:
        self._fallback.set(1.0 if active else 0.0)

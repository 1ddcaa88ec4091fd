"""The quota's alert rules name the metrics the quota exports, as Ray exports them."""

from __future__ import annotations

import re

from deployments.model.quota import metrics as names
from tests.unit.test_deployments_alerts import rules


def test_a_quota_that_stays_spent_and_upstream_429s_are_alerted_on_the_exported_names() -> None:
    quota_rules = {rule["alert"]: rule["expr"] for rule in rules() if re.search(r"\bray_(quota|upstream)_", rule["expr"])}
    assert set(quota_rules) == {"EmbeddingQuotaExhausted", "EmbeddingUpstreamRateLimiting"}
    assert f'ray_{names.REMAINING}{{priority="high"}}' in quota_rules["EmbeddingQuotaExhausted"]
    assert f"ray_{names.UPSTREAM_RATE_LIMITED_TOTAL}[" in quota_rules["EmbeddingUpstreamRateLimiting"]

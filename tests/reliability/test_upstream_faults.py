"""Upstream faults under load: nothing lost, nothing misrouted, poisoned inputs fail alone, nothing billed twice,
every request answered by its deadline."""

from __future__ import annotations

import pytest

from .scale import Scale
from .scenarios import Result, Target, upstream_fault
from .traffic import Outcome, serving_again

pytestmark = pytest.mark.integration


def assert_every_request_accounted_for(result: Result) -> None:
    unexpected = [(o.status, o.message[:160]) for o in result.outcomes if o.kind in ("unclear", "lost", "misrouted")]
    assert result.counts["lost"] == 0, unexpected
    assert result.counts["misrouted"] == 0, unexpected
    assert result.counts["unclear"] == 0, unexpected
    assert result.counts["late"] == 0, [(o.latency, o.plan.timeout_s, o.status) for o in result.outcomes if o.late]


def failed_beyond_short_deadlines(outcomes: list[Outcome]) -> list[tuple[int | None, float, str]]:
    """Failures other than a 504 for a 2 s deadline (which a loaded 2-core machine may miss whatever the fault)."""
    return [(o.status, o.plan.timeout_s, o.message[:120]) for o in outcomes
            if o.kind != "ok" and not (o.status == 504 and o.plan.timeout_s <= 2.0)]


def assert_nothing_billed_twice(result: Result) -> None:
    # Every clean input is billed at most once, except those in calls the service gave up on (the upstream may
    # finish and bill those anyway); and everything delivered was billed.
    assert result.needed <= result.billed <= result.sent_clean + result.abandoned, result.to_json()


def test_five_percent_of_upstream_calls_failing_is_absorbed_by_retries(faults: Target, scale: Scale) -> None:
    result = upstream_fault(faults, scale, "errors-500")
    assert_every_request_accounted_for(result)
    assert failed_beyond_short_deadlines(result.outcomes) == []  # the retries absorbed every 500
    assert result.extra["upstream"]["errors_500"] > 0
    assert_nothing_billed_twice(result)
    assert result.abandoned == 0


def test_poisoned_inputs_fail_alone_naming_their_index(faults: Target, scale: Scale) -> None:
    result = upstream_fault(faults, scale, "poison")
    assert_every_request_accounted_for(result)
    poisoned = [o for o in result.outcomes if o.plan.poisoned]
    assert poisoned, "the workload held no poisoned input"
    assert [o for o in poisoned if o.status != 400 and not (o.status == 504 and o.plan.timeout_s <= 2.0)] == []
    # ... and classify() checked that each 400 names one of the request's poisoned inputs.
    assert failed_beyond_short_deadlines(result.clean_requests()) == [], result.statuses
    assert_nothing_billed_twice(result)
    assert result.abandoned == 0


def test_calls_slower_than_the_batch_timeout_are_retried_not_waited_for(faults: Target, scale: Scale) -> None:
    result = upstream_fault(faults, scale, "slow")
    assert_every_request_accounted_for(result)
    assert result.counts["ok"] >= 0.95 * result.requests, result.statuses
    assert_nothing_billed_twice(result)
    assert serving_again(result.outcomes), result.to_json()  # back to normal within the run


def test_a_429_storm_is_paced_to_the_limit_the_provider_reports(faults: Target, scale: Scale) -> None:
    """The upstream is limited at run time: the service follows its x-ratelimit-* headers (deployments/model/quota/), so
    the provider refuses no call, and each caller gets its vectors or a 429 saying when to retry."""
    result = upstream_fault(faults, scale, "429-storm")
    assert_every_request_accounted_for(result)
    assert result.extra["upstream"]["rejected_429"] == 0
    assert_nothing_billed_twice(result)
    assert result.abandoned == 0
    assert serving_again(result.outcomes), result.to_json()  # back to normal within the run


def test_an_upstream_down_for_seconds_then_back_loses_nothing(faults: Target, scale: Scale) -> None:
    result = upstream_fault(faults, scale, "down")
    assert_every_request_accounted_for(result)
    assert result.extra["upstream"]["unavailable_503"] > 0
    # Requests whose deadline outlasts the outage succeed once the upstream is back; the others end in 504 on time.
    long_deadline = [o for o in result.outcomes if o.plan.timeout_s > scale.down_s + 2]
    assert all(o.kind == "ok" for o in long_deadline), result.statuses
    assert_nothing_billed_twice(result)
    assert result.abandoned == 0
    assert serving_again(result.outcomes), result.to_json()  # back to normal within the run

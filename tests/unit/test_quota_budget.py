"""The shared quota's arithmetic (deployments/model/quota/budget.py), on a made-up clock: every call is told the
time."""

from __future__ import annotations

import pytest

from batching import Priority
from deployments.model.quota.budget import Account, Limits, QuotaBudget
from deployments.model.quota.headers import duration_s, provider_accounts

HIGH, LOW = Priority.HIGH, Priority.LOW


def budget(rpm: int | None = None, tpm: int | None = 60_000, headroom: float = 1.0, low_share: float = 0.1,
           ) -> QuotaBudget:
    return QuotaBudget(Limits(rpm, tpm, headroom, low_share), now=0.0)


def test_high_is_granted_at_once_while_the_bucket_holds_it_then_reserved_for_when_it_will() -> None:
    quota = budget(tpm=60_000)  # 1,000 tokens a second
    assert quota.claim(HIGH, 60_000, now=0.0) == (True, 0.0, (0, 0))
    granted, wait_s, _ = quota.claim(HIGH, 500, now=0.0)
    assert granted and wait_s == pytest.approx(0.5)
    granted, wait_s, _ = quota.claim(HIGH, 500, now=0.25)  # behind the first reservation's debt
    assert granted and wait_s == pytest.approx(0.75)


def test_high_past_its_deadline_is_refused_with_when_it_would_be_held_and_takes_nothing() -> None:
    quota = budget(tpm=60_000)
    quota.claim(HIGH, 60_000, now=0.0)
    assert quota.claim(HIGH, 2_000, now=0.0, max_wait_s=1.0) == (False, pytest.approx(2.0), (0, 0))
    assert quota.claim(HIGH, 1_000, now=0.0, max_wait_s=1.0) == (True, pytest.approx(1.0), (0, 0))


def test_low_leaves_high_a_reserve_so_high_never_waits_behind_it() -> None:
    quota = budget(tpm=60_000, low_share=0.0)
    taken = 0
    while (claim := quota.claim(LOW, 1_000, now=0.0)).granted:
        assert claim.wait_s == 0.0  # LOW never reserves ahead
        taken += 1000
    assert taken == 59_000  # a second of refill is kept back
    assert claim.wait_s == pytest.approx(1.0)  # ask again when the refill covers it
    assert quota.claim(HIGH, 1_000, now=0.0) == (True, 0.0, (0, 0))


def test_the_reserve_grows_with_highs_recent_use() -> None:
    quota = budget(tpm=600_000, low_share=0.0)  # 10,000 tokens a second
    idle_reserve = quota.remaining(HIGH, now=0.0)["tokens"] - quota.remaining(LOW, now=0.0)["tokens"]
    assert idle_reserve == pytest.approx(10_000)  # a second of refill
    for second in range(30):  # HIGH takes 20,000 a second
        quota.claim(HIGH, 20_000, now=float(second))
    busy_reserve = quota.remaining(HIGH, now=30.0)["tokens"] - quota.remaining(LOW, now=30.0)["tokens"]
    assert busy_reserve > 35_000  # two seconds of HIGH's use


def test_low_never_reserves_ahead_even_on_its_share_so_high_waits_only_for_its_own_tokens() -> None:
    quota = budget(tpm=60_000, low_share=0.2)  # LOW's credit starts full: 12,000
    quota.claim(HIGH, 60_000, now=0.0)
    assert quota.claim(LOW, 5_000, now=1.0) == (False, pytest.approx(4.0), (0, 0))  # the bucket holds 1,000
    assert quota.claim(HIGH, 500, now=1.0) == (True, 0.0, (0, 0))


def test_low_gets_what_high_leaves_of_the_refill_and_high_never_waits_for_it() -> None:
    quota = budget(tpm=60_000, low_share=0.2)
    quota.claim(HIGH, 60_000, now=0.0)
    low_tokens = 0
    for tick in range(1, 1201):  # two minutes in 0.1 s steps; HIGH takes 70% of the refill
        now = tick / 10
        assert quota.claim(HIGH, 70, now=now).wait_s == 0.0
        if quota.claim(LOW, 500, now=now).granted:
            low_tokens += 500
    assert 33_000 <= low_tokens <= 36_000  # the other 30% of 120,000, less what is left in the bucket


def test_highs_use_before_a_limit_was_known_fades_as_it_would_have_under_one() -> None:
    quota = QuotaBudget(Limits(None, None), now=0.0)
    quota.claim(HIGH, 1_000_000, now=0.0)  # no limit known: granted, and counted as HIGH's use
    quota.follow({"tokens": Account(60_000, 60_000, 0.0)}, called_at=100.0, now=100.0)  # a limit, 100 s later
    reserve = quota.remaining(HIGH, now=100.0)["tokens"] - quota.remaining(LOW, now=100.0)["tokens"]
    assert reserve == pytest.approx(0.9 * 1_000)  # a second of refill: the old use has faded


def test_pacing_never_overdraws_the_providers_own_bucket() -> None:
    """A provider bucket of the full limit, charged as granted: it never goes below zero, and LOW fills the rest."""
    tpm, rpm = 60_000, 600
    quota = budget(rpm=rpm, tpm=tpm, headroom=0.95)
    provider = {"tokens": float(tpm), "requests": float(rpm)}
    sent_tokens = 0
    for tick in range(1, 3001):  # five minutes, in 0.1 s steps; LOW asks every tick, HIGH every second
        now = tick / 10
        provider["tokens"] = min(tpm, provider["tokens"] + tpm / 600)
        provider["requests"] = min(rpm, provider["requests"] + rpm / 600)
        for priority, tokens in ((HIGH, 100 if tick % 10 == 0 else 0), (LOW, 400)):
            if tokens and quota.claim(priority, tokens, now=now).granted:
                provider["tokens"] -= tokens
                provider["requests"] -= 1
                sent_tokens += tokens
                assert min(provider.values()) >= 0
    assert sent_tokens >= 0.93 * tpm * 5  # 95% headroom, less the reserve kept back at the end


def test_the_providers_remaining_lowers_the_level_less_what_was_granted_since() -> None:
    quota = budget(tpm=60_000)
    quota.claim(HIGH, 1_000, now=0.0)  # the call the provider reports on
    quota.claim(HIGH, 9_000, now=0.5)  # granted after it
    quota.follow({"tokens": Account(60_000, 20_000, None)}, called_at=0.1, now=1.0)
    assert quota.remaining(HIGH, now=1.0)["tokens"] == pytest.approx(11_000)


def test_the_providers_reset_bounds_the_level_too() -> None:
    quota = budget(tpm=60_000)
    quota.follow({"tokens": Account(60_000, None, 30.0)}, called_at=0.0, now=0.0)  # half a minute to be full
    assert quota.remaining(HIGH, now=0.0)["tokens"] == pytest.approx(30_000)


def test_a_lower_limit_the_provider_reports_replaces_the_configured_one_while_it_reports_it() -> None:
    quota = budget(rpm=None, tpm=60_000)
    quota.follow({"requests": Account(20, 20, None)}, called_at=0.0, now=0.0)  # a limit not configured
    assert quota.limited and quota.remaining(HIGH, now=0.0)["requests"] == 20
    for _ in range(20):
        quota.claim(HIGH, 1, now=0.0)
    assert quota.claim(HIGH, 1, now=0.0, max_wait_s=1.0) == (False, pytest.approx(3.0), (0, 0))  # 20 a minute
    quota.follow({}, called_at=1.0, now=1.0)  # the provider stopped reporting it
    assert quota.claim(HIGH, 1, now=1.0, max_wait_s=0.0).granted


def test_a_limit_only_the_headers_gave_is_forgotten_once_no_answer_repeats_it() -> None:
    quota = budget(rpm=None, tpm=None)
    quota.follow({"tokens": Account(600, 0, 60.0)}, called_at=0.0, now=0.0)  # spent, on a limit then lifted
    assert quota.claim(HIGH, 100, now=5.0, max_wait_s=1.0).granted is False  # 10 s of refill away
    assert quota.claim(HIGH, 100, now=10.5, max_wait_s=0.0).granted and not quota.limited


def test_a_429_stops_every_claim_for_its_retry_after() -> None:
    quota = budget(rpm=600, tpm=60_000)
    quota.refused(2.0, now=0.0)
    assert quota.claim(HIGH, 10, now=0.0, max_wait_s=1.0).granted is False
    assert quota.claim(HIGH, 10, now=0.0).wait_s >= 2.0


def test_a_call_larger_than_the_bucket_is_sent_when_the_bucket_is_full() -> None:
    quota = budget(tpm=1_000)
    assert quota.claim(HIGH, 5_000, now=0.0) == (True, 0.0, (0, 0))


def test_a_lease_is_granted_only_from_what_the_bucket_holds_now_at_most_two_percent_and_lows_above_the_reserve(
) -> None:
    quota = budget(rpm=6_000, tpm=600_000)
    assert quota.claim(HIGH, 100, now=0.0, lease=(4, 400)).leased == (4, 400)
    assert quota.claim(HIGH, 100, now=0.0, lease=(500, 400)).leased == (120, 400)  # 2% of 6,000
    assert quota.claim(LOW, 100, now=0.0, lease=(4, 400)).leased == (4, 400)
    assert quota.lease(LOW, (4, 400), now=0.0) == (4, 400)
    small = budget(rpm=20, tpm=60_000)
    assert small.claim(HIGH, 100, now=0.0, lease=(4, 400)).leased == (0, 0)  # 2% of 20 is no whole call
    quota.claim(HIGH, 588_600, now=0.0)  # 9,500 tokens left, under HIGH's reserve (two seconds of its recent use)
    assert quota.lease(LOW, (4, 400), now=0.0) == (0, 0)
    assert quota.lease(HIGH, (4, 400), now=0.0) == (4, 400)
    assert quota.claim(HIGH, 10_000, now=0.0, lease=(4, 400)).leased == (0, 0)


def test_a_model_without_limits_grants_everything_and_is_not_limited() -> None:
    quota = budget(rpm=None, tpm=None)
    assert not quota.limited
    assert quota.claim(LOW, 10**9, now=0.0) == (True, 0.0, (0, 0))


def test_the_headers_of_openai_and_of_the_simulated_upstream_are_read() -> None:
    accounts = provider_accounts({
        "x-ratelimit-limit-requests": "3000", "x-ratelimit-remaining-requests": "2999",
        "x-ratelimit-reset-requests": "20ms", "x-ratelimit-limit-tokens": "1000000",
        "x-ratelimit-remaining-tokens": "999000", "x-ratelimit-reset-tokens": "6m0s",
    })
    assert accounts == {"requests": Account(3000, 2999, 0.02), "tokens": Account(1_000_000, 999_000, 360.0)}
    assert provider_accounts({"x-ratelimit-remaining-tokens": "12"}) == {"tokens": Account(None, 12, None)}
    assert provider_accounts({"content-type": "application/json"}) == {}
    assert [duration_s(text) for text in ("1.5s", "2m3s", "1h", "0.250s", "soon", "3x")] == [
        1.5, 123.0, 3600.0, 0.25, None, None]


def test_the_first_answer_without_the_limit_ends_refusals_even_while_reservations_wait() -> None:
    # The 429 storm's recovery: the provider reported 20 calls a minute, none left; HIGH calls hold reservations
    # ahead (the level below zero) when an answer comes back with no x-ratelimit-* headers at all.
    quota = QuotaBudget(Limits(None, None), now=0.0)
    limited = {"requests": Account(20, 0, 60.0)}
    quota.follow(limited, called_at=0.0, now=0.0)
    assert quota.claim(HIGH, 10, now=0.0, max_wait_s=0.4).granted is False  # spent: 60/18 s a call
    assert quota.claim(HIGH, 10, now=0.0).wait_s == pytest.approx(60 / 18)  # reserved ahead, waiting
    quota.follow({}, called_at=0.5, now=0.5)  # the limit is lifted: nothing reported
    assert not quota.limited
    for _ in range(50):  # every claim at once, HIGH and LOW, whatever was reserved before
        assert quota.claim(HIGH, 10, now=0.5, max_wait_s=0.4) == (True, 0.0, (0, 0))
        assert quota.claim(LOW, 10, now=0.5, max_wait_s=0.4) == (True, 0.0, (0, 0))

"""A replica's side of the quota (deployments/model/quota/pacer.py), on looptime's clock: claims, leases, refusals with a
computed Retry-After, the provider's reports, and pacing alone while the shared budget is unreachable."""

from __future__ import annotations

import asyncio
import logging

import pytest

from batching import AdaptiveBatcher, BatcherConfig, Postponed, Priority
from deployments.errors import UpstreamRateLimited
from deployments.model.quota.budget import Limits, QuotaBudget
from deployments.model.quota.limiter import Answer, Report, answer, apply_reports, renewal
from deployments.model.quota.metrics import QuotaMetrics
from deployments.model.quota.pacer import LEASE_TTL_S, PacedInput, QuotaPacer
from deployments.wire import Deadline

pytestmark = pytest.mark.looptime

HIGH, LOW = Priority.HIGH, Priority.LOW


class InProcessLedger:
    """The limiter actor's methods on a budget in this process, counting the calls."""

    def __init__(self, limits: Limits) -> None:
        self.budget = QuotaBudget(limits, asyncio.get_running_loop().time())
        self.claims = 0
        self.renewals = 0
        self.reports: list[Report] = []

    async def claim(self, priority: Priority, tokens: int, max_wait_s: float | None, lease: tuple[int, int],
                    reports: list[Report]) -> Answer:
        self.claims += 1
        self.reports += reports
        return answer(self.budget, priority, tokens, max_wait_s, lease, reports, asyncio.get_running_loop().time())

    async def renew(self, priority: Priority, lease: tuple[int, int], reports: list[Report]) -> Answer:
        self.renewals += 1
        self.reports += reports
        return renewal(self.budget, priority, lease, reports, asyncio.get_running_loop().time())

    async def report(self, reports: list[Report]) -> None:
        self.reports += reports
        apply_reports(self.budget, reports, asyncio.get_running_loop().time())

    async def release(self, requests: int, tokens: int) -> None:
        self.budget.release(tokens, asyncio.get_running_loop().time(), requests)


class Unreachable:
    async def claim(self, *args: object) -> Answer:
        raise ConnectionError("the limiter's node is gone")

    async def report(self, reports: list[Report]) -> None:
        raise ConnectionError("the limiter's node is gone")


class Recorded(QuotaMetrics):
    def __init__(self) -> None:
        self.fallbacks: list[bool] = []
        self.refusals = 0
        self.upstream_429s = 0
        self.waits: list[tuple[Priority, float]] = []

    def fallback(self, active: bool) -> None:
        self.fallbacks.append(active)

    def refused(self, priority: Priority, count: int) -> None:
        self.refusals += count

    def upstream_rate_limited(self) -> None:
        self.upstream_429s += 1

    def waited(self, priority: Priority, seconds: float) -> None:
        self.waits.append((priority, seconds))


def pacer_on(ledger: object, limits: Limits, metrics: QuotaMetrics | None = None, replicas: int = 2,
             max_wait_s: float | None = None) -> QuotaPacer:
    loop = asyncio.get_running_loop()
    return QuotaPacer(limits, ledger, replicas=replicas, metrics=metrics, max_wait_s=max_wait_s, clock=loop.time)


def batch(priority: Priority, tokens: int, *, timeout_s: float | None = None, size: int = 2) -> list[PacedInput]:
    return [PacedInput(f"text {i}", tokens // size, priority, Deadline.of(timeout_s)) for i in range(size)]


async def sent(inputs: list[PacedInput]) -> list[str]:
    return [item.content for item in inputs]


async def test_a_call_is_sent_once_the_shared_budget_holds_it() -> None:
    limits = Limits(rpm=None, tpm=60_000, headroom=1.0)
    ledger = InProcessLedger(limits)
    pacer = pacer_on(ledger, limits)
    loop = asyncio.get_running_loop()
    ledger.budget.claim(HIGH, 60_000, now=loop.time())  # spent: 1,000 tokens a second come back
    inputs = batch(HIGH, 2_000)
    assert await pacer.paced(inputs, lambda: sent(inputs)) == ["text 0", "text 1"]
    assert loop.time() == pytest.approx(2.0)


async def test_a_batch_the_budget_cannot_hold_before_its_deadline_is_429_with_when_it_could() -> None:
    limits = Limits(rpm=None, tpm=60_000, headroom=1.0)
    ledger = InProcessLedger(limits)
    metrics = Recorded()
    pacer = pacer_on(ledger, limits, metrics)
    ledger.budget.claim(HIGH, 60_000, now=asyncio.get_running_loop().time())
    inputs = batch(HIGH, 5_000, timeout_s=2.0)

    async def never() -> list[str]:
        raise AssertionError("sent past its deadline")

    outcomes = await pacer.paced(inputs, never)
    assert [type(outcome) for outcome in outcomes] == [UpstreamRateLimited, UpstreamRateLimited]
    assert outcomes[0].retry_after_s == pytest.approx(5.0)
    assert metrics.refusals == 2


async def test_past_the_cap_an_input_is_429_if_its_deadline_comes_first_else_queued_again() -> None:
    limits = Limits(rpm=None, tpm=60_000, headroom=1.0)
    ledger = InProcessLedger(limits)
    pacer = pacer_on(ledger, limits, max_wait_s=0.5)
    loop = asyncio.get_running_loop()
    ledger.budget.claim(HIGH, 60_000, now=loop.time())
    inputs = [PacedInput("soon", 500, HIGH, Deadline.after(0.9)), PacedInput("later", 500, HIGH, Deadline.after(9.0))]
    soon, later = await pacer.paced(inputs, lambda: sent(inputs))  # held in 1 s: past the cap
    assert isinstance(soon, UpstreamRateLimited) and soon.retry_after_s == pytest.approx(1.0)
    assert isinstance(later, Postponed) and later.retry_after_s == pytest.approx(1.0)


async def test_low_waiting_for_the_budget_holds_no_batch_slot_so_high_goes_first_and_uses_no_retry() -> None:
    limits = Limits(rpm=None, tpm=60_000, headroom=1.0, low_share=0.0)
    ledger = InProcessLedger(limits)
    pacer = pacer_on(ledger, limits)
    loop = asyncio.get_running_loop()
    ledger.budget.claim(HIGH, 60_000, now=loop.time())
    finished: dict[str, float] = {}

    async def process(inputs: list[PacedInput]) -> list[object]:
        return list(await pacer.paced(inputs, lambda: sent(inputs)))

    config = BatcherConfig(max_batch_size=8, max_wait_ms=0.0, max_concurrent_batches=1, max_retries=0)
    async with AdaptiveBatcher(process, config) as batcher:
        async def run(name: str, priority: Priority) -> None:
            assert await batcher.submit(PacedInput(name, 3_000, priority, None), priority=priority) == name
            finished[name] = loop.time()

        low = asyncio.create_task(run("low", LOW))  # in the only slot first
        await asyncio.sleep(0.5)
        await run("high", HIGH)
        await low
    assert finished["high"] == pytest.approx(3.0)  # its own 3,000 tokens' refill, not behind LOW, which asked first
    assert finished["low"] >= 7.0  # after HIGH's 3,000, its own 3,000 and a second kept back for HIGH


async def test_a_call_cancelled_while_it_waits_for_its_reservation_gives_it_back() -> None:
    limits = Limits(rpm=None, tpm=60_000, headroom=1.0)
    ledger = InProcessLedger(limits)
    pacer = pacer_on(ledger, limits)
    loop = asyncio.get_running_loop()
    ledger.budget.claim(HIGH, 60_000, now=loop.time())
    inputs = batch(HIGH, 10_000)
    waiting = asyncio.create_task(pacer.paced(inputs, lambda: sent(inputs)))
    await asyncio.sleep(1.0)
    waiting.cancel()  # its batch timed out, or every caller gave up
    await asyncio.sleep(0.01)
    assert ledger.budget.remaining(HIGH, now=loop.time())["tokens"] == pytest.approx(1_010, abs=1)


async def test_a_call_the_budget_holds_in_time_but_past_the_cap_is_queued_again_for_then() -> None:
    limits = Limits(rpm=None, tpm=60_000, headroom=1.0)
    ledger = InProcessLedger(limits)
    pacer = pacer_on(ledger, limits, max_wait_s=0.5)  # e.g. the batcher's batch_timeout_s
    inputs = batch(HIGH, 2_000, timeout_s=30.0)  # more than a lease holds (2% of the bucket)

    async def slow() -> list[str]:
        await asyncio.sleep(0.2)
        return await sent(inputs)

    await pacer.paced(inputs, slow)  # leaves 57,000 (with a lease of 1,200)
    ledger.budget.claim(HIGH, 55_400, now=asyncio.get_running_loop().time())  # the next call: 0.4 s short
    (later, _) = await pacer.paced(inputs, slow)  # 0.4 s + twice the last call's 0.2 s would pass the cap
    assert isinstance(later, Postponed) and later.retry_after_s == pytest.approx(0.4)
    await asyncio.sleep(0.35)
    assert await pacer.paced(inputs, slow) == ["text 0", "text 1"]  # 0.05 s + 2 x 0.2 s fit


class SlowLedger(InProcessLedger):
    """The actor 5 ms away: a call that waits for it is seen on the clock."""

    async def claim(self, *args: object) -> Answer:
        await asyncio.sleep(0.005)
        return await super().claim(*args)

    async def renew(self, *args: object) -> Answer:
        await asyncio.sleep(0.005)
        return await super().renew(*args)


async def test_far_from_the_limits_calls_spend_leases_renewed_ahead_and_the_budget_hears_of_them_seldom() -> None:
    limits = Limits(rpm=10**8, tpm=10**9)
    ledger = SlowLedger(limits)
    pacer = pacer_on(ledger, limits)
    loop = asyncio.get_running_loop()
    waited = {HIGH: [], LOW: []}
    for call in range(300):  # 3 s of 100 calls a second of each priority, each a little larger than the last
        for priority in (HIGH, LOW):
            inputs = batch(priority, 100 + 2 * call)
            asked = loop.time()
            await pacer.paced(inputs, lambda: sent(inputs))
            waited[priority].append(loop.time() - asked)
        await asyncio.sleep(0.01)
    for priority in (HIGH, LOW):  # only the first call of each waited for the actor
        assert [wait > 0 for wait in waited[priority]] == [True] + [False] * 299
    assert ledger.claims + ledger.renewals <= 2 * (1 + 3 * 3)  # 600 calls; a few renewals a second of each
    assert ledger.budget.remaining(LOW, now=loop.time())["requests"] < 10**8 * 0.9 - 600  # every call counted


async def test_near_the_limits_no_lease_fits_and_every_call_is_claimed_on_its_own() -> None:
    limits = Limits(rpm=20, tpm=None)  # 2% of 18 is no whole call
    ledger = InProcessLedger(limits)
    pacer = pacer_on(ledger, limits)
    for priority in (HIGH, LOW, HIGH):
        inputs = batch(priority, 100)
        await pacer.paced(inputs, lambda: sent(inputs))
    assert (ledger.claims, ledger.renewals) == (3, 0)


async def test_a_lease_not_spent_goes_back_to_the_shared_budget() -> None:
    limits = Limits(rpm=60_000, tpm=None, headroom=1.0)  # 1,000 calls a second come back
    ledger = InProcessLedger(limits)
    pacer = pacer_on(ledger, limits)
    loop = asyncio.get_running_loop()
    ledger.budget.claim(HIGH, 0, now=loop.time(), requests=30_000)
    inputs = batch(HIGH, 100)
    await pacer.paced(inputs, lambda: sent(inputs))  # one call, and a lease of four
    await asyncio.sleep(LEASE_TTL_S - 0.01)
    assert ledger.budget.remaining(HIGH, now=loop.time())["requests"] == pytest.approx(30_000 - 5 + 4_990)
    await asyncio.sleep(0.02)
    assert ledger.budget.remaining(HIGH, now=loop.time())["requests"] == pytest.approx(30_000 - 1 + 5_010)


async def test_an_unreachable_limiter_means_pacing_alone_on_an_equal_share_never_a_failure(
        caplog: pytest.LogCaptureFixture) -> None:
    limits = Limits(rpm=None, tpm=60_000, headroom=1.0)  # alone, one of 2 replicas: 30,000 a minute
    metrics = Recorded()
    pacer = pacer_on(Unreachable(), limits, metrics, replicas=2)
    loop = asyncio.get_running_loop()
    with caplog.at_level(logging.WARNING, logger="ray.serve"):
        for _ in range(2):
            inputs = batch(HIGH, 30_000)
            assert await pacer.paced(inputs, lambda: sent(inputs)) == ["text 0", "text 1"]
    assert loop.time() == pytest.approx(60.0)  # the second waited for its share to come back
    assert metrics.fallbacks == [True]
    assert [r.message for r in caplog.records if "cannot be reached" in r.message] == [
        "quota: the shared budget cannot be reached (ConnectionError: the limiter's node is gone); this replica "
        "paces alone on 1/2 of the limits"]


async def test_alone_a_replica_follows_its_share_of_what_the_provider_reports() -> None:
    pacer = pacer_on(Unreachable(), Limits(rpm=None, tpm=None, headroom=1.0), replicas=2)
    inputs = batch(HIGH, 100, timeout_s=5.0)

    async def answered() -> list[str]:  # the provider's account: 20 calls a minute, none left
        pacer.observe({"x-ratelimit-limit-requests": "20", "x-ratelimit-remaining-requests": "0"}, None)
        return await sent(inputs)

    assert await pacer.paced(inputs, answered) == ["text 0", "text 1"]
    (refused, _) = await pacer.paced(batch(HIGH, 100, timeout_s=5.0), lambda: sent(inputs))
    assert refused.retry_after_s == pytest.approx(6.0)  # one of 10 calls a minute, its equal share


async def test_the_providers_headers_reach_the_shared_budget_with_the_next_claim() -> None:
    limits = Limits(rpm=None, tpm=60_000, headroom=1.0)
    ledger = InProcessLedger(limits)
    pacer = pacer_on(ledger, limits)
    inputs = batch(LOW, 100)

    async def answered() -> list[str]:
        await asyncio.sleep(0.2)
        pacer.observe({"x-ratelimit-limit-tokens": "60000", "x-ratelimit-remaining-tokens": "1000"}, None)
        return await sent(inputs)

    await pacer.paced(inputs, answered)
    assert ledger.budget.remaining(HIGH, now=asyncio.get_running_loop().time())["tokens"] > 50_000
    await pacer.paced(batch(HIGH, 10), lambda: sent(inputs))
    (report,) = ledger.reports
    assert report.age_s == pytest.approx(0.2)
    assert ledger.budget.remaining(HIGH, now=asyncio.get_running_loop().time())["tokens"] < 1_000


async def test_an_upstream_429_is_counted_and_stops_the_shared_budget_at_once() -> None:
    limits = Limits(rpm=600, tpm=None)
    ledger = InProcessLedger(limits)
    metrics = Recorded()
    pacer = pacer_on(ledger, limits, metrics)
    pacer.observe({}, 3.0)
    await asyncio.sleep(0.01)
    assert metrics.upstream_429s == 1
    assert [report.refused_for_s for report in ledger.reports] == [3.0]
    assert ledger.budget.claim(HIGH, 1, now=asyncio.get_running_loop().time(), max_wait_s=2.0).granted is False


async def test_a_model_without_limits_is_not_paced_until_the_provider_reports_one() -> None:
    limits = Limits(rpm=None, tpm=None)
    ledger = InProcessLedger(limits)
    pacer = pacer_on(ledger, limits)
    inputs = batch(HIGH, 100)
    await pacer.paced(inputs, lambda: sent(inputs))
    pacer.observe({"content-type": "application/json"}, None)  # no limit reported: nothing to learn
    await pacer.paced(inputs, lambda: sent(inputs))
    assert ledger.claims == 0
    pacer.observe({"x-ratelimit-limit-requests": "20", "x-ratelimit-remaining-requests": "0"}, None)
    await pacer.paced(inputs, lambda: sent(inputs))
    assert ledger.claims == 1 and ledger.budget.limited


def test_paced_inputs_are_equal_by_content_so_a_batch_sends_equal_inputs_once() -> None:
    assert PacedInput("a", 1, HIGH, Deadline(1.0)) == PacedInput("a", 1, HIGH, Deadline(2.0))
    assert len({PacedInput("a", 1, HIGH, Deadline(1.0)), PacedInput("a", 1, HIGH, None),
                PacedInput("b", 1, HIGH, Deadline(1.0))}) == 2

"""Tenants' limits (deployments/ingress/tenant_budget.py, tenant_gate.py): one budget, claimed from by every replica
with leases, on a made-up clock; and at the API, a 429 with ``Retry-After`` and OpenAI's ``x-ratelimit-*`` headers,
``insufficient_quota`` past a budget."""

from __future__ import annotations

import calendar
import datetime
import time
from pathlib import Path

import openai
import pytest
from starlette.testclient import TestClient

from deployments.errors import TenantOverBudget, TenantRateLimited
from deployments.ingress.api import create_api
from deployments.ingress.auth import ApiKeys, Tenant, TenantLimits, key_hash
from deployments.ingress.tenant_budget import LEASE_SHARE, TenantBudgets
from deployments.ingress.tenant_gate import IDLE_RETURN_S, TenantGate, TenantLimiter

from .batch_fakes import MODEL, FakeModel

NOON = calendar.timegm(datetime.datetime(2026, 12, 5, 12, 0).timetuple())


class Clock:
    def __init__(self, now: float = NOON) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def test_a_claim_takes_from_every_bucket_that_applies_or_from_none() -> None:
    budgets = TenantBudgets()
    limits = TenantLimits(rpm=10, tpm=100, per_model=(("m", None, 30),))
    assert budgets.claim("a", limits, "m", 1, 25, (0, 0), NOON).granted
    refused = budgets.claim("a", limits, "m", 1, 10, (0, 0), NOON)  # 5 tokens left of m's 30
    assert not refused.granted and not refused.over_budget
    assert refused.wait_s == pytest.approx(5 * 60 / 30)  # m's bucket refills 30 a minute
    assert budgets.claim("a", limits, "other", 1, 70, (0, 0), NOON).granted  # the tenant's 100 held 75 still
    assert budgets.claim("b", limits, "m", 1, 25, (0, 0), NOON).granted  # another tenant has its own


def test_a_lease_is_at_most_a_share_of_each_bucket_and_only_what_it_holds() -> None:
    budgets = TenantBudgets()
    limits = TenantLimits(rpm=6000, tpm=1_000_000)
    grant = budgets.claim("a", limits, "m", 1, 10, (10_000, 10_000_000), NOON)
    assert grant.leased == (int(LEASE_SHARE * 6000), int(LEASE_SHARE * 1_000_000))
    assert grant.remaining["requests"].remaining == 6000 - 1 - 120


def test_a_days_budget_refuses_as_over_budget_until_the_next_utc_day() -> None:
    budgets = TenantBudgets()
    limits = TenantLimits(tokens_per_day=1000)
    assert budgets.claim("a", limits, "m", 1, 900, (0, 0), NOON).granted
    refused = budgets.claim("a", limits, "m", 1, 200, (0, 0), NOON)
    assert not refused.granted and refused.over_budget and refused.wait_s == pytest.approx(12 * 3600)
    assert budgets.claim("a", limits, "m", 1, 200, (0, 0), NOON + 12 * 3600).granted


async def test_two_replicas_share_one_budget_and_hold_a_rate_within_its_limit_over_a_minute() -> None:
    clock = Clock()
    limiter = TenantLimiter(clock)
    replicas = [TenantGate(limiter, clock), TenantGate(limiter, clock)]
    tenant = Tenant("a", limits=TenantLimits(rpm=600))
    answered = 0
    for step in range(6000):  # 100 requests a second offered for a minute, alternating replicas
        clock.now += 0.01
        try:
            await replicas[step % 2].admit(tenant, MODEL, ["text"])
            answered += 1
        except TenantRateLimited:
            pass
    assert 1200 * 0.98 <= answered <= 1200  # the full bucket (600) and a minute's refill (600), never more


async def test_what_a_replica_does_not_spend_goes_back_and_a_low_estimate_is_charged() -> None:
    clock = Clock()
    limiter = TenantLimiter(clock)
    gate = TenantGate(limiter, clock)
    tenant = Tenant("a", limits=TenantLimits(tpm=1000))
    ticket = await gate.admit(tenant, MODEL, ["x" * 100])
    gate.settle(ticket, 40)  # the answer counted 40 tokens of the 100 claimed: 60 are the replica's again
    ticket = await gate.admit(tenant, MODEL, ["x" * 50])
    gate.settle(ticket, 80)  # a low estimate: 30 more are owed
    clock.now += IDLE_RETURN_S
    with pytest.raises(TenantRateLimited):  # returns happen on a later admit; this one is past the limit
        await gate.admit(tenant, MODEL, ["x" * 2000])
    grant = await limiter.claim("a", tenant.limits, MODEL, 0, 0, (0, 0))
    assert grant.remaining["tokens"].remaining == pytest.approx(1000 - 120 + IDLE_RETURN_S * 1000 / 60, abs=2)


async def test_a_tenant_past_its_budget_is_told_so_apart_from_a_rate_limit() -> None:
    clock = Clock()
    gate = TenantGate(TenantLimiter(clock), clock)
    tenant = Tenant("a", limits=TenantLimits(tokens_per_month=10))
    await gate.admit(tenant, MODEL, ["x" * 10])
    with pytest.raises(TenantOverBudget) as refused:
        await gate.admit(tenant, MODEL, ["x"])
    assert refused.value.retry_after_s > 86_400  # the month turns on the 1st


def test_at_the_api_a_limited_tenant_gets_429s_with_retry_after_and_ratelimit_headers(tmp_path: Path) -> None:
    path = tmp_path / "keys.yaml"
    path.write_text(f"tenants: {{a: {{keys: [{key_hash('sk-a')}], rpm: 2}}, "
                    f"b: {{keys: [{key_hash('sk-b')}], tokens_per_day: 3}}}}")
    api = create_api({MODEL: FakeModel()}, api_keys=ApiKeys([], path=path))
    with TestClient(api) as http:
        def post(key: str, text: str):
            return http.post("/v1/embeddings", json={"model": MODEL, "input": text},
                             headers={"Authorization": f"Bearer {key}"})

        first, second, third = post("sk-a", "one"), post("sk-a", "two"), post("sk-a", "three")
        assert (first.status_code, second.status_code, third.status_code) == (200, 200, 429)
        assert first.headers["x-ratelimit-limit-requests"] == "2"
        assert third.json()["error"]["code"] == "rate_limit_exceeded"
        assert int(third.headers["retry-after"]) >= 1 and third.headers["x-ratelimit-remaining-requests"] == "0"
        spent = post("sk-b", "12")  # claims 2 tokens; its answer counts 1 (the fake model's)
        over = post("sk-b", "6789")  # claims 4: the day holds 2
        assert spent.status_code == 200 and over.status_code == 429
        assert over.json()["error"]["type"] == over.json()["error"]["code"] == "insufficient_quota"
        client = openai.OpenAI(base_url=f"{http.base_url}/v1", api_key="sk-b", http_client=http, max_retries=0)
        with pytest.raises(openai.RateLimitError):
            client.embeddings.create(model=MODEL, input="more")


def test_a_batch_group_refused_by_its_tenants_budget_gives_back_what_its_admitted_lines_claimed(tmp_path: Path) -> None:
    from deployments.config import BatchConfig

    path = tmp_path / "keys.yaml"
    path.write_text(f"tenants: {{a: {{keys: [{key_hash('sk-a')}], tokens_per_day: 10}}}}")
    model = FakeModel()
    api = create_api({MODEL: model}, api_keys=ApiKeys([], path=path), batch=BatchConfig(directory=str(tmp_path)))
    with TestClient(api) as http:
        client = openai.OpenAI(base_url=f"{http.base_url}/v1", api_key="sk-a", http_client=http, max_retries=0)
        lines = b"".join(b'{"custom_id": "%d", "method": "POST", "url": "/v1/embeddings", '
                         b'"body": {"model": "%s", "input": "%s"}}\n' % (i, MODEL.encode(), text)
                         for i, text in enumerate((b"aaaa", b"bbbb", b"cccc")))
        uploaded = client.files.create(file=("in.jsonl", lines), purpose="batch")
        batch = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/embeddings", completion_window="24h")
        # The three lines travel together and claim 4 tokens each of the day's 10: the third is refused, and the
        # group waits for the next day; the 8 tokens the first two claimed are the tenant's again meanwhile.
        deadline = time.monotonic() + 30
        while (answer := client.batches.retrieve(batch.id)).status == "validating":
            assert time.monotonic() < deadline
            time.sleep(0.02)
        time.sleep(0.2)  # the group's admission, refused
        assert model.requests == []
        assert client.embeddings.create(model=MODEL, input="xxxxxxxx").data  # claims 8 of the 10

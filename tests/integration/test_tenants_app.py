"""Tenants on a running application (two ingress replicas, an ``openai`` model on the simulated upstream): a tenant's
RPM held as one budget across both replicas, its daily token budget never passed by more than one request, its usage
one ledger across both, and a key revoked in the keys file refused within seconds."""

from __future__ import annotations

import concurrent.futures
import time
from pathlib import Path
from typing import Iterator

import httpx
import pytest
from ray import serve

from deployments.ingress.auth import key_hash
from load.upstream import RunningUpstream, UpstreamConfig, run_upstream

from .helpers import Service

pytestmark = pytest.mark.integration

APP = "tenants"
PREFIX = "/tenants"
MODEL = "sim-tenants"
RPM = 60
TOKENS_PER_DAY = 300
TEXT, TEXT_TOKENS = "a short text", 3  # cl100k_base
KEEP, REVOKE, ADMIN, DAILY = "sk-limited-tenant", "sk-revoked-soon", "sk-admin", "sk-daily-budget"


def write_keys(path: Path, keys: tuple[str, ...]) -> None:
    path.write_text(f"tenants:\n  limited:\n    keys: [{', '.join(key_hash(key) for key in keys)}]\n"
                    f"    rpm: {RPM}\n  finance:\n    keys: [{key_hash(ADMIN)}]\n    admin: true\n"
                    f"  daily:\n    keys: [{key_hash(DAILY)}]\n    tokens_per_day: {TOKENS_PER_DAY}\n")


@pytest.fixture(scope="module")
def tenants_app(serve_instance: Service, tmp_path_factory: pytest.TempPathFactory
                ) -> Iterator[tuple[Service, Path, RunningUpstream]]:
    from deployments.app import build_app

    keys = tmp_path_factory.mktemp("keys") / "keys.yaml"
    write_keys(keys, (KEEP, REVOKE))
    with run_upstream(UpstreamConfig(dim=8, base_latency_ms=1.0, jitter=0.0)) as upstream:
        args = {
            "models": [{"name": MODEL, "backend": "openai", "base_url": upstream.base_url, "num_replicas": 1,
                        "upstream_model": "text-embedding-3-small", "batching": {"max_wait_ms": 2}}],
            "ingress": {"num_replicas": 2, "env_vars": {"EMBEDDINGS_API_KEYS_FILE": str(keys)}},
        }
        serve.run(build_app(args), name=APP, route_prefix=PREFIX)
        try:
            yield serve_instance, keys, upstream
        finally:
            serve.delete(APP)


def post(http: httpx.Client, key: str) -> httpx.Response:
    return http.post(f"{PREFIX}/v1/embeddings", json={"model": MODEL, "input": TEXT},
                     headers={"Authorization": f"Bearer {key}"})


def test_a_tenants_rpm_holds_across_two_ingress_replicas(tenants_app) -> None:
    service, _, _ = tenants_app
    started_at = time.time()
    with service.http() as http:
        started = time.monotonic()
        answers = [post(http, KEEP) for _ in range(3 * RPM)]
        elapsed = time.monotonic() - started
    statuses = [answer.status_code for answer in answers]
    granted = statuses.count(200)
    assert set(statuses) <= {200, 429}
    assert RPM * 0.98 <= granted <= RPM + elapsed * RPM / 60 + 1  # the bucket, and its refill while they ran
    refused = answers[statuses.index(429)]
    assert refused.json()["error"]["code"] == "rate_limit_exceeded" and int(refused.headers["retry-after"]) >= 1
    assert answers[0].headers["x-ratelimit-limit-requests"] == str(RPM)
    time.sleep(1.5)  # each replica hands its counts on within a second
    with service.http() as http:
        usage = http.get(f"{PREFIX}/v1/organization/usage/embeddings", headers={"Authorization": f"Bearer {ADMIN}"},
                         params={"start_time": int(started_at) // 86_400 * 86_400, "group_by": "project_id"}).json()
    results = [result for bucket in usage["data"] for result in bucket["results"]]
    assert [(r["project_id"], r["num_model_requests"]) for r in results] == [("limited", granted)]


def test_a_tenants_daily_budget_is_never_passed_by_more_than_one_request_from_clients_on_both_replicas(
        tenants_app) -> None:
    service, _, _ = tenants_app

    def client() -> list[httpx.Response]:
        answers = []
        with service.http() as http:
            while not answers or answers[-1].status_code == 200:
                answers.append(post(http, DAILY))
        return answers

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        answers = [answer for answers in pool.map(lambda _: client(), range(8)) for answer in answers]
    served = sum(answer.json()["usage"]["total_tokens"] for answer in answers if answer.status_code == 200)
    refusals = [answer for answer in answers if answer.status_code != 200]
    assert served <= TOKENS_PER_DAY + TEXT_TOKENS
    # what a replica still holds of its last claim (a text's claim is its characters) is unspent, not lost
    assert served >= TOKENS_PER_DAY - 2 * (len(TEXT) + TOKENS_PER_DAY // 50) - TEXT_TOKENS
    assert len(refusals) == 8 and {answer.status_code for answer in refusals} == {429}
    assert {answer.json()["error"]["code"] for answer in refusals} == {"insufficient_quota"}
    assert all(int(answer.headers["retry-after"]) >= 1 for answer in refusals)


def test_a_key_revoked_in_the_keys_file_is_refused_within_seconds(tenants_app) -> None:
    service, keys, _ = tenants_app
    write_keys(keys, (KEEP,))
    deadline = time.monotonic() + 10
    with service.http() as http:
        while (status := post(http, REVOKE).status_code) != 401:
            assert status in (200, 429) and time.monotonic() < deadline, "the revoked key is still accepted"
            time.sleep(0.2)
    assert status == 401

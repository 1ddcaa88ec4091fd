"""``GET /healthz`` says which model cannot serve and why (from Serve's status of its deployment), without Ray."""

from __future__ import annotations

import asyncio
import threading
from types import SimpleNamespace

import httpx
import pytest

from deployments.ingress.api import create_api
from deployments.ingress.model_health import ModelHealth, reason, unavailable_models

# Serve's message for a deployment whose replicas fail in their constructor (deployment_state.py), abridged
FAILED = ("The deployment failed to start 3 times in a row. This may be due to a problem with its constructor or "
          "initial health check failing. See controller logs for details. Error:\nTraceback (most recent call last):\n"
          '  File "/srv/deployments/model/backends/model_dir.py", line 142, in _pooling_modes\n'
          "    raise ValueError(...)\n"
          "ValueError: /models/x/1_Pooling: Pooling pooling_mode bogus is not served\n")


def deployment(status: str, message: str = "", **replicas: int) -> SimpleNamespace:
    return SimpleNamespace(status=SimpleNamespace(value=status), message=message, replica_states=replicas)


def serve_status(**deployments: SimpleNamespace) -> SimpleNamespace:
    return SimpleNamespace(applications={"embeddings": SimpleNamespace(deployments=deployments)})


DEPLOYMENTS = {"a": "embed-a", "b": "embed-b"}


def test_a_model_with_no_running_replica_is_unavailable_with_serves_reason() -> None:
    status = serve_status(**{"embed-a": deployment("HEALTHY", RUNNING=2),
                             "embed-b": deployment("DEPLOY_FAILED", FAILED, STARTING=1)})
    assert unavailable_models(status, "embeddings", DEPLOYMENTS) == {
        "b": "The deployment failed to start 3 times in a row: ValueError: /models/x/1_Pooling: Pooling pooling_mode "
             "bogus is not served"}


def test_a_starting_model_and_an_updating_one_that_still_serves() -> None:
    status = serve_status(**{"embed-a": deployment("UPDATING", RUNNING=1, STARTING=1),
                             "embed-b": deployment("UPDATING", STARTING=1)})
    assert unavailable_models(status, "embeddings", DEPLOYMENTS) == {"b": "no replica running (UPDATING)"}


def test_what_serve_does_not_know_of_is_not_reported() -> None:
    assert unavailable_models(serve_status(), "embeddings", DEPLOYMENTS) == {}
    assert unavailable_models(SimpleNamespace(applications={}), "embeddings", DEPLOYMENTS) == {}


def test_a_long_reason_is_cut() -> None:
    assert reason("One line. Kept whole.", "UNHEALTHY") == "One line. Kept whole."
    text = reason("Boom. More.\nValueError: " + "x" * 2000, "UNHEALTHY")
    assert len(text) == 500 and text.startswith("Boom: ValueError: xxx") and text.endswith("...")


@pytest.mark.looptime
async def test_serve_is_asked_at_most_once_per_ttl_and_a_failure_reads_as_available() -> None:
    calls = 0

    def status():
        nonlocal calls
        calls += 1
        if calls == 2:
            raise RuntimeError("controller unreachable")
        return serve_status(**{"embed-a": deployment("UNHEALTHY", "Boom.")})

    health = ModelHealth("embeddings", DEPLOYMENTS, status=status, ttl_s=0.2)
    answers = await asyncio.gather(*(health() for _ in range(5)))
    assert answers == [{"a": "Boom."}] * 5 and calls == 1
    await asyncio.sleep(0.15)
    assert await health() == {"a": "Boom."} and calls == 1  # within the TTL: the answer kept
    await asyncio.sleep(0.1)
    assert await health() == {} and calls == 2
    await asyncio.sleep(0.25)
    assert await health() == {"a": "Boom."} and calls == 3


@pytest.mark.looptime
async def test_a_status_call_that_hangs_is_given_up() -> None:
    release = threading.Event()
    returned = threading.Event()

    def hangs():
        release.wait(5.0)  # bounded: if the call were not given up, the test fails instead of hanging
        returned.set()
        return serve_status(**{"embed-a": deployment("UNHEALTHY", "Boom.")})

    health = ModelHealth("embeddings", DEPLOYMENTS, status=hangs, timeout_s=0.05)
    try:
        assert await health() == {}
        assert not returned.is_set()  # answered while the status call still hung
    finally:
        release.set()


async def healthz(unavailable) -> httpx.Response:
    handle = SimpleNamespace(options=lambda **options: None)  # never called: /healthz asks no model
    api = create_api({"b": handle, "a": handle}, unavailable=unavailable)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=api), base_url="http://service") as client:
        return await client.get("/healthz")


async def test_healthz_keeps_its_shape_while_every_model_serves() -> None:
    async def none_down():
        return {}

    for unavailable in (None, none_down):
        response = await healthz(unavailable)
        assert response.status_code == 200 and response.json() == {"status": "ok", "models": ["a", "b"]}


async def test_healthz_is_a_503_naming_the_model_down_and_why() -> None:
    async def b_down():
        return {"b": "The deployment failed to start 3 times in a row: ValueError: bad"}

    response = await healthz(b_down)
    assert response.status_code == 503
    assert response.json() == {"status": "degraded", "models": ["a", "b"],
                               "unavailable": {"b": "The deployment failed to start 3 times in a row: ValueError: bad"}}

"""Replicas lost or replaced under load: Serve replaces a killed replica and every caller is answered (the ingress
sends what the dead replica held to the other); a redeploy (num_replicas 2 -> 1, every replica replaced) drains what
the old replicas held and drops nothing."""

from __future__ import annotations

from typing import Iterator

import pytest

from batching import BatcherConfig
from tests.integration.helpers import Service

from . import cluster
from .scale import Scale
from .scenarios import Target, redeploy, replica_loss
from .setups import churn_target
from .traffic import serving_again

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def target(serve_instance: Service) -> Iterator[Target]:
    with churn_target(serve_instance.url, replicas=2) as running:
        yield running


def test_a_killed_replica_is_replaced_and_every_caller_answered(target: Target, scale: Scale) -> None:
    result = replica_loss(target, scale)
    unexpected = [(o.status, o.message[:160]) for o in result.outcomes if o.kind != "ok"]
    assert result.counts["ok"] == result.requests, unexpected  # what the dead replica held was sent to the other
    assert result.extra["replaced_after_s"] is not None, result.to_json()
    assert serving_again(result.outcomes), result.to_json()  # back to normal within the run
    # Inputs the dead replica had sent upstream but not answered are billed again: at most what it had in flight.
    batching = BatcherConfig(**{key: value for key, value in target.args["models"][0].get("batching", {}).items()
                                if key in BatcherConfig.field_names()})
    assert result.billed <= result.sent_clean + batching.max_batch_size * batching.max_concurrent_batches


def test_a_redeploy_under_load_drops_nothing(target: Target, scale: Scale) -> None:
    cluster.wait_for_running_replicas(target.app_name, target.deployment, 2)
    result = redeploy(target, scale, replicas_after=1)
    unexpected = [(o.status, o.message[:160]) for o in result.outcomes if o.kind != "ok"]
    assert result.counts["ok"] == result.requests, unexpected
    assert result.billed == result.needed, result.to_json()
    assert result.extra["replicas_after"] == 1

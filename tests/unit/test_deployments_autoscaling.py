"""The queue-depth autoscaling policy's decisions, on synthetic contexts (no Ray cluster)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from ray.serve import autoscaling_policy
from ray.serve._private.autoscaling_state import _resolve_policy_callable
from ray.serve.autoscaling_policy import _apply_autoscaling_config
from ray.serve.config import AutoscalingConfig, AutoscalingContext

from deployments.autoscaling import QUEUE_DEPTH_METRIC, QueueDepthPolicy, queue_depth_policy

POLICY = {
    "policy_function": "deployments.autoscaling:QueueDepthPolicy",
    "policy_kwargs": {"target_queue_depth_per_replica": 64},
}


def context(
    depths: list[float] | None,
    *,
    current: int | None = None,
    target: int | None = None,
    handle_queued: float = 0.0,
    min_replicas: int = 1,
    max_replicas: int = 4,
    policy_state: dict | None = None,
    **config: float,
) -> AutoscalingContext:
    replicas = [f"replica-{i}" for i in range(len(depths or []))]
    current = len(replicas) if current is None else current
    metrics = None if depths is None else {QUEUE_DEPTH_METRIC: dict(zip(replicas, depths))}
    return AutoscalingContext(
        deployment_id="embed-test",
        deployment_name="embed-test",
        app_name="test",
        current_num_replicas=current,
        target_num_replicas=current if target is None else target,
        running_replicas=replicas,
        total_num_requests=sum(depths or []) + handle_queued,
        total_queued_requests=handle_queued,
        aggregated_metrics=metrics,
        raw_metrics=None,
        capacity_adjusted_min_replicas=min_replicas,
        capacity_adjusted_max_replicas=max_replicas,
        policy_state=policy_state or {},
        last_scale_up_time=None,
        last_scale_down_time=None,
        current_time=1000.0,
        config=AutoscalingConfig(min_replicas=min_replicas, max_replicas=max_replicas, policy=POLICY, **config),
    )


def test_desired_replicas_is_total_depth_over_target_rounded_up() -> None:
    policy = QueueDepthPolicy(target_queue_depth_per_replica=64)
    assert policy(context([100.0, 90.0]))[0] == 3  # 190 / 64 = 2.97
    assert policy(context([64.0, 64.0]))[0] == 2
    assert policy(context([65.0, 64.0]))[0] == 3


def test_an_idle_deployment_shrinks_to_min_replicas() -> None:
    policy = QueueDepthPolicy(target_queue_depth_per_replica=64)
    assert policy(context([0.0, 0.0, 0.0], min_replicas=1))[0] == 1
    assert policy(context([0.0, 0.0], min_replicas=0))[0] == 0


def test_decision_stays_within_max_replicas() -> None:
    policy = QueueDepthPolicy(target_queue_depth_per_replica=10)
    replicas, state = policy(context([5000.0], max_replicas=2))
    assert replicas == 2
    assert state["total_queue_depth"] == 5000.0


def test_requests_waiting_at_handles_count_toward_the_depth() -> None:
    assert QueueDepthPolicy(target_queue_depth_per_replica=64)(context([10.0], handle_queued=100.0))[0] == 2
    ignoring = QueueDepthPolicy(target_queue_depth_per_replica=64, include_handle_queue=False)
    assert ignoring(context([10.0], handle_queued=100.0))[0] == 1


def test_without_reports_the_current_target_is_kept() -> None:
    policy = QueueDepthPolicy()
    assert policy(context(None, current=2, target=3))[0] == 3
    assert policy(context([], current=1, target=2))[0] == 2


def test_default_function_form_uses_the_default_target() -> None:
    assert queue_depth_policy(context([64.0 * 2 + 1])) == QueueDepthPolicy()(context([64.0 * 2 + 1]))
    assert queue_depth_policy(context([129.0]))[0] == 3


def test_a_non_positive_target_is_refused() -> None:
    with pytest.raises(ValueError):
        QueueDepthPolicy(target_queue_depth_per_replica=0)


def test_serve_resolves_the_configured_class_with_its_kwargs() -> None:
    policy = _resolve_policy_callable(AutoscalingConfig(policy=POLICY).policy)
    assert isinstance(policy, QueueDepthPolicy)
    assert policy.target == 64


def test_serve_delays_an_upscale_until_upscale_delay_passed(monkeypatch: pytest.MonkeyPatch) -> None:
    """Ray's own smoothing wraps the policy: an upscale waits out upscale_delay_s, measured on the wall clock (here
    a made-up one: Ray's module reads time.time())."""
    now = [1_000.0]
    monkeypatch.setattr(autoscaling_policy, "time", SimpleNamespace(time=lambda: now[0]))
    wrapped = _apply_autoscaling_config(QueueDepthPolicy(target_queue_depth_per_replica=64))
    replicas, state = wrapped(context([300.0], upscale_delay_s=30.0))
    assert replicas == 1  # wants 4, not yet
    now[0] += 29.0
    replicas, state = wrapped(context([300.0], upscale_delay_s=30.0, policy_state=state))
    assert replicas == 1  # still wants 4, still not yet
    now[0] += 1.0
    replicas, _ = wrapped(context([300.0], upscale_delay_s=30.0, policy_state=state))
    assert replicas == 4  # the delay has passed, counted from the first call that wanted more


def test_serve_upscaling_factor_damps_the_step() -> None:
    wrapped = _apply_autoscaling_config(QueueDepthPolicy(target_queue_depth_per_replica=64))
    replicas, _ = wrapped(context([300.0], upscale_delay_s=0.0, upscaling_factor=0.5))
    assert replicas == 3  # ceil(1 + 0.5 * (4 - 1)): 4 = ceil(300 / 64) = 5, bounded by max_replicas

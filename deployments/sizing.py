"""Every Ray sizing decision in one place: what each deployment may hold at once and queue, the CPUs it reserves, how
many replicas it may surge to, how long it may drain, how often it is checked, and what it logs."""

from __future__ import annotations

import logging
from typing import Any

from deployments.config import AppConfig, IngressConfig, ModelConfig

logger = logging.getLogger("ray.serve")

# Serve notices a dead replica at its next health check (default every 10 s) and only then starts a replacement;
# meanwhile the survivors carry the load. A model's health check is a no-op call, so check often.
MODEL_HEALTH_CHECK_PERIOD_S = 2.0
# A replica being removed (scale-down, redeploy) gets no new requests and answers every one it holds before it stops;
# Serve kills it after graceful_shutdown_timeout_s, so that is sized from the queue: twice the time a full one
# (max_queue_depth items) takes at DRAIN_FLOOR_ITEMS_PER_S, less than either backend sustains on two cores. Serve's
# default, 20 s, cut drains short and is the least.
DRAIN_FLOOR_ITEMS_PER_S = 150.0
MIN_GRACEFUL_SHUTDOWN_S = 20.0
# Serve logs a line per request on every replica by default. Written by the event loop that serves the requests, it
# takes that loop's time from the requests, most under a flood, when it can least spare it. The same facts are
# Serve's request metrics (count, status, latency per route). To see them again, give the deployment
# `logging_config: {enable_access_log: true}` in the application's `deployments:` list in serve_config.yaml (an
# application-wide logging_config does not override this one).
QUIET_LOGS = {"enable_access_log": False}


def model_deployment_options(model: ModelConfig) -> dict[str, Any]:
    if model.max_ongoing_requests is not None and model.max_ongoing_requests < min_ongoing_requests(model):
        logger.warning(
            "model %r: max_ongoing_requests=%d is below max_batch_size * max_concurrent_batches = %d, so its "
            "batches could never fill with single-input requests; using %d",
            model.name, model.max_ongoing_requests, min_ongoing_requests(model), max_ongoing_requests(model),
        )
    options: dict[str, Any] = {
        "name": model.deployment_name,
        "max_ongoing_requests": max_ongoing_requests(model),
        "max_queued_requests": max_queued_requests(model),
        "health_check_period_s": MODEL_HEALTH_CHECK_PERIOD_S,
        "graceful_shutdown_timeout_s": graceful_shutdown_s(model),
        "max_surge_percent": max_surge_percent(model),
        "ray_actor_options": model_actor_options(model),
        "logging_config": QUIET_LOGS,
    }
    if model.autoscaling is not None:
        options["autoscaling_config"] = dict(model.autoscaling)
    else:
        options["num_replicas"] = model.num_replicas or 1
    return options


def ingress_deployment_options(config: AppConfig) -> dict[str, Any]:
    # Every model's replicas may be full at once; the ingress must not be the narrower gate.
    model_capacity = sum(max_ongoing_requests(model) * max_replicas(model) for model in config.models)
    return {
        "name": "EmbeddingsIngress",
        "max_ongoing_requests": max(config.ingress.max_ongoing_requests, model_capacity),
        "num_replicas": config.ingress.num_replicas,
        **({"max_replicas_per_node": config.ingress.max_replicas_per_node}
           if config.ingress.max_replicas_per_node is not None else {}),
        # It reserves no CPU: the new ingress starts before the old one stops. Not where a node holds only so many:
        # the old one must leave room first, and the other nodes' ingresses serve meanwhile.
        "max_surge_percent": 100 if config.ingress.max_replicas_per_node is None else 0,
        "ray_actor_options": ingress_actor_options(config.ingress),
        "logging_config": QUIET_LOGS,
    }


def min_ongoing_requests(model: ModelConfig) -> int:
    """Fewer concurrent requests per replica than this and single-text requests could never fill the batches."""
    return model.batcher.max_batch_size * model.batcher.max_concurrent_batches


def max_ongoing_requests(model: ModelConfig) -> int:
    """The user's value, raised to ``min_ongoing_requests`` if lower. By default enough for a full queue of
    single-input requests plus the batches in flight (``max_queue_depth + min_ongoing_requests``), and at least
    twice the floor: every request reaches the batcher, whose admission refuses LOW first and answers 429 when the
    queue is full, instead of waiting unseen (and unbounded) in the callers' handle queues."""
    floor = min_ongoing_requests(model)
    if model.max_ongoing_requests is None:
        return max(2 * floor, model.batcher.max_queue_depth + floor)
    return max(floor, model.max_ongoing_requests)


def max_queued_requests(model: ModelConfig) -> int:
    """Requests a caller (the ingress) may hold for this deployment while no replica can take them (e.g. while a
    lost replica is replaced); beyond it they are refused (429) rather than queued without bound. By default one
    replica's worth."""
    if model.max_queued_requests is not None:
        return model.max_queued_requests
    return max_ongoing_requests(model)


def max_surge_percent(model: ModelConfig) -> int:
    """Extra replicas Serve may start during a redeploy, so the old ones serve until the new ones are ready (Serve's
    default, 0, stops the old replicas first: nothing serves while the new ones start). By default 100% for a
    replica that reserves no CPU; 0 for one that does, whose extra replica might find no free core."""
    if model.max_surge_percent is not None:
        return model.max_surge_percent
    return 100 if not model_actor_options(model).get("num_cpus") else 0


def model_actor_options(model: ModelConfig) -> dict[str, Any]:
    # A local model computes on one core; an API client mostly waits, so it reserves none. A model on cuda still
    # tokenizes and feeds its GPU from one core, and reserves the GPU (by default a whole one): Ray then places the
    # replica on a node with one free and sets its CUDA_VISIBLE_DEVICES to it.
    options: dict[str, Any] = {"num_cpus": 1 if model.backend == "local" else 0}
    if model.device == "cuda":
        options["num_gpus"] = model.num_gpus or 1
    options.update(model.ray_actor_options or {})
    return options


def ingress_actor_options(ingress: IngressConfig) -> dict[str, Any]:
    options: dict[str, Any] = {"num_cpus": 0}  # it parses JSON and awaits handles
    options.update(ingress.ray_actor_options or {})
    if ingress.env_vars:
        runtime_env = dict(options.get("runtime_env") or {})
        runtime_env["env_vars"] = {**(runtime_env.get("env_vars") or {}), **ingress.env_vars}
        options["runtime_env"] = runtime_env
    return options


def graceful_shutdown_s(model: ModelConfig) -> float:
    """How long a replica being removed may take to answer what it holds (10,000 queued items: 133 s)."""
    return max(MIN_GRACEFUL_SHUTDOWN_S, 2 * model.batcher.max_queue_depth / DRAIN_FLOOR_ITEMS_PER_S)


def max_replicas(model: ModelConfig) -> int:
    """The most replicas the model's deployment may run (its autoscaling bound, or its fixed count)."""
    if model.autoscaling is not None:
        return int(model.autoscaling.get("max_replicas", 1))
    return model.num_replicas or 1

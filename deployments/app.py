"""The application builder ``serve_config.yaml`` names: ``import_path: deployments.app:build_app``.

One ``EmbeddingModel`` deployment per model entry, named ``embed-<model>``, and one ``EmbeddingsIngress`` holding
their handles. Each model deployment may take at least ``max_batch_size * max_concurrent_batches`` requests at
once, so single-text requests can fill its batches.
"""

from __future__ import annotations

import logging
from typing import Any, Mapping

from ray.serve import Application

from .config import AppConfig, ModelConfig, parse_app_config
from .embedder import EmbeddingModel
from .ingress import EmbeddingsIngress

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
# cost the ingress ~14% of its loop under a flood. The same facts are Serve's request metrics (count, status, latency
# per route). To see them again, give the deployment `logging_config: {enable_access_log: true}` in the application's
# `deployments:` list in serve_config.yaml (an application-wide logging_config does not override this one).
QUIET_LOGS = {"enable_access_log": False}


def build_app(args: Mapping[str, Any]) -> Application:
    config = parse_app_config(args)
    models = {model.name: bind_model(model) for model in config.models}
    return bind_ingress(config, models)


def model_deployment_options(model: ModelConfig) -> dict[str, Any]:
    if model.max_ongoing_requests is not None and model.max_ongoing_requests < model.min_ongoing_requests:
        logger.warning(
            "model %r: max_ongoing_requests=%d is below max_batch_size * max_concurrent_batches = %d, so its "
            "batches could never fill with single-input requests; using %d",
            model.name, model.max_ongoing_requests, model.min_ongoing_requests, model.effective_max_ongoing_requests,
        )
    options: dict[str, Any] = {
        "name": model.deployment_name,
        "max_ongoing_requests": model.effective_max_ongoing_requests,
        "max_queued_requests": model.effective_max_queued_requests,
        "health_check_period_s": MODEL_HEALTH_CHECK_PERIOD_S,
        "graceful_shutdown_timeout_s": graceful_shutdown_s(model),
        "max_surge_percent": model.effective_max_surge_percent,
        "ray_actor_options": model.effective_ray_actor_options,
        "logging_config": QUIET_LOGS,
    }
    if model.autoscaling is not None:
        options["autoscaling_config"] = dict(model.autoscaling)
    else:
        options["num_replicas"] = model.num_replicas or 1
    return options


def graceful_shutdown_s(model: ModelConfig) -> float:
    """How long a replica being removed may take to answer what it holds (10,000 queued items: 133 s)."""
    return max(MIN_GRACEFUL_SHUTDOWN_S, 2 * model.batcher.max_queue_depth / DRAIN_FLOOR_ITEMS_PER_S)


def bind_model(model: ModelConfig) -> Application:
    return EmbeddingModel.options(**model_deployment_options(model)).bind(model)


def ingress_deployment_options(config: AppConfig) -> dict[str, Any]:
    # Every model's replicas may be full at once; the ingress must not be the narrower gate.
    model_capacity = sum(
        model.effective_max_ongoing_requests * _max_replicas(model) for model in config.models
    )
    return {
        "name": "EmbeddingsIngress",
        "max_ongoing_requests": max(config.ingress.max_ongoing_requests, model_capacity),
        "num_replicas": config.ingress.num_replicas,
        "max_surge_percent": 100,  # it reserves no CPU: the new ingress starts before the old one stops
        "ray_actor_options": config.ingress.effective_ray_actor_options,
        "logging_config": QUIET_LOGS,
    }


def bind_ingress(config: AppConfig, models: Mapping[str, Application]) -> Application:
    return EmbeddingsIngress.options(**ingress_deployment_options(config)).bind(
        dict(models), max_body_bytes=config.ingress.max_body_bytes
    )


def _max_replicas(model: ModelConfig) -> int:
    if model.autoscaling is not None:
        return int(model.autoscaling.get("max_replicas", 1))
    return model.num_replicas or 1

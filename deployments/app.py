"""The application builder ``serve_config.yaml`` names: ``import_path: deployments.app:build_app``.

One ``EmbeddingModel`` deployment per model entry, named ``embed-<model>``, and one ``EmbeddingsIngress`` holding
their handles, each with the options ``deployments.sizing`` decides.
"""

# No `from __future__ import annotations` here: Serve's typed application builder reads build_app's annotation as a
# class, to validate the args into an AppConfig before calling it.
from typing import Mapping

from ray import serve
from ray.serve import Application

from .config import AppConfig, ModelConfig, parse_app_config
from .embedder import EmbeddingModel
from .ingress import EmbeddingsIngress
from .sizing import ingress_deployment_options, model_deployment_options


def build_app(args: AppConfig) -> Application:
    """Serve passes an ``AppConfig`` (its typed builder); a Python caller may pass the args mapping itself, checked
    the same way (an ``AppConfig`` passes through unchanged)."""
    config = parse_app_config(args)
    models = {model.name: bind_model(model) for model in config.models}
    return bind_ingress(config, models)


def bind_model(model: ModelConfig) -> Application:
    return serve.deployment(EmbeddingModel).options(**model_deployment_options(model)).bind(model)


def bind_ingress(config: AppConfig, models: Mapping[str, Application]) -> Application:
    return EmbeddingsIngress.options(**ingress_deployment_options(config)).bind(
        dict(models), max_body_bytes=config.ingress.max_body_bytes
    )

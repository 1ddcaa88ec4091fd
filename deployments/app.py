"""The application builder ``serve_config.yaml`` names: ``import_path: deployments.app:build_app``.

One ``EmbeddingModel`` deployment per model entry, named ``embed-<model>``, and one ``EmbeddingsIngress`` holding
their handles, each with the options ``deployments.sizing`` decides.

Serve runs ``build_app`` before it deploys anything, in a task whose output ``serve run`` shows: everything that can
be checked without starting a replica is checked here, each model's directory included, and a config refused stops
``serve run`` with the message (``deployments.startup``), instead of leaving it up with a model that never starts.
"""

from typing import Any, Mapping

from ray import serve
from ray.serve import Application

from deployments.config import AppConfig, ConfigError, ModelConfig, parse_app_config
from deployments.ingress.api import EmbeddingsIngress
from deployments.model.embedder import EmbeddingModel
from deployments.sizing import ingress_deployment_options, model_deployment_options
from deployments.startup import refuse, warn_about_serve_env


def build_app(args: Mapping[str, Any] | AppConfig) -> Application:
    """The application for ``args`` (an ``AppConfig`` passes through unchanged). The args come as a mapping, not
    validated by Serve into an ``AppConfig`` (its typed builder), so that a refusal is this function's to report."""
    warn_about_serve_env()
    try:
        config = parse_app_config(args)
        check_model_sources(config)
    except ConfigError as error:
        refuse(error)
        raise
    models = {model.name: bind_model(model) for model in config.models}
    return bind_ingress(config, models)


def check_model_sources(config: AppConfig) -> None:
    """``ConfigError`` naming each local model whose directory the local backend would refuse (read from its JSON
    files, on this node: every node holds the models at the same paths)."""
    problems = []
    for index, model in enumerate(config.models):
        if model.backend != "local":
            continue
        from deployments.model.backends.local import read_model

        try:
            read_model(model.model_path, model.default_prompt_name, model.matryoshka_dims or ())
        except Exception as exc:
            cause = str(exc) if isinstance(exc, ValueError) else f"{type(exc).__name__}: {exc}"
            problems.append(f"models[{index}] ({model.name}): {cause}")
    if problems:
        raise ConfigError("invalid application config:\n  - " + "\n  - ".join(problems))


def bind_model(model: ModelConfig) -> Application:
    return serve.deployment(EmbeddingModel).options(**model_deployment_options(model)).bind(model)


def bind_ingress(config: AppConfig, models: Mapping[str, Application]) -> Application:
    return EmbeddingsIngress.options(**ingress_deployment_options(config)).bind(
        dict(models), max_body_bytes=config.ingress.max_body_bytes, batch=config.batch,
        relayed={model.name: model.provider_batches for model in config.models if model.provider_batches is not None},
    )

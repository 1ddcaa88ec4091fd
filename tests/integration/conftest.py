"""One Ray instance and one Serve HTTP proxy for the whole session; the default application started once.

Starting an application costs tens of seconds on two cores, so the application from ``serve_config.yaml`` is
built with its own builder once and shared by every test; tests that need another application deploy it beside.
"""

from __future__ import annotations

import os
from typing import Iterator

import pytest

from .helpers import APP_NAME, MODEL, Service, default_app_args, free_port


@pytest.fixture(scope="session")
def serve_instance() -> Iterator[Service]:
    # The replicas inherit this environment through the raylet: never reach for a model hub.
    os.environ["HF_HUB_OFFLINE"] = "1"
    os.environ["TRANSFORMERS_OFFLINE"] = "1"
    import ray
    from ray import serve

    ray.init(num_cpus=2, include_dashboard=False, logging_level="ERROR", log_to_driver=False)
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    try:
        yield Service(f"http://127.0.0.1:{port}")
    finally:
        serve.shutdown()
        ray.shutdown()


@pytest.fixture(scope="session")
def embeddings_app(serve_instance: Service) -> Service:
    from ray import serve

    from deployments.app import build_app

    serve.run(build_app(default_app_args()), name=APP_NAME, route_prefix="/")
    return serve_instance


@pytest.fixture(scope="session")
def model_handle(embeddings_app: Service):
    from ray import serve

    return serve.get_deployment_handle(f"embed-{MODEL}", app_name=APP_NAME)

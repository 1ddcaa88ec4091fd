"""What every suite shares: one Ray instance and one Serve HTTP proxy for the whole pytest session, and the
application from ``serve_config.yaml`` on it.

Starting Ray is slow, and an application on it slower still (its replicas load their models), so
``tests/integration`` and ``tests/reliability`` use one default application, built with its own builder once, and
deploy their other applications beside it. Both are started only when a test asks for them (the unit tests never do).
"""

from __future__ import annotations

from typing import Iterator

import pytest

from load.bench.serving import use_serve_env

use_serve_env(blocking_handles=True)  # the service as `serve run` starts it (serve.env: HAProxy, gRPC), first

from tests.integration.helpers import (APP_NAME, MODEL, Service, default_app_args, start_ray_and_serve,  # noqa: E402
                                       stop_ray_and_serve)


@pytest.fixture(scope="session")
def serve_instance() -> Iterator[Service]:
    service = start_ray_and_serve()
    try:
        yield service
    finally:
        stop_ray_and_serve()


@pytest.fixture(scope="session")
def embeddings_app(serve_instance: Service, tmp_path_factory: pytest.TempPathFactory) -> Service:
    from ray import serve

    from deployments.app import build_app

    args = {**default_app_args(), "batch": {"directory": str(tmp_path_factory.mktemp("batch"))}}
    serve.run(build_app(args), name=APP_NAME, route_prefix="/")
    return serve_instance


@pytest.fixture(scope="session")
def model_handle(embeddings_app: Service):
    from ray import serve

    return serve.get_deployment_handle(f"embed-{MODEL}", app_name=APP_NAME)

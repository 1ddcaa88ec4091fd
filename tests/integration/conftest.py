"""The default application started once, on the session's Ray instance (``serve_instance``, in tests/conftest.py).

Starting an application costs tens of seconds on two cores, so the application from ``serve_config.yaml`` is
built with its own builder once and shared by every test; tests that need another application deploy it beside.
"""

from __future__ import annotations

import pytest

from .helpers import APP_NAME, MODEL, Service, default_app_args


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

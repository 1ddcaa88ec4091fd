"""Fixtures of the reliability suite. The Ray instance is the session's (``serve_instance``, tests/conftest.py);
each application is deployed beside the others and deleted when its tests are done."""

from __future__ import annotations

from typing import Iterator

import pytest

from tests.integration.helpers import Service

from .scale import Scale, current_scale
from .scenarios import Target
from .setups import faults_target


@pytest.fixture(scope="package")
def scale() -> Scale:
    return current_scale()


@pytest.fixture(scope="package")
def faults(serve_instance: Service, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Target]:
    """Shared by the upstream-fault, bad-input and security tests: one application start instead of three."""
    with faults_target(serve_instance.url, tmp_path_factory.mktemp("secrets")) as target:
        yield target

"""What every suite shares: one Ray instance and one Serve HTTP proxy for the whole pytest session.

Starting Ray costs ~10 s on two cores, so ``tests/integration`` and ``tests/reliability`` deploy their applications
beside each other on this one instance. It is started only when a test asks for it (the unit tests never do).
"""

from __future__ import annotations

from typing import Iterator

import pytest

from tests.integration.helpers import Service, start_ray_and_serve, stop_ray_and_serve


@pytest.fixture(scope="session")
def serve_instance() -> Iterator[Service]:
    service = start_ray_and_serve()
    try:
        yield service
    finally:
        stop_ray_and_serve()

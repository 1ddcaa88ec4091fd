"""Which models cannot serve now, and why, for ``GET /healthz``: from Serve's own view of their deployments.

A model whose replicas cannot start (its directory refused, its GPU missing, its constructor failing) is retried by
Serve for ever, and its requests answer 503 "retry later"; the reason is in Serve's status (``serve status``), which
the ingress asks (a controller call, in a thread: it blocks) at most once every ``ttl_s``.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Callable, Mapping

logger = logging.getLogger("ray.serve")

MAX_REASON_CHARS = 500


def unavailable_models(status: Any, app_name: str, deployments: Mapping[str, str]) -> dict[str, str]:
    """``{model: reason}`` for each model (by its deployment's name in ``deployments``) with no running replica in
    ``status`` (``serve.status()``). A model Serve does not know of is left out: nothing is known of it."""
    application = status.applications.get(app_name)
    if application is None:
        return {}
    down = {}
    for model, deployment_name in deployments.items():
        deployment = application.deployments.get(deployment_name)
        if deployment is not None and deployment.replica_states.get("RUNNING", 0) == 0:
            down[model] = reason(deployment.message, str(getattr(deployment.status, "value", deployment.status)))
    return down


def reason(message: str, status: str) -> str:
    """Serve's message for a deployment, made short: its first sentence and the error its traceback ends with."""
    lines = [line.strip() for line in (message or "").splitlines() if line.strip()]
    if not lines:
        return f"no replica running ({status})"
    text = lines[0] if len(lines) == 1 else f"{lines[0].split('. ')[0].rstrip('.')}: {lines[-1]}"
    return text if len(text) <= MAX_REASON_CHARS else text[:MAX_REASON_CHARS - 3] + "..."


class ModelHealth:
    """``await health()``: ``unavailable_models`` of ``app_name``, from ``status()`` (``serve.status``) asked at most
    once every ``ttl_s`` (one call at a time) and given up after ``timeout_s``; while Serve cannot be asked, every
    model counts as available (the controller's absence does not stop the replicas serving)."""

    def __init__(self, app_name: str, deployments: Mapping[str, str], status: Callable[[], Any] | None = None,
                 ttl_s: float = 2.0, timeout_s: float = 2.0) -> None:
        self._app_name = app_name
        self._deployments = dict(deployments)
        self._status = status if status is not None else _serve_status
        self._ttl_s = ttl_s
        self._timeout_s = timeout_s
        self._answer: dict[str, str] = {}
        self._asked_at = float("-inf")
        self._lock = asyncio.Lock()

    async def __call__(self) -> dict[str, str]:
        loop = asyncio.get_running_loop()  # the loop's clock (monotonic), which a test can control
        async with self._lock:
            if loop.time() - self._asked_at >= self._ttl_s:
                self._answer = await self._ask()
                self._asked_at = loop.time()
            return dict(self._answer)

    async def _ask(self) -> dict[str, str]:
        try:
            status = await asyncio.wait_for(asyncio.to_thread(self._status), self._timeout_s)
            return unavailable_models(status, self._app_name, self._deployments)
        except Exception:
            logger.debug("Serve's status could not be read for /healthz", exc_info=True)
            return {}


def _serve_status() -> Any:
    from ray import serve

    return serve.status()

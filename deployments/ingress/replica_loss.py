"""Whether a handle call failed because the replica serving it was lost, rather than for anything its inputs did."""

from __future__ import annotations

import asyncio

from ray.exceptions import ActorDiedError, ActorUnavailableError, NodeDiedError, RayActorError, TaskCancelledError
from ray.serve.exceptions import ReplicaUnavailableError

from deployments.errors import unwrap

# Causes, as the metric of requests sent again names them.
_CAUSES: tuple[tuple[type[BaseException] | tuple[type[BaseException], ...], str], ...] = (
    (ActorDiedError, "replica_died"),
    (NodeDiedError, "node_died"),
    ((ActorUnavailableError, ReplicaUnavailableError), "replica_unavailable"),
    (RayActorError, "replica_died"),
    # A call cancelled from the replica's side (it was stopped by a redeploy or a scale-down past its drain);
    # a call the ingress cancelled itself never gets here.
    ((TaskCancelledError, asyncio.CancelledError), "replica_stopped"),
)
# Between replicas, Serve's gRPC transport reports a peer that went away with these status codes.
_GRPC_LOST = frozenset({"UNAVAILABLE", "CANCELLED"})


def loss_cause(exc: BaseException) -> str | None:
    """The cause, when the replica's loss is why the call failed; None for any other failure."""
    cause = unwrap(exc)
    for types, name in _CAUSES:
        if isinstance(cause, types):
            return name
    code = getattr(cause, "code", None)
    if callable(code) and type(cause).__name__ == "AioRpcError":
        status = getattr(code(), "name", "")
        if status in _GRPC_LOST:
            return "replica_unavailable"
    return None

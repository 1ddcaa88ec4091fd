"""The ingress side: what runs in the ``EmbeddingsIngress`` replicas (HTTP, schemas, auth, errors, forwarding).

It never imports ``deployments.model`` (``[tool.importlinter]`` in ``pyproject.toml``): what crosses to the model
replicas is in ``deployments.wire``."""

"""The Ray Serve application: an OpenAI-compatible embeddings API batching through ``batching.AdaptiveBatcher``.

``deployments.app:build_app`` is the application builder ``serve_config.yaml`` names. ``deployments.ingress`` runs in
the ingress replicas, ``deployments.model`` in each model's replicas, and neither imports the other; what crosses
between them is in ``deployments.wire``. Submodules are imported where they are used, so importing
``deployments.autoscaling`` (which Serve's controller does) stays cheap.
"""

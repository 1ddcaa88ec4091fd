"""The Ray Serve application: an OpenAI-compatible embeddings API batching through ``batching.AdaptiveBatcher``.

``deployments.app:build_app`` is the application builder ``serve_config.yaml`` names. Submodules are imported
where they are used, so importing ``deployments.autoscaling`` (which Serve's controller does) stays cheap.
"""

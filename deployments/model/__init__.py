"""The model side: what runs in each model's ``EmbeddingModel`` replicas (the embedder, its batchers, backends,
cache, quota pacer, tokens and metrics).

It never imports ``deployments.ingress``; what crosses from the ingress is in ``deployments.wire``."""

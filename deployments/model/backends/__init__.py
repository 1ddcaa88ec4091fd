"""Model access: a backend turns inputs into vectors and knows nothing of batching."""

from __future__ import annotations

from typing import TYPE_CHECKING

from deployments.model.backends.base import EmbeddingBackend, Item, ItemRejected, Prepared, UpstreamError

if TYPE_CHECKING:
    import httpx

    from deployments.config import ModelConfig

__all__ = ["EmbeddingBackend", "Item", "ItemRejected", "Prepared", "UpstreamError", "make_backend"]


def make_backend(model: "ModelConfig", *, http_client: "httpx.AsyncClient | None" = None) -> EmbeddingBackend:
    """The backend a model entry names; heavy imports (torch, onnxruntime, openai) happen only for the one used.
    ``http_client``: what the ``openai`` backend sends its requests through (by default the ``openai`` client's own)."""
    if model.backend == "local":
        from deployments.model.backends.local import LocalBackend

        return LocalBackend(model.model_path, engine=model.engine, device=model.device, precision=model.precision,
                            threads=model.threads, onnx_cache_dir=model.onnx_cache_dir,
                            onnx_optimize=model.onnx_optimize,
                            default_prompt_name=model.default_prompt_name, matryoshka_dims=model.matryoshka_dims or ())
    if model.backend == "openai":
        from deployments.model.backends.openai_api import OpenAIBackend

        return OpenAIBackend(
            base_url=model.base_url,
            upstream_model=model.upstream_model or model.name,
            api_key_env=model.api_key_env,
            timeout_s=model.upstream_timeout_s,
            http_client=http_client,
        )
    raise ValueError(f"unknown backend {model.backend!r}")

"""The local model in PyTorch: the transformer on padded ids, mean-pooled over the attention mask, L2-normalised.

``MeanPooled`` is also what the onnx engine exports, so both engines compute one graph.
"""

from __future__ import annotations

import inspect

import numpy as np
import torch
import torch.nn.functional as F

from .model_dir import ModelDir


class MeanPooled(torch.nn.Module):
    """``(input_ids, attention_mask) -> normalize(masked mean of the last hidden state)``, as sentence-transformers'
    Transformer -> Pooling(mean) -> Normalize computes it."""

    def __init__(self, transformer: torch.nn.Module) -> None:
        super().__init__()
        self.transformer = transformer
        self._token_types = "token_type_ids" in inspect.signature(transformer.forward).parameters

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        extra = {"token_type_ids": torch.zeros_like(input_ids)} if self._token_types else {}
        hidden = self.transformer(input_ids=input_ids, attention_mask=attention_mask, **extra).last_hidden_state
        mask = attention_mask.unsqueeze(-1).to(hidden.dtype)
        pooled = (hidden * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1e-9)
        return F.normalize(pooled, p=2, dim=1)


def load_mean_pooled(model: ModelDir, attn_implementation: str | None = None) -> MeanPooled:
    """The model's transformer, from its files only, on the CPU, in eval mode."""
    from transformers import AutoModel

    options = {"attn_implementation": attn_implementation} if attn_implementation else {}
    transformer = AutoModel.from_pretrained(str(model.transformer_path), local_files_only=True, **options)
    return MeanPooled(transformer).eval()


class TorchEngine:
    def __init__(self, model: ModelDir, *, threads: int) -> None:
        self._threads = threads
        torch.set_num_threads(threads)
        self._module = load_mean_pooled(model)

    def run(self, input_ids: np.ndarray, attention_mask: np.ndarray) -> np.ndarray:
        if torch.get_num_threads() != self._threads:  # the calling thread may not have seen the setting
            torch.set_num_threads(self._threads)
        with torch.inference_mode():
            return self._module(torch.from_numpy(input_ids), torch.from_numpy(attention_mask)).numpy()

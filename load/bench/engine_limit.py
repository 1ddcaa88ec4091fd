"""The packaged model's engine alone on every core: the most texts a second that any server of it could reach on
this machine, measured beside the servers (``python -m load.bench peers`` runs it in each repeat).

The benchmark's own texts, tokenized ahead (tokenizing is a server's work, not the engine's), in the service's engine
calls (like-length texts, cut as ``engines.engine_calls`` cuts a batch), in a few arrangements of ONNX Runtime
sessions: one one-thread session a core, side by side, taking calls from one queue, cut from batches of 64 and of 8
texts; and one session on every core. The best of them is the limit.
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass
from typing import Any, Sequence

from load.workload import pseudo_sentences

BATCH_TEXTS = 64


@dataclass(frozen=True)
class Arrangement:
    sessions: int
    threads: int  # each session's intra-op threads
    batch: int  # texts a batch, cut into engine calls as the service cuts them

    @property
    def name(self) -> str:
        return f"{self.sessions}×{self.threads}-thread session(s), batches of {self.batch}"


def arrangements(cores: int) -> list[Arrangement]:
    return [Arrangement(cores, 1, BATCH_TEXTS), Arrangement(cores, 1, 8), Arrangement(1, cores, BATCH_TEXTS)]


def measure(texts: Sequence[str], cores: int | None = None, repeats: int = 1) -> dict[str, Any]:
    """Each arrangement's texts/s and CPU ms a text (this process's), and the best texts/s."""
    from deployments.model.backends.engines import call_shape, embed_call, engine_calls, make_engine
    from deployments.model.backends.model_dir import ModelDir, packaged_model_path
    from deployments.model.backends.wordpieces import BoundedTokenizer

    cores = cores or len(os.sched_getaffinity(0))
    model = ModelDir.read(packaged_model_path())
    tokenizer = BoundedTokenizer(model.tokenizer_file, model.max_seq_length, lowercase=model.do_lower_case)
    sequences = tokenizer.encode_many(list(texts))
    rows = {}
    for arrangement in arrangements(cores):
        engines = [make_engine("onnx", model, threads=arrangement.threads) for _ in range(arrangement.sessions)]
        batches = [sequences[i:i + arrangement.batch] for i in range(0, len(sequences), arrangement.batch)]
        calls = [(batch, call) for batch in batches for call in engine_calls(batch, call_shape("cpu"))]
        for engine in engines:  # a first call sizes an engine's buffers
            embed_call(engine, *calls[0], tokenizer.pad_id, model.left_padding)
        runs = []
        for _ in range(repeats):
            pending = iter(calls)
            lock = threading.Lock()

            def work(engine: Any) -> None:
                while True:
                    with lock:
                        taken = next(pending, None)
                    if taken is None:
                        return
                    embed_call(engine, *taken, tokenizer.pad_id, model.left_padding)

            workers = [threading.Thread(target=work, args=(engine,)) for engine in engines]
            cpu, start = time.process_time(), time.perf_counter()
            for worker in workers:
                worker.start()
            for worker in workers:
                worker.join()
            elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu
            runs.append({"texts_per_s": len(sequences) / elapsed, "cpu_ms_per_text": 1e3 * cpu / len(sequences)})
        best = max(runs, key=lambda run: run["texts_per_s"])
        rows[arrangement.name] = best
    return {"cores": cores, "texts": len(sequences), "arrangements": rows,
            "best_texts_per_s": max(row["texts_per_s"] for row in rows.values())}

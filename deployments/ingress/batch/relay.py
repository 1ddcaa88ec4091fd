"""A batch's lines for an ``openai`` entry that relays batches (``provider_batches`` set) are embedded by the
provider's own Batch API, at its batch price, and then answered from the entry's cache: nothing the caller sent as a
batch is sent in real time.

The runner calls ``round`` before it answers the lines. A round takes the distinct inputs of the lines not finished
yet, by model and output size, asks the model's replicas which of them the cache lacks, and cuts those into parts
(at most the entry's ``max_lines`` request lines of ``inputs_per_line`` inputs each, and ``max_file_bytes``); every
part's inputs and the round are in the store before any part is submitted. Each part is submitted under a tag naming
the batch, round and part, so a runner resuming the batch after a crash finds the provider batch made before rather
than paying for a second, and is polled until the provider is done; the replica then puts its vectors in the cache.
The runner answers the lines from the cache; a line whose inputs the provider did not embed waits for the next round,
in which each input goes on a request line of its own (one bad input fails alone), for at most the entry's ``tries``
rounds; after that it is an error line.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Callable, Collection, Hashable, Mapping

import orjson

from deployments.config import ProviderBatchConfig
from deployments.errors import ServiceError
from deployments.ingress import schemas
from deployments.ingress.batch import lines
from deployments.ingress.batch.store import LINES_PER_TURN, BatchStore, owner_of
from deployments.usage import DEFAULT_TENANT

logger = logging.getLogger("ray.serve")

LOOKUP_INPUTS = 4096  # inputs in one ask of which the cache lacks
LINE_BYTES = 200  # a request line's bytes besides its inputs (custom_id, method, url, model, format)
FAILED_CALLS = 10  # a part whose submit or poll failed this many times in a row is given up (its lines: errors)


class RelayedModel:
    """A relaying entry's replicas (``EmbeddingModel.relay_*``), through its handle, and its settings."""

    def __init__(self, handle: Any, config: ProviderBatchConfig) -> None:
        self._handle = handle
        self.config = config

    async def uncached(self, inputs: list[Any], dimensions: int | None) -> list[int]:
        return await self._call("relay_uncached", inputs, dimensions)

    async def submit(self, tag: str, inputs: list[Any], dimensions: int | None, per_line: int) -> str:
        return await self._call("relay_submit", tag, inputs, dimensions, per_line)

    async def collect(self, batch_id: str, inputs: list[Any], dimensions: int | None, per_line: int,
                      tenant: str | None) -> tuple[str, bool, int]:
        return tuple(await self._call("relay_collect", batch_id, inputs, dimensions, per_line,  # type: ignore
                                      tenant))

    async def cancel(self, batch_id: str) -> None:
        await self._call("relay_cancel", batch_id)

    async def _call(self, method: str, *args: Any) -> Any:
        return await self._handle.options(method_name=method).remote(*args)


class BatchRelay:
    def __init__(self, store: BatchStore, models: Mapping[str, RelayedModel]) -> None:
        self._store = store
        self._models = models

    def relays(self, model: str | None) -> bool:
        return model in self._models

    async def round(self, batch: dict[str, Any], done: Collection[int], running: Callable[[], bool]) -> bool:
        """Relay what the lines not ``done`` lack; False if nothing was relayed (every line is then final: answered
        from the cache, or an error). Returns early once ``running()`` says the batch stopped."""
        batch_id = batch["id"]
        state = self._store.relay_state(batch_id) or {"round": 0, "parts": [], "open": False}
        if not state["open"]:
            state = await self._next_round(batch, done, state["round"] + 1)
            if state is None:
                return False
        await self._finish_parts(batch, state, running)
        return True

    async def _next_round(self, batch: dict[str, Any], done: Collection[int], number: int) -> dict[str, Any] | None:
        missing = await self._missing(batch, done, number)
        if not missing:
            return None
        parts = []
        for (model, dimensions), inputs in missing.items():
            config = self._models[model].config
            per_line = config.inputs_per_line if number == 1 else 1
            for chunk in _parts(inputs, config, per_line):
                name = f"{number}-{len(parts)}"
                self._store.save_relay_inputs(batch["id"], name, chunk)
                parts.append({"name": name, "model": model, "dimensions": dimensions, "per_line": per_line,
                              "inputs": len(chunk), "provider_batch_id": None, "status": None, "embedded": 0,
                              "failed_calls": 0})
        state = {"round": number, "parts": parts, "open": True}
        self._store.save_relay_state(batch["id"], state)
        logger.info("batch %s: round %d relays %d inputs to the provider in %d batch(es)", batch["id"], number,
                    sum(part["inputs"] for part in parts), len(parts))
        return state

    async def _missing(self, batch: dict[str, Any], done: Collection[int],
                       number: int) -> dict[tuple[str, int | None], list[Any]]:
        """The distinct inputs of the unfinished lines, by model and size, that the cache lacks (models with tries
        left only)."""
        wanted: dict[tuple[str, int | None], dict[Hashable, Any]] = {}
        seen: set[str] = set()
        with self._store.file_path(batch["input_file_id"]).open("rb") as input_lines:
            for index, raw in enumerate(raw for raw in input_lines if raw.strip()):
                if index % LINES_PER_TURN == 0:
                    await asyncio.sleep(0)
                try:
                    request = lines.parse(raw)
                    body = schemas.parse_request(request.body) if request.model in self._models else None
                except (lines.LineError, ServiceError):
                    continue
                first = request.custom_id not in seen
                seen.add(request.custom_id)
                if body is None or index in done or not first or self._models[body.model].config.tries < number:
                    continue
                group = wanted.setdefault((body.model, body.dimensions), {})
                for item in body.input:
                    group.setdefault(item if isinstance(item, str) else tuple(item), item)
        missing = {}
        for (model, dimensions), distinct in wanted.items():
            inputs = list(distinct.values())
            lacking = []
            for start in range(0, len(inputs), LOOKUP_INPUTS):
                chunk = inputs[start:start + LOOKUP_INPUTS]
                lacking += [chunk[i] for i in await self._models[model].uncached(chunk, dimensions)]
            if lacking:
                missing[model, dimensions] = lacking
        return missing

    async def _finish_parts(self, batch: dict[str, Any], state: dict[str, Any], running: Callable[[], bool]) -> None:
        """Submit and poll the round's parts until each is final, saving the state at every change."""
        batch_id = batch["id"]
        owner = owner_of(batch)
        tenant = None if owner == DEFAULT_TENANT else owner  # whose bill the provider's batches are on
        while True:
            open_parts = [part for part in state["parts"] if part["status"] is None]
            if not open_parts:
                state["open"] = False
                self._store.save_relay_state(batch_id, state)
                return
            if not running():
                await self._cancel(batch_id, open_parts)
                return
            for part in open_parts:
                await self._advance(batch_id, part, tenant)
                self._store.save_relay_state(batch_id, state)
            if any(part["status"] is None for part in open_parts):
                await asyncio.sleep(min(self._models[part["model"]].config.poll_s for part in open_parts))

    async def _advance(self, batch_id: str, part: dict[str, Any], tenant: str | None) -> None:
        model = self._models[part["model"]]
        inputs = self._store.relay_inputs(batch_id, part["name"])
        try:
            if part["provider_batch_id"] is None:
                part["provider_batch_id"] = await model.submit(f"{batch_id}-{part['name']}", inputs,
                                                               part["dimensions"], part["per_line"])
            status, final, embedded = await model.collect(part["provider_batch_id"], inputs, part["dimensions"],
                                                          part["per_line"], tenant)
        except Exception as exc:  # noqa: BLE001 - the provider or the replica is down for now: asked again
            part["failed_calls"] += 1
            logger.warning("batch %s: relayed part %s: %s (%d in a row)", batch_id, part["name"], exc,
                           part["failed_calls"])
            if part["failed_calls"] >= FAILED_CALLS:
                part["status"] = "failed"
            return
        part["failed_calls"] = 0
        if final:
            part.update(status=status, embedded=embedded)
            logger.info("batch %s: relayed part %s %s: %d of %d inputs embedded", batch_id, part["name"], status,
                        embedded, part["inputs"])

    async def _cancel(self, batch_id: str, parts: list[dict[str, Any]]) -> None:
        for part in parts:
            if part["provider_batch_id"] is not None:
                try:
                    await self._models[part["model"]].cancel(part["provider_batch_id"])
                except Exception as exc:  # noqa: BLE001 - the batch stops anyway; the provider's runs out its window
                    logger.warning("batch %s: cancelling relayed part %s: %s", batch_id, part["name"], exc)


def _parts(inputs: list[Any], config: ProviderBatchConfig, per_line: int) -> list[list[Any]]:
    """``inputs`` cut into provider batches within the entry's lines and bytes."""
    most_inputs = config.max_lines * per_line
    parts: list[list[Any]] = [[]]
    size = 0
    for item in inputs:
        item_bytes = len(orjson.dumps(item)) + 1 + LINE_BYTES // per_line + 1
        if parts[-1] and (len(parts[-1]) >= most_inputs or size + item_bytes > config.max_file_bytes):
            parts.append([])
            size = 0
        parts[-1].append(item)
        size += item_bytes
    return parts

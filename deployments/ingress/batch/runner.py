"""Runs the store's batches in an ingress replica: each line is a LOW ``/v1/embeddings`` request to its model, through
the same path as the HTTP route (the models' batchers, caches, quotas and split-on-failure), so interactive traffic
keeps its latency while a batch runs and a repeated or cached text is never paid twice.

A batch goes ``validating`` (its input file read and counted) -> ``in_progress`` (its lines sent, at most
``LINES_IN_FLIGHT`` at once; each finished line goes to the batch's journal) -> ``finalizing`` (the output and error
files written in the input's order) -> ``completed``; or ``failed`` (its input file unusable), ``expired`` (its
completion window passed first) or ``cancelling`` -> ``cancelled``, the last two with the lines finished so far.

A batch's lines run as its tenant (the one whose key created it), as that tenant's ``/v1/embeddings`` requests would:
its models, limits, fair share and usage; a tenant no longer in the keys file has its lines refused.

Lines for a model that relays batches to its provider (``provider_batches``) are embedded by the provider's Batch
API first and then answered from the model's cache alone (``relay.py``), in rounds until each is final.

Lines of one text each that differ in nothing else travel together, up to ``LINES_A_CALL`` a call to the model
(``EmbedLines``), each still admitted, answered and counted as its own request: a call, a response and a turn of both
event loops for each line would hold the loops that interactive requests also need. A group the model refuses as a
whole (one bad line, the model lost) is sent again line by line, so each line gets its own outcome.

Every replica runs a runner; a batch runs in whichever replica takes its lock first, and again, after its journal,
in whichever takes it after that one's process ended: a line finished before is never sent again. A line refused
for now (the model overloaded, the quota spent, its replica lost) is sent again after its Retry-After; a line the
model refuses for good (a bad input, an unknown model) is one line of the error file.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import IO, Any, Awaitable, Callable, Sequence

from deployments.config import BatchConfig
from deployments.errors import NotCached, RetryLater, ServiceError, ServiceUnavailable, UpstreamFailed
from deployments.ingress.batch import lines
from deployments.ingress.batch.relay import BatchRelay
from deployments.ingress.batch.store import LINES_PER_TURN, BatchStore, owner_of

logger = logging.getLogger("ray.serve")

# a /v1/embeddings request body, whether only the model's cache may answer it, and its tenant -> its response body,
# sent as LOW
Embed = Callable[[bytes, bool, str], Awaitable[bytes]]
# request bodies of one input each that differ in nothing else, whether the cache alone may answer, and their
# tenant -> each one's response body, from one call to their model (a ServiceError for all of them)
EmbedLines = Callable[[Sequence[bytes], bool, str], Awaitable[list[bytes]]]

LINES_IN_FLIGHT = 256
LINES_A_CALL = 64  # lines that travel together in one call to their model, at most
POLL_S = 1.0  # how often a runner looks for batches to run (and a running batch for a cancel)
RETRY_S = 1.0  # a line refused for now is sent again after this, or after its Retry-After if longer
UNAVAILABLE_TRIES = 10  # a line whose model is unavailable this many times in a row is an error line (503)
SWEEP_S = 600.0  # how often files and batches past their retention are removed
WINDOW_S = {"24h": 24 * 3600}
ACTIVE = ("validating", "in_progress", "finalizing", "cancelling")
FINAL = ("completed", "failed", "expired", "cancelled")
STATUSES = ACTIVE + FINAL


class BatchMetrics:
    """What a runner reports; these hooks do nothing (``deployments.ingress.metrics.RayBatchMetrics`` exports them)."""

    def line_finished(self, ok: bool) -> None:
        """A request line finished: in the output file (``ok``) or the error file."""

    def batches(self, by_status: dict[str, int]) -> None:
        """The store's batches, by status (every status named, 0 included)."""


class BatchRunner:
    def __init__(self, store: BatchStore, embed: Embed, config: BatchConfig,
                 metrics: BatchMetrics | None = None, relay: BatchRelay | None = None,
                 embed_lines: EmbedLines | None = None) -> None:
        """``relay``: the models whose lines the provider's Batch API embeds first (None: none); ``embed_lines``:
        how lines travel together (None: each alone)."""
        self._store = store
        self._embed = embed
        self._embed_lines = embed_lines
        self._relay = relay
        self._config = config
        self._metrics = metrics if metrics is not None else BatchMetrics()
        self._running: dict[str, asyncio.Task] = {}
        self._finished: dict[str, str] = {}  # the final status of each finished batch seen
        self._wake = asyncio.Event()
        self._wakes = 0  # how many times woken: a running batch looks at its status again when this moves
        self._swept = -SWEEP_S

    def wake(self) -> None:
        """A batch was created or cancelled (here): look now, not at the next poll."""
        self._wakes += 1
        self._wake.set()

    async def run_forever(self) -> None:
        while True:
            try:
                self._start_what_is_free()
                self._sweep()
            except Exception:  # noqa: BLE001 - the store's trouble must not end the runner: try again next poll
                logger.exception("batch runner: scanning the store failed")
            self._wake.clear()
            try:
                await asyncio.wait_for(self._wake.wait(), POLL_S)
            except TimeoutError:
                pass

    async def aclose(self) -> None:
        for task in self._running.values():
            task.cancel()
        await asyncio.gather(*self._running.values(), return_exceptions=True)

    def _start_what_is_free(self) -> None:
        statuses = self._statuses()
        self._metrics.batches({status: sum(s == status for s in statuses.values()) for status in STATUSES})
        for batch_id, status in statuses.items():
            if status not in ACTIVE or batch_id in self._running:
                continue
            held = self._store.lock(batch_id)
            if held is None:
                continue  # another replica runs it
            task = asyncio.ensure_future(self._run(batch_id, held))
            self._running[batch_id] = task
            task.add_done_callback(lambda _, batch_id=batch_id: self._running.pop(batch_id, None))

    def _statuses(self) -> dict[str, str]:
        """Every batch's status: a finished batch's is read once (it never changes), an active one's each poll, so
        a poll of a store of many finished batches reads no more than the active ones."""
        ids = self._store.batch_ids()
        statuses = {}
        for batch_id in ids:
            status = self._finished.get(batch_id)
            if status is None:
                batch = self._store.batch(batch_id)
                if batch is None:
                    continue  # removed since the listing
                status = batch["status"]
                if status in FINAL:
                    self._finished[batch_id] = status
            statuses[batch_id] = status
        for removed in self._finished.keys() - set(ids):
            del self._finished[removed]
        return statuses

    async def _run(self, batch_id: str, held: IO[bytes]) -> None:
        try:
            batch = self._store.batch(batch_id)
            if batch is None or batch["status"] in FINAL:
                return  # finished by the replica that held the lock before this one looked
            if batch["status"] == "validating":
                batch = await self._validate(batch_id)
            while batch["status"] in ("in_progress", "cancelling"):
                final = batch["status"] == "cancelling" or not await self._relay_round(batch)
                batch = await self._send_lines(batch, final)  # a relayed line the round did not embed waits
                if final:
                    break
            if batch["status"] in ("finalizing", "cancelling", "expired"):
                await self._finalize(batch)
        except asyncio.CancelledError:
            raise
        except Exception:  # noqa: BLE001 - the batch is tried again at the next poll, after its journal
            logger.exception("batch %s: running it failed; it resumes at the next poll", batch_id)
        finally:
            self._store.close_journal(batch_id)
            held.close()

    # ---- the states ---------------------------------------------------------------------------------------------

    async def _validate(self, batch_id: str) -> dict[str, Any]:
        batch = self._store.batch(batch_id)
        assert batch is not None
        path = self._store.file_path(batch["input_file_id"])
        problem = None
        total = 0
        if self._store.file(batch["input_file_id"]) is None or not path.exists():
            problem = ("invalid_input_file", f"the input file {batch['input_file_id']} no longer exists")
        else:
            with path.open("rb") as input_lines:
                for count, raw in enumerate(input_lines, 1):
                    total += bool(raw.strip())
                    if count % LINES_PER_TURN == 0:
                        await asyncio.sleep(0)
            if total == 0:
                problem = ("empty_file", "the input file has no lines")
            elif total > self._config.max_lines:
                problem = ("too_many_requests",
                           f"the input file has {total} lines; a batch takes at most {self._config.max_lines}")
        now = self._store.now()

        def validated(batch: dict[str, Any]) -> None:
            if problem is not None:
                code, message = problem
                batch.update(status="failed", failed_at=now, errors={"object": "list", "data": [
                    {"code": code, "message": message, "param": "input_file_id", "line": None}]})
            elif batch["status"] == "validating":
                batch.update(status="in_progress", in_progress_at=now,
                             request_counts={"total": total, "completed": 0, "failed": 0})
            else:  # cancelled while validating
                batch["request_counts"] = {"total": total, "completed": 0, "failed": 0}

        return self._store.update_batch(batch_id, validated) or batch

    async def _relay_round(self, batch: dict[str, Any]) -> bool:
        """A round of the provider's Batch API for the relayed lines not finished (relay.py); False if there was
        nothing to relay."""
        if self._relay is None:
            return False
        done = await self._store.journal(batch["id"])
        outcomes = {index: entry.ok for index, entry in done.items()}
        return await self._relay.round(batch, done.keys(),
                                       lambda: self._progress(batch["id"], outcomes) == "in_progress")

    async def _send_lines(self, batch: dict[str, Any], final: bool) -> dict[str, Any]:
        """Send the lines not finished; with ``final``, a relayed line whose inputs the cache lacks is an error line,
        else it is left for the relay's next round."""
        batch_id = batch["id"]
        done = await self._store.journal(batch_id, repair=True)
        outcomes = {index: entry.ok for index, entry in done.items()}
        room = asyncio.Semaphore(LINES_IN_FLIGHT)
        in_flight: set[asyncio.Task] = set()
        seen: set[str] = set()
        checked, wakes = time.monotonic(), self._wakes
        status = batch["status"]
        groups: dict[bytes, list[tuple[int, lines.Request]]] = {}  # lines read, not sent yet, by group

        def send(members: list[tuple[int, lines.Request]]) -> None:
            task = asyncio.ensure_future(self._send_group(batch, members, outcomes, final) if len(members) > 1
                                         else self._send(batch, *members[0], outcomes, final))
            in_flight.add(task)

            def sent(task: asyncio.Task) -> None:
                in_flight.discard(task)
                for _ in members:
                    room.release()

            task.add_done_callback(sent)

        def send_groups() -> None:
            for members in groups.values():
                send(members)
            groups.clear()

        with self._store.file_path(batch["input_file_id"]).open("rb") as input_lines:
            index = -1
            for raw in input_lines:
                if not raw.strip():
                    continue
                index += 1
                if index % LINES_PER_TURN == 0:
                    await asyncio.sleep(0)
                request, finished = self._read(raw, seen)
                if index in done:
                    continue
                if finished is None:
                    if room.locked():
                        send_groups()  # their lines hold the room this one waits for
                    await room.acquire()  # before the status is looked at: a cancel may come while it waits
                if self._wakes != wakes or time.monotonic() - checked >= POLL_S:
                    checked, wakes = time.monotonic(), self._wakes
                    status = self._progress(batch_id, outcomes)
                if status != "in_progress":
                    if finished is None:
                        room.release()
                    break
                if finished is not None:
                    self._record(batch_id, index, finished, outcomes)
                    continue
                assert request is not None
                if request.group is None or self._embed_lines is None:
                    send([(index, request)])
                    continue
                members = groups.setdefault(request.group, [])
                members.append((index, request))
                if len(members) == LINES_A_CALL:
                    send(groups.pop(request.group))
            if status == "in_progress":
                send_groups()
        if in_flight:
            await asyncio.gather(*in_flight)
        every_line = len(outcomes) == batch["request_counts"]["total"]
        self._progress(batch_id, outcomes, finished=status == "in_progress" and every_line)
        return self._store.batch(batch_id) or batch

    def _read(self, raw: bytes, seen: set[str]) -> tuple[lines.Request | None, lines.Finished | None]:
        """The line's request, or its error line if it is none (a repeated ``custom_id`` is none)."""
        try:
            request = lines.parse(raw)
        except lines.LineError as error:
            return None, lines.unreadable(lines.custom_id_of(raw), error)
        if request.custom_id in seen:
            error = lines.LineError("duplicate_custom_id", f"the custom_id {request.custom_id!r} is used before")
            return None, lines.unreadable(request.custom_id, error)
        seen.add(request.custom_id)
        return request, None

    async def _send_group(self, batch: dict[str, Any], members: list[tuple[int, lines.Request]],
                          outcomes: dict[int, bool], final: bool) -> None:
        """Lines of one group in one call; refused for now, the call is made again after its Retry-After; refused
        otherwise, each line is sent alone."""
        assert self._embed_lines is not None
        relayed = self._relay is not None and self._relay.relays(members[0][1].model)
        while True:
            try:
                bodies = await self._embed_lines([request.body for _, request in members], relayed, owner_of(batch))
            except RetryLater as error:
                await asyncio.sleep(max(RETRY_S, error.retry_after_s))
                continue
            except ServiceError:
                await asyncio.gather(*(self._send(batch, index, request, outcomes, final)
                                       for index, request in members))
                return
            for (index, request), body in zip(members, bodies):
                self._record(batch["id"], index, lines.answered(request.custom_id, body), outcomes)
            return

    async def _send(self, batch: dict[str, Any], index: int, request: lines.Request, outcomes: dict[int, bool],
                    final: bool) -> None:
        batch_id, owner = batch["id"], owner_of(batch)
        unavailable = 0
        relayed = self._relay is not None and self._relay.relays(request.model)
        while True:
            try:
                finished = lines.answered(request.custom_id, await self._embed(request.body, relayed, owner))
            except NotCached:
                if not final:
                    return  # the relay's next round embeds it
                finished = lines.refused(request.custom_id, UpstreamFailed(
                    "the provider's Batch API did not embed this line's input; retry it in a new batch"))
            except RetryLater as error:  # the model or its quota is busy: this line's turn comes
                await asyncio.sleep(max(RETRY_S, error.retry_after_s))
                continue
            except ServiceUnavailable as error:  # a lost replica comes back; a line that keeps failing does not
                unavailable += 1
                if unavailable < UNAVAILABLE_TRIES:
                    await asyncio.sleep(RETRY_S)
                    continue
                finished = lines.refused(request.custom_id, error)
            except ServiceError as error:
                finished = lines.refused(request.custom_id, error)
            self._record(batch_id, index, finished, outcomes)
            return

    def _record(self, batch_id: str, index: int, finished: lines.Finished, outcomes: dict[int, bool]) -> None:
        self._store.record(batch_id, index, finished.ok, finished.line.rstrip(b"\n"))
        outcomes[index] = finished.ok
        self._metrics.line_finished(finished.ok)

    def _progress(self, batch_id: str, outcomes: dict[int, bool], finished: bool = False) -> str:
        """Write the counts so far (and, once every line is done, ``finalizing``; past the window, ``expired``);
        the batch's status now."""
        now = self._store.now()

        def progressed(batch: dict[str, Any]) -> None:
            completed = sum(outcomes.values())
            batch["request_counts"] = {**batch["request_counts"], "completed": completed,
                                       "failed": len(outcomes) - completed}
            if batch["status"] != "in_progress":
                return
            if finished:
                batch.update(status="finalizing", finalizing_at=now)
            elif now >= batch["expires_at"]:
                batch.update(status="expired", expired_at=now)

        batch = self._store.update_batch(batch_id, progressed)
        return "cancelled" if batch is None else batch["status"]

    async def _finalize(self, batch: dict[str, Any]) -> None:
        """The output and error files, in the input's order, from the journal; then the batch's final status."""
        batch_id = batch["id"]
        journal = await self._store.journal(batch_id)
        done = [entry for _, entry in sorted(journal.items())]
        files = {}
        for ok, kind in ((True, "output"), (False, "error")):
            chosen = [entry for entry in done if entry.ok is ok]
            if chosen:
                written = await self._store.add_file_lines(f"file-{batch_id}-{kind}", f"{batch_id}_{kind}.jsonl",
                                                           "batch_output", self._store.journal_lines(batch_id, chosen),
                                                           owner_of(batch))
                files[kind] = written["id"]
        now = self._store.now()
        final = {"finalizing": ("completed", "completed_at"), "cancelling": ("cancelled", "cancelled_at"),
                 "expired": ("expired", "expired_at")}

        def finalized(batch: dict[str, Any]) -> None:
            status, stamp = final[batch["status"]]
            batch.update(status=status, output_file_id=files.get("output"), error_file_id=files.get("error"))
            batch[stamp] = batch.get(stamp) or now

        self._store.update_batch(batch_id, finalized)
        await self._store.drop_journal(batch_id)  # its lines are in the files now, once the status says so
        self._store.drop_relay(batch_id)

    def _sweep(self) -> None:
        """Files and finished batches older than the retention time go."""
        if time.monotonic() - self._swept < SWEEP_S:
            return
        self._swept = time.monotonic()
        oldest = self._store.now() - self._config.retention_days * 86_400
        for batch in self._store.batches():
            if batch["status"] in FINAL and batch["created_at"] < oldest:
                self._store.delete_batch(batch["id"])
        for record in self._store.files():
            if record["created_at"] < oldest:
                self._store.delete_file(record["id"])

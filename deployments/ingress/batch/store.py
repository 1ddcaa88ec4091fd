"""The Batch API's durable state, in one directory: uploaded files and batches outlive a restart of ``serve run``,
the loss of the ingress replica running a batch, and a reboot.

Layout: ``files/<id>.json`` (the file object) and ``files/<id>.data`` (its bytes); ``batches/<id>.json`` (the batch
object; ``.state`` locks it for a change), ``batches/<id>.journal`` (one line for each finished request line,
appended as it finishes: a batch resumes after its journal; removed once its lines are in the output files) and
``batches/<id>.lock`` (held by the replica running the batch, released by the OS when that process ends); a batch
relayed to a provider's Batch API adds ``batches/<id>.relay`` (its rounds and provider batches) and
``batches/<id>.relay-<part>`` (each part's inputs), removed with its journal. An object
is written whole to a temporary file and renamed over the old one, so no reader sees half of it.

On a cluster the directory is storage every node mounts at the same path, so that the ingress replicas of all nodes
share it: any of them serves a file or batch another made, and a batch's lock moves to another node's replica when
the node running it is lost. What the store needs of it is ``flock`` between machines and an atomic rename, with
close-to-open consistency: NFS v4, CephFS and EFS give them.
"""

from __future__ import annotations

import asyncio
import fcntl
import os
import time
import uuid
from pathlib import Path
from typing import IO, Any, Callable, Iterable, Iterator, NamedTuple

import orjson

from deployments.usage import DEFAULT_TENANT

COPY_CHUNK_BYTES = 1 << 20
# Lines read or written between turns of the ingress's event loop: a batch's 50,000 lines (hundreds of megabytes of
# output) in one go hold the loop, and with it every interactive request, for a good part of a second. Output lines
# are large (a vector of 384 floats as JSON is ~8 KB), so where they are read or written a turn also ends after
# BYTES_PER_TURN: an interactive request waits for at most one such turn at each of its steps through the loop.
LINES_PER_TURN = 256
BYTES_PER_TURN = 256 * 1024
SYNC_EVERY_S = 1.0  # the journal reaches the disk at least this often: a reboot redoes at most this much work
OWNER = "owner"  # a file's or batch's tenant, kept in its object beside OpenAI's fields (and never shown)


class Entry(NamedTuple):
    """One finished line in a batch's journal: in the output file (``ok``) or the error file, and where its output
    line is in the journal."""

    ok: bool
    offset: int
    length: int


class TooLarge(Exception):
    """An upload past the store's byte limit (nothing of it is kept)."""


def owner_of(record: dict[str, Any]) -> str:
    """The tenant a file or batch is of (one made before tenants were kept: the default tenant's)."""
    return record.get(OWNER, DEFAULT_TENANT)


def new_id(prefix: str) -> str:
    return f"{prefix}{uuid.uuid4().hex}"


class BatchStore:
    def __init__(self, root: Path, clock: Callable[[], float] = time.time) -> None:
        self._files = root / "files"
        self._batches = root / "batches"
        self._clock = clock
        self._files.mkdir(parents=True, exist_ok=True)
        self._batches.mkdir(parents=True, exist_ok=True)
        self._synced: dict[str, float] = {}
        self._journals: dict[str, IO[bytes]] = {}  # open for appending, by batch

    def now(self) -> int:
        return int(self._clock())

    # ---- files --------------------------------------------------------------------------------------------------

    def add_file(self, filename: str, purpose: str, content: IO[bytes], max_bytes: int,
                 owner: str = DEFAULT_TENANT) -> dict[str, Any]:
        """Keep ``content`` (read in chunks; ``TooLarge`` past ``max_bytes``) as a new file of ``owner``'s; its
        object."""
        file_id = new_id("file-")
        data = self._files / f"{file_id}.data"
        size = 0
        try:
            with data.open("wb") as out:
                while chunk := content.read(COPY_CHUNK_BYTES):
                    size += len(chunk)
                    if size > max_bytes:
                        raise TooLarge(f"the file exceeds the {max_bytes}-byte limit")
                    out.write(chunk)
                out.flush()
                os.fsync(out.fileno())
        except BaseException:
            data.unlink(missing_ok=True)
            raise
        return self._describe_file(file_id, filename, purpose, size, owner)

    async def add_file_lines(self, file_id: str, filename: str, purpose: str, lines: Iterator[bytes],
                             owner: str = DEFAULT_TENANT) -> dict[str, Any]:
        """A file the service writes (a batch's output or errors), from ``lines``; written again under the same id
        if it was written before (a batch finalized again after a crash). The event loop runs between each
        ``LINES_PER_TURN`` lines or ``BYTES_PER_TURN`` bytes (on a thread instead, each request the loop serves
        would wait for the GIL at every step)."""
        size = 0
        turns = _Turns()
        with (self._files / f"{file_id}.data").open("wb") as out:
            for line in lines:
                out.write(line)
                size += len(line)
                await turns.after(len(line))
            out.flush()
            await asyncio.to_thread(os.fsync, out.fileno())  # a batch's output is large: its flush takes long
        return self._describe_file(file_id, filename, purpose, size, owner)

    def _describe_file(self, file_id: str, filename: str, purpose: str, size: int, owner: str) -> dict[str, Any]:
        record = {"id": file_id, "object": "file", "bytes": size, "created_at": self.now(), "filename": filename,
                  "purpose": purpose, "status": "processed", "status_details": None, OWNER: owner}
        _write_json(self._files / f"{file_id}.json", record)
        return record

    def file(self, file_id: str) -> dict[str, Any] | None:
        return _read_json(self._files / f"{_safe(file_id)}.json")

    def file_path(self, file_id: str) -> Path:
        return self._files / f"{_safe(file_id)}.data"

    def files(self) -> list[dict[str, Any]]:
        """Every file, newest first."""
        return _newest_first(_read_json(path) for path in self._files.glob("*.json"))

    def delete_file(self, file_id: str) -> bool:
        record = self._files / f"{_safe(file_id)}.json"
        if not record.exists():
            return False
        record.unlink(missing_ok=True)
        self.file_path(file_id).unlink(missing_ok=True)
        return True

    # ---- batches ------------------------------------------------------------------------------------------------

    def save_batch(self, batch: dict[str, Any]) -> None:
        _write_json(self._batches / f"{batch['id']}.json", batch)

    def update_batch(self, batch_id: str, change: Callable[[dict[str, Any]], None]) -> dict[str, Any] | None:
        """Read, ``change`` in place and write the batch, holding its state lock: a cancel from any replica and the
        runner's progress never overwrite each other. None if there is no such batch."""
        with (self._batches / f"{_safe(batch_id)}.state").open("ab") as state:
            fcntl.flock(state.fileno(), fcntl.LOCK_EX)  # held for a read and a write: microseconds
            batch = self.batch(batch_id)
            if batch is not None:
                change(batch)
                self.save_batch(batch)
            return batch

    def batch(self, batch_id: str) -> dict[str, Any] | None:
        return _read_json(self._batches / f"{_safe(batch_id)}.json")

    def batches(self) -> list[dict[str, Any]]:
        """Every batch, newest first."""
        return _newest_first(self.batch(batch_id) for batch_id in self.batch_ids())

    def batch_ids(self) -> list[str]:
        """Every batch's id, from the directory's listing alone."""
        return [path.stem for path in self._batches.glob("*.json")]

    def delete_batch(self, batch_id: str) -> None:
        for suffix in (".json", ".journal", ".lock", ".state"):
            (self._batches / f"{_safe(batch_id)}{suffix}").unlink(missing_ok=True)
        self.drop_relay(batch_id)

    # ---- a batch relayed to a provider's Batch API (relay.py) ---------------------------------------------------

    def relay_state(self, batch_id: str) -> dict[str, Any] | None:
        return _read_json(self._batches / f"{_safe(batch_id)}.relay")

    def save_relay_state(self, batch_id: str, state: dict[str, Any]) -> None:
        _write_json(self._batches / f"{_safe(batch_id)}.relay", state)

    def save_relay_inputs(self, batch_id: str, part: str, inputs: list[Any]) -> None:
        _write_json(self._batches / f"{_safe(batch_id)}.relay-{_safe(part)}", inputs)

    def relay_inputs(self, batch_id: str, part: str) -> list[Any]:
        inputs = _read_json(self._batches / f"{_safe(batch_id)}.relay-{_safe(part)}")
        if inputs is None:
            raise FileNotFoundError(f"the inputs of relayed part {part} are gone")
        return inputs

    def drop_relay(self, batch_id: str) -> None:
        for path in self._batches.glob(f"{_safe(batch_id)}.relay*"):
            path.unlink(missing_ok=True)

    async def journal(self, batch_id: str, *, repair: bool = False) -> dict[int, Entry]:
        """The finished lines of a batch, by index. A last line cut short by a crash is not one; with ``repair`` (the
        runner resuming the batch, before it appends) it is cut off the file, so the next line starts on its own.
        The event loop runs between each ``LINES_PER_TURN`` lines or ``BYTES_PER_TURN`` bytes."""
        path = self._batches / f"{_safe(batch_id)}.journal"
        done: dict[int, Entry] = {}
        if not path.exists():
            return done
        offset = 0
        turns = _Turns()
        with path.open("rb") as journal:
            for line in journal:
                if not line.endswith(b"\n"):
                    break
                index, ok, _ = line.split(b" ", 2)
                start = offset + len(index) + len(ok) + 2
                done[int(index)] = Entry(ok == b"1", start, offset + len(line) - 1 - start)
                offset += len(line)
                await turns.after(len(line))
        if repair and path.stat().st_size > offset:
            os.truncate(path, offset)
        return done

    def journal_lines(self, batch_id: str, entries: Iterable[Entry]) -> Iterator[bytes]:
        """The output lines of ``entries``, in their order, read one at a time."""
        with (self._batches / f"{_safe(batch_id)}.journal").open("rb") as journal:
            for entry in entries:
                journal.seek(entry.offset)
                yield journal.read(entry.length) + b"\n"

    def record(self, batch_id: str, index: int, ok: bool, line: bytes) -> None:
        """Append one finished line (its output ``line``, one line of JSON) to the batch's journal; it reaches the OS
        at once (a killed process loses none) and the disk within ``SYNC_EVERY_S``."""
        journal = self._journals.get(batch_id)
        if journal is None:
            journal = self._journals[batch_id] = (self._batches / f"{_safe(batch_id)}.journal").open("ab")
        journal.write(b"%d %d %s\n" % (index, ok, line))
        journal.flush()
        now = time.monotonic()
        if now - self._synced.get(batch_id, 0.0) >= SYNC_EVERY_S:
            _sync_apart(journal)
            self._synced[batch_id] = now

    def close_journal(self, batch_id: str) -> None:
        journal = self._journals.pop(batch_id, None)
        if journal is not None:
            journal.close()
        self._synced.pop(batch_id, None)

    async def drop_journal(self, batch_id: str) -> None:
        self.close_journal(batch_id)
        # a batch's journal holds all its output: freeing that much disk takes a while
        await asyncio.to_thread((self._batches / f"{_safe(batch_id)}.journal").unlink, missing_ok=True)

    def lock(self, batch_id: str) -> IO[bytes] | None:
        """The batch's lock, held until the returned file is closed; None if another process holds it."""
        handle = (self._batches / f"{_safe(batch_id)}.lock").open("ab")
        try:
            fcntl.flock(handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            handle.close()
            return None
        return handle


def _safe(object_id: str) -> str:
    """An id as a file name: never a path out of the store."""
    return object_id if object_id.replace("-", "").replace("_", "").isalnum() else "-invalid-"


class _Turns:
    """Where a loop reads or writes a batch's lines: a turn of the event loop after every ``LINES_PER_TURN`` lines or
    ``BYTES_PER_TURN`` bytes, whichever comes first."""

    def __init__(self) -> None:
        self._lines = self._bytes = 0

    async def after(self, size: int) -> None:
        """A line of ``size`` bytes was read or written."""
        self._lines += 1
        self._bytes += size
        if self._lines >= LINES_PER_TURN or self._bytes >= BYTES_PER_TURN:
            self._lines = self._bytes = 0
            await asyncio.sleep(0)


def _sync_apart(out: IO[bytes]) -> None:
    """``out``'s data to the disk, from a thread when called on an event loop: an fsync of what a batch wrote in a
    second would hold the loop, and the interactive requests it serves, for as long as the disk takes. The thread
    syncs a copy of the descriptor, so the file may be closed meanwhile."""
    try:
        loop = asyncio.get_running_loop()
    except RuntimeError:
        os.fsync(out.fileno())
        return
    loop.run_in_executor(None, _sync_and_close, os.dup(out.fileno()))


def _sync_and_close(descriptor: int) -> None:
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def _write_json(path: Path, value: Any) -> None:
    temporary = path.with_suffix(f".{uuid.uuid4().hex}.tmp")
    with temporary.open("wb") as out:
        out.write(orjson.dumps(value))
        out.flush()
        os.fsync(out.fileno())
    os.replace(temporary, path)


def _read_json(path: Path) -> Any:
    try:
        return orjson.loads(path.read_bytes())
    except FileNotFoundError:
        return None


def _newest_first(records: Iterator[dict[str, Any] | None]) -> list[dict[str, Any]]:
    return sorted((r for r in records if r is not None), key=lambda r: (r["created_at"], r["id"]), reverse=True)

"""Durable output. Every finished batch is appended to a JSONL log with flush + fsync, so a kill at any moment
leaves whole rows on disk (at worst followed by a torn last line, which the next run cuts off); the ids in the log
are the rows already done.

- `*.jsonl` output is that log itself: rows `{"id", "embedding"}` in the order batches finished.
- `*.npy` output is `<out>` + `<out>.ids.jsonl` (one JSON id a line, row i of the matrix is line i), in input order.
  Its work log is `<out>.partial.jsonl`: a line per finished batch, `{"ids": [...], "b64": ...}`, its rows as one
  little-endian float32 matrix in base64 (one-row lines `{"id", "b64"}`, which earlier versions wrote, are read too:
  a run they left unfinished continues). Each batch is also written at its rows' input positions into a draft of the
  matrix, `<out>.draft`, memory-mapped (the rows wait in the page cache, not the heap), so a run's end reads back
  from the log only the rows of earlier runs. The draft is renamed to `<out>` (compacted first when rows are missing)
  after the ids file is in place. The work log is deleted once every input row is in the matrix; while rows are
  missing (failed or interrupted) it stays, and the next run continues it.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any, BinaryIO, Protocol

import numpy as np
import orjson
import pybase64

from embed_bulk.documents import DocId
from embed_bulk.settings import BulkSettings, sidecar

Row = tuple[DocId, np.ndarray]


class StoreError(RuntimeError):
    """The output on disk cannot be continued (e.g. rows of different widths)."""


class EmbeddingStore(Protocol):
    @property
    def dropped_bytes(self) -> int: ...

    def recover(self) -> set[DocId]: ...

    def append(self, rows: Sequence[Row]) -> None: ...

    def finish(self) -> None: ...

    def close(self) -> None: ...


class AppendLog:
    """A JSONL file only ever appended to, one fsync per append."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.dropped_bytes = 0  # the torn tail `recover` cut off
        self._file: BinaryIO | None = None

    def recover(self, rows_of: Callable[[dict[str, Any], Path], Iterable[Any]] | None = None) -> list[Any]:
        """The ids of the complete rows (what `rows_of` lists for each line: by default its `id`); a torn tail (a
        last line cut short or unreadable) is cut off the file."""
        if not self.path.exists():
            return []
        rows, intact = [], 0
        with self.path.open("rb") as log:
            for line in log:
                record = _parse_line(line)
                if record is None:
                    break
                rows.extend([_record_id(record, self.path)] if rows_of is None else rows_of(record, self.path))
                intact += len(line)
        self._cut_after(intact)
        return rows

    def records(self, first_bytes: int | None = None) -> Iterator[dict[str, Any]]:
        """The lines of the log (of its first `first_bytes` only, if given)."""
        if not self.path.exists():
            return
        left = first_bytes
        with self.path.open("rb") as log:
            for line in log:
                if left is not None:
                    left -= len(line)
                    if left < 0:
                        return
                yield json.loads(line)

    def size(self) -> int:
        return self.path.stat().st_size if self.path.exists() else 0

    def append(self, records: Iterable[dict[str, Any]]) -> None:
        data = b"".join(map(_json_line, records))
        if self._file is None:
            self._file = self.path.open("ab")
        self._file.write(data)
        self._file.flush()
        os.fsync(self._file.fileno())

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None

    def _cut_after(self, intact: int) -> None:
        size = self.path.stat().st_size
        if size > intact:
            self.dropped_bytes = size - intact
            with self.path.open("r+b") as log:
                log.truncate(intact)
                os.fsync(log.fileno())


class JsonlStore:
    """`*.jsonl` output: rows `{"id": ..., "embedding": [...]}`, appended as batches finish."""

    def __init__(self, path: Path) -> None:
        self._log = AppendLog(path)

    @property
    def dropped_bytes(self) -> int:
        return self._log.dropped_bytes

    def recover(self) -> set[DocId]:
        return set(self._log.recover())

    def append(self, rows: Sequence[Row]) -> None:
        self._log.append({"id": doc_id, "embedding": vector.tolist()} for doc_id, vector in rows)

    def finish(self) -> None:
        self.close()

    def close(self) -> None:
        self._log.close()


class NpyStore:
    """`*.npy` output over the documents `input_ids`: a float32 matrix in input order plus `<out>.ids.jsonl`, from a
    work log and a draft matrix (the module docstring)."""

    def __init__(self, path: Path, input_ids: Sequence[DocId]) -> None:
        self.path = path
        self.ids_path = sidecar(path, "ids.jsonl")
        self._input_ids = input_ids
        self._position = {doc_id: row for row, doc_id in enumerate(input_ids)}
        self._work = AppendLog(sidecar(path, "partial.jsonl"))
        self._draft_path = sidecar(path, "draft")
        self._draft: np.memmap | None = None
        self._widths: dict[DocId, int] = {}  # the work log's rows and their widths, known without reading it again
        self._earlier_bytes: int | None = None  # the work log's length before this run's first row

    @property
    def dropped_bytes(self) -> int:
        return self._work.dropped_bytes

    def recover(self) -> set[DocId]:
        """The rows done; called before any `append`, as a run does."""
        if self._work.path.exists():
            self._widths = dict(self._work.recover(_row_widths))
            return set(self._widths)
        if self.path.exists() and self.ids_path.exists():
            return set(_read_ids(self.ids_path))
        return set()

    def append(self, rows: Sequence[Row]) -> None:
        if self._earlier_bytes is None:
            if not self._work.path.exists() and self.path.exists():
                self._seed_work_from_matrix()
            self._earlier_bytes = self._work.size()
        ids = [doc_id for doc_id, _ in rows]
        block = np.stack([vector for _, vector in rows])
        draft = self._draft_of_width(block.shape[1])
        self._work.append([{"ids": ids, "b64": _encode(block)}])
        draft[[self._position[doc_id] for doc_id in ids]] = block
        self._widths.update(dict.fromkeys(ids, block.shape[1]))

    def finish(self) -> None:
        """Writes the matrix; deletes the work log once every input row is in it."""
        self.close()
        if not self._work.path.exists() and self.path.exists():
            return  # an earlier run assembled it and nothing was added since
        kept = [doc_id for doc_id in self._input_ids if doc_id in self._widths]
        widths = {self._widths[doc_id] for doc_id in kept}
        if len(widths) > 1:
            raise StoreError(f"{self.path}: rows of different widths {sorted(widths)}; start afresh")
        if kept:
            self._draft_earlier_rows(widths.pop())
        self._publish(kept)
        if len(kept) == len(self._input_ids):
            self._work.path.unlink(missing_ok=True)

    def close(self) -> None:
        self._work.close()

    def _draft_of_width(self, width: int) -> np.memmap:
        if self._draft is None:
            self._draft = np.lib.format.open_memmap(self._draft_path, mode="w+", dtype="<f4",
                                                    shape=(len(self._input_ids), width))
        elif self._draft.shape[1] != width:
            raise StoreError(f"{self.path}: rows of different widths {sorted({self._draft.shape[1], width})}; "
                             "start afresh")
        return self._draft

    def _draft_earlier_rows(self, width: int) -> None:
        """Writes into the draft the rows of the work log that earlier runs left (this run's are there already)."""
        draft = self._draft_of_width(width)
        for record in self._work.records(self._earlier_bytes):
            ids, block = _block(record, self._work.path)
            placed = [(row, self._position[doc_id]) for row, doc_id in enumerate(ids) if doc_id in self._position]
            if placed:
                draft[[position for _, position in placed]] = block[[row for row, _ in placed]]

    def _publish(self, kept: Sequence[DocId]) -> None:
        """The draft as `<out>`: whole, or with only the rows of `kept` (in input order) when some are missing."""
        draft, self._draft = self._draft, None
        matrix = self.path.with_name(self.path.name + ".tmp")
        if draft is None:  # no row at all
            _write_matrix(matrix, (0, 0), [])
        elif len(kept) == len(self._input_ids):
            _flush(draft)
            matrix = self._draft_path
        else:
            positions = [self._position[doc_id] for doc_id in kept]
            _write_matrix(matrix, (len(kept), draft.shape[1]), _compacted(draft, positions))
            del draft
            self._draft_path.unlink()
        ids_tmp = self.ids_path.with_name(self.ids_path.name + ".tmp")
        _write_ids(ids_tmp, kept)
        os.replace(ids_tmp, self.ids_path)
        os.replace(matrix, self.path)
        _fsync_directory(self.path.parent)

    def _seed_work_from_matrix(self) -> None:
        """Starts a work log holding an earlier run's matrix, atomically, so new rows can join it."""
        matrix = np.load(self.path, mmap_mode="r")
        seed = AppendLog(self._work.path.with_name(self._work.path.name + ".tmp"))
        seed.path.unlink(missing_ok=True)
        ids = _read_ids(self.ids_path)
        for start in range(0, len(ids), 1024):
            seed.append([{"ids": ids[start : start + 1024], "b64": _encode(matrix[start : start + 1024])}])
        seed.close()
        self._widths = dict.fromkeys(ids, matrix.shape[1])
        if seed.path.exists():
            os.replace(seed.path, self._work.path)
            _fsync_directory(self.path.parent)


def open_store(settings: BulkSettings, input_ids: Sequence[DocId]) -> EmbeddingStore:
    if settings.output_kind == "npy":
        return NpyStore(settings.output_path, input_ids)
    return JsonlStore(settings.output_path)


def _compacted(draft: np.ndarray, positions: Sequence[int], chunk: int = 4096) -> Iterator[np.ndarray]:
    """The draft's rows at `positions`, in order, a chunk at a time."""
    for start in range(0, len(positions), chunk):
        yield draft[positions[start : start + chunk]]


def _write_matrix(path: Path, shape: tuple[int, int], blocks: Iterable[np.ndarray]) -> None:
    """The matrix of `shape` from its rows, given as consecutive blocks."""
    if shape[0] == 0:
        with path.open("wb") as file:
            np.save(file, np.zeros(shape, dtype="<f4"))
            file.flush()
            os.fsync(file.fileno())
        return
    matrix = np.lib.format.open_memmap(path, mode="w+", dtype="<f4", shape=shape)
    start = 0
    for block in blocks:
        matrix[start : start + len(block)] = block
        start += len(block)
    _flush(matrix)


def _flush(matrix: np.memmap) -> None:
    """A memory-mapped matrix written through to the disk."""
    matrix.flush()
    with open(matrix.filename, "rb+") as file:
        os.fsync(file.fileno())


def _json_line(record: dict[str, Any]) -> bytes:
    """One line of JSON, by orjson: a batch's line of base64 is long, and a cached re-run, which waits little on the
    service, spends its CPU on lines like this, where json.dumps is the slower encoder."""
    try:
        return orjson.dumps(record) + b"\n"
    except orjson.JSONEncodeError:  # an integer id wider than 64 bits
        return (json.dumps(record, ensure_ascii=False) + "\n").encode("utf-8")


def _write_ids(path: Path, ids: Sequence[DocId]) -> None:
    with path.open("w", encoding="utf-8") as file:
        file.writelines(json.dumps(doc_id, ensure_ascii=False) + "\n" for doc_id in ids)
        file.flush()
        os.fsync(file.fileno())


def _read_ids(path: Path) -> list[DocId]:
    with path.open(encoding="utf-8") as file:
        return [json.loads(line) for line in file if line.strip()]


def _parse_line(line: bytes) -> dict[str, Any] | None:
    if not line.endswith(b"\n"):
        return None
    try:
        record = json.loads(line)
    except ValueError:
        return None
    return record if isinstance(record, dict) else None


def _record_id(record: dict[str, Any], path: Path) -> DocId:
    if "id" not in record:
        raise StoreError(f"{path}: a row has no 'id'; is this the output of another tool?")
    return record["id"]


def _batch(record: dict[str, Any], path: Path) -> tuple[list[DocId], str]:
    """A work-log line's ids and the base64 of its rows: a batch, or one row as earlier versions wrote them."""
    if "ids" in record:
        return list(record["ids"]), record["b64"]
    return [_record_id(record, path)], record["b64"]


def _row_widths(record: dict[str, Any], path: Path) -> list[tuple[DocId, int]]:
    """Each row of a work-log line with the floats it holds, from the length of the base64 text (each 4 characters
    hold 3 bytes), so nothing is decoded."""
    ids, text = _batch(record, path)
    floats = (len(text) // 4 * 3 - text[-2:].count("=")) // 4
    if not ids or floats % len(ids):
        raise StoreError(f"{path}: a line holds {floats} floats for {len(ids)} rows; start afresh")
    return [(doc_id, floats // len(ids)) for doc_id in ids]


def _block(record: dict[str, Any], path: Path) -> tuple[list[DocId], np.ndarray]:
    ids, text = _batch(record, path)
    return ids, np.frombuffer(pybase64.b64decode(text), dtype="<f4").reshape(len(ids), -1)


def _encode(rows: np.ndarray) -> str:
    return pybase64.b64encode_as_string(np.ascontiguousarray(rows, dtype="<f4"))


def _fsync_directory(directory: Path) -> None:
    descriptor = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)

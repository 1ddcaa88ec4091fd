"""Durable output. Every finished batch is appended to a JSONL log with flush + fsync, so a kill at any moment
leaves whole rows on disk (at worst followed by a torn last line, which the next run cuts off); the ids in the log
are the rows already done.

- `*.jsonl` output is that log itself: rows `{"id", "embedding"}` in the order batches finished.
- `*.npy` output is assembled at the end of a run, in input order, from the work log `<out>.partial.jsonl`
  (a line per finished batch, `{"ids": [...], "b64": ...}`: its rows as one little-endian float32 matrix, base64;
  one-row lines `{"id", "b64"}`, which earlier versions wrote, are read too: a run they left unfinished continues)
  into `<out>` + `<out>.ids.jsonl` (one JSON id a line,
  row i of the matrix is line i), both written to temporary files and renamed into place. The work log is deleted
  once every input row is in the matrix; while rows are missing (failed or interrupted) it stays, and the next run
  continues it.
"""

from __future__ import annotations

import base64
import json
import os
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, BinaryIO, Protocol

import numpy as np

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

    def finish(self, input_ids: Sequence[DocId]) -> None: ...

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

    def records(self) -> Iterator[dict[str, Any]]:
        if not self.path.exists():
            return
        with self.path.open("rb") as log:
            for line in log:
                yield json.loads(line)

    def append(self, records: Iterable[dict[str, Any]]) -> None:
        data = "".join(json.dumps(record, ensure_ascii=False) + "\n" for record in records).encode("utf-8")
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

    def finish(self, input_ids: Sequence[DocId]) -> None:
        self.close()

    def close(self) -> None:
        self._log.close()


class NpyStore:
    """`*.npy` output: a float32 matrix in input order plus `<out>.ids.jsonl`, assembled from a work log."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.ids_path = sidecar(path, "ids.jsonl")
        self._work = AppendLog(sidecar(path, "partial.jsonl"))
        self._widths: dict[DocId, int] = {}  # the work log's rows and their widths, known without reading it again

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
        if not self._work.path.exists() and self.path.exists():
            self._seed_work_from_matrix()
        ids = [doc_id for doc_id, _ in rows]
        block = np.stack([vector for _, vector in rows])
        self._work.append([{"ids": ids, "b64": _encode(block)}])
        self._widths.update(dict.fromkeys(ids, block.shape[1]))

    def finish(self, input_ids: Sequence[DocId]) -> None:
        """Writes the matrix from the work log; deletes the log once every input row is in the matrix."""
        self.close()
        if not self._work.path.exists() and self.path.exists():
            return  # an earlier run assembled it and nothing was added since
        kept = assemble_matrix(self._work.records, self._widths, input_ids, self.path, self.ids_path)
        if kept == len(input_ids):
            self._work.path.unlink(missing_ok=True)

    def close(self) -> None:
        self._work.close()

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


def open_store(settings: BulkSettings) -> EmbeddingStore:
    if settings.output_kind == "npy":
        return NpyStore(settings.output_path)
    return JsonlStore(settings.output_path)


def assemble_matrix(
    records: Callable[[], Iterable[dict[str, Any]]], row_widths: Mapping[DocId, int], input_ids: Sequence[DocId],
    matrix_path: Path, ids_path: Path,
) -> int:
    """Writes the rows of `records()` (`row_widths`: their ids and widths) whose ids are in `input_ids` as a matrix
    in input order; returns its rows. The log is read once."""
    position = {doc_id: i for i, doc_id in enumerate(input_ids)}
    widths = {doc_id: width for doc_id, width in row_widths.items() if doc_id in position}
    if len(set(widths.values())) > 1:
        raise StoreError(f"{matrix_path}: rows of different widths {sorted(set(widths.values()))}; start afresh")
    kept = sorted(widths, key=position.__getitem__)
    row_of = {doc_id: row for row, doc_id in enumerate(kept)}
    width = next(iter(widths.values()), 0)
    matrix_tmp = matrix_path.with_name(matrix_path.name + ".tmp")
    ids_tmp = ids_path.with_name(ids_path.name + ".tmp")
    blocks = (_block(record, matrix_path) for record in records())
    _write_matrix(matrix_tmp, (len(kept), width), (([row_of.get(doc_id) for doc_id in ids], block)
                                                   for ids, block in blocks))
    _write_ids(ids_tmp, kept)
    os.replace(ids_tmp, ids_path)
    os.replace(matrix_tmp, matrix_path)
    _fsync_directory(matrix_path.parent)
    return len(kept)


def _write_matrix(path: Path, shape: tuple[int, int], placed: Iterable[tuple[list[int | None], np.ndarray]]) -> None:
    """The matrix of `shape` from blocks of rows, each row going to the row of the matrix named beside it (or
    nowhere: None)."""
    if shape[0] == 0:
        with path.open("wb") as file:
            np.save(file, np.zeros(shape, dtype="<f4"))
            file.flush()
            os.fsync(file.fileno())
        return
    matrix = np.lib.format.open_memmap(path, mode="w+", dtype="<f4", shape=shape)
    for rows, block in placed:
        kept = [i for i, row in enumerate(rows) if row is not None]
        if kept:
            matrix[[rows[i] for i in kept]] = block[kept]
    matrix.flush()
    del matrix
    with path.open("rb+") as file:
        os.fsync(file.fileno())


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
    return ids, np.frombuffer(base64.b64decode(text), dtype="<f4").reshape(len(ids), -1)


def _encode(rows: np.ndarray) -> str:
    return base64.b64encode(np.ascontiguousarray(rows, dtype="<f4").tobytes()).decode("ascii")


def _fsync_directory(directory: Path) -> None:
    descriptor = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)

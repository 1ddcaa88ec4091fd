"""Reading the documents to embed: JSONL rows with an id and a text field, or plain text, one document a line."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NamedTuple

import orjson

DocId = str | int


class InputError(ValueError):
    """The input cannot be read as asked (bad JSON, a missing or repeated id)."""


class Document(NamedTuple):
    """One document; `problem` says why it cannot be sent (it is then reported as failed, never embedded, with its
    input `line`). `id` is None for a line that holds no document (not JSON, or no usable id): it is no row of the
    output. A tuple: a run makes two of each input row (its ids first, then its batches), and a frozen dataclass's
    ``__init__`` (``object.__setattr__`` per field) is slower to make than a tuple."""

    id: DocId | None
    text: str
    problem: str | None = None
    line: int | None = None


def read_documents(
    path: Path, *, jsonl: bool, id_field: str = "id", text_field: str = "text", strict: bool = False
) -> Iterator[Document]:
    """The documents of `path` in file order. Plain text: blank lines are skipped and the id is the line number.
    A malformed line (not JSON, not an object, no usable id; not UTF-8) is a document with a `problem`, or with
    `strict` an `InputError`."""
    if jsonl:  # bytes: orjson reads them as they are (a fourth of the time json takes for str lines)
        with path.open("rb") as rows:
            for line_number, row in enumerate(rows, start=1):
                try:
                    document = _jsonl_document(row, line_number, id_field, text_field)
                except InputError as error:
                    if strict:
                        raise
                    document = Document(None, "", problem=str(error), line=line_number)
                if document is not None:
                    yield document
        return
    with path.open(encoding="utf-8", errors="surrogateescape") as lines:  # a byte that is not UTF-8 fails its line
        for line_number, line in enumerate(lines, start=1):
            content = line.rstrip("\r\n")
            if content.strip():
                yield _text_document(content, line_number, strict)


def unique_ids(documents: Iterator[Document]) -> tuple[list[DocId], int]:
    """The ids in input order, and how many lines hold no document; a repeated id is an `InputError` (resuming keys
    on ids: which of the two would be done?)."""
    ids: list[DocId] = []
    seen: set[DocId] = set()
    malformed = 0
    for document in documents:
        if document.id is None:
            malformed += 1
            continue
        if document.id in seen:
            raise InputError(f"id {document.id!r} appears more than once; ids must be unique")
        seen.add(document.id)
        ids.append(document.id)
    return ids, malformed


def _text_document(content: str, line_number: int, strict: bool) -> Document:
    try:
        content.encode("utf-8")
    except UnicodeEncodeError:  # a surrogate escape: a byte that is not UTF-8
        if strict:
            raise InputError(f"line {line_number}: not UTF-8") from None
        return Document(line_number, "", problem=f"line {line_number}: not UTF-8", line=line_number)
    return Document(line_number, content)


def _jsonl_document(content: bytes, line_number: int, id_field: str, text_field: str) -> Document | None:
    """The line's document; None for a line of whitespace only (Unicode's too: skipped, as in plain text), which
    orjson refuses like any line that is not JSON."""
    try:
        row = orjson.loads(content)
    except orjson.JSONDecodeError:
        if not content.decode("utf-8", "replace").strip():
            return None
        row = _parsed_by_json(content, line_number)  # what orjson refuses and json reads (NaN), or InputError
    if not isinstance(row, dict):
        raise InputError(f"line {line_number}: expected a JSON object")
    doc_id = row.get(id_field)
    if isinstance(doc_id, float):  # orjson reads an integer wider than 64 bits as a float; json keeps it whole
        doc_id = _parsed_by_json(content, line_number).get(id_field)
    if isinstance(doc_id, bool) or not isinstance(doc_id, (str, int)):
        raise InputError(f"line {line_number}: field {id_field!r} must be a string or an integer")
    text = row.get(text_field)
    if not isinstance(text, str):
        problem = f"line {line_number}: field {text_field!r} is missing or not a string"
        return Document(doc_id, "", problem=problem, line=line_number)
    return Document(doc_id, text)


def _parsed_by_json(content: bytes, line_number: int) -> Any:
    """The row as json reads it: exact where orjson is not (integers wider than 64 bits), and saying why a line that
    is not JSON is not."""
    try:
        return json.loads(content)
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        reason = error.msg if isinstance(error, json.JSONDecodeError) else "not UTF-8"
        raise InputError(f"line {line_number}: not valid JSON ({reason})") from None

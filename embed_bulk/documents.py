"""Reading the documents to embed: JSONL rows with an id and a text field, or plain text, one document a line."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

DocId = str | int


class InputError(ValueError):
    """The input cannot be read as asked (bad JSON, a missing or repeated id)."""


@dataclass(frozen=True)
class Document:
    """One document; `problem` says why it cannot be sent (it is then reported as failed, never embedded)."""

    id: DocId
    text: str
    problem: str | None = None


def read_documents(path: Path, *, jsonl: bool, id_field: str = "id", text_field: str = "text") -> Iterator[Document]:
    """The documents of `path` in file order. Plain text: blank lines are skipped and the id is the line number."""
    with path.open(encoding="utf-8") as lines:
        for line_number, line in enumerate(lines, start=1):
            content = line.rstrip("\r\n")
            if not content.strip():
                continue
            if jsonl:
                yield _jsonl_document(content, line_number, id_field, text_field)
            else:
                yield Document(line_number, content)


def unique_ids(documents: Iterator[Document]) -> list[DocId]:
    """The ids in input order; a repeated id is an `InputError` (resuming keys on ids)."""
    ids: list[DocId] = []
    seen: set[DocId] = set()
    for document in documents:
        if document.id in seen:
            raise InputError(f"id {document.id!r} appears more than once; ids must be unique")
        seen.add(document.id)
        ids.append(document.id)
    return ids


def _jsonl_document(content: str, line_number: int, id_field: str, text_field: str) -> Document:
    try:
        row = json.loads(content)
    except json.JSONDecodeError as error:
        raise InputError(f"line {line_number}: not valid JSON ({error.msg})") from None
    if not isinstance(row, dict):
        raise InputError(f"line {line_number}: expected a JSON object")
    doc_id = row.get(id_field)
    if isinstance(doc_id, bool) or not isinstance(doc_id, (str, int)):
        raise InputError(f"line {line_number}: field {id_field!r} must be a string or an integer")
    text = row.get(text_field)
    if not isinstance(text, str):
        return Document(doc_id, "", problem=f"line {line_number}: field {text_field!r} is missing or not a string")
    return Document(doc_id, text)

"""Bulk indexing client: embed every document of a file through the embeddings API, resumably.

    python -m embed_bulk docs.jsonl vectors.npy --base-url http://127.0.0.1:8000/v1
    embed-bulk corpus.txt vectors.jsonl --batch-size 128        (same command again resumes after a kill)

Input: JSONL rows with an id and a text field (`--id-field`, `--text-field`), or plain text: one document a line,
id = line number (1-based; blank lines skipped). Ids must be unique: resuming keys on them.

Output, by extension: `*.jsonl` rows `{"id", "embedding"}` in the order batches finished (every row carries its id);
`*.npy` a float32 matrix in input order plus `<out>.ids.jsonl` naming each row. Rows that failed for good are listed
in `<out>.failures.jsonl` and left out of the output; a rerun tries them again, and so are malformed input lines
(with `--strict` they end the run before it starts). How a kill at any moment leaves a state the next run continues
from is in `embed_bulk.store`; the retry rules are in `embed_bulk.api`; how SIGINT/SIGTERM end a run within a bound
in `embed_bulk.interrupt`; one run per output at a time, in `embed_bulk.lock`.

Requests carry `X-Priority: low` (`--priority high` to change it), so the service treats them as background work.
"""

from embed_bulk.api import BatchOutcome, CallCounters, EmbeddingsClient, Failure
from embed_bulk.cli import main
from embed_bulk.documents import Document, InputError, read_documents
from embed_bulk.job import BulkJob, Summary
from embed_bulk.lock import OutputBusy
from embed_bulk.settings import BulkSettings, parse_args
from embed_bulk.store import StoreError

__all__ = [
    "BatchOutcome",
    "BulkJob",
    "BulkSettings",
    "CallCounters",
    "Document",
    "EmbeddingsClient",
    "Failure",
    "InputError",
    "OutputBusy",
    "StoreError",
    "Summary",
    "main",
    "parse_args",
    "read_documents",
]

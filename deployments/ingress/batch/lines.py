"""A batch file's lines, in OpenAI's shapes. An input line is
``{"custom_id", "method": "POST", "url": "/v1/embeddings", "body": {...}}``; each becomes one output line
``{"id", "custom_id", "response": {"status_code", "request_id", "body"}, "error": null}``, in the output file when
its status is 200 and in the error file otherwise. A line that never reached a model (not JSON, no ``custom_id``, a
wrong method or URL) has ``"response": null`` and an ``error`` with a ``code`` and ``message``."""

from __future__ import annotations

from typing import NamedTuple

import orjson

from deployments.errors import ServiceError
from deployments.ingress.openai_errors import error_body, http_error
from deployments.ingress.batch.store import new_id

ENDPOINT = "/v1/embeddings"


class LineError(Exception):
    """A line that is no request: its error ``code`` and message."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


class Request(NamedTuple):
    custom_id: str
    body: bytes  # the /v1/embeddings request body, as JSON
    model: str | None  # the model the body names, if it names one as a string
    # For a body of one text: the rest of the body, as JSON; lines with the same one may travel as one request
    # (None: the line travels alone)
    group: bytes | None


class Finished(NamedTuple):
    """One line's outcome: ``ok`` (it goes in the output file, else in the error file) and its output line."""

    ok: bool
    line: bytes


def parse(raw: bytes) -> Request:
    """One input line as a request, or ``LineError``."""
    try:
        line = orjson.loads(raw)
    except orjson.JSONDecodeError:
        raise LineError("invalid_json_line", "the line is not valid JSON") from None
    if not isinstance(line, dict):
        raise LineError("invalid_request", "the line must be a JSON object")
    custom_id = line.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        raise LineError("missing_custom_id", "each line needs a non-empty string 'custom_id'")
    if line.get("method") != "POST":
        raise LineError("invalid_method", "the line's 'method' must be POST")
    if line.get("url") != ENDPOINT:
        raise LineError("invalid_url", f"the line's 'url' must be {ENDPOINT}, this batch's endpoint")
    if not isinstance(line.get("body"), dict):
        raise LineError("invalid_body", "the line's 'body' must be a JSON object")
    body = line["body"]
    model = body.get("model")
    text = body.get("input")
    if isinstance(text, list) and len(text) == 1:
        text = text[0]
    group = (orjson.dumps({key: value for key, value in body.items() if key != "input"}, option=orjson.OPT_SORT_KEYS)
             if isinstance(text, str) and isinstance(model, str) else None)
    return Request(custom_id, orjson.dumps(body), model if isinstance(model, str) else None, group)


def custom_id_of(raw: bytes) -> str | None:
    """The line's ``custom_id`` when it has one (for the error line of a line that is no request)."""
    try:
        line = orjson.loads(raw)
    except orjson.JSONDecodeError:
        return None
    custom_id = line.get("custom_id") if isinstance(line, dict) else None
    return custom_id if isinstance(custom_id, str) else None


def answered(custom_id: str, body: bytes) -> Finished:
    """A line the model answered: ``body`` is the /v1/embeddings response body (JSON)."""
    return Finished(True, _line(custom_id, b'{"status_code":200,"request_id":%s,"body":%s}'
                                % (orjson.dumps(new_id("req_")), body), b"null"))


def refused(custom_id: str, error: ServiceError) -> Finished:
    """A line the service answered with an error, as /v1/embeddings would have."""
    response = {"status_code": http_error(error).status, "request_id": new_id("req_"), "body": error_body(error)}
    return Finished(False, _line(custom_id, orjson.dumps(response), b"null"))


def unreadable(custom_id: str | None, error: LineError) -> Finished:
    return Finished(False, _line(custom_id, b"null", orjson.dumps({"code": error.code, "message": error.message})))


def _line(custom_id: str | None, response: bytes, error: bytes) -> bytes:
    return b'{"id":%s,"custom_id":%s,"response":%s,"error":%s}\n' % (
        orjson.dumps(new_id("batch_req_")), orjson.dumps(custom_id), response, error)


"""The OpenAI embeddings wire format: the request body, the response body, and headers that shape a request."""

from __future__ import annotations

import math
import re
from typing import Any, Literal

import numpy as np
import orjson
import pybase64
from pydantic import BaseModel, ConfigDict, Field, StrictInt, StrictStr, ValidationError, field_validator

from batching import Priority

from deployments.config import MAX_INPUTS
from deployments.errors import InvalidRequest
from deployments.wire import INPUT_TYPES

Inputs = list[str] | list[list[int]]

_INPUT_SHAPES = "a non-empty string, an array of strings, an array of token ids, or an array of token-id arrays"


class EmbeddingRequest(BaseModel):
    """``POST /v1/embeddings``. Unknown fields are accepted and ignored, as OpenAI-compatible servers do."""

    model_config = ConfigDict(extra="allow")

    model: StrictStr
    input: Any  # after validation, the items as a list (Inputs): texts, or token-id lists
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: StrictInt | None = Field(default=None, ge=1)
    user: StrictStr | None = None
    # Extensions (the openai client sends them in extra_body): the model's prompt by name (TEI's field), or the
    # kind of input ("query" | "document") mapped to the model's prompt for it; neither: the model's default prompt.
    prompt_name: StrictStr | None = None
    input_type: Literal[INPUT_TYPES] | None = None  # type: ignore[valid-type]

    @field_validator("input")
    @classmethod
    def _one_of_the_input_shapes(cls, value: Any) -> Inputs:
        return normalize_input(value)


class InvalidInputItem(ValueError):
    """One item of ``input`` is at fault: its index travels to the response's ``param``."""

    def __init__(self, message: str, index: int) -> None:
        super().__init__(message)
        self.index = index


def normalize_input(value: Any) -> Inputs:
    """``input`` as a list of items; ``ValueError`` saying what is wrong, OpenAI-style."""
    if isinstance(value, str):
        if not value.strip():
            raise ValueError("'input' must hold text, not an empty or whitespace-only string")
        return [value]
    if not isinstance(value, list) or not value:
        raise ValueError(f"'input' must be {_INPUT_SHAPES}")
    if all(_is_token(token) for token in value):
        return [value]
    if len(value) > MAX_INPUTS:
        raise ValueError(f"'input' holds {len(value)} items; at most {MAX_INPUTS} are allowed per request")
    if all(isinstance(item, str) for item in value):
        for i, item in enumerate(value):
            if not item.strip():
                raise InvalidInputItem(f"'input[{i}]' must hold text, not an empty or whitespace-only string", i)
        return value
    if all(isinstance(item, list) for item in value):
        for i, item in enumerate(value):
            if not item:
                raise InvalidInputItem(f"'input[{i}]' must not be an empty array of token ids", i)
            if not all(_is_token(token) for token in item):
                raise InvalidInputItem(f"'input[{i}]' must hold non-negative integer token ids only", i)
        return value
    raise ValueError(f"'input' must be {_INPUT_SHAPES}; its items must all be strings or all be token-id arrays")


def _is_token(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def parse_request(body: bytes) -> EmbeddingRequest:
    try:
        return EmbeddingRequest.model_validate_json(body)
    except ValidationError as exc:
        raise invalid_request_from(exc) from None


def invalid_request_from(exc: ValidationError) -> InvalidRequest:
    """The first problem pydantic found, as an OpenAI 400 naming the field."""
    error = exc.errors(include_url=False)[0]
    location = [str(part) for part in error.get("loc", ()) if part != "body"]
    param = location[0] if location else None
    if error.get("type") == "json_invalid":
        return InvalidRequest(f"the body is not valid JSON: {error.get('msg', '')}".rstrip(": "))
    message = str(error.get("msg", "invalid request"))
    message = message.removeprefix("Value error, ")
    if error.get("type") == "missing":
        message = f"'{'.'.join(location)}' is required"
    elif param and f"'{param}" not in message:
        message = f"'{'.'.join(location)}': {message}"
    cause = error.get("ctx", {}).get("error")
    return InvalidRequest(message, param=param, index=cause.index if isinstance(cause, InvalidInputItem) else None)


def parse_priority(header: str | None) -> Priority | None:
    """The priority ``X-Priority`` asks for; None where it is not sent."""
    if header is None:
        return None
    try:
        return Priority.parse(header)
    except ValueError:
        raise InvalidRequest(f"X-Priority must be 'high' or 'low', not {shortened(header)!r}",
                             param="X-Priority") from None


_SECONDS = re.compile(r"\s*(\d+(\.\d*)?|\.\d+)\s*")  # plain decimal: no signs, exponents, underscores or inf/nan


def parse_timeout(header: str | None) -> float | None:
    if header is None:
        return None
    seconds = float(header) if _SECONDS.fullmatch(header) else math.nan
    if not (math.isfinite(seconds) and seconds > 0):
        raise InvalidRequest(
            f"X-Request-Timeout must be a positive decimal number of seconds, not {shortened(header)!r}",
            param="X-Request-Timeout",
        )
    return seconds


def shortened(text: str, limit: int = 100) -> str:
    """What an error message may quote of a caller's text: at most ``limit`` characters."""
    return text if len(text) <= limit else f"{text[:limit]}… ({len(text):,} characters)"


def base64_rows(rows: np.ndarray) -> list[str]:
    """The base64 of each row's bytes (``rows``: a C-contiguous matrix). Rows whose bytes come in whole 3-byte
    groups (float32 widths divisible by 3: 384, 768, 1536, 3072) are encoded as one buffer and cut: base64 maps each
    group to 4 characters on its own, so the cuts fall between rows (one call for the whole matrix, where encoding
    one row at a time pays a call's overhead for every row)."""
    width = rows.shape[1] * rows.itemsize
    if width and width % 3 == 0:
        text = pybase64.b64encode_as_string(rows)
        step = width // 3 * 4
        return [text[start:start + step] for start in range(0, len(text), step)]
    return [pybase64.b64encode_as_string(row) for row in rows]


def embedding_response(model: str, vectors: np.ndarray, token_counts: list[int], encoding_format: str) -> bytes:
    """The response body, data in input order; base64 is the little-endian float32 bytes of each vector."""
    rows = np.ascontiguousarray(vectors, dtype="<f4")
    if encoding_format == "base64":
        embeddings: Any = base64_rows(rows)
    else:
        embeddings = rows  # orjson writes each float32 row as its shortest round-tripping decimals
    tokens = int(sum(token_counts))
    body = {
        "object": "list",
        "data": [{"object": "embedding", "index": i, "embedding": e} for i, e in enumerate(embeddings)],
        "model": model,
        "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
    }
    return orjson.dumps(body, option=orjson.OPT_SERIALIZE_NUMPY)


def model_card(name: str, created: int, owned_by: str) -> dict[str, Any]:
    return {"id": name, "object": "model", "created": created, "owned_by": owned_by}

"""A simulated OpenAI-compatible embeddings API: latency, a concurrency cap, rate limits and injectable faults.

Run it:      python -m load.upstream --port 8100 --rpm 3000 --error-rate 0.01   (every UpstreamConfig field is a flag)
In process:  with run_upstream(UpstreamConfig(base_latency_ms=1)) as upstream: ... upstream.base_url ...

Each input's embedding is `load.hashvec.hash_embedding(input, dim)`, so a client can check every result belongs to
its input. Fault settings change at run time through `POST /admin/faults`; counters are at `GET /stats`. Its Batch API
(`/v1/files`, `/v1/batches`) is `load.upstream_batches`.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import dataclasses
import functools
import math
import socket
import threading
import time
import typing
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Literal

import bpe_openai
import httpx
import numpy as np
import uvicorn
from fastapi import FastAPI, Form, Request, UploadFile
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from load.hashvec import hash_embedding
from load.upstream_batches import BatchNotFound, SimulatedBatches

MAX_INPUTS_PER_CALL = 2048

# Idle connections stay open longer than clients keep them (httpx: 5 s), so a client never reuses one being closed.
SERVER_OPTIONS: dict[str, Any] = {"log_level": "warning", "access_log": False, "timeout_keep_alive": 75}


@functools.cache
def cl100k() -> bpe_openai.Encoding:
    """OpenAI's cl100k_base tokenizer: offline and fast enough to count every input, so token counts are exact."""
    return bpe_openai.get_encoding("cl100k_base")


@dataclass(frozen=True)
class UpstreamConfig:
    """How the simulated provider behaves. Defaults: one-text calls from 50 callers give ~220 items/s."""

    dim: int = field(default=384, metadata={"help": "width of every embedding"})
    base_latency_ms: float = field(default=42.0, metadata={"help": "latency of a call before per-token cost"})
    per_token_ms: float = field(default=0.02, metadata={"help": "latency added per input token of the call"})
    jitter: float = field(default=0.32, metadata={"help": "sigma of the lognormal latency factor (median 1)"})
    max_concurrency: int = field(default=10, metadata={"help": "calls processed at once; others wait for a slot"})
    rpm: int | None = field(default=None, metadata={"help": "requests per minute before 429 (none = no limit)"})
    tpm: int | None = field(default=None, metadata={"help": "tokens per minute before 429 (none = no limit)"})
    error_rate: float = field(default=0.0, metadata={
        "help": "fraction of calls answered 500, spread evenly: the first call after it is set, then one in 1/rate"})
    max_input_tokens: int = field(default=8192, metadata={"help": "an input longer than this fails its call (400)"})
    fail_marker: str | None = field(default=None, metadata={"help": "an input containing this fails its call (400)"})
    slow_marker: str | None = field(default=None, metadata={"help": "an input containing this adds slow_ms to a call"})
    slow_rate: float = field(default=0.0, metadata={"help": "fraction of calls that take slow_ms extra"})
    slow_ms: float = field(default=1000.0, metadata={"help": "extra latency of a slow call"})
    api_key: str | None = field(default=None, metadata={"help": "require 'Authorization: Bearer <key>' on /v1"})
    seed: int = field(default=0, metadata={"help": "seed of the latency and fault random draws"})
    batch_delay_s: float = field(default=2.0, metadata={"help": "a Batch API batch completes this long after it "
                                                                "was created"})
    batch_error_rate: float = field(default=0.0, metadata={
        "help": "fraction of Batch API lines answered 500 in the error file, spread evenly"})

    def __post_init__(self) -> None:
        durations = (self.base_latency_ms, self.per_token_ms, self.jitter, self.slow_ms, self.batch_delay_s)
        rates = (self.error_rate, self.slow_rate, self.batch_error_rate)
        rules = (
            ("dim must be >= 1", self.dim >= 1),
            ("base_latency_ms, per_token_ms, jitter, slow_ms and batch_delay_s must be >= 0", min(durations) >= 0),
            ("max_concurrency must be >= 1", self.max_concurrency >= 1),
            ("rpm and tpm must be None or >= 1", all(limit is None or limit >= 1 for limit in (self.rpm, self.tpm))),
            ("error_rate, slow_rate and batch_error_rate must be within [0, 1]", all(0 <= rate <= 1 for rate in rates)),
            ("max_input_tokens must be >= 1", self.max_input_tokens >= 1),
            ("fail_marker and slow_marker must be None or non-empty", "" not in (self.fail_marker, self.slow_marker)),
        )
        problems = [problem for problem, ok in rules if not ok]
        if problems:
            raise ValueError("invalid UpstreamConfig: " + "; ".join(problems))


class ProviderError(Exception):
    """A failed call, answered in OpenAI's error shape."""

    def __init__(
        self,
        status: int,
        message: str,
        error_type: str,
        *,
        code: str | None = None,
        param: str | None = None,
        retry_after_s: float | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.error_type = error_type
        self.code = code
        self.param = param
        self.retry_after_s = retry_after_s
        self.headers = headers or {}

    def response(self) -> JSONResponse:
        headers = dict(self.headers)
        if self.retry_after_s is not None:
            headers["Retry-After"] = str(math.ceil(self.retry_after_s))
            headers["retry-after-ms"] = str(math.ceil(self.retry_after_s * 1000))
        return JSONResponse(self.body(), status_code=self.status, headers=headers)

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.error_type, "param": self.param, "code": self.code}}


def invalid_input(index: int, reason: str, code: str) -> ProviderError:
    return ProviderError(400, f"Invalid 'input[{index}]': {reason}", "invalid_request_error", code=code, param="input")


class EmbeddingsRequest(BaseModel):
    model: str
    input: str | list[str] | list[int] | list[list[int]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None
    user: str | None = None


class BatchRequest(BaseModel):
    input_file_id: str
    endpoint: Literal["/v1/embeddings"]
    completion_window: Literal["24h"]
    metadata: dict[str, str] | None = None


class FaultChanges(BaseModel):
    """Fault settings to change; fields left out keep their value, `rpm`/`tpm` null turns the limit off."""

    model_config = ConfigDict(extra="forbid")

    error_rate: float = 0.0
    slow_rate: float = 0.0
    slow_ms: float = 0.0
    rpm: int | None = None
    tpm: int | None = None
    down_for_s: float = Field(default=0.0, ge=0)


class MinuteBudget:
    """A token bucket holding up to `per_minute` units, refilled continuously at `per_minute / 60` per second, on the
    server's event loop's clock (a test's looptime, in process). Full until its first use."""

    def __init__(self, per_minute: int) -> None:
        self.per_minute = per_minute
        self._level = float(per_minute)
        self._updated: float | None = None

    def wait_s(self, amount: int) -> float:
        """Seconds until `amount` units are available; 0 if they are now."""
        now = _now()
        if self._updated is not None:
            self._level = min(self.per_minute, self._level + (now - self._updated) * self.per_minute / 60)
        self._updated = now
        return max(0.0, (amount - self._level) * 60 / self.per_minute)

    def take(self, amount: int) -> None:
        self._level -= amount

    def headers(self, kind: str) -> dict[str, str]:
        """OpenAI's `x-ratelimit-*-<kind>` headers: the limit, what is left, and how long until it is all back."""
        remaining = max(0, math.floor(self._level))
        reset_s = (self.per_minute - self._level) * 60 / self.per_minute
        return {f"x-ratelimit-limit-{kind}": str(self.per_minute), f"x-ratelimit-remaining-{kind}": str(remaining),
                f"x-ratelimit-reset-{kind}": f"{max(0.0, reset_s):.3f}s"}


@dataclass
class UpstreamStats:
    """Counters over embeddings calls that passed authentication. Items and tokens are billed on success only;
    `max_concurrent_seen` counts calls in flight at once, including those waiting for a provider slot.
    `text_call_ms` sums, over the texts billed, the time of the call each rode in (from its slot taken to its answer
    built): a text's mean of it is the least time a client waits for that text through any caller of this upstream."""

    calls: int = 0
    succeeded: int = 0
    items_billed: int = 0
    tokens_billed: int = 0
    largest_batch: int = 0
    text_call_ms: float = 0.0
    max_concurrent_seen: int = 0
    failures_by_status: Counter[int] = field(default_factory=Counter)

    def bill(self, items: int, tokens: int, call_ms: float) -> None:
        self.succeeded += 1
        self.items_billed += items
        self.tokens_billed += tokens
        self.largest_batch = max(self.largest_batch, items)
        self.text_call_ms += items * call_ms

    def as_json(self) -> dict[str, Any]:
        return {
            "calls": self.calls,
            "items_billed": self.items_billed,
            "tokens_billed": self.tokens_billed,
            "text_call_ms": self.text_call_ms,
            "rejected_429": self.failures_by_status[429],
            "errors_500": self.failures_by_status[500],
            "failed_400": self.failures_by_status[400],
            "unavailable_503": self.failures_by_status[503],
            "max_concurrent_seen": self.max_concurrent_seen,
            "batch_size": {
                "count": self.succeeded,
                "mean": self.items_billed / self.succeeded if self.succeeded else 0.0,
                "max": self.largest_batch,
            },
        }


@dataclass(frozen=True)
class EmbeddingsResult:
    body: dict[str, Any]
    processing_ms: float
    headers: dict[str, str] = field(default_factory=dict)  # the rate limits' account, when there are limits


class SimulatedProvider:
    """The provider's behaviour behind `POST /v1/embeddings`; all state lives on the server's event loop."""

    def __init__(self, config: UpstreamConfig) -> None:
        self.config = config
        self.stats = UpstreamStats()
        self._rng = np.random.default_rng(config.seed)
        self._slots = asyncio.Semaphore(config.max_concurrency)
        self._requests_budget = MinuteBudget(config.rpm) if config.rpm else None
        self._tokens_budget = MinuteBudget(config.tpm) if config.tpm else None
        self._down_until = 0.0
        self._in_flight = 0
        self._calls_at_error_rate = 0  # calls since error_rate was set
        self._tokenizer = cl100k()

    async def embeddings(self, body: bytes) -> EmbeddingsResult:
        self.stats.calls += 1
        try:
            return await self._embeddings(body)
        except ProviderError as error:
            self.stats.failures_by_status[error.status] += 1
            raise

    def answer_offline(self, body: bytes) -> tuple[int, dict[str, Any], int, int]:
        """A Batch API line's body answered as ``/v1/embeddings`` would answer it, without latency, rate limits or
        real-time billing: its status, response body, inputs and tokens."""
        try:
            request = _parse_request(body)
            items = _items(request.input)
            tokens = sum(self._check_items(items))
            self._check_dimensions(request.dimensions)
        except ProviderError as error:
            return error.status, error.body(), 0, 0
        return 200, self._response(request, items, tokens), len(items), tokens

    def reset_stats(self) -> None:
        self.stats = UpstreamStats(max_concurrent_seen=self._in_flight)

    def set_faults(self, changes: FaultChanges) -> None:
        updates = changes.model_dump(exclude_unset=True)
        down_for_s = updates.pop("down_for_s", None)
        try:
            config = dataclasses.replace(self.config, **updates)
        except ValueError as error:
            raise ProviderError(400, str(error), "invalid_request_error") from error
        if config.rpm != self.config.rpm:
            self._requests_budget = MinuteBudget(config.rpm) if config.rpm else None
        if config.tpm != self.config.tpm:
            self._tokens_budget = MinuteBudget(config.tpm) if config.tpm else None
        if down_for_s is not None:
            self._down_until = _now() + down_for_s
        if config.error_rate != self.config.error_rate:
            self._calls_at_error_rate = 0
        self.config = config

    def faults(self) -> dict[str, Any]:
        config = self.config
        return {
            "error_rate": config.error_rate,
            "slow_rate": config.slow_rate,
            "slow_ms": config.slow_ms,
            "rpm": config.rpm,
            "tpm": config.tpm,
            "down_for_s": max(0.0, self._down_until - _now()),
        }

    async def _embeddings(self, body: bytes) -> EmbeddingsResult:
        down_for_s = self._down_until - _now()
        if down_for_s > 0:
            raise ProviderError(503, "The server is temporarily unavailable.", "server_error", retry_after_s=down_for_s)
        request = _parse_request(body)
        items = _items(request.input)
        tokens = sum(self._check_items(items))
        self._check_dimensions(request.dimensions)
        self._charge_rate_limits(tokens)
        self._in_flight += 1
        self.stats.max_concurrent_seen = max(self.stats.max_concurrent_seen, self._in_flight)
        try:
            async with self._slots:
                started = _now()
                await asyncio.sleep(self._latency_s(items, tokens))
                if self._fails_this_call():
                    raise ProviderError(500, "The server had an error while processing your request.", "server_error")
                response = self._response(request, items, tokens)
                processing_ms = (_now() - started) * 1000
                self.stats.bill(len(items), tokens, processing_ms)
                return EmbeddingsResult(response, processing_ms, self._rate_limit_headers())
        finally:
            self._in_flight -= 1

    def _fails_this_call(self) -> bool:
        # Counted, not drawn: call k since the rate was set fails when floor(k * rate) steps up (k = 0, 1/rate, ...),
        # so a short fault window still sees its share (a 5% draw over 20 calls gives none a third of the time).
        k, rate = self._calls_at_error_rate, self.config.error_rate
        self._calls_at_error_rate += 1
        return rate > 0 and math.floor(k * rate) != math.floor((k - 1) * rate)

    def _check_items(self, items: list[str] | list[list[int]]) -> list[int]:
        """Token count of every input; the first invalid input fails the call with 400 naming its index."""
        if not items or len(items) > MAX_INPUTS_PER_CALL:
            raise ProviderError(
                400,
                f"'input' must hold between 1 and {MAX_INPUTS_PER_CALL} items, got {len(items)}.",
                "invalid_request_error",
                param="input",
            )
        config = self.config
        tokens = []
        for index, item in enumerate(items):
            count = len(self._tokenizer.encode_ordinary(item)) if isinstance(item, str) else len(item)
            if count == 0:
                raise invalid_input(index, "the input must not be empty.", "empty_input")
            if count > config.max_input_tokens:
                raise invalid_input(
                    index,
                    f"maximum input length is {config.max_input_tokens} tokens, got {count} tokens.",
                    "context_length_exceeded",
                )
            if config.fail_marker and isinstance(item, str) and config.fail_marker in item:
                raise invalid_input(index, "the provider rejected this input.", "invalid_input")
            tokens.append(count)
        return tokens

    def _check_dimensions(self, dimensions: int | None) -> None:
        if dimensions is not None and not 1 <= dimensions <= self.config.dim:
            raise ProviderError(
                400,
                f"'dimensions' must be between 1 and {self.config.dim}, got {dimensions}.",
                "invalid_request_error",
                param="dimensions",
            )

    def _charge_rate_limits(self, tokens: int) -> None:
        if self._tokens_budget and tokens > self._tokens_budget.per_minute:
            raise ProviderError(
                400,
                f"Request too large: {tokens} tokens requested, the limit is {self._tokens_budget.per_minute} per min.",
                "invalid_request_error",
                code="request_too_large",
                param="input",
            )
        candidates = [(self._requests_budget, 1, "requests"), (self._tokens_budget, tokens, "tokens")]
        limits = [(budget, amount, kind) for budget, amount, kind in candidates if budget is not None]
        for budget, amount, kind in limits:
            wait_s = budget.wait_s(amount)
            if wait_s > 0:
                raise ProviderError(
                    429,
                    f"Rate limit reached for {kind} per min: limit {budget.per_minute}, requested {amount}. "
                    f"Please try again in {wait_s:.3f}s.",
                    kind,
                    code="rate_limit_exceeded",
                    retry_after_s=wait_s,
                    headers=self._rate_limit_headers(),
                )
        for budget, amount, _ in limits:
            budget.take(amount)

    def _rate_limit_headers(self) -> dict[str, str]:
        headers: dict[str, str] = {}
        for budget, kind in ((self._requests_budget, "requests"), (self._tokens_budget, "tokens")):
            if budget is not None:
                headers.update(budget.headers(kind))
        return headers

    def _latency_s(self, items: list[str] | list[list[int]], tokens: int) -> float:
        config = self.config
        latency_ms = (config.base_latency_ms + config.per_token_ms * tokens) * self._rng.lognormal(0.0, config.jitter)
        has_slow_input = config.slow_marker is not None and any(
            isinstance(item, str) and config.slow_marker in item for item in items
        )
        if has_slow_input or self._rng.random() < config.slow_rate:
            latency_ms += config.slow_ms
        return latency_ms / 1000

    def _response(self, request: EmbeddingsRequest, items: list[str] | list[list[int]], tokens: int) -> dict[str, Any]:
        vectors = np.stack([hash_embedding(item, self.config.dim) for item in items])
        if request.dimensions is not None:
            vectors = vectors[:, : request.dimensions]
            vectors /= np.linalg.norm(vectors, axis=1, keepdims=True)
        encode = _base64_floats if request.encoding_format == "base64" else np.ndarray.tolist
        data = [{"object": "embedding", "index": i, "embedding": encode(vector)} for i, vector in enumerate(vectors)]
        usage = {"prompt_tokens": tokens, "total_tokens": tokens}
        return {"object": "list", "data": data, "model": request.model, "usage": usage}


def _parse_request(body: bytes) -> EmbeddingsRequest:
    try:
        return EmbeddingsRequest.model_validate_json(body)
    except ValidationError as error:
        first = error.errors()[0]
        location = ".".join(str(part) for part in first["loc"])
        param = str(first["loc"][0]) if first["loc"] else None
        raise ProviderError(400, f"Invalid request: {location}: {first['msg']}", "invalid_request_error", param=param)


def _items(raw: str | list[str] | list[int] | list[list[int]]) -> list[str] | list[list[int]]:
    if isinstance(raw, str):
        return [raw]
    if raw and isinstance(raw[0], int):
        return [typing.cast(list[int], raw)]
    return typing.cast(list[str] | list[list[int]], raw)


def _now() -> float:
    """The provider's clock: its event loop's."""
    return asyncio.get_running_loop().time()


def _base64_floats(vector: np.ndarray) -> str:
    return base64.b64encode(vector.astype("<f4").tobytes()).decode("ascii")


def create_app(config: UpstreamConfig) -> FastAPI:
    provider = SimulatedProvider(config)
    batches = SimulatedBatches(provider)
    app = FastAPI(title="Simulated upstream embeddings API")

    @app.exception_handler(ProviderError)
    async def answer_provider_error(_: Request, error: ProviderError) -> JSONResponse:
        return error.response()

    @app.exception_handler(BatchNotFound)
    async def answer_not_found(_: Request, error: BatchNotFound) -> JSONResponse:
        return ProviderError(404, str(error), "invalid_request_error").response()

    def authorized(request: Request) -> None:
        if config.api_key is not None and request.headers.get("authorization") != f"Bearer {config.api_key}":
            raise ProviderError(401, "Incorrect API key provided.", "invalid_request_error", code="invalid_api_key")

    @app.post("/v1/embeddings")
    async def embeddings(request: Request) -> JSONResponse:
        authorized(request)
        result = await provider.embeddings(await request.body())
        headers = {"openai-processing-ms": f"{result.processing_ms:.0f}", **result.headers}
        return JSONResponse(result.body, headers=headers)

    @app.post("/v1/files")
    async def create_file(request: Request, file: UploadFile, purpose: str = Form()) -> dict[str, Any]:
        authorized(request)
        return batches.add_file(file.filename or "upload.jsonl", purpose, await file.read())

    @app.get("/v1/files/{file_id}")
    async def get_file(request: Request, file_id: str) -> dict[str, Any]:
        authorized(request)
        return batches.file(file_id)

    @app.get("/v1/files/{file_id}/content")
    async def file_content(request: Request, file_id: str) -> Response:
        authorized(request)
        return Response(batches.content(file_id), media_type="application/octet-stream")

    @app.post("/v1/batches")
    async def create_batch(request: Request, body: BatchRequest) -> dict[str, Any]:
        authorized(request)
        return batches.create(body.input_file_id, body.endpoint, body.completion_window, body.metadata, _now())

    @app.get("/v1/batches")
    async def list_batches(request: Request, limit: int = 20) -> dict[str, Any]:
        authorized(request)
        data = batches.list(limit)
        return {"object": "list", "data": data, "first_id": data[0]["id"] if data else None,
                "last_id": data[-1]["id"] if data else None, "has_more": False}

    @app.get("/v1/batches/{batch_id}")
    async def get_batch(request: Request, batch_id: str) -> dict[str, Any]:
        authorized(request)
        return await batches.retrieve(batch_id, _now())

    @app.post("/v1/batches/{batch_id}/cancel")
    async def cancel_batch(request: Request, batch_id: str) -> dict[str, Any]:
        authorized(request)
        return batches.cancel(batch_id, _now())

    @app.get("/stats")
    async def stats() -> dict[str, Any]:
        return {**provider.stats.as_json(), "batch": batches.stats.as_json()}

    @app.post("/stats/reset")
    async def reset_stats() -> dict[str, Any]:
        provider.reset_stats()
        batches.reset_stats()
        return {**provider.stats.as_json(), "batch": batches.stats.as_json()}

    @app.post("/admin/faults")
    async def set_faults(changes: FaultChanges) -> dict[str, Any]:
        provider.set_faults(changes)
        return provider.faults()

    return app


@dataclass(frozen=True)
class RunningUpstream:
    """A simulated upstream serving in this process; `base_url` is what an OpenAI client takes."""

    root_url: str
    client: httpx.Client

    @property
    def base_url(self) -> str:
        return f"{self.root_url}/v1"

    def stats(self) -> dict[str, Any]:
        return self._call("GET", "/stats")

    def reset(self) -> dict[str, Any]:
        return self._call("POST", "/stats/reset")

    def set_faults(self, **changes: Any) -> dict[str, Any]:
        return self._call("POST", "/admin/faults", json=changes)

    def _call(self, method: str, path: str, json: dict[str, Any] | None = None) -> dict[str, Any]:
        response = self.client.request(method, path, json=json)
        response.raise_for_status()
        return response.json()


@contextmanager
def run_upstream(
    config: UpstreamConfig | None = None, host: str = "127.0.0.1", port: int = 0, startup_timeout_s: float = 10.0
) -> Iterator[RunningUpstream]:
    """Serve a simulated upstream on `host:port` (0: a free port) in a background thread until the block exits."""
    app = create_app(config or UpstreamConfig())
    server = uvicorn.Server(uvicorn.Config(app, lifespan="off", timeout_graceful_shutdown=1, **SERVER_OPTIONS))
    with socket.create_server((host, port)) as listener:
        thread = threading.Thread(target=server.run, kwargs={"sockets": [listener]}, name="simulated-upstream")
        thread.start()
        try:
            _wait_until_started(server, thread, startup_timeout_s)
            bound_host, bound_port = listener.getsockname()[:2]
            root_url = f"http://{bound_host}:{bound_port}"
            with httpx.Client(base_url=root_url, timeout=10.0) as client:
                upstream = RunningUpstream(root_url, client)
                upstream.stats()
                yield upstream
        finally:
            server.should_exit = True
            thread.join()


def _wait_until_started(server: uvicorn.Server, thread: threading.Thread, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("the simulated upstream did not start")
        time.sleep(0.01)


def _argument_type(hint: Any) -> Callable[[str], Any]:
    """How argparse reads a config field: its type, and for optional fields also the word 'none'."""
    members = typing.get_args(hint)
    if type(None) not in members:
        return hint
    (value_type,) = [member for member in members if member is not type(None)]

    def parse(text: str) -> Any:
        return None if text.lower() == "none" else value_type(text)

    parse.__name__ = value_type.__name__
    return parse


def parse_args(argv: list[str] | None = None,
               prog: str = "python -m load.upstream") -> tuple[argparse.Namespace, UpstreamConfig]:
    parser = argparse.ArgumentParser(
        prog=prog,
        description="A simulated OpenAI-compatible embeddings API.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--host", default="127.0.0.1", help="address to bind")
    parser.add_argument("--port", type=int, default=8100, help="port to bind")
    hints = typing.get_type_hints(UpstreamConfig)
    for config_field in dataclasses.fields(UpstreamConfig):
        parser.add_argument(
            f"--{config_field.name.replace('_', '-')}",
            type=_argument_type(hints[config_field.name]),
            default=config_field.default,
            help=config_field.metadata["help"],
        )
    args = parser.parse_args(argv)
    config_values = {name: getattr(args, name) for name in (f.name for f in dataclasses.fields(UpstreamConfig))}
    try:
        return args, UpstreamConfig(**config_values)
    except ValueError as error:
        parser.error(str(error))


def main(argv: list[str] | None = None) -> None:
    args, config = parse_args(argv)
    uvicorn.run(create_app(config), host=args.host, port=args.port, **SERVER_OPTIONS)


if __name__ == "__main__":
    main()

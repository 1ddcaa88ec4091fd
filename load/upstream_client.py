"""A lean asyncio client for an OpenAI-compatible embeddings API: one call embeds a list of texts.

Built on one ``aiohttp.ClientSession``: a load generator needs a client that costs little CPU per call, since it
shares the machine with the service it measures, and httpx's AsyncClient costs many times aiohttp's. Vectors come as
base64 (little-endian float32), which is cheaper for both sides than JSON floats.
"""

from __future__ import annotations

import asyncio
import base64
import json
from typing import Any, Mapping

import aiohttp
import numpy as np


class UpstreamError(Exception):
    """The upstream answered with an error status."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"upstream answered {status}: {message}")
        self.status = status


class UpstreamClient:
    """``embed(texts)``: one ``POST /v1/embeddings`` call; ``stats``/``reset_stats``: the simulator's counters.
    ``priority``, when given, goes in this service's ``X-Priority`` header; ``headers`` (an API key) with every call."""

    def __init__(self, root_url: str, *, model: str = "sim-embed", connections: int = 256, timeout_s: float = 120.0,
                 priority: str | None = None, headers: Mapping[str, str] | None = None):
        self.root_url = root_url.rstrip("/")
        self.model = model
        self._headers = {"Content-Type": "application/json", **(headers or {})}
        if priority is not None:
            self._headers["X-Priority"] = priority
        self.calls = 0
        self._connections = connections
        self._timeout = aiohttp.ClientTimeout(total=timeout_s)
        self._session: aiohttp.ClientSession | None = None

    async def __aenter__(self) -> "UpstreamClient":
        connector = aiohttp.TCPConnector(limit=self._connections, limit_per_host=self._connections)
        self._session = aiohttp.ClientSession(connector=connector, timeout=self._timeout)
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def embed(self, texts: list[str]) -> list[np.ndarray]:
        """The embeddings of ``texts`` in input order, from one upstream call."""
        self.calls += 1
        body = json.dumps({"model": self.model, "input": texts, "encoding_format": "base64"})
        async with self._require_session().post(
            f"{self.root_url}/v1/embeddings", data=body, headers=self._headers
        ) as response:
            raw = await response.read()
            if response.status != 200:
                raise UpstreamError(response.status, raw.decode("utf-8", "replace")[:300])
        data = sorted(json.loads(raw)["data"], key=lambda entry: entry["index"])
        return [np.frombuffer(base64.b64decode(entry["embedding"]), dtype="<f4") for entry in data]

    async def embed_one(self, text: str) -> np.ndarray:
        """One text in one call: what a load generator's single-text caller sends."""
        return (await self.embed([text]))[0]

    async def stats(self) -> dict[str, Any]:
        return await self._json("GET", "/stats")

    async def reset_stats(self) -> dict[str, Any]:
        """Zero the counters; the answer's ``max_concurrent_seen`` is the number of calls in flight now."""
        return await self._json("POST", "/stats/reset")

    async def wait_idle(self, timeout_s: float = 30.0, poll_s: float = 0.05) -> None:
        """Return once no call is in flight at the upstream (calls left over by a run that was cut short)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while (await self.reset_stats())["max_concurrent_seen"] > 0:
            if loop.time() > deadline:
                raise TimeoutError(f"upstream still busy after {timeout_s} s")
            await asyncio.sleep(poll_s)

    async def _json(self, method: str, path: str) -> dict[str, Any]:
        async with self._require_session().request(method, f"{self.root_url}{path}") as response:
            response.raise_for_status()
            return await response.json()

    def _require_session(self) -> aiohttp.ClientSession:
        if self._session is None:
            raise RuntimeError("use UpstreamClient inside 'async with'")
        return self._session

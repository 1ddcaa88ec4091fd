"""``GET /v1/organization/usage/embeddings``: the tenants' usage in the shape of OpenAI's organization usage API for
embeddings, for admin keys only (a keys file's tenant with ``admin: true``; every caller while no key is required).

A tenant is a ``project_id``. Buckets are a UTC day (``bucket_width=1d``, the default) or hour (``1h``), from
``start_time`` (required) to ``end_time`` (default: now), at most ``limit`` of them a page (``next_page`` names the
next); ``group_by`` takes ``project_id`` and ``model`` (``user_id`` and ``api_key_id`` are always null here). Each result
adds two fields to OpenAI's: ``input_cached_tokens``, of ``input_tokens`` those answered without the backend (the
cache, or the same input in flight or repeated), and ``input_billed_tokens``, what the provider billed for the
tenant's inputs (0 for a local model). Read from the ledger every replica writes to (``deployments/usage.py``): this
replica's counts up to now, the others' up to a second ago.
"""

from __future__ import annotations

import time
from typing import Any

from fastapi import FastAPI, Request

from deployments.errors import InvalidRequest, PermissionDenied
from deployments.ingress.auth import ApiKeys
from deployments.usage import BILLED_TOKENS, CACHED_TOKENS, COUNTS, HOUR_S, REQUESTS, TOKENS, TenantUsage

WIDTHS = {"1h": HOUR_S, "1d": 24 * HOUR_S}
LIMITS = {"1h": (24, 168), "1d": (7, 31)}  # OpenAI's default and most buckets a page
GROUPS = ("project_id", "model", "user_id", "api_key_id")
PATH = "/v1/organization/usage/embeddings"


class UsageRoutes:
    def __init__(self, api_keys: ApiKeys, usage: TenantUsage) -> None:
        self._api_keys = api_keys
        self._usage = usage

    def add_to(self, app: FastAPI) -> None:
        app.add_api_route(PATH, self.embeddings_usage, methods=["GET"])

    async def embeddings_usage(self, request: Request) -> dict[str, Any]:
        tenant = self._api_keys.check(request.headers.get("authorization"))
        if self._api_keys.required and not tenant.admin:
            raise PermissionDenied("the usage API takes an admin key (a tenant with admin: true in the keys file)")
        query = request.query_params
        width_name = query.get("bucket_width", "1d")
        if width_name not in WIDTHS:
            raise InvalidRequest(f"bucket_width must be one of {', '.join(WIDTHS)}", param="bucket_width")
        width = WIDTHS[width_name]
        start = _whole(query.get("page") or query.get("start_time"), "start_time")
        end = _whole(query.get("end_time"), "end_time") if "end_time" in query else int(time.time())
        default_limit, most = LIMITS[width_name]
        limit = _whole(query.get("limit", str(default_limit)), "limit")
        if not 1 <= limit <= most:
            raise InvalidRequest(f"limit must be between 1 and {most} for bucket_width {width_name}", param="limit")
        groups = query.getlist("group_by")
        if any(group not in GROUPS for group in groups):
            raise InvalidRequest(f"group_by takes {', '.join(GROUPS)}", param="group_by")
        first = start // width * width
        last = min(end, first + limit * width)
        self._usage.flush_now()
        await self._usage.written()
        rows = [] if self._usage.store is None else await self._usage.store.usage(first, last)
        buckets = []
        for bucket_start in range(first, last, width):
            results: dict[tuple[Any, ...], list[int]] = {}
            for hour, project, model, *counts in rows:
                if bucket_start <= hour < bucket_start + width:
                    key = (project if "project_id" in groups else None, model if "model" in groups else None)
                    totals = results.setdefault(key, [0] * len(COUNTS))
                    for position, count in enumerate(counts):
                        totals[position] += count
            buckets.append({"object": "bucket", "start_time": bucket_start, "end_time": bucket_start + width,
                            "results": [_result(project, model, counts) for (project, model), counts in results.items()]})
        more = last < end
        return {"object": "page", "data": buckets, "has_more": more, "next_page": str(last) if more else None}


def _result(project: str | None, model: str | None, counts: list[int]) -> dict[str, Any]:
    return {"object": "organization.usage.embeddings.result", "input_tokens": counts[TOKENS],
            "num_model_requests": counts[REQUESTS], "project_id": project, "user_id": None, "api_key_id": None,
            "model": model, "input_cached_tokens": counts[CACHED_TOKENS], "input_billed_tokens": counts[BILLED_TOKENS]}


def _whole(value: str | None, param: str) -> int:
    if value is None or not value.strip().isdigit():
        raise InvalidRequest(f"{param} must be a whole number (Unix seconds, or a count)", param=param)
    return int(value)

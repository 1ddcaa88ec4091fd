"""The provider's account as its responses state it: OpenAI's ``x-ratelimit-{limit,remaining,reset}-{requests,tokens}``
headers (``reset`` a duration such as ``6m0s``, ``1.5s`` or ``120ms``)."""

from __future__ import annotations

import re
from typing import Mapping

from deployments.model.quota.budget import KINDS, Account

_DURATION = re.compile(r"(\d+(?:\.\d+)?)(ms|h|m|s)")
_UNIT_S = {"h": 3600.0, "m": 60.0, "s": 1.0, "ms": 0.001}


def provider_accounts(headers: Mapping[str, str]) -> dict[str, Account]:
    """Each limit the headers speak of (``requests``, ``tokens``); a limit they do not mention is left out."""
    accounts = {}
    for kind in KINDS:
        limit = _count(headers.get(f"x-ratelimit-limit-{kind}"))
        remaining = _count(headers.get(f"x-ratelimit-remaining-{kind}"))
        reset_s = duration_s(headers.get(f"x-ratelimit-reset-{kind}"))
        if (limit, remaining, reset_s) != (None, None, None):
            accounts[kind] = Account(limit, remaining, reset_s)
    return accounts


def duration_s(text: str | None) -> float | None:
    """``6m0s`` -> 360.0, ``120ms`` -> 0.12, a bare number -> seconds; None if it is not a duration."""
    if text is None:
        return None
    text = text.strip()
    try:
        return max(0.0, float(text))
    except ValueError:
        pass
    parts = _DURATION.findall(text)
    if not parts or "".join(number + unit for number, unit in parts) != text:
        return None
    return sum(float(number) * _UNIT_S[unit] for number, unit in parts)


def _count(text: str | None) -> int | None:
    if text is None:
        return None
    try:
        return max(0, int(text.strip()))
    except ValueError:
        return None

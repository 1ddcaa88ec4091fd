"""Bearer-key auth: when ``EMBEDDINGS_API_KEYS`` (comma-separated) is set, every ``/v1`` route needs one of them.

The keys may instead be in a file that ``EMBEDDINGS_API_KEYS_FILE`` names (comma- or newline-separated), which
keeps them out of Ray's runtime_env logs (see ``deployments.secrets``).
"""

from __future__ import annotations

import hmac
import os
from typing import Mapping

from deployments.errors import AuthenticationFailed
from deployments.secrets import read_secret

API_KEYS_ENV = "EMBEDDINGS_API_KEYS"


class ApiKeys:
    def __init__(self, keys: list[str]) -> None:
        self._keys = [key.encode("utf-8") for key in keys]

    @classmethod
    def from_env(cls, environ: Mapping[str, str] = os.environ) -> "ApiKeys":
        listed = read_secret(API_KEYS_ENV, environ).replace("\n", ",")
        return cls([key.strip() for key in listed.split(",") if key.strip()])

    @property
    def required(self) -> bool:
        return bool(self._keys)

    def check(self, authorization: str | None) -> None:
        """Raise ``AuthenticationFailed`` unless the header carries a known key (never logged or echoed)."""
        if not self._keys:
            return
        scheme, _, presented = (authorization or "").partition(" ")
        if scheme.lower() != "bearer" or not presented.strip():
            raise AuthenticationFailed(
                "missing API key: send it as 'Authorization: Bearer <key>'"
            )
        candidate = presented.strip().encode("utf-8")
        matched = False
        for key in self._keys:  # compare with every key, so the time taken does not say which one matched
            matched |= hmac.compare_digest(candidate, key)
        if not matched:
            raise AuthenticationFailed("incorrect API key provided")

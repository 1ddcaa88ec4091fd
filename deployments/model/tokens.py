"""OpenAI's token encodings (cl100k_base, o200k_base) offline, through ``bpe-openai``, which embeds the tables.

``tiktoken`` would download its tables at run time. Loading an encoding takes about a second, so each is loaded
once per process; ``load_async`` does it off the event loop.
"""

from __future__ import annotations

import asyncio
import functools
from typing import Sequence

import bpe_openai

DEFAULT_ENCODING = "cl100k_base"


class TokenDecodeError(ValueError):
    """Token ids that are not tokens of the encoding."""


@functools.lru_cache(maxsize=None)
def get_encoding(name: str = DEFAULT_ENCODING) -> bpe_openai.Encoding:
    return bpe_openai.get_encoding(name)


async def load_async(name: str = DEFAULT_ENCODING) -> bpe_openai.Encoding:
    return await asyncio.to_thread(get_encoding, name)


def encoding_name_for_model(model: str | None) -> str:
    """The encoding an OpenAI model counts tokens in; cl100k_base for models bpe-openai does not know."""
    if model:
        try:
            return bpe_openai.encoding_name_for_model(model)
        except (KeyError, ValueError, bpe_openai.TokenizerError):
            pass
    return DEFAULT_ENCODING


def encode(text: str, encoding: str = DEFAULT_ENCODING) -> list[int]:
    """Token ids of ``text``; special-token text such as ``<|endoftext|>`` is encoded as ordinary text."""
    return get_encoding(encoding).encode_ordinary(text)


def count(text: str, encoding: str = DEFAULT_ENCODING) -> int:
    """``len(encode(text, encoding))``, counted by the Rust tokenizer without building the list of ids (a Python
    list of ints, most of the cost of ``encode``), paid for every input of every request (a cached one too, for
    ``usage``)."""
    enc = get_encoding(encoding)
    try:
        return enc._backend.count(text)
    except UnicodeEncodeError:  # a lone surrogate, which ``encode`` replaces before encoding
        return len(encode(text, encoding))


def decode(ids: Sequence[int], encoding: str = DEFAULT_ENCODING) -> str:
    """The text of ``ids``; ``TokenDecodeError`` if any id is not a token of the encoding."""
    enc = get_encoding(encoding)
    for position, token in enumerate(ids):
        if not isinstance(token, int) or isinstance(token, bool) or not 0 <= token <= enc.max_token_value:
            raise TokenDecodeError(f"token {position} ({token!r}) is not a {enc.name} token id")
    try:
        raw = enc.decode_bytes(ids)
    except KeyError:
        bad = next(token for token in ids if not _defined(enc, token))
        raise TokenDecodeError(f"token id {bad} is not defined in {enc.name}") from None
    # A chunk cut mid-character (LangChain splits long texts by tokens) decodes with U+FFFD there.
    return raw.decode("utf-8", errors="replace")


def _defined(enc: bpe_openai.Encoding, token: int) -> bool:
    try:
        enc.decode_single_token_bytes(token)
    except KeyError:
        return False
    return True

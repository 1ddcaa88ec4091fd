"""Texts to the token ids a model embeds, truncated at its max sequence length, reading only the head of a long text.

A dedicated ``tokenizers.Tokenizer`` whose truncation is set once, when it is built, and never changed: the
tokenizers library encodes with ``&self``, so threads may share it. (The old backend shared the transformers
tokenizer with ``SentenceTransformer.encode``, which switches truncation on and off around each call, so a count
running beside a batch could embed a 500,000-token input.)

Bounded reading: the ids of a text cut just before a whitespace character are exactly the first ids of the whole
text, for every tokenizer that splits words at whitespace (WordPiece, byte-level BPE, Metaspace/SentencePiece
pre-tokenizers). So each text is first cut to about ``max_seq_length x CHARS_PER_TOKEN`` characters, there; only
if that head yields fewer ids than the model takes (whitespace runs, very long words) is a four times longer head
read, and so on up to the whole text. A multi-megabyte text of prose costs what a 4,096-character one does.
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

from tokenizers import Tokenizer

# English prose runs 4-6 characters a word piece; 16 leaves room for markup, numbers and long words.
CHARS_PER_TOKEN = 16
_CUT_BEFORE = (" ", "\n", "\t", "\r")  # whitespace to every tokenizer (unlike, say, U+001C, which BERT deletes)


class BoundedTokenizer:
    def __init__(self, tokenizer_file: Path | str, max_length: int, *, lowercase: bool = False) -> None:
        tokenizer = Tokenizer.from_file(str(tokenizer_file))
        padding = tokenizer.padding
        self.pad_id: int = padding["pad_id"] if padding else 0
        tokenizer.no_padding()  # a tokenizer.json may fix a padding length (MiniLM's says 128): padding is embed's job
        tokenizer.enable_truncation(max_length)  # the only place truncation is set
        self._tokenizer = tokenizer
        self.max_length = max_length
        self.special_tokens = tokenizer.num_special_tokens_to_add(is_pair=False)  # [CLS] and [SEP] for BERT
        self.head_chars = max_length * CHARS_PER_TOKEN
        self._lowercase = lowercase
        self.chars_tokenized = 0  # characters handed to the tokenizer so far (what the head cut saves shows here)

    def encode_many(self, texts: Sequence[str]) -> list[tuple[int, ...]]:
        """Each text's ids, special tokens included, at most ``max_length``; one batch call per round of heads."""
        ids: list[tuple[int, ...] | None] = [None] * len(texts)
        pending = list(range(len(texts)))
        chars = self.head_chars
        while pending:
            heads = [head(texts[i], chars) for i in pending]
            self.chars_tokenized += sum(map(len, heads))
            encodings = self._tokenizer.encode_batch([h.lower() for h in heads] if self._lowercase else heads)
            short: list[int] = []
            for i, cut, encoding in zip(pending, heads, encodings):
                if len(encoding.ids) < self.max_length and len(cut) < len(texts[i]):
                    short.append(i)  # the head ran out of tokens before the model's limit: read more of it
                else:
                    ids[i] = tuple(encoding.ids)
            pending, chars = short, chars * 4
        return ids  # type: ignore[return-value]


def head(text: str, chars: int) -> str:
    """``text`` if it is at most ``chars`` long; else its longest head of at most ``chars`` characters that ends
    just before whitespace (and not in a run of it), so no word is cut; "" if there is none."""
    if len(text) <= chars:
        return text
    cut = max(text.rfind(space, 0, chars + 1) for space in _CUT_BEFORE)
    while cut > 0 and text[cut - 1] in _CUT_BEFORE:
        cut -= 1
    return text[:max(cut, 0)]

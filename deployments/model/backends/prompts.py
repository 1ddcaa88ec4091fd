"""A model's named prompts (``config_sentence_transformers.json``) and which one a request gets.

A request names a prompt (``prompt_name``, as TEI and sentence-transformers name it: one of the model's, else a
400), or says what its inputs are (``input_type``: ``query`` or ``document``, so a client need not know each
model's names: sentence-transformers' ``encode_query`` / ``encode_document`` rule picks the prompt, and a model
without one for that type gets none), or neither: the default prompt then applies (the model entry's
``default_prompt_name``, else the model's own), or none. The prompt's text is put before the input's, as
sentence-transformers does, before the input is tokenized.
"""

from __future__ import annotations

from dataclasses import dataclass

from deployments.wire import INPUT_TYPES
_PROMPTS_OF_TYPE = {"query": ("query",), "document": ("document", "passage", "corpus")}


class UnknownPrompt(ValueError):
    """The prompt asked for is not one of the model's."""


@dataclass(frozen=True)
class Prompts:
    named: tuple[tuple[str, str], ...] = ()  # (name, text)
    default_name: str | None = None

    def __post_init__(self) -> None:
        if self.default_name is not None:
            self.text(self.default_name)  # UnknownPrompt naming the valid ones

    def choose(self, prompt_name: str | None = None, input_type: str | None = None) -> str:
        """The text to put before each input of a request that sent ``prompt_name`` and/or ``input_type``."""
        if prompt_name is not None and input_type is not None:
            raise UnknownPrompt("send prompt_name or input_type, not both")
        if prompt_name is not None:
            return self.text(prompt_name)
        if input_type is not None:
            if input_type not in INPUT_TYPES:
                raise UnknownPrompt(f"input_type must be one of {', '.join(INPUT_TYPES)}, not {input_type!r}")
            names = dict(self.named)
            return next((names[name] for name in _PROMPTS_OF_TYPE[input_type] if name in names), "")
        return "" if self.default_name is None else self.text(self.default_name)

    def text(self, name: str) -> str:
        for known, text in self.named:
            if known == name:
                return text
        names = ", ".join(repr(known) for known, _ in self.named)
        valid = f"this model's prompts are {names}" if names else "this model has no prompts"
        raise UnknownPrompt(f"unknown prompt_name {str(name)[:100]!r}; {valid}")

"""The configuration reference (docs/configuration.md) is the code's: every setting of the application's args (the pydantic models
of ``deployments/config.py``) and of the batcher (``BatcherConfig``) has a row with its default, and no row names a
setting the code does not have. Adding a setting without documenting it, or changing a default, fails here.

Each section of the reference is a heading naming its class in backticks and parentheses, e.g.
``### `cache:` (`CacheConfig`)``, followed by a table ``| field | default | meaning |``. A default is a YAML literal
in backticks (`` `25.0` ``, `` `null` ``, `` `local` ``), ``required``, or, for a nested section, prose pointing to it.
"""

from __future__ import annotations

import dataclasses
import re
import typing
from pathlib import Path
from typing import Any

import pytest
import yaml
from pydantic import BaseModel

from batching import BatcherConfig
from deployments.config import (AppConfig, BatchConfig, CacheConfig, IngressConfig, ModelConfig, ProviderBatchConfig,
                                QuotaLimits)

REFERENCE = Path(__file__).resolve().parents[2] / "docs" / "configuration.md"
ROW = re.compile(r"^\|\s*`(?P<field>\w+)`\s*\|(?P<default>[^|]*)\|(?P<meaning>.*)\|\s*$")
LITERAL = re.compile(r"^`(?P<value>[^`]*)`")
REQUIRED = "required"
NESTED = object()  # a default documented in prose: the nested section's own table

# A model entry's ``batching:`` takes every BatcherConfig field and ``max_batch_tokens``, its name for the
# ``max_batch_cost`` budget counted in the backend's tokens (deployments/config.py turns one into the other).
MODEL_ENTRY_BATCHING = {"max_batch_tokens": None}

Section = type[BaseModel] | type[BatcherConfig]
SECTIONS: dict[str, Section] = {
    "AppConfig": AppConfig,
    "ModelConfig": ModelConfig,
    "BatcherConfig": BatcherConfig,
    "CacheConfig": CacheConfig,
    "QuotaLimits": QuotaLimits,
    "ProviderBatchConfig": ProviderBatchConfig,
    "IngressConfig": IngressConfig,
    "BatchConfig": BatchConfig,
}


def documented(section: str) -> dict[str, tuple[str, str]]:
    """``field -> (default cell, meaning cell)`` from the table under the one heading naming ``(`<section>`)``."""
    lines = REFERENCE.read_text(encoding="utf-8").splitlines()
    marker = f"(`{section}`)"
    starts = [i for i, line in enumerate(lines) if line.startswith("#") and marker in line]
    assert len(starts) == 1, f"docs/configuration.md needs exactly one heading containing {marker}, found {len(starts)}"
    rows: dict[str, tuple[str, str]] = {}
    for line in lines[starts[0] + 1:]:
        if line.startswith("#"):
            break
        match = ROW.match(line)
        if match:
            field = match["field"]
            assert field not in rows, f"{section}: `{field}` has two rows"
            rows[field] = (match["default"].strip(), match["meaning"].strip())
    assert rows, f"no `| field | default | meaning |` rows under the heading containing {marker}"
    return rows


def is_section(value: Any) -> bool:
    return isinstance(value, BaseModel) or (dataclasses.is_dataclass(value) and not isinstance(value, type))


def defaults_in_code(section: Section) -> dict[str, Any]:
    """Each setting as the config file spells it (a field's alias, e.g. ``batching``), and its default."""
    if isinstance(section, type) and issubclass(section, BaseModel):
        settings: dict[str, Any] = {}
        for name, field in section.model_fields.items():
            key = field.validation_alias if isinstance(field.validation_alias, str) else name
            settings[key] = REQUIRED if field.is_required() else field.get_default(call_default_factory=True)
        return settings
    settings = {}
    for field in dataclasses.fields(section):
        factory = field.default_factory
        settings[field.name] = factory() if factory is not dataclasses.MISSING else field.default
    return {**settings, **MODEL_ENTRY_BATCHING}


def parse_default(cell: str) -> Any:
    if cell == REQUIRED:
        return REQUIRED
    literal = LITERAL.match(cell)
    if literal:
        return yaml.safe_load(literal["value"])
    return NESTED


def same_default(written: Any, actual: Any) -> bool:
    if isinstance(actual, bool) or isinstance(written, bool):
        return written is actual
    if isinstance(actual, tuple):
        actual = list(actual)
    return written == actual  # 25 == 25.0: YAML's numbers as the config file would give them


@pytest.mark.parametrize("section", list(SECTIONS))
def test_every_setting_has_a_row_and_every_row_is_a_setting(section: str) -> None:
    in_code = set(defaults_in_code(SECTIONS[section]))
    in_readme = set(documented(section))
    assert not in_code - in_readme, f"{section}: add reference rows for {sorted(in_code - in_readme)}"
    assert not in_readme - in_code, f"{section}: the reference documents settings the code lacks: " \
                                    f"{sorted(in_readme - in_code)}"


@pytest.mark.parametrize("section", list(SECTIONS))
def test_every_documented_default_is_the_codes(section: str) -> None:
    rows = documented(section)
    wrong = []
    for setting, actual in defaults_in_code(SECTIONS[section]).items():
        if setting not in rows:
            continue  # reported by the test above
        cell, meaning = rows[setting]
        written = parse_default(cell)
        if not meaning:
            wrong.append(f"`{setting}` has no meaning")
        elif actual == REQUIRED or written == REQUIRED:
            if written != actual:
                wrong.append(f"`{setting}`: the reference says {cell!r}, the code says {actual!r}")
        elif is_section(actual):
            if written is not NESTED:
                wrong.append(f"`{setting}` is a nested section: its default cell should point to its table")
        elif written is NESTED or not same_default(written, actual):
            wrong.append(f"`{setting}`: the reference says {cell!r}, the code's default is {actual!r}")
    assert not wrong, f"{section}: " + "; ".join(wrong)


def nested_sections(annotation: Any) -> set[type]:
    """The config classes an annotation holds (through Optional, Annotated, tuples, ...)."""
    found = set()
    if isinstance(annotation, type) and (issubclass(annotation, BaseModel) or dataclasses.is_dataclass(annotation)):
        found.add(annotation)
    for argument in typing.get_args(annotation):
        found |= nested_sections(argument)
    return found


def test_every_nested_section_of_the_args_has_its_own_table() -> None:
    reached: set[type] = set()
    for section in SECTIONS.values():
        if isinstance(section, type) and issubclass(section, BaseModel):
            for field in section.model_fields.values():
                reached |= nested_sections(field.annotation)
                for meta in field.metadata:
                    reached |= nested_sections(getattr(meta, "cls", None))
    missing = {cls.__name__ for cls in reached} - set(SECTIONS)
    assert not missing, f"give each nested section a reference table and a SECTIONS entry: {sorted(missing)}"

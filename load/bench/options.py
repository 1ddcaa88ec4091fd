"""A scenario's settings from its command line: one frozen dataclass per scenario, its defaults and its ``QUICK``."""

from __future__ import annotations

import argparse
from dataclasses import fields, replace
from typing import TypeVar

S = TypeVar("S")  # a scenario's settings dataclass


def chosen_settings(args: argparse.Namespace, defaults: S, quick: S) -> S:
    """``quick`` with ``--quick``, else ``defaults``; every field given as an option replaced by the given value.

    A scenario's settings dataclass checks itself (``ValueError``); here that is the command line's error.
    """
    base = quick if getattr(args, "quick", False) else defaults
    given = {f.name: getattr(args, f.name) for f in fields(base) if getattr(args, f.name, None) is not None}
    try:
        return replace(base, **given)
    except ValueError as exc:
        raise SystemExit(str(exc)) from None


def add_settings_arguments(parser: argparse.ArgumentParser, defaults: object, quick: object) -> None:
    """A ``--<field-name>`` option for each field of a scenario's settings dataclass (``defaults``), its help naming
    the default and ``quick``'s value; a bool field is an on/off flag (``--no-<name>``)."""
    for setting in fields(defaults):  # type: ignore[arg-type]
        flag = f"--{setting.name.replace('_', '-')}"
        help_text = f"(default {getattr(defaults, setting.name)}; --quick {getattr(quick, setting.name)})"
        if setting.type == "bool":
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, help=help_text)
        else:
            parser.add_argument(flag, type={"int": int, "float": float}.get(str(setting.type), str), help=help_text)

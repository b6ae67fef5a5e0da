"""Turn frozen config dataclasses into command-line options, one option per field.

Each field carries its help text in `metadata["help"]`; `add_dataclass_args` adds `--field-name`
options and `dataclass_from_args` builds the dataclass back from the parsed namespace, so `--help`
and validation come from one definition.
"""

from __future__ import annotations

import argparse
import dataclasses
import types
import typing
from collections.abc import Collection, Mapping
from pathlib import PurePath
from typing import Any, TypeVar

T = TypeVar("T")


# The largest integer any option takes. A larger one (2**63, a natural "unlimited") was
# accepted and then overflowed at request time: SQLite's 64-bit integers (`limit + 1`: a
# reply's save failed and was lost, batches never ran), C sizes (found by a review).
MAX_INT_OPTION = 2**62


def check_int_fields(config: Any) -> None:
    """Raise ValueError, naming the field, for an integer field of dataclass `config`
    beyond `MAX_INT_OPTION` either way."""
    for field in dataclasses.fields(config):
        value = getattr(config, field.name)
        if isinstance(value, int) and not isinstance(value, bool) \
                and abs(value) > MAX_INT_OPTION:
            raise ValueError(f"{field.name} must be at most 2**62 ({MAX_INT_OPTION}), "
                             f"got {value}")


def doc(help_text: str, **kwargs: Any) -> Any:
    """A dataclass field with help text for `--help` (keyword arguments go to `field`)."""
    return dataclasses.field(metadata={"help": help_text}, **kwargs)


def _base_type(tp: Any) -> Any:
    """`int | None` -> int; `tuple[str, ...]` -> tuple."""
    if isinstance(tp, types.UnionType) or typing.get_origin(tp) is typing.Union:
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return _base_type(args[0])
    return typing.get_origin(tp) or tp


def add_dataclass_args(parser: argparse.ArgumentParser, cls: type, prefix: str = "",
                       defaults: Mapping[str, Any] | None = None,
                       exclude: Collection[str] = ()) -> None:
    """Add one `--<prefix><field>` option per field of `cls` but those named in `exclude`
    (fields the command sets itself, or that do nothing there); defaults stay in the
    dataclass, except the command's own `defaults` (by field name)."""
    hints = typing.get_type_hints(cls)
    group = parser.add_argument_group(cls.__name__)
    defaults = defaults or {}  # of scalar fields (an appended option keeps its own)
    for f in dataclasses.fields(cls):
        if not f.init or "help" not in f.metadata or f.name in exclude:
            continue
        flag = "--" + prefix + f.name.replace("_", "-")
        base = _base_type(hints[f.name])
        default = f.default if f.default is not dataclasses.MISSING else None
        default = defaults.get(f.name, default)
        # argparse formats help with %: a literal one ("3% of") must be doubled
        shown = str(default) if isinstance(default, PurePath) else repr(default)
        help_text = f"{f.metadata['help']} (default: {shown})".replace("%", "%%")
        dest = prefix.replace("-", "_") + f.name
        given = defaults.get(f.name)  # None: unset, the dataclass decides
        if base is bool:
            group.add_argument(flag, dest=dest, action=argparse.BooleanOptionalAction,
                               default=given, help=help_text)
        elif base is tuple:
            group.add_argument(flag, dest=dest, action="append", default=None, help=help_text)
        else:
            group.add_argument(flag, dest=dest, type=base, default=given, help=help_text)


def dataclass_from_args(cls: type[T], args: argparse.Namespace, prefix: str = "", *,
                        fallbacks: Mapping[str, Any] | None = None, **overrides: Any) -> T:
    """Build `cls` from options given on the command line; unset options take `fallbacks`
    (by field name: the environment's settings, which the command line beats), else keep
    their defaults. `overrides` beat both (what the command itself decides)."""
    values: dict[str, Any] = {k: v for k, v in (fallbacks or {}).items() if v is not None}
    for f in dataclasses.fields(cls):  # type: ignore[arg-type]
        value = getattr(args, prefix.replace("-", "_") + f.name, None)
        if value is not None:
            values[f.name] = tuple(value) if isinstance(value, list) else value
    values.update({k: v for k, v in overrides.items() if v is not None})
    return cls(**values)

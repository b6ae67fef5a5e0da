"""Argument types shared by the benchmarks' command lines."""

from __future__ import annotations

import argparse
from collections.abc import Callable, Collection


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def names_in(valid: Collection[str]) -> Callable[[str], str]:
    """An argument type for a comma-separated list of names, each one of `valid`."""
    def parse(value: str) -> str:
        unknown = [s for s in value.split(",") if s not in valid]
        if unknown:
            raise argparse.ArgumentTypeError(
                f"unknown systems {unknown}; valid: {', '.join(valid)}")
        return value
    return parse

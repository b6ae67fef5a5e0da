"""`antiphon bench ...`: each benchmark is a sub-command."""

from __future__ import annotations

import argparse
from typing import Any


def add_bench_parser(commands: Any) -> None:
    bench = commands.add_parser("bench", help="run a benchmark")
    bench.set_defaults(func=run)
    kinds = bench.add_subparsers(dest="bench_command", required=True)
    from antiphon.bench import blocks, mixed, serving, sessions

    serving.add_parser(kinds)
    mixed.add_parser(kinds)
    sessions.add_parser(kinds)
    blocks.add_parser(kinds)


def run(args: argparse.Namespace) -> int:
    return int(args.bench_func(args))

"""`antiphon bench ...`: each benchmark is a sub-command."""

from __future__ import annotations

import argparse
import signal
from typing import Any


def add_bench_parser(commands: Any) -> None:
    bench = commands.add_parser("bench", help="run a benchmark")
    bench.set_defaults(func=run)
    kinds = bench.add_subparsers(dest="bench_command", required=True)
    from antiphon.bench import agents, blocks, mixed, serving, sessions

    serving.add_parser(kinds)
    mixed.add_parser(kinds)
    sessions.add_parser(kinds)
    blocks.add_parser(kinds)
    agents.add_parser(kinds)


def run(args: argparse.Namespace) -> int:
    # A benchmark stopped with SIGTERM (e.g. by `timeout`) unwinds like Ctrl-C, so the servers
    # it started are stopped too instead of left running.
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    return int(args.bench_func(args))


def _exit_on_sigterm(signum: int, _frame: Any) -> None:
    raise SystemExit(128 + signum)

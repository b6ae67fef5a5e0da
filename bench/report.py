"""Output of every benchmark: a JSON record and a readable side-by-side table."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def args_config(args: Any) -> dict[str, Any]:
    """The scalar command-line options of a benchmark run, for its JSON record."""
    return {k: v for k, v in vars(args).items() if isinstance(v, (int, float, str, bool))}


def write_json(path: str | Path, record: dict[str, Any]) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(record, indent=2) + "\n")
    print(f"wrote {path}")


def print_table(systems: dict[str, dict[str, float]], baseline: str) -> None:
    """One row per metric, one column per system, and each system's ratio to `baseline`."""
    names = list(systems)
    others = [n for n in names if n != baseline]
    header = ["metric", *names, *(f"{n}/{baseline}" for n in others)]
    rows = []
    for metric in systems[baseline]:
        base = systems[baseline][metric]
        cells = [metric, *(fmt(systems[n][metric]) for n in names)]
        cells += [f"{systems[n][metric] / base:.3f}" if base else "-" for n in others]
        rows.append(cells)
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    for r in [header, ["-" * w for w in widths], *rows]:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)))


def fmt(value: float) -> str:
    return f"{value:.4f}" if abs(value) < 10 else f"{value:.1f}"

"""Output of every benchmark: a JSON record and a readable side-by-side table."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any


def args_config(args: Any) -> dict[str, Any]:
    """The scalar command-line options of a benchmark run, for its JSON record."""
    return {k: v for k, v in vars(args).items() if isinstance(v, (int, float, str, bool))}


def write_json(path: str | Path, record: dict[str, Any]) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(record, indent=2) + "\n")
    print(f"wrote {path}")


def print_table(systems: Mapping[str, Mapping[str, float | None]],
                baseline: str | None) -> None:
    """One row per metric, one column per system, and each system's ratio to `baseline`
    (no ratios without one). A metric no run measured shows as n/a."""
    names = list(systems)
    others = [n for n in names if n != baseline] if baseline is not None else []
    header = ["metric", *names, *(f"{n}/{baseline}" for n in others)]
    rows = []
    for metric in systems[baseline if baseline is not None else names[0]]:
        base = systems[baseline][metric] if baseline is not None else None
        cells = [metric, *(fmt(systems[n].get(metric)) for n in names)]
        for n in others:
            value = systems[n].get(metric)
            cells.append(f"{value / base:.3f}" if base and value is not None else "-")
        rows.append(cells)
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    for r in [header, ["-" * w for w in widths], *rows]:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)))


def fmt(value: float | None) -> str:
    if value is None:
        return "n/a"
    return f"{value:.4f}" if abs(value) < 10 else f"{value:.1f}"

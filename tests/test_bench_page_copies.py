"""`python -m antiphon.bench.page_copies` runs every mover over the real copier and checks the
bytes: here on CPU tensors at toy sizes (on a GPU it is the benchmark of docs/benchmarks.md)."""

from __future__ import annotations

import json
from pathlib import Path

from antiphon.bench import page_copies


def test_every_mover_moves_the_bytes_exactly(tmp_path: Path) -> None:
    out = tmp_path / "copies.json"
    code = page_copies.main(["--device", "cpu", "--layers", "3", "--pages", "10",
                             "--blocks", "24", "--chunk-pages", "4", "--staging-pages", "6",
                             "--page-bytes", "4096", "--layer-compute-ms", "0.1",
                             "--repeats", "1", "--out", str(out)])
    assert code == 0
    result = json.loads(out.read_text())
    assert result["benchmark"] == "page_copies"
    assert set(result["systems"]) == set(page_copies.MOVERS)
    for row in result["systems"].values():
        assert row["bytes_exact"] and row["layer_reads_exact"]
        assert row["bytes_per_step"] == 10 * 3 * 4096
        assert row["load_gb_per_s"] > 0 and row["save_gb_per_s"] > 0

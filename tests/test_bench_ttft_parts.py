"""`python -m antiphon.bench.ttft_parts` times each part of a follow-up turn's TTFT (here on a
CPU with a toy model; on a GPU at Llama-3.1-8B's shape, docs/benchmarks.md)."""

from __future__ import annotations

import json
from pathlib import Path

from antiphon.bench import ttft_parts


def test_every_part_is_timed_and_the_sums_follow(tmp_path: Path) -> None:
    out = tmp_path / "parts.json"
    code = ttft_parts.main(["--device", "cpu", "--model", "tiny", "--contexts", "200,512",
                            "--new-tokens", "8", "--chunk-tokens", "64", "--repeats", "1",
                            "--dir", str(tmp_path), "--out", str(out)])
    assert code == 0
    result = json.loads(out.read_text())
    assert result["benchmark"] == "ttft_parts"
    assert set(result["contexts"]) == {"200", "512"}
    for row in result["contexts"].values():
        for part in ("fresh_ms", "with_context_ms", "recompute_ms", "ssd_read_ms",
                     "host_to_device_ms"):
            assert row[part] > 0
        assert row["ttft_host_ms"] == row["host_to_device_ms"] + row["with_context_ms"]
        assert row["ttft_ssd_ms"] == row["ssd_read_ms"] + row["ttft_host_ms"]
    assert not list(tmp_path.glob("tmp*"))  # the SSD tier's scratch files are gone

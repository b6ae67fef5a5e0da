"""`python -m antiphon.bench.ttft_parts` times each part of a follow-up turn's TTFT (here on a
CPU with a toy model; on a GPU at Llama-3.1-8B's shape, docs/benchmarks.md)."""

from __future__ import annotations

import json
from pathlib import Path

import torch

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


def test_the_with_context_step_writes_in_place_and_matches_a_whole_prefill() -> None:
    """Each timed call of the "with context" prefill writes the new tokens' KV into the
    same slots after the context's: a `DynamicCache` copied the whole context's K/V into a
    new tensor on every call, which the time counted and a paged cache never does."""
    from transformers import StaticCache

    model = ttft_parts.build_model("tiny", torch.device("cpu"))
    gen = torch.Generator().manual_seed(0)
    ctx_ids = torch.randint(model.config.vocab_size, (1, 200), generator=gen)
    new_ids = torch.randint(model.config.vocab_size, (1, 8), generator=gen)
    with torch.inference_mode():
        whole = model(torch.cat([ctx_ids, new_ids], dim=1), use_cache=False,
                      logits_to_keep=1).logits
        cache = StaticCache(config=model.config, max_cache_len=208)
        step = ttft_parts.context_step(model, cache, ctx_ids, new_ids)
        keys = [layer.keys for layer in cache.layers]
        storage = [k.data_ptr() for k in keys]
        for _ in range(3):
            # the context's KV attended, at its positions, to two bfloat16 steps at the
            # logits' size (below 1; one step is 2**-8): a GEMM over 8 rows and one over
            # 208 may sum in another order, and runs differed by one step (CI failed on
            # 1e-5). A context one token off moves the logits by 0.02, another by 0.13.
            torch.testing.assert_close(step(), whole, rtol=0, atol=2 * 2**-8)
            assert int(cache.get_seq_length()) == 208
            assert all(layer.keys is k for layer, k in zip(cache.layers, keys, strict=True))
            assert [layer.keys.data_ptr() for layer in cache.layers] == storage

"""KV is stored under the model's identity: new weights in the same folder get new keys."""

from __future__ import annotations

import os
from pathlib import Path

from antiphon.engine_ext.config import EngineConfig
from antiphon.engine_ext.vllm_engine import VllmEngine
from antiphon.model import weights_fingerprint


def make_model(folder: Path) -> Path:
    folder.mkdir()
    (folder / "config.json").write_text('{"num_hidden_layers": 2}')
    (folder / "model.safetensors").write_bytes(b"weights v1")
    (folder / "tokenizer.json").write_text("{}")
    return folder


def test_the_fingerprint_follows_weights_and_config_not_other_files(tmp_path: Path) -> None:
    model = make_model(tmp_path / "m")
    first = weights_fingerprint(model)
    assert weights_fingerprint(model) == first
    (model / "tokenizer.json").write_text('{"changed": true}')  # tokens are in the keys already
    (model / "antiphon-prepared.json").write_text("{}")
    assert weights_fingerprint(model) == first

    weights = model / "model.safetensors"
    stat = weights.stat()
    weights.write_bytes(b"weights v2")  # same size, replaced in place
    os.utime(weights, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000))
    second = weights_fingerprint(model)
    assert second != first
    (model / "model-00002-of-00002.safetensors").write_bytes(b"a shard more")
    third = weights_fingerprint(model)
    assert third != second
    (model / "config.json").write_text('{"num_hidden_layers": 3}')
    assert weights_fingerprint(model) not in (first, second, third)


def test_the_engines_kv_identity_holds_dtype_and_weights(tmp_path: Path) -> None:
    model = make_model(tmp_path / "m")
    identity = VllmEngine(EngineConfig(dtype="float32"), model)._tier_model_id
    assert identity == VllmEngine(EngineConfig(dtype="float32"), model)._tier_model_id
    assert identity != VllmEngine(EngineConfig(dtype="bfloat16"), model)._tier_model_id
    (model / "model.safetensors").write_bytes(b"fine-tuned weights, longer")
    assert identity != VllmEngine(EngineConfig(dtype="float32"), model)._tier_model_id


def test_the_kv_identity_follows_vllms_kv_layout_block_size_and_kv_dtype() -> None:
    """The connector adds how vLLM lays KV out, once the engine has resolved it: a chunk's
    bytes under LBHNC pages of 128 tokens (CPU) are another order than under 16-token ones
    (GPU) or LBNHC, at the same size, and must not be found under the same key."""
    from types import SimpleNamespace

    from antiphon.tiering.connector import kv_model_id

    def identity(layout: str, block: int, kv_dtype: str) -> str:
        cache = SimpleNamespace(kv_cache_layout=layout, block_size=block, cache_dtype=kv_dtype)
        return kv_model_id("/models/m|bfloat16|f1", SimpleNamespace(cache_config=cache))  # type: ignore[arg-type]

    base = identity("LBHNC", 128, "auto")
    assert base.startswith("/models/m|bfloat16|f1|") and base == identity("LBHNC", 128, "auto")
    assert len({base, identity("LBNHC", 128, "auto"), identity("LBHNC", 16, "auto"),
                identity("LBHNC", 128, "fp8")}) == 4


def test_the_cost_model_fit_is_stored_per_weights(tmp_path: Path) -> None:
    """The step-cost fit was stored under the model's folder alone: weights replaced in the
    folder kept the old fit (another model's step times). New weights now get a fit of their
    own (profiled on the next start); the file keeps the folder's name."""
    from antiphon.engine_ext.costfit import fit_path

    model = make_model(tmp_path / "m")
    first = VllmEngine(EngineConfig(), model).cost_model_key()
    assert first == VllmEngine(EngineConfig(), model).cost_model_key()
    (model / "model.safetensors").write_bytes(b"fine-tuned weights, longer")
    second = VllmEngine(EngineConfig(), model).cost_model_key()
    assert second[0] != first[0] and second[1] == first[1]
    assert fit_path(tmp_path, *first) != fit_path(tmp_path, *second)
    assert fit_path(tmp_path, *second).name.startswith("m-")

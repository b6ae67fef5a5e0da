"""A compiled engine's second start loads the model its first start compiled (vLLM's AOT
compile cache), instead of compiling it again, and gives the same greedy output."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
from safetensors import safe_open
from safetensors.torch import save_file

from antiphon.engine_ext.config import EngineConfig
from antiphon.engine_ext.types import ChatTurn, GenerationParams
from antiphon.engine_ext.vllm_engine import VllmEngine
from antiphon.model import resolve_model
from tests.engine import TEST_DTYPE

pytestmark = pytest.mark.engine

PROMPTS = ["What is the capital of France? Answer in one word.",
           "Write a haiku about the sea, and say why you chose its images."]


def two_layer_model(folder: Path) -> Path:
    """The default model cut to its first two layers (of 30), in `folder`: its graph compiles
    in seconds, not the whole model's two minutes on two cores, by the same path."""
    source = resolve_model(None)
    folder.mkdir()
    for item in source.iterdir():
        if item.suffix != ".safetensors" and item.name != "config.json":
            shutil.copy(item, folder / item.name)
    config = json.loads((source / "config.json").read_text())
    config["num_hidden_layers"] = 2
    (folder / "config.json").write_text(json.dumps(config))
    kept = {}
    for weights in source.glob("*.safetensors"):
        with safe_open(weights, framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (a safetensors file, not a dict)
                layer = re.match(r"model\.layers\.(\d+)\.", name)
                if layer is None or int(layer.group(1)) < 2:
                    kept[name] = f.get_tensor(name)
    save_file(kept, folder / "model.safetensors", metadata={"format": "pt"})
    return folder


async def greedy_replies(model: Path) -> list[list[int]]:
    """Start a compiled engine, take each prompt's greedy tokens, stop it."""
    config = EngineConfig(max_model_len=1024, kv_cache_gib=0.25, enforce_eager=False,
                          policy="fcfs", cost_model="online", dtype=TEST_DTYPE)
    engine = VllmEngine(config, model)
    await engine.start()
    try:
        replies = []
        for i, prompt in enumerate(PROMPTS):
            tokens: list[int] = []
            async for delta in engine.generate(f"compiled-{i}",
                                               engine.render_chat([ChatTurn("user", prompt)]),
                                               GenerationParams(max_tokens=32, ignore_eos=True)):
                tokens += delta.token_ids
            replies.append(tokens)
        return replies
    finally:
        await engine.shutdown()


def saved_models(cache_root: Path) -> dict[Path, tuple[int, int]]:
    """Each saved compiled model's file, with its inode and modification time."""
    found = cache_root.glob("torch_compile_cache/torch_aot_compile/*/rank_*/model")
    return {p: (p.stat().st_ino, p.stat().st_mtime_ns) for p in found}


async def test_second_start_loads_the_compiled_model(tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    # vLLM's processes inherit the variable; a cache of this test's own compiles cold
    monkeypatch.setenv("VLLM_CACHE_ROOT", str(tmp_path / "cache"))
    model = two_layer_model(tmp_path / "model")
    compiled = await greedy_replies(model)
    first = saved_models(tmp_path / "cache")
    assert len(first) == 1, f"expected one compiled model saved, found {list(first)}"

    loaded = await greedy_replies(model)
    # vLLM saves the model again (a new file replaces it) whenever its load fails
    assert saved_models(tmp_path / "cache") == first
    assert loaded == compiled
    assert all(len(tokens) == 32 for tokens in compiled)

"""A compiled engine's second start loads the model its first start compiled (vLLM's AOT
compile cache), instead of compiling it again, and gives the same greedy output."""

from __future__ import annotations

from pathlib import Path

import pytest

from antiphon.engine_ext.config import EngineConfig
from antiphon.engine_ext.types import ChatTurn, GenerationParams
from antiphon.engine_ext.vllm_engine import VllmEngine
from antiphon.model import resolve_model
from tests.engine import TEST_DTYPE

pytestmark = pytest.mark.engine

PROMPTS = ["What is the capital of France? Answer in one word.",
           "Write a haiku about the sea, and say why you chose its images."]


async def greedy_replies() -> list[list[int]]:
    """Start a compiled engine, take each prompt's greedy tokens, stop it."""
    config = EngineConfig(max_model_len=1024, kv_cache_gib=0.25, enforce_eager=False,
                          policy="fcfs", cost_model="online", dtype=TEST_DTYPE)
    engine = VllmEngine(config, resolve_model(None))
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
    monkeypatch.setenv("VLLM_CACHE_ROOT", str(tmp_path))
    compiled = await greedy_replies()
    first = saved_models(tmp_path)
    assert len(first) == 1, f"expected one compiled model saved, found {list(first)}"

    loaded = await greedy_replies()
    # vLLM saves the model again (a new file replaces it) whenever its load fails
    assert saved_models(tmp_path) == first
    assert loaded == compiled
    assert all(len(tokens) == 32 for tokens in compiled)

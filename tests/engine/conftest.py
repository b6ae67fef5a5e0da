from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
import pytest_asyncio

from antiphon.engine_ext.config import EngineConfig
from antiphon.engine_ext.vllm_engine import VllmEngine
from antiphon.model import resolve_model
from tests.engine import TEST_DTYPE


@pytest_asyncio.fixture(scope="session", loop_scope="session")
async def engine(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[VllmEngine]:
    """One real vLLM engine with the default model for the whole test run.

    AsyncLLM binds to the event loop it starts on, so every test shares the session loop.
    """
    # 20 pages of 128 tokens: small enough that a few long requests contend for memory; vLLM's
    # own page allocation (no KV tiers, so no bidirectional blocks: test_biblocks.py). The
    # cost model starts from its prior, whatever fit `antiphon profile` stored on this machine.
    # float32 (the engine's default is bfloat16) because the tests compare greedy output of
    # reused KV with recompute: in bfloat16 the KV a decode step wrote differs in its low bits
    # from the KV a prefill recomputes for the same token, enough to flip a near-tied argmax;
    # reused pages themselves come back byte for byte (tests/test_tier_copier.py).
    config = EngineConfig(max_model_len=2048, kv_cache_gib=0.5, num_kv_pages=20,
                          enforce_eager=True, policy="bros", cost_model="online",
                          dtype=TEST_DTYPE, biblocks=False,
                          step_trace=str(tmp_path_factory.mktemp("trace") / "steps.jsonl"))
    eng = VllmEngine(config, resolve_model(None))
    await eng.start()
    yield eng
    await eng.shutdown()

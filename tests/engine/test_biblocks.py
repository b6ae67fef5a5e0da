"""Bidirectional blocks inside a real vLLM engine: BE work that RT turns preempt is checkpointed
to the host tier and restored, never recomputed, and its greedy output is the undisturbed one."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import pytest_asyncio

from antiphon.engine_ext.config import EngineConfig
from antiphon.engine_ext.types import ChatTurn, GenerationParams, RequestClass
from antiphon.engine_ext.vllm_engine import VllmEngine
from antiphon.model import resolve_model
from antiphon.tiering.config import MiB, TieringConfig
from tests.engine import TEST_DTYPE

pytestmark = pytest.mark.engine

DOC = ("The history of navigation spans thousands of years, from coastal piloting by "
       "landmarks to celestial navigation and satellite systems. ") * 12
BE_PROMPTS = [f"Document {i}. {DOC * 4} Summarise it." for i in range(2)]
RT_PROMPTS = [f"Answer briefly ({i}): {DOC} What is this about?" for i in range(3)]


@pytest_asyncio.fixture(scope="module", loop_scope="session", params=["through", "checkpoint"])
async def biblock_engine(tmp_path_factory: pytest.TempPathFactory,
                         request: pytest.FixtureRequest) -> AsyncIterator[VllmEngine]:
    # 20 pages of 128 tokens: the two BE jobs (about 1,120 prompt tokens each) hold 18 of
    # them, so every RT turn must take pages from BE work. BE work's KV saved as it fills
    # (the default) or only when checkpointed (`background_saves`).
    config = EngineConfig(max_model_len=2048, kv_cache_gib=0.5, num_kv_pages=20,
                          enforce_eager=True, policy="bros", cost_model="online",
                          biblocks=True, shared_block_pages=4, dtype=TEST_DTYPE)
    ssd: Path = tmp_path_factory.mktemp("biblocks-ssd")
    tiering = TieringConfig(host_tier_bytes=64 * MiB, ssd_tier_bytes=256 * MiB, ssd_dir=ssd,
                            background_saves=request.param)
    eng = VllmEngine(config, resolve_model(None), tiering)
    await eng.start()
    yield eng
    await eng.shutdown()


async def run(engine: VllmEngine, rid: str, content: str, max_tokens: int, cls: RequestClass,
              first_token: asyncio.Event | None = None) -> list[int]:
    """Greedy token ids of one request; sets `first_token` when the first token arrives."""
    params = GenerationParams(max_tokens=max_tokens, request_class=cls, ignore_eos=True,
                              temperature=0.0)
    tokens: list[int] = []
    async for delta in engine.generate(rid, engine.render_chat([ChatTurn("user", content)]),
                                       params):
        tokens += delta.token_ids
        if tokens and first_token is not None:
            first_token.set()
    return tokens


async def test_preempted_be_work_is_checkpointed_and_restored_exactly(
        biblock_engine: VllmEngine) -> None:
    engine = biblock_engine
    alone_be = [await run(engine, f"ref-be-{i}", p, 80, RequestClass.BE)
                for i, p in enumerate(BE_PROMPTS)]
    alone_rt = [await run(engine, f"ref-rt-{i}", p, 24, RequestClass.RT)
                for i, p in enumerate(RT_PROMPTS)]
    assert await engine.reset_prefix_cache()
    sched0, tier0 = await engine.scheduler_stats(), await engine.tiering_stats()

    started = [asyncio.Event(), asyncio.Event()]
    be = [asyncio.create_task(run(engine, f"be-{i}", p, 80, RequestClass.BE, started[i]))
          for i, p in enumerate(BE_PROMPTS)]
    await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started)), 60)
    rt = []
    for i, prompt in enumerate(RT_PROMPTS):  # one RT turn after another: BE is preempted often
        rt.append(await run(engine, f"rt-{i}", prompt, 24, RequestClass.RT))
    disturbed_be = await asyncio.gather(*be)
    sched1, tier1 = await engine.scheduler_stats(), await engine.tiering_stats()

    assert sched1["num_preemptions"]["be"] > sched0["num_preemptions"]["be"]
    assert tier1["checkpoints"] > tier0["checkpoints"]
    assert tier1["restores"] > tier0["restores"]
    assert tier1["pages_restored"] > tier0["pages_restored"]
    assert sched1["recomputed_tokens"]["be"] == sched0["recomputed_tokens"]["be"]
    assert sched1["num_preemptions"]["rt"] == sched0["num_preemptions"]["rt"]
    assert disturbed_be == alone_be
    assert rt == alone_rt
    assert await engine.check_integrity() == []
    blocks = sched1["biblocks"]
    assert blocks["pages_placed"] > 0 and blocks["strays"] == 0
    assert sched1["integrity_problems"] == 0


async def test_follow_up_turns_find_their_context_in_vllms_prefix_cache(
        biblock_engine: VllmEngine) -> None:
    """Pages are placed by position, but not over the cached KV of a turn that just finished:
    taking the lowest shared block every time, each new turn evicted the last one's, and a
    follow-up found none of its context on the device (it came from the host tier instead)."""
    before = (await biblock_engine.tiering_stats())["tokens_from_device"]
    turns = {s: [ChatTurn("user", f"Conversation {s}. {DOC[:900]} Reply in a word.")]
             for s in range(3)}
    cached: list[int] = []
    for turn in range(2):
        for s, history in turns.items():
            params = GenerationParams(max_tokens=8, ignore_eos=True, session_id=f"pc{s}")
            reply, most = "", 0
            async for delta in biblock_engine.generate(f"pc{s}-{turn}",
                                                       biblock_engine.render_chat(history),
                                                       params):
                reply, most = reply + delta.text, max(most, delta.num_cached_tokens)
            history += [ChatTurn("assistant", reply), ChatTurn("user", "And in two words?")]
            if turn:
                cached.append(most)
    from_device = (await biblock_engine.tiering_stats())["tokens_from_device"] - before
    # vLLM caches whole pages (128 tokens): each follow-up's first page came from the device.
    assert min(cached) >= 128 and from_device >= 128 * len(cached), (cached, from_device)
    assert await biblock_engine.check_integrity() == []


async def test_checkpoints_are_taken_before_fresh_rt_turns_overwrite_the_pages(
        biblock_engine: VllmEngine) -> None:
    """RT turns that no tier holds any of: vLLM starts a step's connector loads after the
    forward pass when no request in it loads stored KV (`has_sync_kv_loads`), so a checkpoint
    taken there copied the RT turn's KV, already written over the BE request's tail, instead of
    the BE request's own (restored BE output then went wrong). Checkpoints are taken in
    `handle_preemptions`, before the forward pass, whatever the step loads."""
    fresh = [f"Question {i} about rivers, lakes and canals: {DOC} Explain it."
             for i in range(3)]
    alone_be = [await run(biblock_engine, f"ref2-be-{i}", p, 80, RequestClass.BE)
                for i, p in enumerate(BE_PROMPTS)]
    assert await biblock_engine.reset_prefix_cache()
    tier0 = await biblock_engine.tiering_stats()
    started = [asyncio.Event(), asyncio.Event()]
    be = [asyncio.create_task(run(biblock_engine, f"be2-{i}", p, 80, RequestClass.BE,
                                  started[i]))
          for i, p in enumerate(BE_PROMPTS)]
    await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started)), 60)
    rt = [await run(biblock_engine, f"rt2-{i}", p, 24, RequestClass.RT)
          for i, p in enumerate(fresh)]
    disturbed_be = await asyncio.gather(*be)
    tier1 = await biblock_engine.tiering_stats()
    assert tier1["checkpoints"] > tier0["checkpoints"]
    # a checkpoint the worker got after the forward pass began fails its step's copies
    assert tier1["copy_steps_failed"] == tier0["copy_steps_failed"]
    assert disturbed_be == alone_be
    assert await biblock_engine.reset_prefix_cache()
    assert rt == [await run(biblock_engine, f"ref2-rt-{i}", p, 24, RequestClass.RT)
                  for i, p in enumerate(fresh)]
    assert await biblock_engine.check_integrity() == []

"""KV tiering inside real vLLM engines: a multi-turn conversation whose KV comes from the host
tier, from the SSD tier after a restart, and from recompute after a corrupted SSD chunk gives
greedy output identical to the same conversation without tiering."""

from __future__ import annotations

import asyncio
import dataclasses
import shutil
from contextlib import aclosing
from pathlib import Path
from typing import Any

import pytest

from antiphon.engine_ext.config import EngineConfig
from antiphon.engine_ext.types import ChatTurn, GenerationParams
from antiphon.engine_ext.vllm_engine import VllmEngine
from antiphon.model import resolve_model
from antiphon.tiering.config import MiB, TieringConfig
from antiphon.tiering.keys import chain_hashes
from antiphon.tiering.slot_file import RECORD_HEADER_BYTES, SlotFile, stored_slot_bytes
from antiphon.tiering.tails import common_prefix
from tests.engine import TEST_DTYPE

pytestmark = pytest.mark.engine

STORY = ("A lighthouse keeper on a rocky island kept a logbook of every ship that passed, the "
         "weather each morning, and the birds that nested on the cliffs. ") * 9
QUESTIONS = [f"Read this log and tell me what it is about.\n\n{STORY}",
             "What kind of birds might nest on such cliffs? Name two.",
             "Write one sentence the keeper might add to the logbook tonight."]


async def converse(engine: VllmEngine, tag: str, *, reset_device: bool
                   ) -> tuple[list[str], list[tuple[int, int, tuple[int, int] | None]]]:
    """Greedy replies to QUESTIONS as one conversation, and (prompt, cached, (host, SSD) of
    those) tokens per turn. With `reset_device`, vLLM's own page cache is emptied before
    every turn."""
    turns: list[ChatTurn] = []
    replies, usage = [], []
    for index, question in enumerate(QUESTIONS):
        if reset_device:
            assert await engine.reset_prefix_cache()
        turns.append(ChatTurn("user", question))
        params = GenerationParams(max_tokens=40, temperature=0.0, session_id=tag)
        text, prompt, cached, tiers = "", 0, 0, None
        async for delta in engine.generate(f"{tag}-{index}", engine.render_chat(turns), params):
            text += delta.text
            prompt, cached = delta.num_prompt_tokens, max(cached, delta.num_cached_tokens)
            tiers = delta.tier_tokens or tiers
        turns.append(ChatTurn("assistant", text))
        replies.append(text)
        usage.append((prompt, cached, tiers))
    return replies, usage


async def tiered_engine(ssd_dir: Path) -> VllmEngine:
    config = EngineConfig(max_model_len=2048, num_kv_pages=24, enforce_eager=True,
                          policy="bros", kv_cache_gib=0.5, cost_model="online",
                          dtype=TEST_DTYPE)
    tiering = TieringConfig(host_tier_bytes=64 * MiB, ssd_tier_bytes=256 * MiB, ssd_dir=ssd_dir)
    eng = VllmEngine(config, resolve_model(None), tiering)
    await eng.start()
    return eng


@dataclasses.dataclass
class FirstRun:
    """The conversation on a fresh tiered engine, whose SSD tier later engines start from."""

    ssd_dir: Path
    replies: list[str]
    usage: list[tuple[int, int, tuple[int, int] | None]]
    stats: dict[str, Any]
    by_salt: dict[str | None, tuple[int, int | None]] = dataclasses.field(default_factory=dict)


@pytest.fixture(scope="module")
async def reference(engine: VllmEngine) -> list[str]:
    replies, _ = await converse(engine, "ref", reset_device=True)
    return replies


@pytest.fixture(scope="module")
async def first_run(tmp_path_factory: pytest.TempPathFactory) -> FirstRun:
    ssd_dir = tmp_path_factory.mktemp("kv-ssd")
    eng = await tiered_engine(ssd_dir)
    try:
        replies, usage = await converse(eng, "host", reset_device=True)
        stats = await eng.tiering_stats()
        by_salt = {salt: await found_by_salt(eng, salt) for salt in ("tenant-b", None)}
    finally:
        await eng.shutdown()
    return FirstRun(ssd_dir, replies, usage, stats, by_salt)


async def found_by_salt(engine: VllmEngine, salt: str | None) -> tuple[int, int | None]:
    """(prompt tokens a request with `salt` finds cached, context tokens an advisory with
    `salt` finds in the tiers) for the conversation's first prompt, stored without a salt."""
    prompt = engine.render_chat([ChatTurn("user", QUESTIONS[0])])
    advised = await engine.advise(f"probe-{salt}", prompt, None, salt)
    assert await engine.reset_prefix_cache()
    cached = 0
    params = GenerationParams(max_tokens=1, cache_salt=salt)
    async for delta in engine.generate(f"salted-{salt}", prompt, params):
        cached = max(cached, delta.num_cached_tokens)
    return cached, advised


async def rerun(first: FirstRun, tmp_path: Path, tag: str
                ) -> tuple[list[str], list[tuple[int, int, tuple[int, int] | None]],
                           dict[str, Any]]:
    """The conversation again on a new engine over a copy of the first run's SSD tier."""
    ssd_dir = tmp_path / "ssd"
    shutil.copytree(first.ssd_dir, ssd_dir, ignore=shutil.ignore_patterns("*.lock"))
    eng = await tiered_engine(ssd_dir)
    try:
        replies, usage = await converse(eng, tag, reset_device=True)
        return replies, usage, await eng.tiering_stats()
    finally:
        await eng.shutdown()


def test_host_tier_turns_match_recompute(reference: list[str], first_run: FirstRun) -> None:
    assert first_run.replies == reference
    stats = first_run.stats
    # Every follow-up found its whole prior context (the previous prompt and reply) in the host
    # tier, though vLLM's own page cache was emptied before each turn.
    for (_, cached, tiers), (previous_prompt, _, _) in zip(first_run.usage[1:],
                                                           first_run.usage, strict=False):
        assert cached >= previous_prompt, (first_run.usage, stats)
        # each turn's output says where: all of it from the host arena
        assert tiers == (cached, 0), first_run.usage
    assert first_run.usage[0][2] == (0, 0)  # the first turn found nothing stored
    assert stats["tokens_from_host"] > 0 and stats["tokens_from_ssd"] == 0, stats
    assert stats["tiers"]["ssd"]["bytes_in"] > 0, stats


def test_a_salt_keeps_kv_apart(first_run: FirstRun) -> None:
    """KV stored without a salt is found by requests and advisories without one, and by no
    request or advisory with another salt (a tenant's key), in vLLM's cache or the tiers."""
    assert first_run.by_salt["tenant-b"] == (0, 0), first_run.by_salt
    cached, advised = first_run.by_salt[None]
    assert cached > 0 and advised is not None and advised > 0, first_run.by_salt


async def test_ssd_tier_after_restart_matches_recompute(reference: list[str],
                                                        first_run: FirstRun,
                                                        tmp_path: Path) -> None:
    # A new engine: empty host arena, the SSD index rebuilt from the files.
    replies, usage, stats = await rerun(first_run, tmp_path, "ssd")
    assert replies == reference
    assert usage[0][1] > 0, usage  # even the first turn was stored before the restart
    assert stats["tokens_from_ssd"] > 0, stats
    assert usage[0][2] is not None and usage[0][2][1] > 0, usage  # from SSD, it says


async def test_corrupt_ssd_chunk_falls_back_to_recompute(reference: list[str],
                                                        first_run: FirstRun,
                                                        tmp_path: Path) -> None:
    copy_dir = tmp_path / "source"
    shutil.copytree(first_run.ssd_dir, copy_dir, ignore=shutil.ignore_patterns("*.lock"))
    damaged = damage_every_third_record(copy_dir)
    assert damaged
    replies, _, stats = await rerun(FirstRun(copy_dir, [], [], {}), tmp_path, "corrupt")
    assert replies == reference
    assert stats["tiers"]["ssd"]["corrupt_dropped"] > 0, stats
    assert stats["computed_prompt_tokens"] > 0, stats


def damage_every_third_record(ssd_dir: Path) -> int:
    """Flip a payload byte of every third record in an SSD tier's slot file (its checksum then
    fails); returns how many were damaged."""
    slot_bytes = stored_slot_bytes(ssd_dir)
    assert slot_bytes is not None
    with SlotFile(ssd_dir, slot_bytes) as slots, open(slots.path, "r+b") as f:
        damaged = 0
        for slot in range(0, slots.num_slots_on_disk, 3):
            record = slots.read_header(slot)
            if record is None or record.payload_len < 100:
                continue
            f.seek(slots.offset(slot) + RECORD_HEADER_BYTES + record.payload_len - 100)
            byte = f.read(1)[0]
            f.seek(-1, 1)
            f.write(bytes([byte ^ 0xFF]))
            damaged += 1
    return damaged


async def test_a_failed_load_fails_its_request_alone(reference: list[str],
                                                     tmp_path: Path) -> None:
    """A page load that fails (a broken copy) was raised out of the attention layer and took
    the engine and every request in it down. Now its pages are reported to vLLM, which fails
    the request reading them and drops them from its prefix cache: the engine serves on, and
    the turn asked again (a retry, with the same prefix) answers as before."""
    from antiphon.engine_ext.engine import EngineRequestFailedError

    eng = await tiered_engine(tmp_path / "ssd")
    params = GenerationParams(max_tokens=40, temperature=0.0, session_id="fail")

    async def reply(request_id: str, turns: list[ChatTurn]) -> str:
        text = ""
        async for delta in eng.generate(request_id, eng.render_chat(turns), params):
            text += delta.text
        return text

    try:
        assert eng._llm is not None
        turns: list[ChatTurn] = []
        replies = []
        for index, question in enumerate(QUESTIONS):
            assert await eng.reset_prefix_cache()
            turns.append(ChatTurn("user", question))
            if index == 1:  # the follow-up's load of its stored context fails
                assert await eng._llm.collective_rpc("antiphon_fail_kv_loads", args=(1,)) == [
                    True]
                with pytest.raises(EngineRequestFailedError, match="KV load"):
                    await reply("fail-1", turns)
            replies.append(await reply(f"retry-{index}", turns))
            turns.append(ChatTurn("assistant", replies[-1]))
        stats = await eng.tiering_stats()
    finally:
        await eng.shutdown()
    assert replies == reference
    assert stats["copy_steps_failed"] == 1, stats


def test_tiering_config_is_validated() -> None:
    with pytest.raises(ValueError, match="advisory_ttl_s"):
        dataclasses.replace(TieringConfig(), advisory_ttl_s=0)


async def test_a_deleted_sessions_kv_leaves_host_and_ssd(tmp_path: Path) -> None:
    """`forget` erases a session's KV from both tiers (the SSD slot file keeps no record of
    it), leaves another session's, and the session's prompt then recomputes to the same
    greedy reply."""
    eng = await tiered_engine(tmp_path / "ssd")
    try:
        turns: list[ChatTurn] = []
        chains, replies = [], []
        for index, question in enumerate(QUESTIONS[:2]):
            assert await eng.reset_prefix_cache()
            turns.append(ChatTurn("user", question))
            prompt = eng.render_chat(turns)
            output: list[int] = []
            text = ""
            params = GenerationParams(max_tokens=40, temperature=0.0, session_id="gone")
            async for delta in eng.generate(f"gone-{index}", prompt, params):
                output += delta.token_ids
                text += delta.text
            turns.append(ChatTurn("assistant", text))
            chains.append(eng.context_tokens(prompt, output))  # what the server stores
            replies.append(text)
        other = eng.render_chat([ChatTurn("user", "Name three colours of the sea. " * 20)])
        async for _ in eng.generate("kept-0", other, GenerationParams(max_tokens=8,
                                                                        session_id="kept")):
            pass
        first_prompt = eng.render_chat([ChatTurn("user", QUESTIONS[0])])
        # An advisory of the session pins its KV in the host tier; the delete releases it.
        assert (await eng.advise("gone", first_prompt, None) or 0) > 0
        # The session living on, its first turn's chain is one its last extends: none goes.
        assert await eng.forget("gone", chains[:1], keep=chains[-1:]) == 0
        before = await eng.tiering_stats()

        erased = await eng.forget("gone", chains)

        stats = await eng.tiering_stats()
        assert erased and stats["chunk_layers_forgotten"] == erased, stats
        assert (stats["tiers"]["host"]["used_bytes"] < before["tiers"]["host"]["used_bytes"])
        assert await eng.advise("probe-2", first_prompt, None) == 0  # in no tier
        assert (await eng.advise("probe-3", other, None) or 0) > 0  # the other session's stay
        ssd_dir = tmp_path / "ssd"
        gone = chain_hashes(chains, eng.tiering.chunk_tokens,  # type: ignore[union-attr]
                            eng._tier_model_id)
        slot_bytes = stored_slot_bytes(ssd_dir)
        assert slot_bytes is not None
        with SlotFile(ssd_dir, slot_bytes) as slots:
            records = [slots.read_header(s) for s in range(slots.num_slots_on_disk)]
        keys = [r.key for r in records if r is not None]
        assert keys and not [k for k in keys if k.prefix_hash in gone]
        assert await eng.reset_prefix_cache()
        text, cached = "", 0
        async for delta in eng.generate("again", first_prompt,
                                        GenerationParams(max_tokens=40, temperature=0.0)):
            text += delta.text
            cached = max(cached, delta.num_cached_tokens)
        assert (text, cached) == (replies[0], 0)
    finally:
        await eng.shutdown()


async def reset_when_free(eng: VllmEngine) -> None:
    """Empty vLLM's page cache once no request holds pages (an aborted reply's pages stay
    until its last partial chunk is saved)."""
    for _ in range(100):
        if await eng.reset_prefix_cache():
            return
        await asyncio.sleep(0.05)
    raise AssertionError("the device's pages were never all free")


async def test_a_reply_a_stop_string_ends_says_what_the_tiers_served(
        tmp_path: Path, engine: VllmEngine) -> None:
    """vLLM's front end ends a reply at a stop string and aborts it in the engine, so the
    connector's last output, which said what the tiers served, never came: such replies had
    no `tier_prompt_tokens` in their usage. And by then the engine had computed a token or
    more past the stop string, which the follow-up's prompt renders without: the partial
    chunk saved with them was recomputed whole (up to 127 tokens)."""
    eng = await tiered_engine(tmp_path / "ssd")
    first = [ChatTurn("user", QUESTIONS[0])]
    try:
        prompt = eng.render_chat(first)
        async for _ in eng.generate("store", prompt, GenerationParams(max_tokens=1)):
            pass
        assert await eng.reset_prefix_cache()  # the prompt's KV is in the tiers alone
        deltas = [delta async for delta in eng.generate(
            "stopped", prompt, GenerationParams(max_tokens=60, stop=(".",)))]
        follow_up = eng.render_chat([*first, ChatTurn("assistant", "".join(
            delta.text for delta in deltas)), ChatTurn("user", QUESTIONS[1])])
        await reset_when_free(eng)
        params = GenerationParams(max_tokens=30, temperature=0.0)
        served = [delta async for delta in eng.generate("follow-up", follow_up, params)]
        # A reply its client cancels says what the tiers served too (it has no last output)
        await reset_when_free(eng)
        async with aclosing(eng.generate("cancelled", follow_up, params)) as stream:
            first = await anext(stream)
    finally:
        await eng.shutdown()
    last = deltas[-1]
    assert last.finished and last.finish_reason == "stop"
    assert len(deltas) < 60 and last.num_cached_tokens > 0
    assert last.tier_tokens is not None and sum(last.tier_tokens) == last.num_cached_tokens
    assert not first.finished and first.tier_tokens is not None and sum(first.tier_tokens) > 0
    # The follow-up loads the first turn's prompt and the reply up to the stop string
    shared = common_prefix(follow_up, [*prompt, *(t for delta in deltas for t in delta.token_ids)])
    assert shared > len(prompt) + 10
    assert served[-1].num_cached_tokens == shared
    assert await engine.reset_prefix_cache()
    recomputed = [delta async for delta in engine.generate("recomputed", follow_up, params)]
    assert "".join(d.text for d in served) == "".join(d.text for d in recomputed)

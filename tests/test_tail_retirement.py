"""Partial chunks a later save covers leave the tiers (`tiering/retirement.py`), and what they
held is still found: the KV connector's scheduler side without vLLM, as in test_tier_planner."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from antiphon.tiering.keys import ChunkKey
from antiphon.tiering.planner import TierPlanner, TokenView
from antiphon.tiering.tails import TAILS_PER_CHAIN
from tests.test_tier_planner import (
    LAYERS,
    PAGE_BYTES,
    TURN1,
    fake_worker_saves,
    make_planner,
    preempt_after,
    run_turn,
)

# TURN1 with a token whose KV is not computed: 2 full chunks [100..103] [104..107], and the
# 2-token tail [108, 109] after chunk 1.
FIRST = [*TURN1, 110]


@pytest.fixture
def planner(tmp_path: Path) -> Iterator[TierPlanner]:
    p = make_planner(tmp_path / "ssd")
    yield p
    p.close()


def tail_keys(planner: TierPlanner) -> list[ChunkKey]:
    """The layer keys of the first turn's tail, [108, 109] after chunk 1."""
    view = TokenView("probe", FIRST)
    planner.add_request(view)
    st = planner._requests["probe"]
    key = planner.matcher.tail_key(st, len(TURN1))
    del planner._requests["probe"]
    return [key.with_layer(layer) for layer in range(LAYERS)]


def hold_the_eraser(planner: TierPlanner) -> threading.Event:
    """Keep the retirements' background thread busy until the event returned is set."""
    started, release = threading.Event(), threading.Event()
    planner.retirement._eraser.submit(lambda: (started.set(), release.wait(10)))
    assert started.wait(10)
    return release


def stored_anywhere(planner: TierPlanner, keys: list[ChunkKey]) -> list[bool]:
    planner.retirement.settle()
    planner.store.flush()
    return [any(tier.contains(key) for tier in planner.store.tiers) for key in keys]


def matched(planner: TierPlanner, request_id: str, tokens: list[int]) -> int | None:
    view = TokenView(request_id, tokens)
    planner.add_request(view)
    return planner.num_new_matched_tokens(view, 0)


def test_a_tail_a_full_chunk_covers_leaves_the_tiers(planner: TierPlanner) -> None:
    """The follow-up fills chunk 2, which begins with the tail's tokens: the tail's slots are
    freed in the host and SSD tiers, and a prompt that stops inside chunk 2 (a regenerate)
    still finds the part it shares, through chunk 2."""
    run_turn(planner, "r1", FIRST, [7, 8, 9])
    old_tail = tail_keys(planner)
    assert stored_anywhere(planner, old_tail) == [True] * LAYERS
    second = [*FIRST, 111, 112, 113, 114]  # 14 with KV: 3 chunks and a 2-token tail
    assert run_turn(planner, "r2", second, [7, 8, 10, 11])[0] == 10
    assert stored_anywhere(planner, old_tail) == [False] * LAYERS
    assert planner.stats()["tail_layers_retired"] == 2 * LAYERS  # host and SSD copies
    # 3 full chunks and the new tail, in each tier: the old tail is no longer a fifth
    assert len(planner.store.tiers[1].keys()) == 4 * LAYERS
    # chunks 0, 1 and 3 of chunk 2's 4 tokens (the prompt diverges after 110)
    assert matched(planner, "again", [*FIRST, 999, 998]) == 11
    assert matched(planner, "next", [*second, 115, 116]) == 14
    planner.store.check_integrity()


def test_a_tail_a_longer_tail_covers_leaves_the_tiers(planner: TierPlanner) -> None:
    run_turn(planner, "r1", FIRST, [7, 8, 9])
    old_tail = tail_keys(planner)
    run_turn(planner, "r2", [*FIRST, 111], [7, 8, 9])  # 11 with KV: its tail [108, 109, 110]
    assert stored_anywhere(planner, old_tail) == [False] * LAYERS
    assert len(planner.store.tiers[1].keys()) == 3 * LAYERS
    assert matched(planner, "again", [*TURN1, 555, 556]) == 10  # the new tail's first two


def test_a_tail_that_does_not_begin_the_later_chunk_stays(planner: TierPlanner) -> None:
    """Another conversation after the same chunks (a regenerated reply) covers nothing."""
    run_turn(planner, "r1", FIRST, [7, 8, 9])
    old_tail = tail_keys(planner)
    run_turn(planner, "r2", [*TURN1[:8], 300, 301, 302, 303, 304, 305], [7, 8, 10, 11])
    assert stored_anywhere(planner, old_tail) == [True] * LAYERS
    assert planner.stats()["tail_layers_retired"] == 0
    assert matched(planner, "next", [*FIRST, 111]) == 10


def test_a_tail_a_checkpoint_restores_is_not_retired(planner: TierPlanner) -> None:
    _, meta = preempt_after(planner, "be", FIRST, [7, 8, 9], [10])
    fake_worker_saves(planner, meta.checkpoints)
    planner.step_done({meta.step}, set())
    old_tail = tail_keys(planner)
    run_turn(planner, "r2", [*FIRST, 111, 112, 113, 114], [1, 2, 3, 4])
    assert stored_anywhere(planner, old_tail) == [True] * LAYERS
    assert planner.check_integrity() == []
    assert matched(planner, "be", FIRST) == 10  # its restore loads all of it


def test_a_tail_stays_when_the_save_that_covers_it_fails(planner: TierPlanner) -> None:
    """vLLM reports a step's copies in a later step: the request finishes with the save of
    its covering chunk in flight. The copy step fails: the old tail is all there is."""
    run_turn(planner, "r1", FIRST, [7, 8, 9])
    old_tail = tail_keys(planner)
    release = hold_the_eraser(planner)  # (an erasure queued now runs after the step's end)
    second = [*FIRST, 111, 112, 113, 114]
    view = TokenView("r2", second, "s1")
    planner.add_request(view)
    planner.test_blocks["r2"] = [1, 2, 3, 4]  # type: ignore[attr-defined]
    planner.plan_load("r2", [1, 2, 3, 4], planner.num_new_matched_tokens(view, 0) or 0,
                      len(second))
    meta = planner.build_metadata([("r2", len(second) - 1)])
    planner.request_finished("r2", len(second) - 1, [1, 2, 3, 4])
    final = planner.build_metadata([])
    planner.step_done({meta.step, final.step}, {meta.step, final.step})
    release.set()
    assert stored_anywhere(planner, old_tail) == [True] * LAYERS
    assert matched(planner, "again", [*FIRST, 999, 998]) == 10


def test_a_save_that_stays_in_host_ram_retires_nothing(tmp_path: Path) -> None:
    """BE work (its KV is written through only once checkpointed) covers a session's tail:
    the tail's SSD copy stays, and the session's next turn finds it after a restart."""
    planner = make_planner(tmp_path / "ssd")
    run_turn(planner, "r1", FIRST, [7, 8, 9])
    run_turn(planner, "be", [*FIRST, 111, 112, 113, 114], [1, 2, 3, 4], session=None,
             background=True)
    assert stored_anywhere(planner, tail_keys(planner)) == [True] * LAYERS
    planner.close()
    restarted = make_planner(tmp_path / "ssd")
    try:
        assert matched(restarted, "next", [*FIRST, 555, 556]) == 10
    finally:
        restarted.close()


def test_a_tail_handed_to_a_checkpoint_before_its_erasure_runs_stays(
        planner: TierPlanner) -> None:
    """The erasure runs later, in the background: a BE request checkpointed onto the tail
    meanwhile (a tier holds it: handed over, not copied) keeps it."""
    run_turn(planner, "r1", FIRST, [7, 8, 9])
    old_tail = tail_keys(planner)
    release = hold_the_eraser(planner)
    run_turn(planner, "r2", [*FIRST, 111, 112, 113, 114], [1, 2, 3, 4])  # retires the tail
    _, meta = preempt_after(planner, "be", FIRST, [7, 8, 9], [10], background=True)
    fake_worker_saves(planner, meta.checkpoints)
    planner.step_done({meta.step}, set())
    release.set()
    assert stored_anywhere(planner, old_tail) == [True] * LAYERS
    assert planner.check_integrity() == []


def test_a_covering_chunk_pushes_no_other_tail_out_of_a_full_chain(tmp_path: Path) -> None:
    planner = make_planner(tmp_path / "ssd", host_tier_bytes=256 * PAGE_BYTES)
    try:
        run_turn(planner, "u", [*TURN1[:8], 200, 201, 202, 203], [1, 2, 3])  # [200, 201, 202]
        run_turn(planner, "t", FIRST, [4, 5, 6])  # [108, 109]
        for i in range(TAILS_PER_CHAIN - 2):  # the chain after chunk 1 full
            run_turn(planner, f"o{i}", [*TURN1[:8], 300 + i, 400, 401], [7, 8, 9])
        run_turn(planner, "t2", [*FIRST, 111, 112, 113, 114], [10, 11, 12, 13])
        assert matched(planner, "q", [*TURN1[:8], 200, 201, 999, 998]) == 10
    finally:
        planner.close()


def test_a_session_tail_stays_on_ssd_when_the_ssd_tier_refuses_its_cover(
        tmp_path: Path) -> None:
    planner = make_planner(tmp_path / "ssd")
    run_turn(planner, "r1", FIRST, [7, 8, 9])
    ssd = planner.store.tiers[1]
    put = ssd.put
    ssd.put = lambda *args, **kwargs: False  # type: ignore[method-assign]  # no room below
    run_turn(planner, "r2", [*FIRST, 111, 112, 113, 114], [1, 2, 3, 4])
    ssd.put = put  # type: ignore[method-assign]
    assert [ssd.contains(key) for key in tail_keys(planner)] == [True] * LAYERS
    planner.close()
    restarted = make_planner(tmp_path / "ssd")
    try:
        assert matched(restarted, "next", [*FIRST, 555]) == 10
    finally:
        restarted.close()


@pytest.mark.parametrize("ssd_tier_bytes", [1 << 20, 0])
def test_tails_that_stay_in_host_ram_retire_there(tmp_path: Path, ssd_tier_bytes: int) -> None:
    """A chat without a session (an OpenAI client's) keeps its KV in host RAM, as every
    turn does without an SSD tier: its covered tails leave host RAM all the same."""
    planner = make_planner(tmp_path / "ssd", ssd_tier_bytes=ssd_tier_bytes)
    try:
        run_turn(planner, "r1", FIRST, [7, 8, 9], session=None)
        old_tail = tail_keys(planner)
        run_turn(planner, "r2", [*FIRST, 111, 112, 113, 114], [1, 2, 3, 4], session=None)
        assert stored_anywhere(planner, old_tail) == [False] * LAYERS
    finally:
        planner.close()


def test_deleting_a_session_spares_the_chunk_that_covered_its_tail(planner: TierPlanner
                                                                   ) -> None:
    """Session B's conversation began with all of session A's: B's first chunk took the
    place of A's tail in the index. Deleting A erases A's KV, not B's chunk."""
    a = [100, 101, 102]  # 2 tokens with KV: a tail after the seed
    run_turn(planner, "a1", a, [1], session="A")
    b = [100, 101, 102, 103, 104, 105, 106]  # chunk 0 [100..103] covers A's tail
    run_turn(planner, "b1", b, [2, 3], session="B")
    planner.retirement.settle()
    planner.erasure.forget("A", [a[:2]]).result(10)
    assert matched(planner, "b2", [*b, 107]) == 6


def test_a_tail_an_advisory_holds_leaves_host_ram_once_let_go(planner: TierPlanner) -> None:
    """The user types while the follow-up streams: the advisory's prefetch of the
    conversation, which still ends inside the tail, pins it in host RAM when the follow-up's
    chunk covers it. The copy goes once the next turn has used the advisory."""
    run_turn(planner, "r1", FIRST, [7, 8, 9])
    old_tail = tail_keys(planner)
    tokens = [*FIRST, 111]
    view = TokenView("r2", tokens, "s1")
    planner.add_request(view)
    planner.test_blocks["r2"] = [1, 2, 3, 4]  # type: ignore[attr-defined]
    planner.plan_load("r2", [1, 2, 3, 4], planner.num_new_matched_tokens(view, 0) or 0,
                      len(tokens))
    meta = planner.build_metadata([("r2", 11)])  # the prompt: chunk 2 not yet full
    fake_worker_saves(planner, meta.saves)
    planner.step_done({meta.step}, set())
    assert planner.advise("s1", [*FIRST, 111], None) == 10  # typing: the old tail, pinned
    advisory = planner.advisories.get("s1")  # pinned once its prefetch is done (the tail is in
    # host RAM already: waiting for it to be there raced the prefetch thread's pin)
    assert advisory is not None and advisory.handle is not None and advisory.handle.wait(10)
    tokens.append(200)  # a decode step fills chunk 2, which covers the old tail
    meta = planner.build_metadata([("r2", 12)])
    fake_worker_saves(planner, meta.saves)
    planner.step_done({meta.step}, set())
    tokens.append(201)
    if planner.request_finished("r2", 13, [1, 2, 3, 4]):
        final = planner.build_metadata([])
        fake_worker_saves(planner, final.final_saves["r2"])
        planner.step_done({final.step}, set())
    planner.retirement.settle()
    assert [planner.host.contains(key) for key in old_tail] == [True] * LAYERS  # pinned
    next_turn = TokenView("r3", [*tokens, 115, 116], "s1")  # the session's: it uses the advisory
    planner.add_request(next_turn)
    assert planner.num_new_matched_tokens(next_turn, 0) == 13
    planner.settle_retired_prefetches()  # (its prefetch lets go of its pins in its thread)
    planner.step_done(set(), set())
    assert stored_anywhere(planner, old_tail) == [False] * LAYERS

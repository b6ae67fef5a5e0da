"""Partial chunks a later save covers leave the tiers (`tiering/retirement.py`), and what they
held is still found: the KV connector's scheduler side without vLLM, as in test_tier_planner."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from antiphon.tiering.keys import ChunkKey
from antiphon.tiering.planner import TierPlanner, TokenView
from tests.test_tier_planner import (
    LAYERS,
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

"""The KV connector's scheduler side without vLLM: what it saves, matches, loads and prefetches.

The worker is played by writing slot bytes straight into the host arena, as `KvPageCopier` does.
"""

from __future__ import annotations

import collections
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from antiphon.tiering.config import TieringConfig
from antiphon.tiering.connector_meta import PageCopy, TieringMetadata
from antiphon.tiering.keys import ChunkKey, prefix_hashes
from antiphon.tiering.planner import NO_SLOT, TierPlanner, TokenView

LAYERS = 2
PAGE_BYTES = 64
CHUNK = 4  # tokens per chunk and per page
TURN1 = list(range(100, 110))  # 10 tokens: 2 full chunks and a 2-token tail


def make_planner(ssd_dir: Path, **overrides: object) -> TierPlanner:
    settings: dict[str, object] = {"host_tier_bytes": 64 * PAGE_BYTES,
                                   "ssd_tier_bytes": 1 << 20, "page_tokens": CHUNK,
                                   **overrides}
    config = TieringConfig(ssd_dir=ssd_dir, chunk_tokens=CHUNK,
                           host_shm_name=f"antiphon-test-{uuid.uuid4().hex[:12]}",
                           **settings)  # type: ignore[arg-type]
    blocks: dict[str, list[int]] = {}
    planner = TierPlanner(config, model_id="test-model", num_layers=LAYERS,
                          page_bytes=PAGE_BYTES, block_ids_of=blocks.__getitem__)
    planner.test_blocks = blocks  # type: ignore[attr-defined]
    return planner


def restarted_planner(tmp_path: Path, **overrides: object) -> TierPlanner:
    """A planner started over the SSD tier of one that ran the first turn of TURN1."""
    first = make_planner(tmp_path / "ssd")
    run_turn(first, "r1", [*TURN1, 110], [7, 8, 9])
    first.close()
    return make_planner(tmp_path / "ssd", **overrides)


@pytest.fixture
def planner(tmp_path: Path) -> Iterator[TierPlanner]:
    p = make_planner(tmp_path / "ssd")
    yield p
    p.close()


@pytest.fixture
def host_only(tmp_path: Path) -> Iterator[TierPlanner]:
    """A planner whose host tier holds 4 chunks, and no SSD tier."""
    p = make_planner(tmp_path / "ssd", host_tier_bytes=4 * PAGE_BYTES * LAYERS, ssd_tier_bytes=0)
    yield p
    p.close()


def fake_worker_saves(planner: TierPlanner, copies: list[PageCopy]) -> None:
    """What the worker would write: every page filled with (block, layer) bytes."""
    for copy in copies:
        for layer, slot in enumerate(copy.slots):
            if slot == NO_SLOT:
                continue
            for i, block in enumerate(copy.blocks):
                page = bytes([block % 256, layer]) * (PAGE_BYTES // 2)
                planner.host.arena.write(slot, page, (copy.first_page + i) * PAGE_BYTES)


def run_step(planner: TierPlanner, scheduled: list[tuple[str, int]]) -> TieringMetadata:
    """One step of `scheduled` (request id, tokens computed after it): its saves written as
    the worker would, the step reported done."""
    meta = planner.build_metadata(scheduled)
    fake_worker_saves(planner, meta.saves)
    planner.step_done({meta.step}, set())
    return meta


def admit(planner: TierPlanner, view: TokenView, blocks: list[int]) -> None:
    """Add `view`'s request and allocate `blocks` for it, loading nothing from the tiers."""
    planner.add_request(view)
    planner.num_new_matched_tokens(view, 0)
    planner.test_blocks[view.request_id] = blocks  # type: ignore[attr-defined]
    planner.plan_load(view.request_id, blocks, 0, len(view.token_ids))


def run_turn(planner: TierPlanner, request_id: str, tokens: list[int], blocks: list[int],
             session: str | None = "s1", background: bool = False
             ) -> tuple[int | None, TieringMetadata]:
    """Admit, allocate, run one step computing every token but the last, finish (a turn of
    `session`, whose KV is written through to the SSD tier)."""
    view = TokenView(request_id, tokens, session, background=background)
    planner.add_request(view)
    matched = planner.num_new_matched_tokens(view, 0)
    planner.test_blocks[request_id] = blocks  # type: ignore[attr-defined]
    planner.plan_load(request_id, blocks, matched or 0, len(tokens))
    meta = run_step(planner, [(request_id, len(tokens) - 1)])
    if planner.request_finished(request_id, len(tokens) - 1, blocks):
        final = planner.build_metadata([])
        fake_worker_saves(planner, final.final_saves[request_id])
        planner.step_done({final.step}, set())
    return matched, meta


def test_a_turn_saves_full_chunks_then_its_partial_tail(planner: TierPlanner) -> None:
    tokens = [*TURN1, 110]  # 11 tokens; 10 get KV
    matched, meta = run_turn(planner, "r1", tokens, [7, 8, 9])
    assert matched == 0
    assert [c.blocks for c in meta.saves] == [(7,), (8,)]
    stats = planner.stats()
    assert stats["saved_chunks"] == 2
    planner.store.flush()
    # 2 full chunks and the tail, each in both tiers (write-through), every layer.
    assert stats["tiers"]["host"]["used_bytes"] == 3 * LAYERS * PAGE_BYTES
    assert len(planner.store.tiers[1].keys()) == 3 * LAYERS
    planner.store.check_integrity()


def test_a_partial_chunk_keeps_no_byte_of_its_slots_last_occupant(tmp_path: Path) -> None:
    # Two pages a chunk (a GPU's 8): a tail of one page published its whole slot, and the
    # write-through kept the other page, another session's KV left in the slot, on the SSD
    # under this session's tag, past that session's erasure.
    p = make_planner(tmp_path / "ssd", page_tokens=CHUNK // 2)
    try:
        for slot in range(p.host.arena.num_slots):
            p.host.arena.write(slot, b"\xee" * p.host.slot_bytes)  # the last occupant's
        run_turn(p, "r1", [100, 101, 102], [5])  # 2 tokens of KV: one page of the tail's two
        p.store.flush()
        ssd = p.store.tiers[1]
        kept_keys = ssd.keys()
        assert len(kept_keys) == LAYERS
        for key in kept_keys:
            kept = bytes(ssd.peek(key) or b"")
            assert len(kept) == PAGE_BYTES and b"\xee" not in kept
    finally:
        p.close()
    # and a follow-up after a restart loads the page back from the SSD tier
    p = make_planner(tmp_path / "ssd", page_tokens=CHUNK // 2, ssd_fetch_wait_s=10.0)
    try:
        view = TokenView("r2", [100, 101, 102, 103], "s1")
        p.add_request(view)
        assert p.num_new_matched_tokens(view, 0) == 2
        p.plan_load("r2", [6], 2, 4)
        meta = p.build_metadata([])
        (load,) = [*meta.loads, *meta.early_loads]
        assert load.blocks == (6,)
        for layer, slot in enumerate(load.slots):
            assert p.host.arena.read(slot, PAGE_BYTES) == bytes([5, layer]) * (PAGE_BYTES // 2)
    finally:
        p.close()


def test_a_follow_up_loads_its_whole_prior_context(planner: TierPlanner) -> None:
    run_turn(planner, "r1", [*TURN1, 110], [7, 8, 9])
    follow_up = [*TURN1, 110, 111, 112, 113, 114]
    view = TokenView("r2", follow_up)
    planner.add_request(view)
    assert planner.num_new_matched_tokens(view, 0) == 10  # 2 chunks + the 2-token tail
    planner.plan_load("r2", [1, 2, 3, 4], 10, len(follow_up))
    meta = planner.build_metadata([])
    # Whole pages load layer by layer; the tail page, which this step also writes, up front.
    assert [c.blocks for c in meta.loads] == [(1,), (2,)]
    assert [c.blocks for c in meta.early_loads] == [(3,)]
    for copy in [*meta.loads, *meta.early_loads]:
        assert NO_SLOT not in copy.slots
    # Loaded slots stay pinned until the worker reports the step, and until it has, the
    # engine steps on even with nothing to run (the connector's `has_pending_push_work`).
    keys = list(planner.host.keys())  # a tier, not a dict: keys() is its snapshot
    loaded = next(k for k in keys if planner.host.slot_of(k) == meta.loads[0].slots[0])
    assert not planner.host.remove(loaded)
    assert planner.has_steps_in_flight()
    planner.step_done({meta.step}, set())
    assert not planner.has_steps_in_flight()
    assert planner.host.remove(loaded)
    stats = planner.stats()
    assert stats["tokens_from_host"] == 10
    assert stats["computed_prompt_tokens"] == 11 + 5  # the first turn's prompt, then 5 new
    # the worker's reads of the host tier: 2 chunks and the tail, each layer, none missed
    assert (stats["tiers"]["host"]["hits"], stats["tiers"]["host"]["misses"]) == (3 * LAYERS, 0)
    planner.store.check_integrity()


def test_a_turn_vllm_could_not_place_is_answered_again_from_its_pins(
        planner: TierPlanner, monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM asks every step while it has no pages for the turn: the match its pins hold is the
    answer, without matching and pinning the context again; a new device hit re-admits."""
    run_turn(planner, "r1", [*TURN1, 110], [7, 8, 9])
    view = TokenView("r2", [*TURN1, 110, 111, 112])
    planner.add_request(view)
    assert planner.num_new_matched_tokens(view, 0) == 10
    pins = []
    real_pin_all = planner.host.pin_all
    monkeypatch.setattr(planner.host, "pin_all",
                        lambda keys: pins.extend(keys) or real_pin_all(keys))
    assert planner.num_new_matched_tokens(view, 0) == 10  # no page for it last step
    assert pins == []
    assert planner.num_new_matched_tokens(view, 4) == 6  # vLLM's own cache holds a page now
    assert pins  # admitted afresh
    planner.plan_load("r2", [1, 2, 3], 6, len(view.token_ids))
    planner.step_done({planner.build_metadata([]).step}, set())
    planner.store.check_integrity()


def test_a_follow_up_loads_the_part_of_a_tail_it_shares(planner: TierPlanner) -> None:
    # The turn ran past where the follow-up's prompt leaves it: a reply a stop string ended
    # (the engine computed a token or more past the stop, which the next prompt renders
    # without) or one its user cancelled. Its tail was stored under its own 3 tokens only,
    # and the follow-up, which shares 2 of them, recomputed the whole partial chunk.
    run_turn(planner, "r1", [*TURN1, 110, 111], [7, 8, 9])  # 11 computed: tail 108-110
    follow = [*TURN1, 200, 201, 202]
    view = TokenView("r2", follow)
    planner.add_request(view)
    assert planner.num_new_matched_tokens(view, 0) == 10
    planner.plan_load("r2", [1, 2, 3, 4], 10, len(follow))
    meta = planner.build_metadata([])
    assert [c.blocks for c in meta.loads] == [(1,), (2,)]
    assert [c.blocks for c in meta.early_loads] == [(3,)]  # the shared tail's page
    planner.step_done({meta.step}, set())
    # Of two tails, the one that shares more
    run_turn(planner, "r3", [*TURN1, 200, 201], [4, 5, 6])  # tail 108, 109, 200
    view = TokenView("r4", [*TURN1, 200, 201, 202])
    planner.add_request(view)
    assert planner.num_new_matched_tokens(view, 0) == 11


def test_a_tail_a_tier_held_already_is_matched_by_the_part_it_shares(tmp_path: Path) -> None:
    # The same conversation after a restart saves the same tail, which the SSD tier holds
    # from before: nothing to copy, and it was left out of the index.
    first = make_planner(tmp_path / "ssd")
    run_turn(first, "r1", [*TURN1, 110, 111], [7, 8, 9])  # tail 108-110
    first.close()
    planner = make_planner(tmp_path / "ssd", ssd_fetch_wait_s=5.0)
    try:
        run_turn(planner, "r1", [*TURN1, 110, 111], [7, 8, 9])
        view = TokenView("r2", [*TURN1, 200, 201, 202])
        planner.add_request(view)
        assert planner.num_new_matched_tokens(view, 0) == 10
    finally:
        planner.close()


def test_after_a_restart_an_advisory_lets_the_turn_load_the_part_of_a_tail_it_shares(
        tmp_path: Path) -> None:
    # The reply a stop string ended: the session keeps its tokens up to the stop string's
    # (110), which the next prompt renders without. After a restart the tail index is empty,
    # and the follow-up's prompt finds no tail by its exact tokens; the advisory's context does.
    first = make_planner(tmp_path / "ssd")
    run_turn(first, "r1", [*TURN1, 110, 111], [7, 8, 9])  # tail 108-110: the session's context
    first.close()
    planner = make_planner(tmp_path / "ssd", ssd_fetch_wait_s=5.0)
    try:
        follow = [*TURN1, 200, 201, 202]
        view = TokenView("r2", follow)
        planner.add_request(view)
        assert planner.num_new_matched_tokens(view, 0) == 8  # the full chunks alone
        assert planner.advise("s1", [*TURN1, 110], expected_arrival_s=None) == 11
        view = TokenView("r3", follow, "s1")
        planner.add_request(view)
        assert planner.num_new_matched_tokens(view, 0) == 10
    finally:
        planner.close()


def test_a_tail_saved_before_a_restart_is_found_by_its_exact_tokens(tmp_path: Path) -> None:
    first = make_planner(tmp_path / "ssd")
    run_turn(first, "r1", [*TURN1, 200, 201], [7, 8, 9])  # tail 108, 109, 200
    first.close()
    planner = make_planner(tmp_path / "ssd")  # its tail index is empty
    try:
        run_turn(planner, "r2", [*TURN1, 300, 301], [4, 5, 6])  # tail 108, 109, 300: indexed
        view = TokenView("r3", [*TURN1, 200, 201, 202])
        planner.add_request(view)
        assert planner.num_new_matched_tokens(view, 0) == 11  # not 10 (the indexed one)
    finally:
        planner.close()


def test_a_different_prefix_matches_nothing(planner: TierPlanner) -> None:
    run_turn(planner, "r1", [*TURN1, 110], [7, 8, 9])
    view = TokenView("r2", [1, *TURN1])
    planner.add_request(view)
    assert planner.num_new_matched_tokens(view, 0) == 0


def follow_up(planner: TierPlanner) -> TokenView:
    """The second turn of TURN1's session, added to `planner`."""
    view = TokenView("r2", [*TURN1, 110, 111])
    planner.add_request(view)
    return view


@pytest.mark.parametrize(("wait_s", "first", "fetched_in_step_and_held"), [
    (5.0, 10, (1, 0)),  # fetched within the wait: the turn runs in the same step
    (0, None, (0, 1))])  # held (None) until its SSD fetch is done
def test_after_a_restart_a_turn_loads_its_context_from_ssd(
        tmp_path: Path, wait_s: float, first: int | None,
        fetched_in_step_and_held: tuple[int, int]) -> None:
    planner = restarted_planner(tmp_path, ssd_fetch_wait_s=wait_s)
    try:
        view = follow_up(planner)
        matched = planner.num_new_matched_tokens(view, 0)
        assert matched == first
        if matched is None:
            assert wait_for_admission(planner, view) == 10
        planner.plan_load("r2", [1, 2, 3], 10, 12)
        stats = planner.stats()
        assert stats["tokens_from_ssd"] == 10
        # fetched from below, then loaded through the host tier: 2 chunks and the tail
        host = stats["tiers"]["host"]
        assert (host["misses"], host["hits"]) == (3 * LAYERS, 0)
        assert host["bytes_out"] == 3 * LAYERS * PAGE_BYTES
        assert (stats["turns_fetched_in_step"], stats["turns_held"]) == fetched_in_step_and_held
        planner.store.check_integrity()
    finally:
        planner.close()


def wait_for_admission(planner: TierPlanner, view: TokenView) -> int | None:
    """`num_new_matched_tokens` until the turn is no longer held (at most 10 s)."""
    matched = None
    deadline = time.monotonic() + 10
    while matched is None and time.monotonic() < deadline:
        matched = planner.num_new_matched_tokens(view, 0)
        time.sleep(0.01)
    return matched


def test_a_context_larger_than_the_host_tier_loads_its_leading_chunks(tmp_path: Path) -> None:
    first = make_planner(tmp_path / "ssd")
    run_turn(first, "r1", [*TURN1, 110], [7, 8, 9])
    first.close()
    # Room for 3 chunk-layers: one whole chunk (2 layers), not the 3 chunks of the context.
    planner = make_planner(tmp_path / "ssd", host_tier_bytes=3 * PAGE_BYTES,
                           ssd_fetch_wait_s=0)
    try:
        view = follow_up(planner)
        # Layer 0 of every chunk first would fill the host and leave no chunk whole (all
        # recomputed); the fetch is cut to the first chunk, which loads.
        assert wait_for_admission(planner, view) == CHUNK
        stats = planner.stats()
        assert stats["ssd_fetches_cut"] == 1 and stats["turns_held"] == 1
        planner.plan_load("r2", [1, 2, 3], CHUNK, 12)
        assert planner.stats()["tokens_from_ssd"] == CHUNK
        planner.store.check_integrity()
    finally:
        planner.close()


def test_a_fetch_that_lost_keys_goes_again(tmp_path: Path) -> None:
    planner = restarted_planner(tmp_path, ssd_fetch_wait_s=0)
    try:
        view = follow_up(planner)
        assert planner.num_new_matched_tokens(view, 0) is None
        fetch = planner._requests["r2"].prefetch
        assert fetch is not None and fetch.wait(10)
        # Another fetch took the room of one chunk-layer after this one brought it up.
        fetch.release()
        assert planner.host.remove(fetch.keys[0])
        assert wait_for_admission(planner, view) == 10
        stats = planner.stats()
        assert (stats["fetch_retries"], stats["turns_held"]) == (1, 1)
    finally:
        planner.close()


def test_a_fetch_goes_again_for_chunks_the_device_dropped_meanwhile(tmp_path: Path) -> None:
    planner = restarted_planner(tmp_path, ssd_fetch_wait_s=0)
    try:
        view = follow_up(planner)
        # vLLM's prefix cache holds the first chunk: the fetch is for the rest.
        assert planner.num_new_matched_tokens(view, CHUNK) is None
        fetch = planner._requests["r2"].prefetch
        assert fetch is not None and fetch.wait(10)
        assert min(key.chunk_index for key in fetch.keys) == 1
        # By the time the fetch is done, vLLM has reused that page: the first chunk is wanted
        # from SSD too, and fetched, instead of everything being recomputed.
        assert planner.num_new_matched_tokens(view, 0) is None
        assert wait_for_admission(planner, view) == 10
        stats = planner.stats()
        assert (stats["fetch_retries"], stats["turns_held"]) == (1, 1)
    finally:
        planner.close()


def test_an_advisory_fetches_only_the_leading_chunks_the_host_has_room_for(
        tmp_path: Path) -> None:
    planner = restarted_planner(tmp_path, host_tier_bytes=3 * PAGE_BYTES)
    try:
        assert planner.advise("s1", [*TURN1, 110], expected_arrival_s=0.0) == 10
        handle = planner.advisories.get("s1").handle
        assert handle is not None and handle.wait(10)
        assert {key.chunk_index for key in handle.keys} == {0}  # whole, both layers
        assert len(handle.keys) == LAYERS and planner.stats()["ssd_fetches_cut"] == 1
    finally:
        planner.close()


def test_an_advisory_prefetches_and_is_used_by_its_sessions_turn(tmp_path: Path) -> None:
    planner = restarted_planner(tmp_path)
    try:
        assert planner.advise("s1", [*TURN1, 110], expected_arrival_s=0.0) == 10
        handle = planner.advisories.get("s1").handle
        assert handle is not None and handle.wait(10)
        view = TokenView("r2", [*TURN1, 110, 111], session="s1")
        planner.add_request(view)
        hints = planner.host.policy._sessions  # type: ignore[attr-defined]
        assert "s1" in hints  # kept ahead of other sessions' KV until the turn comes
        assert planner.num_new_matched_tokens(view, 0) == 10  # no wait: already in host
        stats = planner.stats()
        assert stats["advisories_received"] == 1 and stats["advisories_used"] == 1
        assert stats["prefetches_timed"] == 1 and stats["prefetch_load_s_sum"] > 0
        assert stats["turns_held"] == 0
        assert "s1" not in hints  # it spoke: no longer ahead of the others
    finally:
        planner.close()


OTHER = [t + 500 for t in TURN1] + [610]  # another session's context, as long as s1's


def two_sessions_on_ssd(tmp_path: Path, **overrides: object) -> TierPlanner:
    """A planner started over the SSD tier of one that ran a turn of s9 (`OTHER`), then of s1
    (TURN1 and a token)."""
    first = make_planner(tmp_path / "ssd")
    run_turn(first, "r9", OTHER, [20, 21, 22], session="s9")
    run_turn(first, "r1", [*TURN1, 110], [7, 8, 9], session="s1")
    first.close()
    return make_planner(tmp_path / "ssd", **overrides)


def test_a_turn_reclaiming_a_running_prefetchs_room_gets_it_at_once(tmp_path: Path) -> None:
    """An advisory's prefetch still running kept what it had pinned until it settled, and
    went on after the turn's fetch it yielded to: the turn reclaiming its room found none,
    cut its fetch, and recomputed most of its context."""
    planner = two_sessions_on_ssd(tmp_path, host_tier_bytes=3 * LAYERS * PAGE_BYTES,
                                  ssd_fetch_wait_s=0)
    try:
        ssd = planner.store.tiers[1]
        read, gate, reads = ssd.get, threading.Event(), [0]

        def held_after_three(key: ChunkKey) -> bytes | None:  # s9's prefetch: layer 0 of
            reads[0] += 1  # its 3 chunks up, pinned, then it waits
            if reads[0] > 3:
                gate.wait(10)
            return read(key)
        ssd.get = held_after_three  # type: ignore[method-assign]
        planner.advise("s9", OTHER, expected_arrival_s=60.0)
        deadline = time.monotonic() + 5
        while reads[0] < 4 and time.monotonic() < deadline:
            time.sleep(0.01)
        view = TokenView("r2", [*TURN1, 110, 111], session="s1")
        planner.add_request(view)
        assert planner.num_new_matched_tokens(view, 0) is None  # fetching
        gate.set()
        assert wait_for_admission(planner, view) == 10
        assert planner.stats()["advisories_reclaimed"] == 1
    finally:
        planner.close()


def test_an_advisory_expected_sooner_takes_the_room_of_one_expected_later(
        tmp_path: Path) -> None:
    """Symphony: the session expected soonest first. A user typing now got no prefetch while
    an advisory due in ten minutes held the host tier's room."""
    planner = two_sessions_on_ssd(tmp_path, host_tier_bytes=3 * LAYERS * PAGE_BYTES)
    try:
        planner.advise("s9", OTHER, expected_arrival_s=600.0)
        assert planner.advisories.get("s9").handle.wait(10)
        planner.advise("s1", [*TURN1, 110], expected_arrival_s=0.0)
        handle = planner.advisories.get("s1").handle
        assert handle is not None and handle.wait(10)
        assert planner.advisories.get("s9").reclaimed
        # and not the other way round: one expected later takes no room from it
        planner.advise("s9", OTHER, expected_arrival_s=600.0)
        assert not planner.advisories.get("s1").reclaimed
        assert planner.stats()["advisories_reclaimed"] == 1
    finally:
        planner.close()


def test_an_advisory_of_higher_priority_takes_the_room_of_one_of_lower(tmp_path: Path) -> None:
    """Symphony moves a prioritised session's KV at once: an advisory's `priority` went
    unused, and one of a paying user expected in a minute got no room from a free user's
    expected now."""
    planner = two_sessions_on_ssd(tmp_path, host_tier_bytes=3 * LAYERS * PAGE_BYTES)
    try:
        planner.advise("s9", OTHER, expected_arrival_s=0.0)
        assert planner.advisories.get("s9").handle.wait(10)
        planner.advise("s1", [*TURN1, 110], expected_arrival_s=60.0, priority=1)
        handle = planner.advisories.get("s1").handle
        assert handle is not None and handle.wait(10) and not handle.failed_keys()
        assert planner.advisories.get("s9").reclaimed
        # and not the other way round, however soon the lower one expects its turn
        planner.advise("s9", OTHER, expected_arrival_s=0.0)
        assert not planner.advisories.get("s1").reclaimed
        # the same KV advised again with a higher priority is no renewal: it goes ahead
        assert planner.advisories.get("s9").handle is None  # (no room for it)
        assert not planner.advisories.renew("s1", handle.keys, 60.0, priority=2)
        assert planner.advisories.renew("s1", handle.keys, 60.0, priority=1)
        stats = planner.stats()
        assert (stats["advisories_reclaimed"], stats["advisories_renewed"]) == (1, 1)
    finally:
        planner.close()


def test_an_advisory_again_for_the_same_kv_keeps_the_prefetch_it_has(tmp_path: Path) -> None:
    """A typing user and a long agent call advise again every 15 s: each released the pins
    of the KV already fetched and queued their return behind every other fetch."""
    planner = restarted_planner(tmp_path, advisory_ttl_s=30.0)
    try:
        planner.advise("s1", [*TURN1, 110], expected_arrival_s=0.0)
        first = planner.advisories.get("s1")
        assert first.handle is not None and first.handle.wait(10)
        expires_at = first.expires_at
        planner.advise("s1", [*TURN1, 110], expected_arrival_s=5.0)
        again = planner.advisories.get("s1")
        assert again is first and again.handle is first.handle  # kept, pins and all
        assert again.expires_at > expires_at
        stats = planner.stats()
        assert (stats["advisories_received"], stats["advisories_renewed"]) == (1, 1)
        planner.advise("s1", TURN1[:CHUNK], expected_arrival_s=0.0)
        assert planner.advisories.get("s1") is not first  # other KV: a prefetch of its own
    finally:
        planner.close()


def test_an_advisory_again_for_more_kv_than_the_host_holds_keeps_the_prefetch_it_has(
        tmp_path: Path) -> None:
    """A context larger than the host is fetched cut to its leading chunks: compared with the
    whole context, every refresh dropped that prefetch, pinned the same KV again and queued it
    anew (counted dropped, and late where the turn came first; found by a review)."""
    planner = restarted_planner(tmp_path, host_tier_bytes=2 * LAYERS * PAGE_BYTES)
    try:
        planner.advise("s1", [*TURN1, 110], expected_arrival_s=5.0)
        first = planner.advisories.get("s1")
        assert first is not None and first.handle is not None and first.handle.wait(10)
        assert 0 < len(first.handle.keys) < 3 * LAYERS  # cut: the host holds 2 of 3 chunks
        planner.advise("s1", [*TURN1, 110], expected_arrival_s=5.0)
        again = planner.advisories.get("s1")
        assert again is first and again.handle is first.handle
        stats = planner.stats()
        assert (stats["advisories_renewed"], stats["advisories_dropped"]) == (1, 0)
    finally:
        planner.close()


def test_a_turn_overtaking_its_prefetch_keeps_what_it_pinned_until_it_settles(
        tmp_path: Path) -> None:
    """Let go at once, the chunk-layers it had brought up were unpinned before the turn had
    pinned them, and another fetch's writes could evict them."""
    planner = restarted_planner(tmp_path)
    try:
        ssd = planner.store.tiers[1]
        read, gate, reads = ssd.get, threading.Event(), [0]

        def held_after_two(key: ChunkKey) -> bytes | None:
            reads[0] += 1
            if reads[0] > 2:
                gate.wait(10)
            return read(key)
        ssd.get = held_after_two  # type: ignore[method-assign]
        planner.advise("s1", [*TURN1, 110], expected_arrival_s=0.0)
        deadline = time.monotonic() + 5
        while reads[0] < 3 and time.monotonic() < deadline:
            time.sleep(0.01)
        with planner.lock:  # as its turn's admission does, before it pins anything
            planner.advisories.overtake("s1")
        assert planner.host._index.pinned_bytes == 2 * PAGE_BYTES  # type: ignore[attr-defined]
        gate.set()
        view = TokenView("r2", [*TURN1, 110, 111], session="s1")
        planner.add_request(view)
        assert wait_for_admission(planner, view) == 10
    finally:
        planner.close()


def test_a_prefetch_that_brought_nothing_up_is_not_counted_timed(tmp_path: Path) -> None:
    planner = restarted_planner(tmp_path)
    try:
        ssd = planner.store.tiers[1]
        read = ssd.get
        ssd.get = lambda key: None  # type: ignore[method-assign]  # every chunk gone meanwhile
        planner.advise("s1", [*TURN1, 110], expected_arrival_s=0.0)
        handle = planner.advisories.get("s1").handle
        assert handle is not None and not handle.wait(10)  # (settled, none ready)
        assert handle.is_done and set(handle.failed_keys()) == set(handle.keys)
        ssd.get = read  # type: ignore[method-assign]
        view = TokenView("r2", [*TURN1, 110, 111], session="s1")
        planner.add_request(view)
        assert wait_for_admission(planner, view) == 10  # loaded on its critical path
        stats = planner.stats()
        assert (stats["advisories_used"], stats["prefetches_failed"]) == (1, 1)
        assert (stats["prefetches_timed"], stats["prefetch_lead_s_sum"]) == (0, 0)
    finally:
        planner.close()


def test_an_unused_advisory_expires_and_releases_its_pins(tmp_path: Path) -> None:
    planner = make_planner(tmp_path / "ssd", advisory_ttl_s=0.05)
    try:
        run_turn(planner, "r1", [*TURN1, 110], [7, 8, 9])
        planner.advise("s1", [*TURN1, 110], expected_arrival_s=None)
        time.sleep(0.2)
        stats = planner.stats()
        assert stats["advisories_expired"] == 1 and stats["advisories_live"] == 0
        planner.store.flush()
        assert planner.store.tiers[0].evict(planner.store.tiers[0].capacity_bytes) == 3 * LAYERS  # nothing left pinned
    finally:
        planner.close()


def test_a_stale_advisory_expires_with_the_steps_and_background_saves_get_its_room(
        tmp_path: Path) -> None:
    """Advisories expired only when a turn was admitted, an advisory came, or the stats were
    read: while a batch item ran alone, a session's advisory long past its time kept the
    whole host arena pinned, and the item's saves were refused (found by a review)."""
    context = list(range(100, 117))  # 4 full chunks
    planner = make_planner(tmp_path / "ssd", host_tier_bytes=4 * LAYERS * PAGE_BYTES,
                           advisory_ttl_s=0.05)
    try:
        run_turn(planner, "r1", context, [1, 2, 3, 4, 5])  # the arena full of s1's KV
        planner.store.flush()
        admit(planner, TokenView("be", list(range(500, 509)), None, background=True),
              [20, 21, 22])
        planner.advise("s1", context[:16], None)  # pins every slot
        time.sleep(0.2)  # s1's user left
        meta = planner.build_metadata([("be", 8)])  # the item's step fills 2 chunks
        planner.step_done({meta.step}, set())
        assert len(meta.saves) == 2 and planner.counters.saves_refused == 0
        assert planner.stats()["advisories_expired"] == 1
    finally:
        planner.close()


def test_a_full_host_drops_the_smaller_sessions_top_layers_first(tmp_path: Path) -> None:
    """Sessions without an advisory had no size in the host tier's order: the largest
    session's last chunk went first, not the smallest session's (Symphony's order)."""
    planner = make_planner(tmp_path / "ssd", host_tier_bytes=5 * LAYERS * PAGE_BYTES)
    try:
        run_turn(planner, "r1", list(range(100, 105)), [1, 2], session="small")  # 1 chunk
        run_turn(planner, "r2", list(range(200, 217)), [3, 4, 5, 6, 7], session="big")  # 4
        planner.store.flush()
        run_turn(planner, "r3", list(range(300, 305)), [8, 9], session="new")  # takes 2 slots
        planner.store.flush()
        host = set(planner.store.tiers[0].keys())
        small = prefix_hashes(list(range(100, 104)), CHUNK, planner.model_id)
        big_hashes = prefix_hashes(list(range(200, 216)), CHUNK, planner.model_id)
        assert [k.layer for k in host if k.prefix_hash in small] == [0]  # its top layer went
        big = sorted((k.chunk_index, k.layer) for k in host if k.prefix_hash in big_hashes)
        assert big == [(c, layer) for c in range(4) for layer in range(LAYERS)
                       if (c, layer) != (3, LAYERS - 1)]  # then the big one's last chunk's
        planner.store.check_integrity()
    finally:
        planner.close()


def test_a_session_whose_turn_loaded_its_chunks_keeps_its_size(tmp_path: Path) -> None:
    """As above, with the big session's next turn running when the host fills: its loads
    pinned its chunks, and the pins took their noted size with them, so the big session
    ranked as size 0 and lost two chunks' top layers before the small session lost its one
    (found by a review)."""
    planner = make_planner(tmp_path / "ssd", host_tier_bytes=5 * LAYERS * PAGE_BYTES)
    try:
        run_turn(planner, "r1", list(range(100, 105)), [1, 2], session="small")  # 1 chunk
        big_tokens = list(range(200, 217))
        run_turn(planner, "r2", big_tokens, [3, 4, 5, 6, 7], session="big")  # 4 chunks
        planner.store.flush()
        view = TokenView("r2b", [*big_tokens[:16], 900, 901, 902], "big")  # its next turn
        planner.add_request(view)
        assert planner.num_new_matched_tokens(view, 0) == 16
        blocks = [10, 11, 12, 13, 14]
        planner.test_blocks["r2b"] = blocks  # type: ignore[attr-defined]
        planner.plan_load("r2b", blocks, 16, len(view.token_ids))
        run_step(planner, [("r2b", 17)])  # its loads land and unpin; it decodes on
        run_turn(planner, "r3", list(range(300, 305)), [8, 9], session="new")  # takes 2 slots
        planner.store.flush()
        host = set(planner.store.tiers[0].keys())
        small = prefix_hashes(list(range(100, 104)), CHUNK, planner.model_id)
        big_hashes = prefix_hashes(big_tokens[:16], CHUNK, planner.model_id)
        assert [k.layer for k in host if k.prefix_hash in small] == [0]  # its top layer went
        big = sorted((k.chunk_index, k.layer) for k in host if k.prefix_hash in big_hashes)
        assert big == [(c, layer) for c in range(4) for layer in range(LAYERS)
                       if (c, layer) != (3, LAYERS - 1)]
        planner.store.check_integrity()
    finally:
        planner.close()


def test_a_failed_step_publishes_nothing(planner: TierPlanner) -> None:
    view = TokenView("r1", [*TURN1, 110])
    admit(planner, view, [7, 8, 9])
    meta = planner.build_metadata([("r1", 10)])
    planner.step_done(set(), {meta.step})
    assert planner.stats()["tiers"]["host"]["used_bytes"] == 0
    planner.store.check_integrity()


def test_a_running_turn_reclaims_the_host_room_an_advisory_holds(tmp_path: Path) -> None:
    # The arena holds exactly one conversation (3 chunks x 2 layers); advising it pins it all.
    planner = make_planner(tmp_path / "ssd", host_tier_bytes=3 * LAYERS * PAGE_BYTES)
    try:
        run_turn(planner, "r1", [*TURN1, 110], [7, 8, 9], session="s1")
        planner.store.flush()
        planner.advise("s1", [*TURN1, 110], expected_arrival_s=60.0)
        handle = planner.advisories.get("s1").handle
        assert handle is not None and handle.wait(10)
        other = [t + 1000 for t in TURN1] + [1110]
        _, meta = run_turn(planner, "r2", other, [4, 5, 6], session="s2")
        assert [c.blocks for c in meta.saves] == [(4,), (5,)]  # saved, not refused for room
        stats = planner.stats()
        assert stats["advisories_reclaimed"] == 1 and stats["saved_chunks"] == 4
        # s1's turn still finds its whole context (now coming back from SSD) and is not late.
        planner.store.flush()
        view = TokenView("r3", [*TURN1, 110, 111], session="s1")
        planner.add_request(view)
        deadline = time.monotonic() + 10
        while (matched := planner.num_new_matched_tokens(view, 0)) is None:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert matched == 10
        stats = planner.stats()
        assert stats["advisories_used"] == 1 and stats["advisories_late"] == 0
        # Its prefetch went back to the tiers: no time to average in the dashboard.
        assert stats["prefetches_timed"] == 0 and stats["prefetch_lead_s_sum"] == 0
    finally:
        planner.close()


def test_a_chat_turn_takes_the_host_room_waiting_be_restores_hold(tmp_path: Path) -> None:
    # BE restores waiting for device pages keep their pins: three filled the arena, and a
    # chat turn recomputed the context the SSD tier held, its saves refused (found by a
    # review). An RT request takes memory from BE work, never the reverse.
    contexts = {name: [base + i for i in range(2 * CHUNK + 1)] for name, base in
                [("be1", 1000), ("be2", 2000), ("be3", 3000), ("rt", 4000)]}
    first = make_planner(tmp_path / "ssd")
    for i, (name, tokens) in enumerate(contexts.items()):  # each written through to SSD
        run_turn(first, f"w{i}", tokens, [10 * i + 1, 10 * i + 2, 10 * i + 3], session=name)
    first.close()
    planner = make_planner(tmp_path / "ssd", host_tier_bytes=6 * LAYERS * PAGE_BYTES,
                           ssd_fetch_wait_s=5.0)
    try:
        waiting = [TokenView(f"q-{name}", [*contexts[name], 7], name, background=True)
                   for name in ("be1", "be2", "be3")]
        for view in waiting:
            planner.add_request(view)
            assert planner.num_new_matched_tokens(view, 0) is None  # BE waits for no fetch
        for view in waiting:  # fetched; vLLM has no pages for them: they wait, pinned
            assert wait_for_admission(planner, view) == 2 * CHUNK
        assert len(planner.host.keys()) == 6 * LAYERS
        chat = TokenView("q-rt", [*contexts["rt"], 7], "rt")
        planner.add_request(chat)
        assert planner.num_new_matched_tokens(chat, 0) == 2 * CHUNK
        blocks = [50, 51, 52, 53, 54]
        planner.test_blocks["q-rt"] = blocks  # type: ignore[attr-defined]
        planner.plan_load("q-rt", blocks, 2 * CHUNK, len(chat.token_ids))
        chat.token_ids.extend([9] * CHUNK)  # its reply so far completes a third chunk
        meta = planner.build_metadata([("q-rt", len(chat.token_ids) - 1)])
        assert len(meta.saves) == 1 and planner.stats()["saves_refused"] == 0
        fake_worker_saves(planner, meta.saves)
        planner.step_done({meta.step}, set())
        planner.request_finished("q-rt", len(chat.token_ids) - 1, blocks)
        # A BE restore let go matches again when asked (its fetch sent again).
        assert wait_for_admission(planner, waiting[0]) == 2 * CHUNK
        planner.store.check_integrity()
    finally:
        planner.close()


def test_the_advisory_expected_last_gives_its_room_first_even_while_it_fetches() -> None:
    # Settled prefetches went first: a user due in 5 s lost its KV to a turn short of room,
    # while a session due in 10 minutes, still fetching, kept (and added to) its pins (found
    # by a review; a retired prefetch gives back what it has pinned at once).
    from types import SimpleNamespace

    from antiphon.tiering.advisory_book import Advisory, AdvisoryBook
    from antiphon.tiering.plan_state import TieringCounters

    host = SimpleNamespace(slot_bytes=1, freed=0)
    host.can_make_room = lambda num_bytes: host.freed >= num_bytes
    retired: list[object] = []

    def retire(handle: object) -> None:
        retired.append(handle)
        host.freed += 4

    book = AdvisoryBook(SimpleNamespace(retire=retire), SimpleNamespace(),  # type: ignore[arg-type]
                        host, TieringCounters(), 30.0)  # type: ignore[arg-type]
    now = time.monotonic()
    soon, late = SimpleNamespace(is_done=True), SimpleNamespace(is_done=False)
    book._advisories["soon"] = Advisory("soon", now, now + 35, soon, 8,  # type: ignore[arg-type]
                                        due_at=now + 5)
    book._advisories["late"] = Advisory("late", now, now + 630, late, 8,  # type: ignore[arg-type]
                                        due_at=now + 600)
    book.make_room(4, None)  # a running turn: room for one advisory's pins
    assert retired == [late]
    assert book.get("late").reclaimed and not book.get("soon").reclaimed


def test_every_counter_is_exported_to_prometheus(planner: TierPlanner) -> None:
    from antiphon.server.rest import tiering_metrics_text

    text = tiering_metrics_text(planner.stats()).decode()
    assert 'antiphon_kv_tokens_total{tier="host"} 0' in text
    assert "antiphon_kv_advisories_reclaimed_total 0" in text
    assert "antiphon_kv_chunk_layers_forgotten_total 0" in text
    assert 'antiphon_kv_tier_bytes{tier="host",kind="capacity"} 4096' in text
    assert tiering_metrics_text({}) == b""


def test_a_waiting_turn_reports_what_the_tiers_will_supply(planner: TierPlanner) -> None:
    run_turn(planner, "r1", [*TURN1, 110], [7, 8, 9])
    follow_up = TokenView("r2", [*TURN1, 110, 111, 112])
    assert planner.stored_prefix_tokens(follow_up) == 10  # 2 chunks and the saved tail
    assert planner.stored_prefix_tokens(TokenView("r9", [1, 2, 3, 4, 5, 6])) == 0
    # Looked up again only once the request has more tokens (e.g. preempted after output).
    assert planner.stored_prefix_tokens(TokenView("r3", TURN1[:5])) == 4  # chunk 0 only
    assert planner.stored_prefix_tokens(TokenView("r3", [*TURN1, 110, 111])) == 10


def preempt_after(planner: TierPlanner, request_id: str, tokens: list[int], blocks: list[int],
                  computed: list[int], background: bool = False) -> tuple[int, TieringMetadata]:
    """Admit the request, run one step per entry of `computed` (tokens with KV after it), then
    preempt it: (tokens its checkpoint holds, the metadata of the preempting step)."""
    admit(planner, TokenView(request_id, tokens, background=background), blocks)
    for done in computed:
        meta = run_step(planner, [(request_id, done)])
    held = planner.checkpoint(request_id, computed[-1], blocks)
    meta = planner.build_metadata([])
    return held, meta


def test_a_checkpointed_tail_is_kept_until_it_is_on_ssd(tmp_path: Path) -> None:
    # Published unpinned and then written through, the tail could be evicted in between by
    # the prefetch thread filling the arena: its only copy was gone, the SSD tier had room.
    from antiphon.tiering.keys import ChunkKey

    planner = make_planner(tmp_path / "ssd", host_tier_bytes=8 * PAGE_BYTES * LAYERS)
    try:
        _, meta = preempt_after(planner, "be", [*TURN1, 110], [7, 8, 9], [10],
                                background=True)
        fake_worker_saves(planner, meta.checkpoints)
        commit = planner.host.commit

        def commit_then_fill(key: ChunkKey, *args: Any, **kwargs: Any) -> bool:
            done = commit(key, *args, **kwargs)
            for i in range(16):  # a turn's chunks come up from SSD meanwhile, pinned
                planner.host.put(ChunkKey("test-model", bytes([i]) * 32, 0, 0),
                                 b"x" * PAGE_BYTES, pin=True)
            return done

        planner.host.commit = commit_then_fill  # type: ignore[method-assign]
        planner.step_done({meta.step}, set())
        planner.store.flush()
        assert planner.check_integrity() == []
    finally:
        planner.close()


def test_a_request_waits_for_its_checkpoint_to_land_before_it_is_restored(
        planner: TierPlanner) -> None:
    # With async scheduling the step after the preempting one is scheduled before that one's
    # copies are done: admitted then, the request matched no tail and recomputed it.
    tokens = [*TURN1, 110]
    _, meta = preempt_after(planner, "be", tokens, [7, 8, 9], [10])  # scheduled, not done
    view = TokenView("be", tokens)
    assert planner.num_new_matched_tokens(view, 0) is None  # not yet: it waits a step
    fake_worker_saves(planner, meta.checkpoints)
    planner.step_done({meta.step}, set())
    assert planner.num_new_matched_tokens(view, 0) == 10  # all of it, the tail included


def test_a_preempted_request_checkpoints_only_what_no_tier_holds(planner: TierPlanner) -> None:
    tokens = [*TURN1, 110]
    held, meta = preempt_after(planner, "be", tokens, [7, 8, 9], [10])
    # Chunks 0 and 1 were written through as they filled: handed over. The 2-token tail on
    # block 9 is copied before the forward pass that may overwrite it.
    assert held == 10
    assert [c.blocks for c in meta.checkpoints] == [(9,)]
    assert not meta.saves and not meta.loads
    assert meta.num_page_copies == LAYERS  # one page, every layer (the step trace's `copies`)
    stats = planner.stats()
    assert (stats["checkpoints"], stats["pages_checkpointed"], stats["pages_handed_over"]) == (
        1, 1, 2)
    assert planner.check_integrity() == []  # the tail is reserved, on its way
    fake_worker_saves(planner, meta.checkpoints)
    planner.step_done({meta.step}, set())
    assert planner.check_integrity() == []
    # Admitted again, it finds all 10 tokens in the tiers and loads them back.
    view = TokenView("be", tokens)
    assert planner.stored_prefix_tokens(view) == 10
    assert planner.num_new_matched_tokens(view, 0) == 10
    planner.plan_load("be", [3, 4, 5], 10, len(tokens))
    stats = planner.stats()
    assert (stats["restores"], stats["pages_restored"]) == (1, 3)


def ssd_chunks(planner: TierPlanner) -> set[int]:
    """Indexes of the chunks whose every layer the SSD tier holds (writes flushed)."""
    planner.store.flush()
    stored = planner.store.tiers[1].keys()
    layers = collections.Counter(key.chunk_index for key in stored)
    return {index for index, count in layers.items() if count == LAYERS}


def test_background_kv_reaches_the_ssd_tier_only_once_checkpointed(planner: TierPlanner
                                                                  ) -> None:
    # A BE request's chunks go to the host tier alone: a lazy checkpoint needs them there,
    # and writing every document through to the SSD took a fifth of the BE throughput.
    tokens = [*TURN1, 110]
    held, meta = preempt_after(planner, "be", tokens, [7, 8, 9], [10], background=True)
    assert held == 10
    # Preempted, its handed-over chunks are written down (a full host tier cannot lose
    # them); the tail follows once the step has copied it.
    assert ssd_chunks(planner) == {0, 1}
    fake_worker_saves(planner, meta.checkpoints)
    planner.step_done({meta.step}, set())
    assert ssd_chunks(planner) == {0, 1, 2}
    assert planner.check_integrity() == []


def checkpoint_left_on_ssd(planner: TierPlanner) -> TokenView:
    """Preempt BE work and checkpoint it, then run another turn, which needs the host room:
    with 6 host slots (the BE request's 2 chunks and tail, every layer) the checkpoint's host
    copies go. Returns the BE request's view."""
    tokens = [*TURN1, 110]
    _, meta = preempt_after(planner, "be", tokens, [7, 8, 9], [10], background=True)
    fake_worker_saves(planner, meta.checkpoints)
    planner.step_done({meta.step}, set())
    # The checkpoint's write-down to SSD done: a host copy still being written down is not
    # evicted (the turn's saves were refused instead, one run in six or so).
    planner.store.flush()
    run_turn(planner, "other", list(range(500, 509)), [1, 2, 3])
    return TokenView("be", tokens, background=True)


def test_a_checkpoint_the_host_tier_evicts_is_restored_from_the_ssd_tier(tmp_path: Path
                                                                         ) -> None:
    planner = make_planner(tmp_path / "ssd", host_tier_bytes=6 * PAGE_BYTES)
    try:
        view = checkpoint_left_on_ssd(planner)
        assert planner.host.stats.evictions == 4  # 4 of the checkpoint's 6 host copies
        assert planner.stored_prefix_tokens(view) == 10  # from the SSD tier: nothing lost
    finally:
        planner.close()


def test_be_work_restored_from_ssd_is_held_while_a_turn_would_wait(tmp_path: Path) -> None:
    planner = make_planner(tmp_path / "ssd", host_tier_bytes=6 * PAGE_BYTES,
                           ssd_fetch_wait_s=5.0)
    try:
        view = checkpoint_left_on_ssd(planner)
        # The step's RT streams do not wait for BE work's fetch: it is held to a later step.
        assert planner.num_new_matched_tokens(view, 0) is None
        assert wait_for_admission(planner, view) == 10
        stats = planner.stats()  # (turns: chat turns, which BE work's holds are not)
        assert (stats["turns_fetched_in_step"], stats["turns_held"]) == (0, 0)
    finally:
        planner.close()


@pytest.mark.parametrize(("mode", "on_ssd"), [
    ("sessions", {"turn": True, "sessionless": False, "be": False}),
    ("rt", {"turn": True, "sessionless": True, "be": False}),
    ("all", {"turn": True, "sessionless": True, "be": True})])
def test_whose_kv_is_written_through_to_the_ssd_tier(tmp_path: Path, mode: str,
                                                     on_ssd: dict[str, bool]) -> None:
    planner = make_planner(tmp_path / "ssd", ssd_write_through=mode)
    try:
        requests = {"turn": ("s1", False, 100), "sessionless": (None, False, 200),
                    "be": (None, True, 300)}
        for name, (session, background, first) in requests.items():
            tokens = list(range(first, first + 11))
            run_turn(planner, name, tokens, [7, 8, 9], session=session, background=background)
            planner.store.flush()
            ssd = planner.store.tiers[1]
            stored = ssd.keys()
            assert bool(stored) == on_ssd[name], name
            for key in stored:
                ssd.remove(key)
            # Whatever the SSD tier holds, the host tier serves the prefix again.
            assert planner.stored_prefix_tokens(TokenView(f"{name}2", [*tokens, 1])) == 10
    finally:
        planner.close()


def test_be_work_saved_at_checkpoint_copies_all_of_it_when_preempted(tmp_path: Path) -> None:
    # `background_saves="checkpoint"`: a BE request's steps copy nothing to the host tier;
    # preempted, its checkpoint copies every page, and its restore loads every token.
    planner = make_planner(tmp_path / "ssd", background_saves="checkpoint")
    try:
        tokens = [*TURN1, 110]
        admit(planner, TokenView("be", tokens, background=True), [7, 8, 9])
        meta = run_step(planner, [("be", 10)])
        assert not meta.saves
        assert planner.checkpoint_cost_pages("be", 10) == 3
        held = planner.checkpoint("be", 10, [7, 8, 9])
        meta = planner.build_metadata([])
        assert held == 10
        assert [c.blocks for c in meta.checkpoints] == [(7,), (8,), (9,)]
        stats = planner.stats()
        assert (stats["pages_checkpointed"], stats["pages_handed_over"]) == (3, 0)
        fake_worker_saves(planner, meta.checkpoints)
        planner.step_done({meta.step}, set())
        assert planner.check_integrity() == []
        assert ssd_chunks(planner) == {0, 1, 2}  # written down, as every checkpoint is
        view = TokenView("be", tokens, background=True)
        assert planner.num_new_matched_tokens(view, 0) == 10
        planner.plan_load("be", [3, 4, 5], 10, len(tokens))
        planner.test_blocks["be"] = [3, 4, 5]  # type: ignore[attr-defined]
        # Restored: the chunks its checkpoint saved are not copied again, nor counted in
        # what preempting it once more would copy.
        assert planner.checkpoint_cost_pages("be", 12) == 1
        assert not run_step(planner, [("be", 12)]).saves
    finally:
        planner.close()


def test_a_checkpoint_is_written_down_off_the_schedulers_thread(tmp_path: Path) -> None:
    """A checkpoint's copies were written through to the SSD tier in `step_done`, on the
    engine's scheduler thread: saved only at checkpoint, a BE request's whole KV (hundreds
    of chunk-layers) held the step that preempted it for an RT turn."""
    planner = make_planner(tmp_path / "ssd", background_saves="checkpoint")
    try:
        threads: list[str] = []
        write_through = planner.store.write_through

        def recorded(key: ChunkKey, *args: Any, **kwargs: Any) -> bool:
            threads.append(threading.current_thread().name)
            return write_through(key, *args, **kwargs)

        planner.store.write_through = recorded  # type: ignore[method-assign]
        tokens = [*TURN1, 110]
        _, meta = preempt_after(planner, "be", tokens, [7, 8, 9], [10], background=True)
        fake_worker_saves(planner, meta.checkpoints)
        planner.step_done({meta.step}, set())
        assert ssd_chunks(planner) == {0, 1, 2}  # (flushed)
        assert threads and threading.current_thread().name not in threads, threads
        assert planner.check_integrity() == []
    finally:
        planner.close()


def test_finished_be_work_saved_at_checkpoint_leaves_nothing_in_the_tiers(tmp_path: Path
                                                                          ) -> None:
    planner = make_planner(tmp_path / "ssd", background_saves="checkpoint")
    try:
        be, turn = list(range(300, 311)), list(range(400, 411))
        run_turn(planner, "be", be, [7, 8, 9], session=None, background=True)
        assert planner.stored_prefix_tokens(TokenView("be2", [*be, 1])) == 0
        assert planner.stats()["saved_chunks"] == 0
        run_turn(planner, "turn", turn, [7, 8, 9])  # chat turns are saved as they fill
        assert planner.stored_prefix_tokens(TokenView("turn2", [*turn, 1])) == 10
    finally:
        planner.close()


def test_a_chunk_a_checkpoint_takes_while_it_is_copied_is_written_down(
        planner: TierPlanner) -> None:
    tokens = [*TURN1, 110]
    admit(planner, TokenView("be", tokens, background=True), [7, 8, 9])
    saving = planner.build_metadata([("be", 8)])  # the step saving chunks 0 and 1 ...
    assert planner.checkpoint("be", 8, [7, 8]) == 8  # ... is still running: handed over
    fake_worker_saves(planner, saving.saves)
    planner.step_done({saving.step}, set())
    assert ssd_chunks(planner) == {0, 1}


def run_failed_step(planner: TierPlanner, tokens: list[int]) -> None:
    """Admit request "be" on blocks 1-4 and run a step computing 12 tokens whose saves fail."""
    admit(planner, TokenView("be", tokens), [1, 2, 3, 4])
    meta = planner.build_metadata([("be", 12)])
    planner.step_done(set(), {meta.step})  # the step's saves failed: nothing published


def test_a_restore_waits_for_a_checkpoint_that_copies_only_upper_layers(tmp_path: Path) -> None:
    """A checkpoint copying only a chunk's top layer (its others still in the host tier):
    the restore looked at layer 0 alone, did not wait, and recomputed the chunk."""
    p = make_planner(tmp_path / "ssd", ssd_tier_bytes=0)  # the host tier alone
    try:
        tokens = list(range(100, 111))  # 11 tokens: chunks of 4
        view = TokenView("be", tokens, background=True)
        admit(p, view, [7, 8, 9])
        run_step(p, [("be", 8)])  # chunks 0 and 1 written through (host)
        top = ChunkKey("test-model", p._requests["be"].hashes[1], 1, LAYERS - 1)
        assert p.host.remove(top)  # host pressure took chunk 1's top layer
        held = p.checkpoint("be", 8, [7, 8, 9])
        meta = p.build_metadata([])
        assert held == 8 and [c.slots[0] for c in meta.checkpoints] == [NO_SLOT]
        # The checkpoint's copy of chunk 1's top layer is still running (async scheduling):
        # the request must wait for it, as it does when layer 0 is copied.
        matched = p.num_new_matched_tokens(view, 0)
        assert matched is None, f"restored now: {matched} tokens, chunk 1 recomputed"
    finally:
        p.close()


def test_a_request_preempted_mid_prefill_reports_its_checkpoint_as_stored(
        tmp_path: Path) -> None:
    """What the tiers hold of a waiting request was looked up again only when it grew: one
    preempted before its prompt was done had not, and policies saw none of its checkpoint."""
    p = make_planner(tmp_path / "ssd")
    try:
        tokens = list(range(100, 111))
        view = TokenView("be", tokens, background=True)
        assert p.stored_prefix_tokens(view) == 0  # the policy's view while it first waited
        admit(p, view, [7, 8, 9])
        run_step(p, [("be", 6)])  # a prefill chunk: chunk 0 written through
        held = p.checkpoint("be", 6, [7, 8, 9])  # preempted before its prompt is done
        meta = p.build_metadata([])
        fake_worker_saves(p, meta.checkpoints)
        p.step_done({meta.step}, set())
        assert held == 6
        assert p.num_new_matched_tokens(TokenView("be", tokens, background=True), 0) == 6
        assert p.stored_prefix_tokens(view) == 6
    finally:
        p.close()


def test_a_checkpoint_copies_full_chunks_a_failed_save_left_behind(planner: TierPlanner) -> None:
    run_failed_step(planner, list(range(200, 213)))  # 3 full chunks and 1 token
    held = planner.checkpoint("be", 12, [1, 2, 3, 4])
    assert held == 12
    assert [c.blocks for c in planner.build_metadata([]).checkpoints] == [(1,), (2,), (3,)]


def test_a_full_host_arena_leaves_the_rest_to_recompute(tmp_path: Path) -> None:
    planner = make_planner(tmp_path / "ssd", host_tier_bytes=2 * PAGE_BYTES)  # 2 slots: 1 chunk
    try:
        run_failed_step(planner, list(range(300, 313)))
        assert planner.checkpoint("be", 12, [1, 2, 3, 4]) == 4  # room for chunk 0 only
        assert planner.stats()["checkpoint_short_tokens"] == 8
    finally:
        planner.close()


def test_a_checkpoint_never_evicts_its_own_chunks_for_its_tail(tmp_path: Path) -> None:
    # Host tier alone, 5 slots. The BE request's 2 full chunks fill 4; its tail needs 2 more.
    # Reserving them must not evict a layer of the chunks just found held (it took the top
    # layers of a real checkpoint's chunks, and the restore recomputed everything): the tail
    # is left to recompute instead.
    planner = make_planner(tmp_path / "ssd", host_tier_bytes=5 * PAGE_BYTES, ssd_tier_bytes=0)
    try:
        tokens = [*TURN1, 110]
        held, meta = preempt_after(planner, "be", tokens, [7, 8, 9], [10], background=True)
        assert held == 8 and not meta.checkpoints
        assert planner.stats()["checkpoint_short_tokens"] == 2
        assert planner.check_integrity() == []
        assert planner.stored_prefix_tokens(TokenView("be", tokens)) == 8
    finally:
        planner.close()


def test_write_through_evicts_other_kv_before_a_checkpoint(tmp_path: Path) -> None:
    # Host tier alone, 10 slots. "be" is preempted holding 2 chunks and a tail (6 slots, the
    # full chunks handed over from its write-through, so older than what follows). Another
    # turn saves 2 chunks (4 slots: full), a third 1 chunk: the tier evicts the other turn's
    # chunks for it, not the checkpoint's.
    planner = make_planner(tmp_path / "ssd", host_tier_bytes=10 * PAGE_BYTES, ssd_tier_bytes=0)
    other, third = list(range(500, 509)), list(range(600, 605))
    try:
        tokens = [*TURN1, 110]
        _, meta = preempt_after(planner, "be", tokens, [7, 8, 9], [10])
        fake_worker_saves(planner, meta.checkpoints)
        planner.step_done({meta.step}, set())
        run_turn(planner, "other", other, [1, 2, 3])
        run_turn(planner, "third", third, [4, 5])
        assert planner.check_integrity() == []
        assert planner.stored_prefix_tokens(TokenView("be", tokens)) == 10
        assert planner.stored_prefix_tokens(TokenView("other2", other)) == 0
        hints = planner.host.policy._sessions  # type: ignore[attr-defined]
        assert list(hints) == [("checkpoint", "be")]
        # Restored, "be" leaves the preemption table: its KV is evicted like any other.
        assert planner.num_new_matched_tokens(TokenView("be", tokens), 0) == 10
        planner.plan_load("be", [3, 4, 5], 10, len(tokens))
        assert not hints
    finally:
        planner.close()


def test_a_checkpoint_a_full_host_tier_evicts_is_cut_where_it_was_evicted(tmp_path: Path
                                                                          ) -> None:
    # Host tier alone, 10 slots, 6 of them "be"'s checkpoint. Later turns fill the rest, then
    # need more: with nothing else to evict the tier takes checkpointed chunks (a full tier
    # may: the request recomputes them). The preemption table still listed them, and the
    # idle integrity check logged an error for it.
    planner = make_planner(tmp_path / "ssd", host_tier_bytes=10 * PAGE_BYTES, ssd_tier_bytes=0)
    try:
        tokens = [*TURN1, 110]
        _, meta = preempt_after(planner, "be", tokens, [7, 8, 9], [10])
        fake_worker_saves(planner, meta.checkpoints)
        planner.step_done({meta.step}, set())
        short = planner.stats()["checkpoint_short_tokens"]
        run_turn(planner, "other", list(range(500, 509)), [1, 2, 3])
        run_turn(planner, "third", list(range(600, 613)), [4, 5, 6, 11])
        assert planner.stored_prefix_tokens(TokenView("be", tokens)) < 10
        assert planner.check_integrity() == []
        assert planner.stats()["checkpoint_short_tokens"] > short
    finally:
        planner.close()


def test_a_finished_request_leaves_the_preemption_table(planner: TierPlanner) -> None:
    tokens = [*TURN1, 110]
    _, meta = preempt_after(planner, "be", tokens, [7, 8, 9], [10])
    planner.step_done({meta.step}, set())
    planner.request_finished("be", 10, [7, 8, 9])
    assert planner.check_integrity() == []
    assert not planner.host.policy._sessions  # type: ignore[attr-defined]  # nor its hint
    assert planner.checkpoint("unknown", 5, [1, 2]) == 0


def test_counters_start_again_from_zero_and_the_tiers_keep_their_kv(planner: TierPlanner
                                                                     ) -> None:
    run_turn(planner, "r1", [*TURN1, 110], [7, 8, 9])
    planner.store.flush()
    before = planner.stats()
    assert before["saved_chunks"] == 2 and before["tiers"]["host"]["bytes_in"] > 0
    planner.reset_counters()
    after = planner.stats()
    assert after["saved_chunks"] == 0 and after["prompt_tokens"] == 0
    assert all(v == 0 for tier in after["tiers"].values() for k, v in tier.items()
               if k not in ("used_bytes", "capacity_bytes"))
    assert after["tiers"]["host"]["used_bytes"] == before["tiers"]["host"]["used_bytes"]


def test_positions_whose_tokens_are_not_known_yet_wait_to_be_saved(planner: TierPlanner) -> None:
    # Async scheduling (vLLM's default on a GPU): a decode step is scheduled before the token
    # sampled in the step ahead of it is added, so the computed positions run one past the
    # known tokens. Reaching a chunk's end that way used to crash the engine core (its key
    # hashes tokens not known yet); the chunk is saved once they are.
    tokens = list(range(100, 107))  # 7 known: the 8th, ending chunk 1, not sampled yet
    view = TokenView("r", tokens, "s1")
    admit(planner, view, [1, 2])
    first = planner.build_metadata([("r", 7)])
    assert [c.blocks for c in first.saves] == [(1,)]
    ahead = planner.build_metadata([("r", 8)])
    assert ahead.saves == []
    tokens.append(107)  # the step's output arrives
    after = planner.build_metadata([("r", 9)])
    assert [c.blocks for c in after.saves] == [(2,)]
    # a preemption or an end in that state holds only the known tokens
    tokens.extend([108])
    assert planner.checkpoint("r", 11, [1, 2, 3]) == 9


def test_a_finished_request_saves_only_the_tail_it_knows(planner: TierPlanner) -> None:
    tokens = list(range(100, 110))  # 10 known
    view = TokenView("r", tokens, "s1")
    admit(planner, view, [1, 2, 3])
    run_step(planner, [("r", 10)])
    assert planner.request_finished("r", 12, [1, 2, 3])  # 2 positions past the known tokens
    final = planner.build_metadata([])
    assert [c.blocks for c in final.final_saves["r"]] == [(3,)]


def test_a_preempted_turn_admitted_again_leaves_the_next_turns_advisory(tmp_path: Path) -> None:
    # The user types the next message while a reply streams; the reply's request, preempted
    # and admitted again, took that advisory (counted used), and the next turn found nothing
    # prefetched.
    planner = make_planner(tmp_path / "ssd")
    try:
        run_turn(planner, "r1", [*TURN1, 110], [7, 8, 9], session="s1")
        tokens = [*TURN1, 110, 111, 112, 113, 114, 115]
        view = TokenView("r2", tokens, session="s1")
        planner.add_request(view)
        planner.num_new_matched_tokens(view, 0)
        planner.test_blocks["r2"] = [1, 2, 3, 4]
        planner.plan_load("r2", [1, 2, 3, 4], 10, len(tokens))
        meta = run_step(planner, [("r2", 14)])
        planner.advise("s1", tokens, expected_arrival_s=5.0)  # the next turn's
        assert planner.stats()["advisories_live"] == 1
        planner.checkpoint("r2", 14, [1, 2, 3, 4])  # preempted
        meta = planner.build_metadata([])
        fake_worker_saves(planner, meta.checkpoints)
        planner.step_done({meta.step}, set())
        again = TokenView("r2", [*tokens, 116], session="s1")
        while planner.num_new_matched_tokens(again, 0) is None:
            time.sleep(0.01)
        stats = planner.stats()
        assert (stats["advisories_live"], stats["advisories_used"]) == (1, 0), stats
    finally:
        planner.close()


def test_an_advisory_with_nothing_to_fetch_is_not_counted_late(tmp_path: Path) -> None:
    planner = make_planner(tmp_path / "ssd")
    try:
        planner.advise("s9", [1, 2, 3], expected_arrival_s=0.0)  # nothing stored: no prefetch
        view = TokenView("r9", [1, 2, 3, 4], session="s9")
        planner.add_request(view)
        planner.num_new_matched_tokens(view, 0)
        stats = planner.stats()
        assert (stats["advisories_used"], stats["advisories_late"]) == (1, 0), stats
        assert stats["prefetches_timed"] == 0, stats
    finally:
        planner.close()


def test_a_request_that_reads_no_cached_kv_starts_no_fetch() -> None:
    """vLLM asks the connector about a request asking for its prompt's logprobs, then reads
    none of what it answers: the planner started SSD fetches whose pins held host slots."""
    from types import SimpleNamespace

    from vllm import SamplingParams
    from vllm.v1.request import Request

    from antiphon.tiering.connector import AntiphonKVConnector

    asked: list[str] = []
    connector = object.__new__(AntiphonKVConnector)
    connector._planner = SimpleNamespace(  # type: ignore[assignment]
        num_new_matched_tokens=lambda view, num_computed: asked.append(view.request_id) or 64,
        admit_without_match=lambda view: asked.append(f"{view.request_id} unmatched"))
    for rid, prompt_logprobs in (("scored", 1), ("chat", None)):
        request = Request(rid, list(range(100)), SamplingParams(
            max_tokens=4, prompt_logprobs=prompt_logprobs), None)
        found = connector.get_num_new_matched_tokens(request, 0)
        assert found == ((0, False) if prompt_logprobs else (64, False))
    assert asked == ["scored unmatched", "chat"]


def test_a_turn_that_reads_no_stored_kv_still_uses_its_sessions_advisory(
        planner: TierPlanner) -> None:
    """Skipped before the planner, its session's advisory held its pins until it expired."""
    run_turn(planner, "r1", TURN1, [7, 8, 9], session="s1")
    planner.advise("s1", TURN1, 5.0)
    assert planner.advisories.get("s1") is not None
    planner.admit_without_match(TokenView("r2", [*TURN1, 120], "s1"))
    assert planner.advisories.get("s1") is None
    assert planner.counters.advisories_used == 1


def test_a_chunk_cut_from_a_checkpoint_is_no_longer_kept_from_an_erasure() -> None:
    """Cut from its checkpoint (evicted from every tier), a chunk's remaining layers were
    still kept out of a deleted session's erasure."""
    from antiphon.tiering.keys import ChunkKey
    from antiphon.tiering.plan_state import Checkpoint
    from antiphon.tiering.preemption import PreemptionTable

    table = PreemptionTable(chunk_tokens=16)
    first, second = ChunkKey("m", b"A", 0, 0), ChunkKey("m", b"B", 1, 0)
    table.record("be", Checkpoint(32, 32, (first, second)))
    table.note_evicted([second.with_layer(0)])
    assert table.settle_evictions(lambda key: key.prefix_hash == b"A") == 16
    assert table.chunk_hashes == {b"A"}


def test_the_host_tier_counts_a_turns_loads_by_layer(tmp_path: Path) -> None:
    """One layer of a chunk had left host RAM: the turn fetches that layer from SSD (a miss)
    and loads the rest from the host tier (hits)."""
    planner = make_planner(tmp_path / "ssd", ssd_fetch_wait_s=5.0)
    try:
        run_turn(planner, "r1", [*TURN1, 110], [7, 8, 9])
        planner.store.flush()
        gone = next(k for k in list(planner.host.keys()) if k.chunk_index == 0 and k.layer == 1)
        assert planner.host.remove(gone)
        planner.reset_counters()
        view = follow_up(planner)
        assert wait_for_admission(planner, view) == 10
        planner.plan_load("r2", [1, 2, 3], 10, 12)
        host = planner.stats()["tiers"]["host"]
        assert (host["hits"], host["misses"]) == (3 * LAYERS - 1, 1)
    finally:
        planner.close()


def held_ssd_reads(planner: TierPlanner) -> threading.Event:
    """Hold every read of the SSD tier until the event returned is set."""
    gate = threading.Event()
    ssd = planner.store.tiers[1]
    read = ssd.get

    def held(key: ChunkKey) -> bytes | None:
        gate.wait(10)
        return read(key)
    ssd.get = held  # type: ignore[method-assign]
    return gate


def test_a_preempted_turn_admitted_again_leaves_the_next_turns_prefetch_running(
        tmp_path: Path) -> None:
    """Admitted again, the preempted reply's request stopped the prefetch of the advisory the
    user's typing of the next message had sent (still queued behind another session's), and
    the next turn loaded its context from SSD on its critical path."""
    other = [t + 500 for t in TURN1] + [610]
    planner = make_planner(tmp_path / "ssd")
    try:
        run_turn(planner, "r9", other, [20, 21, 22], session="s9")
        run_turn(planner, "r1", [*TURN1, 110], [7, 8, 9], session="s1")
        planner.store.flush()
        mine = set(planner.matcher.match([*TURN1, 110], 11, b"", None).layer_keys())
        stored = planner.host.keys()  # a snapshot, not a dict's view
        for key in [k for k in stored if k not in mine]:  # s9's: on SSD only
            assert planner.host.remove(key)
        gate = held_ssd_reads(planner)
        planner.advise("s9", other, expected_arrival_s=0.0)  # its fetch holds the queue
        tokens = [*TURN1, 110, 111, 112, 113, 114, 115]
        view = TokenView("r2", tokens, session="s1")
        planner.add_request(view)
        assert planner.num_new_matched_tokens(view, 0) == 10
        planner.test_blocks["r2"] = [1, 2, 3, 4]  # type: ignore[attr-defined]
        planner.plan_load("r2", [1, 2, 3, 4], 10, len(tokens))
        meta = run_step(planner, [("r2", 14)])
        planner.advise("s1", tokens, expected_arrival_s=5.0)  # the next turn's, typed meanwhile
        planner.checkpoint("r2", 14, [1, 2, 3, 4])  # preempted
        meta = planner.build_metadata([])
        fake_worker_saves(planner, meta.checkpoints)
        planner.step_done({meta.step}, set())
        assert planner.num_new_matched_tokens(TokenView("r2", [*tokens, 116], session="s1"),
                                              0) == 14
        advisory = planner.advisories.get("s1")
        gate.set()
        assert advisory is not None and advisory.handle is not None
    finally:
        planner.close()


def test_a_turn_that_overtakes_its_advisorys_prefetch_is_counted_late(tmp_path: Path) -> None:
    """The turn's admission stopped the prefetch and dropped its handle before the advisory
    was used, so `advisories_late` never counted (its metric read 0 for good)."""
    planner = restarted_planner(tmp_path, ssd_fetch_wait_s=0)  # the KV on SSD only
    try:
        gate = held_ssd_reads(planner)
        planner.advise("s1", [*TURN1, 110], expected_arrival_s=0.0)
        view = TokenView("r2", [*TURN1, 110, 111], session="s1")
        planner.add_request(view)
        assert planner.num_new_matched_tokens(view, 0) is None  # its prefetch still running
        gate.set()
        assert wait_for_admission(planner, view) == 10
        stats = planner.stats()
        assert (stats["advisories_used"], stats["advisories_late"]) == (1, 1), stats
    finally:
        planner.close()


def test_an_advisory_that_comes_while_a_turn_waits_for_its_fetch_is_the_next_turns(
        tmp_path: Path) -> None:
    # The user typed the next message while the turn's context came up from SSD: the turn,
    # admitted once it was up, stopped and used up that advisory, and the next turn lost its
    # prefetch (found by a review).
    planner = restarted_planner(tmp_path, ssd_fetch_wait_s=0)  # the KV on SSD only
    try:
        gate = held_ssd_reads(planner)
        view = TokenView("r2", [*TURN1, 110, 111], session="s1")
        planner.add_request(view)
        assert planner.num_new_matched_tokens(view, 0) is None  # held for its fetch
        planner.advise("s1", [*TURN1, 110, 111, 112], expected_arrival_s=30.0)
        gate.set()
        assert wait_for_admission(planner, view) == 10
        advisory = planner.advisories.get("s1")
        assert advisory is not None and not advisory.overtaken
        assert planner.stats()["advisories_used"] == 0
    finally:
        planner.close()


def test_a_checkpoint_whose_copies_failed_is_cut(tmp_path: Path) -> None:
    """The worker fails a step whose checkpoint copies came too late (the forward pass had
    begun): its slots were given up, but the preemption table still listed the chunks, and
    `check_integrity` reported them in no tier."""
    planner = make_planner(tmp_path / "ssd")
    try:
        held, meta = preempt_after(planner, "be", [*TURN1, 110], [7, 8, 9], [10],
                                   background=True)
        assert held == 10 and meta.checkpoints
        planner.step_done(set(), {meta.step})
        assert planner.check_integrity() == []
        assert planner.stats()["checkpoint_short_tokens"] == 2  # its tail, recomputed
    finally:
        planner.close()


def checkpoint_copies(planner: TierPlanner, request_id: str, num_computed: int,
                      blocks: list[int]) -> tuple[int, int]:
    """(pages `checkpoint_cost_pages` said, pages the checkpoint then copied)."""
    cost = planner.checkpoint_cost_pages(request_id, num_computed)
    planner.checkpoint(request_id, num_computed, blocks)
    return cost, sum(len(c.blocks) for c in planner.build_metadata([]).checkpoints)


def test_saves_whose_step_failed_cost_a_checkpoint(planner: TierPlanner) -> None:
    # They counted as saved: a policy was told preempting the request copied nothing.
    run_failed_step(planner, list(range(200, 213)))  # 3 full chunks and 1 token
    assert checkpoint_copies(planner, "be", 12, [1, 2, 3, 4]) == (3, 3)


def test_saves_whose_step_failed_are_made_again(planner: TierPlanner) -> None:
    run_failed_step(planner, list(range(200, 213)))
    meta = planner.build_metadata([("be", 12)])
    assert [c.blocks for c in meta.saves] == [(1,), (2,), (3,)]
    assert planner.checkpoint_cost_pages("be", 12) == 0  # on their way


def test_a_refused_save_costs_a_checkpoint_and_is_tried_again(tmp_path: Path) -> None:
    planner = make_planner(tmp_path / "ssd", host_tier_bytes=LAYERS * PAGE_BYTES)  # 1 chunk
    try:
        view = TokenView("be", list(range(100, 109)), background=True)
        admit(planner, view, [1, 2, 3])
        meta = planner.build_metadata([("be", 8)])
        assert [c.blocks for c in meta.saves] == [(1,)]  # no room for chunk 1 while it is
        assert planner.checkpoint_cost_pages("be", 8) == 1  # copied
        fake_worker_saves(planner, meta.saves)
        planner.step_done({meta.step}, set())
        assert [c.blocks for c in planner.build_metadata([("be", 8)]).saves] == [(2,)]
    finally:
        planner.close()


def test_the_checkpoint_cost_counts_chunks_the_host_tier_evicted(host_only: TierPlanner) -> None:
    # A BE request's chunks go to the host tier alone; a later turn's saves evict them.
    planner = host_only
    view = TokenView("be", list(range(100, 113)), background=True)  # 3 full chunks
    admit(planner, view, [1, 2, 3, 4])
    run_step(planner, [("be", 12)])
    assert planner.checkpoint_cost_pages("be", 12) == 0
    run_turn(planner, "rt", list(range(500, 517)), [5, 6, 7, 8, 9])
    cost, copied = checkpoint_copies(planner, "be", 12, [1, 2, 3, 4])
    assert copied > 0 and cost == copied
    assert planner.check_integrity() == []


def test_a_checkpoint_that_holds_nothing_is_no_checkpoint(tmp_path: Path) -> None:
    planner = make_planner(tmp_path / "ssd", host_tier_bytes=PAGE_BYTES)  # not one chunk
    try:
        run_failed_step(planner, list(range(300, 313)))
        assert planner.checkpoint("be", 12, [1, 2, 3, 4]) == 0
        stats = planner.stats()
        assert (stats["checkpoints"], stats["checkpoint_short_tokens"]) == (0, 12)
        assert planner.preemption.get("be") is None
    finally:
        planner.close()


def test_a_checkpoint_cut_to_nothing_is_not_restored(planner: TierPlanner) -> None:
    tokens = list(range(200, 213))
    run_failed_step(planner, tokens)
    assert planner.checkpoint("be", 12, [1, 2, 3, 4]) == 12
    meta = planner.build_metadata([])
    planner.step_done(set(), {meta.step})  # its copies failed: the checkpoint holds nothing
    assert planner.check_integrity() == []
    view = TokenView("be", tokens)
    assert planner.num_new_matched_tokens(view, 0) == 0
    planner.plan_load("be", [5, 6, 7, 8], 0, len(tokens))
    stats = planner.stats()
    assert (stats["checkpoints"], stats["restores"], stats["pages_restored"]) == (1, 0, 0)


def test_a_chunk_refused_step_after_step_counts_once(tmp_path: Path) -> None:
    """A refused save is tried again each step: each try counted, one chunk refused for five
    steps read as five chunks not saved."""
    planner = make_planner(tmp_path / "ssd", host_tier_bytes=LAYERS * PAGE_BYTES)  # 1 chunk
    try:
        view = TokenView("be", list(range(100, 109)), background=True)
        admit(planner, view, [1, 2, 3])
        metas = [planner.build_metadata([("be", 8)]) for _ in range(5)]  # 5 steps in flight
        assert [c.blocks for c in metas[0].saves] == [(1,)]
        assert planner.stats()["saves_refused"] == 1
        fake_worker_saves(planner, metas[0].saves)
        for meta in metas:
            planner.step_done({meta.step}, set())
        assert [c.blocks for c in planner.build_metadata([("be", 8)]).saves] == [(2,)]
        assert planner.stats()["saves_refused"] == 1
    finally:
        planner.close()


def test_a_save_made_again_after_a_failed_step_counts_once(tmp_path: Path) -> None:
    planner = make_planner(tmp_path / "ssd")
    try:
        run_failed_step(planner, list(range(200, 213)))  # 3 chunks planned, their step failed
        run_step(planner, [("be", 12)])
        assert planner.stats()["saved_chunks"] == 3  # (6: counted when planned)
    finally:
        planner.close()


def test_a_chunk_refused_again_after_it_was_saved_counts_again(tmp_path: Path) -> None:
    planner = make_planner(tmp_path / "ssd", host_tier_bytes=LAYERS * PAGE_BYTES)  # 1 chunk
    try:
        admit(planner, TokenView("be", list(range(100, 109)), background=True), [1, 2, 3])
        first = planner.build_metadata([("be", 8)])  # chunk 0 saved, chunk 1 refused
        fake_worker_saves(planner, first.saves)
        planner.step_done({first.step}, set())
        second = planner.build_metadata([("be", 8)])  # chunk 1 now (evicting chunk 0)
        assert [c.blocks for c in second.saves] == [(2,)]
        planner.step_done(set(), {second.step})  # its copy failed: it is saved again, but
        for layer in range(LAYERS):  # another save holds the arena meanwhile
            assert planner.host.reserve(ChunkKey("test-model", b"x" * 32, 5, layer)) is not None
        assert planner.build_metadata([("be", 8)]).saves == []
        assert planner.stats()["saves_refused"] == 2  # (1: the earlier refusal's mark stayed)
    finally:
        planner.close()


def test_a_lost_chunk_another_request_saved_again_costs_no_checkpoint(host_only: TierPlanner) -> None:
    planner = host_only
    tokens = list(range(100, 113))
    admit(planner, TokenView("be", tokens, background=True), [1, 2, 3, 4])
    run_step(planner, [("be", 12)])
    run_turn(planner, "rt", list(range(500, 517)), [5, 6, 7, 8, 9])  # evicts be's chunks
    assert planner.checkpoint_cost_pages("be", 12) > 0
    # an item over the same document saves those chunks again (from its own pages)
    admit(planner, TokenView("be2", tokens, background=True), [11, 12, 13, 14])
    run_step(planner, [("be2", 12)])
    assert checkpoint_copies(planner, "be", 12, [1, 2, 3, 4]) == (0, 0)


def test_a_reply_ending_on_a_chunk_boundary_under_async_scheduling_saves_that_chunk(
        planner: TierPlanner) -> None:
    """With async scheduling, the step computing a chunk's last token is planned before that
    token is known, so the chunk is saved a step later; a reply that ended there lost it, and
    its next turn recomputed the chunk (about one turn in 128)."""
    tokens = list(range(100, 107))  # 7 known; chunks of 4
    admit(planner, TokenView("r", tokens, "s1"), [1, 2])
    run_step(planner, [("r", 7)])  # the prefill: chunk 0 saved
    run_step(planner, [("r", 8)])  # position 7 scheduled before its token is known
    tokens.append(107)  # that step's output: the reply's last token
    assert planner.request_finished("r", 8, [1, 2])  # its pages kept for the save
    final = planner.build_metadata([])
    fake_worker_saves(planner, final.final_saves["r"])
    planner.step_done({final.step}, set())
    assert planner.stats()["saved_chunks"] == 2
    view = TokenView("r2", [*tokens, 200, 201], "s1")
    planner.add_request(view)
    assert planner.num_new_matched_tokens(view, 0) == 8


def test_an_advisory_renewed_for_sooner_keeps_its_room_against_later_ones(
        tmp_path: Path) -> None:
    """Renewed (the same KV, fetched), an advisory kept its first expected arrival as its
    place: advised for ten minutes, then for now, it lost its prefetched KV to one due in a
    minute (found by a review)."""
    planner = two_sessions_on_ssd(tmp_path, host_tier_bytes=3 * LAYERS * PAGE_BYTES)
    try:
        planner.advise("s1", [*TURN1, 110], expected_arrival_s=600.0)
        first = planner.advisories.get("s1")
        assert first is not None and first.handle is not None and first.handle.wait(10)
        planner.advise("s1", [*TURN1, 110], expected_arrival_s=0.0)  # now: renewed
        assert planner.stats()["advisories_renewed"] == 1
        planner.advise("s9", OTHER, expected_arrival_s=60.0)
        renewed = planner.advisories.get("s1")
        assert renewed is not None and not renewed.reclaimed
    finally:
        planner.close()


def _admit_and_plan(planner: TierPlanner, request_id: str, tokens: list[int], session: str,
                    blocks: list[int], num_done: int) -> TieringMetadata:
    """Admit a request, allocate `blocks`, and plan a step computing `num_done` tokens."""
    view = TokenView(request_id, tokens, session)
    planner.add_request(view)
    matched = planner.num_new_matched_tokens(view, 0) or 0
    planner.test_blocks[request_id] = blocks  # type: ignore[attr-defined]
    planner.plan_load(request_id, blocks, matched, len(tokens))
    return planner.build_metadata([(request_id, num_done)])


def test_saves_reserved_after_an_erasure_began_are_kept_while_steps_overlap(
        tmp_path: Path) -> None:
    """A deleted session's chunks were dropped by hash from every save published until no
    step with copies was in flight, which under overlapped steps may be never: a live session
    sharing the prefix (a system prompt) saved them again, and lost them each time (found by a
    review)."""
    planner = make_planner(tmp_path / "ssd")
    try:
        chain = [*TURN1, 110]
        run_turn(planner, "r1", chain, [7, 8, 9], session="s1")
        a = _admit_and_plan(planner, "r5", list(range(200, 211)), "s5", [20, 21, 22], 8)
        assert a.saves
        assert planner.erasure.forget("s1", [chain]).result(10)[0] > 0
        b = _admit_and_plan(planner, "r6", list(range(300, 311)), "s6", [30, 31, 32], 8)
        fake_worker_saves(planner, a.saves)
        planner.step_done({a.step}, set())  # b in flight
        c = _admit_and_plan(planner, "r2", [*chain, 111], "s2", [40, 41, 42], 11)
        assert c.saves
        d = _admit_and_plan(planner, "r7", list(range(400, 411)), "s7", [50, 51, 52], 8)
        fake_worker_saves(planner, b.saves)
        planner.step_done({b.step}, set())  # c and d in flight
        fake_worker_saves(planner, c.saves)
        planner.step_done({c.step}, set())  # d in flight
        assert planner.stored_prefix_tokens(TokenView("r3", [*chain, 111, 112], "s2")) >= 8
        fake_worker_saves(planner, d.saves)
        planner.step_done({d.step}, set())
    finally:
        planner.close()


def test_a_session_turn_writes_down_the_prefix_another_request_left_in_host_ram(
        tmp_path: Path) -> None:
    """A sessionless request's KV stays in host RAM; a session turn that loaded it as its
    prefix never wrote it to the SSD tier, so after a restart (or once the host let it go)
    the session's own chunks after it, on the SSD, were out of reach and its next turn
    recomputed the conversation (found by a review)."""
    first = make_planner(tmp_path / "ssd")
    run_turn(first, "anon", [*TURN1, 110], [7, 8, 9], session=None)
    tokens = [*TURN1, 110, 111, 112, 113, 114, 115]  # 16 tokens, 4 chunks
    matched, _ = run_turn(first, "r1", tokens, [1, 2, 3, 4], session="s1")
    assert matched
    first.store.wait_for_write_downs()
    first.store.flush()
    first.close()
    planner = make_planner(tmp_path / "ssd")
    try:
        assert planner.stored_prefix_tokens(TokenView("r2", [*tokens, 116], "s1")) >= 12
    finally:
        planner.close()


@pytest.mark.parametrize("other", ["be", "sessionless"])
def test_a_session_turn_writes_through_a_prefix_another_request_is_saving(
        tmp_path: Path, other: str) -> None:
    """A session's turn computed its first chunk in the step where BE work (or a sessionless
    request) with the same prefix did: the other's save had reserved the host slots, kept in
    host RAM alone, and the turn's write-down found nothing there to write. The session's
    later chunks on the SSD were out of reach after a restart, or once the host let the first
    go (found by a review)."""
    first = make_planner(tmp_path / "ssd")
    shared = list(range(100, 100 + CHUNK))
    chat, rest = [*shared, 200, 201, 202, 203, 204], [*shared, 300, 301, 302]
    for request_id, tokens, session, blocks in (("other", rest, None, [1, 2]),
                                                ("chat", chat, "s1", [5, 6, 7])):
        view = TokenView(request_id, tokens, session,
                         background=request_id == "other" and other == "be")
        first.add_request(view)
        assert first.num_new_matched_tokens(view, 0) == 0
        first.test_blocks[request_id] = blocks  # type: ignore[attr-defined]
        first.plan_load(request_id, blocks, 0, len(tokens))
    meta = first.build_metadata([("other", len(rest) - 1), ("chat", len(chat) - 1)])
    assert [c.blocks for c in meta.saves] == [(1,), (6,)]  # chunk 0 saved once, the other's
    fake_worker_saves(first, meta.saves)
    first.step_done({meta.step}, set())
    first.store.wait_for_write_downs()
    first.store.flush()
    first.close()
    planner = make_planner(tmp_path / "ssd")
    try:
        assert planner.stored_prefix_tokens(TokenView("chat2", [*chat, 205], "s1")) == 8
    finally:
        planner.close()


def test_the_step_built_before_a_failed_load_was_reported_publishes_nothing(
        planner: TierPlanner) -> None:
    # Async scheduling (a GPU's): step N + 1 is built before N's output says N's loads failed,
    # and computes over the pages they left unfilled. Published, its chunks would serve wrong
    # KV under the right keys to every later turn with the prefix.
    run_turn(planner, "r1", [*TURN1, 110], [7, 8, 9])
    prompt = [*TURN1, 110, *range(200, 216)]  # 27 tokens: 6 full chunks
    view = TokenView("r2", prompt, "s2")
    planner.add_request(view)
    matched = planner.num_new_matched_tokens(view, 0)
    assert matched is not None and matched >= 8
    blocks = list(range(20, 27))
    planner.test_blocks["r2"] = blocks  # type: ignore[attr-defined]
    planner.plan_load("r2", blocks, matched, len(prompt))
    first = planner.build_metadata([("r2", 16)])  # loads chunks 0-1, computes to token 16
    assert first.loads or first.early_loads
    fake_worker_saves(planner, first.saves)
    second = planner.build_metadata([("r2", 24)])  # built before the first's output came
    assert second.saves
    fake_worker_saves(planner, second.saves)
    planner.step_done(set(), {first.step})  # its loads failed: vLLM fails the request
    planner.request_finished("r2", 10, blocks[:3])
    planner.step_done({second.step}, set())
    hashes = prefix_hashes(prompt, CHUNK, planner.model_id)
    stored = [index for index in range(2, 6)
              if planner.store.contains(ChunkKey(planner.model_id, hashes[index], index, 0))]
    assert stored == []
    assert planner.stats()["copy_steps_failed"] == 2
    # A step built after the report is not touched by it.
    tokens = [t + 1000 for t in TURN1] + [1110]
    _, meta = run_turn(planner, "r3", tokens, [4, 5, 6], session="s3")
    assert [c.blocks for c in meta.saves] == [(4,), (5,)]
    assert planner.store.contains(ChunkKey(planner.model_id, prefix_hashes(
        tokens, CHUNK, planner.model_id)[1], 1, 0))
    planner.store.check_integrity()


def test_a_step_built_before_the_failed_one_and_reported_after_it_keeps_its_saves(
        planner: TierPlanner) -> None:
    # A GPU's copies report a step done once its event completes, a failed step at once:
    # step 0, reported after step 1's failure, was failed too, its landed saves dropped
    # (found by a review).
    view = TokenView("a", list(range(100, 120)), "s1")
    admit(planner, view, [1, 2, 3, 4, 5])
    first = planner.build_metadata([("a", 8)])  # saves chunks 0-1
    assert len(first.saves) == 2
    fake_worker_saves(planner, first.saves)
    second = planner.build_metadata([("a", 12)])  # saves chunk 2, and fails
    fake_worker_saves(planner, second.saves)
    planner.step_done(set(), {second.step})
    planner.step_done({first.step}, set())
    stats = planner.stats()
    assert (stats["saved_chunks"], stats["copy_steps_failed"]) == (2, 1)
    hashes = prefix_hashes(list(view.token_ids), CHUNK, planner.model_id)
    assert [planner.store.contains(ChunkKey(planner.model_id, hashes[i], i, 0))
            for i in range(3)] == [True, True, False]
    planner.store.check_integrity()


def test_a_restore_waits_for_the_saves_its_checkpoint_was_handed(planner: TierPlanner) -> None:
    # Async scheduling (a GPU's): preempted right after a step that saves chunks ending on a
    # chunk boundary, the checkpoint is handed those saves and copies nothing, so its restore
    # did not wait for them: admitted before they were reported, it matched nothing, dropped
    # the checkpoint and recomputed both chunks (found by a review).
    view = TokenView("be", [*TURN1, 110], background=True)
    admit(planner, view, [7, 8, 9])
    saving = planner.build_metadata([("be", 8)])  # a prefill chunk to token 8, running
    assert planner.checkpoint("be", 8, [7, 8, 9]) == 8  # preempted
    assert not planner.build_metadata([]).checkpoints  # every page handed over
    assert planner.num_new_matched_tokens(view, 0) is None  # it waits for them
    fake_worker_saves(planner, saving.saves)
    planner.step_done({saving.step}, set())
    assert planner.num_new_matched_tokens(view, 0) == 8


def test_what_a_checkpointed_request_has_stored_is_looked_up_again_as_its_copies_land(
        planner: TierPlanner) -> None:
    # The policy's view of a preempted request, built while its checkpoint's copies ran,
    # found only what was published, and the answer stood for as long as it waited.
    view = TokenView("be", [*TURN1, 110], background=True)  # chunks 0, 1 and a 2-token tail
    admit(planner, view, [7, 8, 9])
    run_step(planner, [("be", 10)])  # chunks 0 and 1 saved
    assert planner.checkpoint("be", 10, [7, 8, 9]) == 10  # the tail is copied next step
    copying = planner.build_metadata([])
    assert copying.checkpoints
    assert planner.stored_prefix_tokens(view) == 8
    fake_worker_saves(planner, copying.checkpoints)
    planner.step_done({copying.step}, set())
    assert planner.stored_prefix_tokens(view) == 10


def test_an_advisory_does_not_count_its_own_host_kv_as_room(tmp_path: Path) -> None:
    # The host (4 slots) holds s1's chunks 0 and 1, unpinned; the SSD tier holds its whole
    # context (two chunks and a tail). The advisory counted those chunks as room, took the
    # tail too, and its prefetch, layer 0 first, evicted chunk 1's top layer for the tail's
    # bottom one: it failed partway, and the advised turn loaded 4 tokens where an unadvised
    # one loads 8 (found by a review).
    tokens = [*TURN1, 110]
    planner = restarted_planner(tmp_path, host_tier_bytes=4 * PAGE_BYTES, ssd_fetch_wait_s=0)
    try:
        ssd = planner.store.tiers[1]
        match = planner.matcher.match(tokens, len(tokens), b"", None)
        for keys in match.layers[:2]:
            for key in keys:
                assert planner.host.put(key, bytes(ssd.peek(key)))
        planner.advise("s1", tokens, expected_arrival_s=0.0)
        handle = planner.advisories.get("s1").handle
        assert handle is not None and handle.wait(10)
        assert handle.failed_keys() == []
        view = TokenView("r2", [*tokens, 111], session="s1")
        planner.add_request(view)
        assert wait_for_admission(planner, view) == 8
        planner.advisories.release("s1")
        planner.store.check_integrity()
    finally:
        planner.close()


@pytest.mark.parametrize("how", ["evicted_in_the_same_schedule", "no_host_room_at_restore"])
def test_a_restore_that_loads_less_than_its_checkpoint_counts_what_it_recomputes(
        tmp_path: Path, how: str) -> None:
    """Two ways a restore matched less than its checkpoint held, and the tokens it recomputed
    went uncounted (`recomputed_tokens` and `checkpoint_short_tokens` disagreed; found by a
    review): its chunks evicted by another checkpoint's reservation in the very schedule that
    admitted it, before any settled the eviction; its SSD chunks with no host room to load
    them into at that moment."""
    if how == "evicted_in_the_same_schedule":
        p = make_planner(tmp_path / "ssd", host_tier_bytes=2 * PAGE_BYTES, ssd_tier_bytes=0)
        tokens = [1, 2, 3, 4]
        held, meta = preempt_after(p, "a", tokens, [5], [3], background=True)
        fake_worker_saves(p, meta.checkpoints)
        p.step_done({meta.step}, set())
        admit(p, TokenView("b", [9, 8, 7, 6], background=True), [6])
        run_step(p, [("b", 3)])
        assert p.checkpoint("b", 3, [6]) == 3  # its tail's slots evict a's from the full arena
        blocks = [7]
    else:
        p = make_planner(tmp_path / "ssd", host_tier_bytes=8 * PAGE_BYTES)
        tokens = [*TURN1, 110]
        held, meta = preempt_after(p, "a", tokens, [7, 8, 9], [10], background=True)
        fake_worker_saves(p, meta.checkpoints)
        p.step_done({meta.step}, set())
        p.store.flush()
        for i in range(8):  # other work pins the whole host arena for a moment
            p.host.put(ChunkKey("test-model", bytes([i]) * 32, 0, 0), b"x" * PAGE_BYTES,
                       pin=True)
        blocks = [3, 4, 5]
    try:
        assert held == len(tokens) - 1
        matched = p.num_new_matched_tokens(TokenView("a", tokens, background=True), 0)
        assert matched == 0
        p.plan_load("a", blocks, 0, len(tokens))
        assert p.stats()["checkpoint_short_tokens"] == held
    finally:
        p.close()


def test_a_chunk_evicted_while_its_checkpoint_is_taken_cuts_the_checkpoint(
        tmp_path: Path) -> None:
    """The SSD tier's writer evicted a chunk the checkpoint had just found held, before the
    preemption table knew the chunk: the notice was dropped, and the checkpoint listed a chunk
    no tier held (its restore recomputed it, uncounted; found by a review)."""
    p = make_planner(tmp_path / "ssd")
    try:
        tokens = [*TURN1, 110]
        admit(p, TokenView("be", tokens, background=True), [7, 8, 9])
        run_step(p, [("be", 10)])  # chunks 0 and 1 saved to the host tier
        ssd = p.store.tiers[1]
        for index, prefix_hash in enumerate(p._requests["be"].hashes[:2]):
            for layer in range(LAYERS):
                p.store.write_through(ChunkKey("test-model", prefix_hash, index, layer))
        p.store.flush()
        for key in list(p.host.keys()):
            p.host.remove(key)  # host pressure took them: the SSD copies remain
        reserve = p._reserve

        def evicting_reserve(*args: Any, **kwargs: Any) -> Any:
            p._reserve = reserve  # type: ignore[method-assign]
            assert ssd.evict(ssd.capacity_bytes)  # the SSD writer thread, meanwhile
            return reserve(*args, **kwargs)

        p._reserve = evicting_reserve  # type: ignore[method-assign]
        assert p.checkpoint("be", 10, [7, 8, 9]) == 0
        assert p.check_integrity() == []
        stats = p.stats()  # (a checkpoint that holds nothing is none)
        assert (stats["checkpoint_short_tokens"], stats["checkpoints"]) == (10, 0)
        assert stats["pages_handed_over"] == 0
    finally:
        p.close()


def test_an_overtaken_advisory_gives_its_pins_back_once_its_turn_has_pinned_its_kv(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The turn came while its session's advisory waited in the prefetch queue behind
    another's slow fetch: the advisory kept the pins it was given until the prefetch thread
    reached it, long past the turn, and the session's deletion meanwhile erased around them,
    leaving its KV in host memory (found by a review)."""
    import antiphon.tiering.planner as planner_module
    from antiphon.tiering.keys import chain_hashes

    first = make_planner(tmp_path / "ssd")
    run_turn(first, "r9", OTHER, [20, 21, 22], session="s9")
    first.close()
    planner = make_planner(tmp_path / "ssd")  # s9's KV on the SSD tier only
    ssd = planner.store.tiers[1]
    read, gate, reads = ssd.get, threading.Event(), [0]

    def slow_read(key: ChunkKey) -> Any:
        reads[0] += 1
        gate.wait(30)
        return read(key)

    try:
        context = [*TURN1, 110]
        run_turn(planner, "r1", context, [7, 8, 9], session="s1")  # in host memory
        planner.store.flush()
        ssd.get = slow_read  # type: ignore[method-assign]
        planner.advise("s9", OTHER, expected_arrival_s=0.0)  # its fetch runs, and waits
        deadline = time.monotonic() + 10
        while reads[0] < 1 and time.monotonic() < deadline:
            time.sleep(0.01)
        planner.advise("s1", context, expected_arrival_s=60.0)  # queued behind it
        assert planner.host._index.pinned_bytes > 0
        view = TokenView("r2", [*context, 111], session="s1")
        planner.add_request(view)
        assert planner.num_new_matched_tokens(view, 0) == 10
        planner.test_blocks["r2"] = [30, 31, 32]
        planner.plan_load("r2", [30, 31, 32], 10, len(view.token_ids))
        meta = planner.build_metadata([("r2", 11)])
        planner.step_done({meta.step}, set())
        planner.request_finished("r2", 11, [30, 31, 32])
        done = planner.build_metadata([])
        planner.step_done({done.step}, set())
        assert planner.host._index.pinned_bytes == 0  # the turn is over: nothing held for it
        monkeypatch.setattr(planner_module, "PREFETCH_SETTLE_TIMEOUT_S", 0.5)
        erased, kept = planner.erasure.forget("s1", [[*context, 111]]).result(20)
        assert erased and kept == 0
        hashes = chain_hashes([[*context, 111]], CHUNK, planner.model_id)
        stored = planner.host.keys()
        assert [k for k in stored if k.prefix_hash in hashes] == []
    finally:
        gate.set()
        planner.close()


def test_every_advisory_received_is_counted_used_expired_dropped_renewed_or_live(
        tmp_path: Path) -> None:
    """An advisory replaced by a newer one of its session (due sooner while its fetch still
    moved: not renewed), or let go by a deletion, was counted neither used nor expired:
    received advisories added up to more than the rest (found by a review)."""
    planner = restarted_planner(tmp_path)
    ssd = planner.store.tiers[1]
    read, gate = ssd.get, threading.Event()
    ssd.get = lambda key: (gate.wait(10), read(key))[1]  # type: ignore[method-assign]
    try:
        planner.advise("s1", [*TURN1, 110], expected_arrival_s=60.0)
        planner.advise("s1", [*TURN1, 110], expected_arrival_s=0.0)  # sooner, still moving
        gate.set()
        view = TokenView("r2", [*TURN1, 110, 111], session="s1")
        planner.add_request(view)
        assert wait_for_admission(planner, view) == 10
        planner.advise("s2", [*TURN1, 110], expected_arrival_s=60.0)
        planner.erasure.forget("s2", []).result(10)
        s = planner.stats()
        assert (s["advisories_received"], s["advisories_dropped"]) == (3, 2)
        assert s["advisories_received"] == s["advisories_used"] + s["advisories_expired"] \
            + s["advisories_dropped"] + s["advisories_live"]
    finally:
        planner.close()


def test_be_work_saved_at_checkpoint_counts_the_prefix_it_loaded_as_held(tmp_path: Path
                                                                         ) -> None:
    """A BE request over a document whose chunks the tiers hold: its checkpoint hands them
    over, but the cost policies weigh (`checkpoint_cost_pages`) counted every page."""
    planner = make_planner(tmp_path / "ssd", background_saves="checkpoint")
    try:
        doc = list(range(100, 108))  # 2 chunks, saved by a chat turn over them
        run_turn(planner, "chat", [*doc, 1, 2, 3], [7, 8, 9])
        tokens = [*doc, 300, 301, 302, 303, 304]
        view = TokenView("be", tokens, background=True)
        planner.add_request(view)
        matched = planner.num_new_matched_tokens(view, 0)
        assert matched == 8
        planner.test_blocks["be"] = [1, 2, 3, 4]  # type: ignore[attr-defined]
        planner.plan_load("be", [1, 2, 3, 4], matched, len(tokens))
        run_step(planner, [("be", 12)])
        cost = planner.checkpoint_cost_pages("be", 12)
        planner.checkpoint("be", 12, [1, 2, 3, 4])
        copied = sum(len(c.blocks) for c in planner.build_metadata([]).checkpoints)
        assert cost == copied == 1
    finally:
        planner.close()


def test_be_work_never_takes_the_host_room_an_advised_chat_holds(tmp_path: Path) -> None:
    """An advisory's prefetched KV fills the host: a batch item restoring its document from
    SSD reclaimed it (and the typing user's turn then waited for the SSD); it goes without
    host room instead (recomputing what it could not load), and the turn finds its KV."""
    document = [t + 700 for t in TURN1] + [810]
    first = make_planner(tmp_path / "ssd", ssd_write_through="all")
    run_turn(first, "r1", [*TURN1, 110], [7, 8, 9], session="s1")
    run_turn(first, "b1", document, [20, 21, 22], session=None, background=True)
    first.close()
    planner = make_planner(tmp_path / "ssd", host_tier_bytes=3 * LAYERS * PAGE_BYTES,
                           ssd_fetch_wait_s=0)
    try:
        planner.advise("s1", [*TURN1, 110], expected_arrival_s=5.0)  # the user is typing
        advisory = planner.advisories.get("s1")
        assert advisory is not None and advisory.handle is not None
        assert advisory.handle.wait(10) and not advisory.handle.failed_keys()
        item = TokenView("b2", [*document, 811], None, background=True)
        planner.add_request(item)
        assert wait_for_admission(planner, item) == 0  # no room: recomputed, not restored
        assert not advisory.reclaimed and planner.stats()["advisories_reclaimed"] == 0
        turn = TokenView("r2", [*TURN1, 110, 111], session="s1")
        planner.add_request(turn)
        assert planner.num_new_matched_tokens(turn, 0) == len(TURN1)  # not held for SSD
        assert planner.stats()["turns_held"] == 0  # (and BE work's fetches are never turns)
    finally:
        planner.close()

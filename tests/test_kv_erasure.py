"""A deleted session's KV leaves the tiers: the planner erases it from host and SSD (bytes and
all), the store queues the erasure with the session's delete and keeps it across a restart,
and the server has the engine carry it out."""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from websockets.asyncio.client import connect

from antiphon.engine_ext.scripted import ScriptedEngine
from antiphon.sessions.store import SessionStore
from antiphon.tiering.connector_meta import TieringMetadata
from antiphon.tiering.keys import chain_hashes, prefix_hashes, tail_hashes
from antiphon.tiering.manager import ErasureIncomplete
from antiphon.tiering.planner import TierPlanner, TokenView
from tests.conftest import erasures, scripted_config
from tests.liveserver import live_server
from tests.test_tier_planner import CHUNK, LAYERS, TURN1, make_planner, run_turn
from tests.wsclient import chat, open_session, recv_until, send

OTHER = list(range(200, 211))  # another session's 11 tokens


def test_chain_hashes_name_every_full_chunk_and_every_partial_one() -> None:
    tokens = list(range(10))  # 2 full chunks of 4, then 2 tokens
    found = chain_hashes([tokens], CHUNK, "m")
    full = prefix_hashes(tokens, CHUNK, "m")
    assert set(full) <= found
    assert set(tail_hashes(full[1], tokens[8:])) <= found  # the tail a turn ended with
    assert set(tail_hashes(full[0], tokens[4:7])) <= found  # one an earlier turn ended with
    assert len(found) == 2 + 3 + 3 + 2  # full chunks, then tails of 1-3, 1-3 and 1-2 tokens
    assert not found & chain_hashes([tokens], CHUNK, "m", salt=b"other key")


def session_keys(planner: TierPlanner, tier: int, tokens: list[int]) -> list[object]:
    wanted = chain_hashes([tokens], CHUNK, "test-model")
    stored = planner.store.tiers[tier].keys()  # a tier's snapshot, not a dict's view
    return [k for k in stored if k.prefix_hash in wanted]



def step_of_new_turn(planner: TierPlanner, tokens: list[int], num_done: int) -> TieringMetadata:
    """Session s1's turn r1 (pages 7, 8, 9) admitted and planned in a step computing
    `num_done` tokens; the copies are left to the caller."""
    view = TokenView("r1", tokens, "s1")
    planner.add_request(view)
    planner.num_new_matched_tokens(view, 0)
    planner.test_blocks["r1"] = [7, 8, 9]  # type: ignore[attr-defined]
    planner.plan_load("r1", [7, 8, 9], 0, len(tokens))
    return planner.build_metadata([("r1", num_done)])


def test_kv_still_being_saved_when_its_session_is_deleted_is_not_kept(tmp_path: Path) -> None:
    # The session's last turn has just run: its chunks are copied into host slots this step
    # and its tail the next. The erasure scans the tiers, which hold none of it yet; the
    # copies were then published and written through to SSD, outliving the deletion.
    from tests.test_tier_planner import fake_worker_saves

    planner = make_planner(tmp_path / "ssd")
    chain = [*TURN1, 110]
    try:
        meta = step_of_new_turn(planner, chain, 10)  # saves chunks 0 and 1
        assert planner.request_finished("r1", 10, [7, 8, 9])  # the tail goes next step
        assert planner.erasure.forget("s1", [chain]).result(10) == (0, 0)
        fake_worker_saves(planner, meta.saves)
        planner.step_done({meta.step}, set())
        final = planner.build_metadata([])
        fake_worker_saves(planner, final.final_saves["r1"])
        planner.step_done({final.step}, set())
        planner.store.flush()
        assert session_keys(planner, 0, chain) == [] == session_keys(planner, 1, chain)
        host = planner.store.tiers[0]
        for copy in [*meta.saves, *final.final_saves["r1"]]:
            for slot in copy.slots:  # what the copies wrote is zeroed
                assert host.arena.read(slot) == bytes(host.slot_bytes)  # type: ignore[attr-defined]
        planner.store.check_integrity()
        # later turns of the same tokens (another session) are saved again
        run_turn(planner, "r2", chain, [4, 5, 6], session="s2")
        assert len(session_keys(planner, 0, chain)) == 3 * LAYERS
    finally:
        planner.close()

def test_a_deleted_sessions_kv_is_erased_from_every_tier_bytes_and_all(tmp_path: Path) -> None:
    planner = make_planner(tmp_path / "ssd")
    chain = [*TURN1, 110]
    try:
        run_turn(planner, "r1", chain, [7, 8, 9], session="s1")
        run_turn(planner, "r2", OTHER, [4, 5, 6], session="s2")
        planner.store.flush()
        host, ssd = planner.store.tiers
        mine = session_keys(planner, 0, chain)
        assert len(mine) == 3 * LAYERS == len(session_keys(planner, 1, chain))
        host_slots = [host.slot_of(k) for k in mine]  # type: ignore[attr-defined]
        ssd_slots = [ssd.slot_of(k) for k in mine]  # type: ignore[attr-defined]
        planner.advise("s1", chain, expected_arrival_s=None)

        erased, kept = planner.erasure.forget("s1", [chain]).result(10)

        assert (erased, kept) == (2 * 3 * LAYERS, 0)
        assert session_keys(planner, 0, chain) == [] == session_keys(planner, 1, chain)
        assert len(session_keys(planner, 0, OTHER)) == 3 * LAYERS  # the other session's stay
        assert len(session_keys(planner, 1, OTHER)) == 3 * LAYERS
        for slot in host_slots:
            assert host.arena.read(slot) == bytes(host.slot_bytes)  # type: ignore[attr-defined]
        with open(ssd.path, "rb") as f:  # type: ignore[attr-defined]
            for slot in ssd_slots:
                f.seek(ssd._file.offset(slot))  # type: ignore[attr-defined]
                assert f.read(ssd.stride) == bytes(ssd.stride)  # type: ignore[attr-defined]
        stats = planner.stats()
        assert stats["chunk_layers_forgotten"] == erased and stats["advisories_live"] == 0
        planner.store.check_integrity()
    finally:
        planner.close()
    again = make_planner(tmp_path / "ssd")  # a restart finds none of it on SSD
    try:
        assert again.advise("s1", chain, expected_arrival_s=None) == 0
        assert again.advise("s2", OTHER, expected_arrival_s=None) == 10
    finally:
        again.close()


def test_an_advisory_that_arrives_as_its_session_is_deleted_keeps_nothing(
        tmp_path: Path) -> None:
    """The server checks the session, then renders its history and advises the engine: a
    deletion in between reached the engine first, and the advisory's prefetch pinned the
    session's KV, which the erasure then kept, in host RAM, for good."""
    planner = make_planner(tmp_path / "ssd")
    try:
        run_turn(planner, "r1", [*TURN1, 110], [7, 8, 9], session="s1")
        planner.store.flush()
        release = threading.Event()
        real = planner.settle_retired_prefetches

        def settle_then_wait() -> None:  # (the erasure's thread, held before it erases)
            real()
            release.wait(10)
        planner.settle_retired_prefetches = settle_then_wait  # type: ignore[method-assign]
        done = planner.erasure.forget("s1", [[*TURN1, 110]])
        assert planner.advise("s1", [*TURN1, 110], expected_arrival_s=600.0) == 0
        release.set()
        assert done.result(20)[1] == 0  # none kept
        assert planner.host.keys() == [] and planner.store.tiers[1].keys() == []
    finally:
        planner.close()


def test_an_erasure_is_not_done_while_an_unopened_slot_file_may_hold_the_kv(
        tmp_path: Path) -> None:
    """A start without the SSD tier (turned off, or its directory unusable) erased in the host
    tier alone and reported the erasure done; the next start with the SSD tier served the
    deleted session's KV from the slot file it had never opened."""
    chain = [*TURN1, 110]
    first = make_planner(tmp_path / "ssd")
    try:
        run_turn(first, "r1", chain, [7, 8, 9], session="s1")
        first.store.flush()
    finally:
        first.close()
    off = make_planner(tmp_path / "ssd", ssd_tier_bytes=0)
    try:
        with pytest.raises(ErasureIncomplete, match="not open"):
            off.erasure.forget("s1", [chain]).result(10)
    finally:
        off.close()
    again = make_planner(tmp_path / "ssd")  # the erasure, kept queued, runs again
    try:
        assert again.erasure.forget("s1", [chain]).result(10) == (3 * LAYERS, 0)
        assert again.advise("s1", chain, expected_arrival_s=None) == 0
    finally:
        again.close()


@pytest.mark.parametrize("failing", ["clear", "fdatasync"])
def test_an_erasure_is_not_done_until_it_is_on_the_device(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, failing: str) -> None:
    """A failed clear was logged and the erasure reported done: a restart found the record
    and served the deleted session's KV again. Without `ssd_fsync` (the default) the cleared
    slots were handed to the operating system only: after a power loss the records, intact,
    came back. The erasure is done once its clears are on the device, not while either
    fails."""
    chain = [*TURN1, 110]
    planner = make_planner(tmp_path / "ssd")
    try:
        run_turn(planner, "r1", chain, [7, 8, 9], session="s1")
        planner.store.flush()
        ssd = planner.store.tiers[1]
        assert not ssd._file.fsync  # type: ignore[attr-defined]
        clear = ssd._file.clear  # type: ignore[attr-defined]
        fails, synced = [True], []

        def clear_or_fail(slot: int) -> None:
            if fails[0] and failing == "clear":
                raise OSError(5, "Input/output error")
            clear(slot)

        def fdatasync(fd: int) -> None:
            if fails[0] and failing == "fdatasync":
                raise OSError(5, "Input/output error")
            synced.append(fd)

        monkeypatch.setattr(ssd._file, "clear", clear_or_fail)  # type: ignore[attr-defined]
        monkeypatch.setattr("antiphon.tiering.slot_file.os.fdatasync", fdatasync)
        with pytest.raises((ErasureIncomplete, OSError)):
            planner.erasure.forget("s1", [chain]).result(10)
        assert ssd.uncleared_slots == (3 * LAYERS if failing == "clear" else 0)
        fails[0] = False
        # The erasure runs again (the next one, or the next start): the index no longer has
        # the keys, and the tier clears the slots it failed to clear.
        assert planner.erasure.forget("s1", [chain]).result(10) == (0, 0)
        assert ssd.uncleared_slots == 0 and synced
    finally:
        planner.close()
    again = make_planner(tmp_path / "ssd")
    try:
        assert again.advise("s1", chain, expected_arrival_s=None) == 0
    finally:
        again.close()


def test_kv_computed_past_a_sessions_last_kept_token_is_erased_with_it(tmp_path: Path) -> None:
    # A reply a stop string ended (or its user cancelled) ran on in the engine: its tail holds
    # a token the session never kept, so no hash of the session's chains names it, and it
    # outlived the session's deletion.
    planner = make_planner(tmp_path / "ssd")
    try:
        run_turn(planner, "r1", [*TURN1, 110, 111], [7, 8, 9], session="s1")  # tail 108-110
        run_turn(planner, "r2", OTHER, [4, 5, 6], session="s2")
        planner.store.flush()

        erased, kept = planner.erasure.forget("s1", [TURN1]).result(10)  # the session kept 100-109

        assert (erased, kept) == (2 * 3 * LAYERS, 0)
        others = set(chain_hashes([OTHER], CHUNK, "test-model"))
        for tier in planner.store.tiers:
            stored = tier.keys()  # a tier's snapshot, not a dict's view
            assert {key.prefix_hash for key in stored} <= others
        assert planner.stats()["chunk_layers_forgotten"] == erased
    finally:
        planner.close()


def test_kv_an_earlier_turn_computed_past_what_the_session_kept_is_erased_with_it(
        tmp_path: Path) -> None:
    # Turn 1's reply ran on in the engine past what the session kept (TURN1); turn 2 went on
    # from TURN1 without it. The session's chain (turn 2's) runs past turn 1's tail.
    planner = make_planner(tmp_path / "ssd")
    chain = [*TURN1, 120, 121, 122, 123, 124]
    try:
        run_turn(planner, "r1", [*TURN1, 110, 111], [7, 8, 9], session="s1")  # tail 108-110
        run_turn(planner, "r2", chain, [4, 5, 6, 7], session="s1")
        planner.store.flush()
        erased, _ = planner.erasure.forget("s1", [chain]).result(10)
        for tier in planner.store.tiers:
            assert len(tier.keys()) == 0
        assert erased == 2 * (4 + 1) * LAYERS  # 3 full chunks and 2 tails, on both tiers
    finally:
        planner.close()


@pytest.mark.parametrize("restart", [False, True])
def test_kv_a_reply_ran_on_into_past_what_the_session_kept_is_erased_with_it(
        tmp_path: Path, restart: bool) -> None:
    # The engine computed 108-111 and 112 past the reply the session kept (TURN1: a stop
    # string ended it at 109): a full chunk and a tail no hash of the session's chains names.
    # The tail index knew the tail until a restart; nothing knew the full chunk.
    planner = make_planner(tmp_path / "ssd")
    try:
        run_turn(planner, "r1", [*TURN1, 110, 111, 112, 113], [7, 8, 9, 10], session="s1")
        run_turn(planner, "r2", OTHER, [4, 5, 6], session="s2")
        planner.store.flush()
        if restart:
            planner.close()
            planner = make_planner(tmp_path / "ssd")

        erased, kept = planner.erasure.forget("s1", [TURN1]).result(10)

        tiers = 1 if restart else 2  # the host tier starts empty
        assert (erased, kept) == (tiers * 4 * LAYERS, 0)  # 3 full chunks and the tail
        others = set(chain_hashes([OTHER], CHUNK, "test-model"))
        for tier in planner.store.tiers:
            stored = tier.keys()  # a tier's snapshot, not a dict's view
            assert {key.prefix_hash for key in stored} <= others
    finally:
        planner.close()


def test_kv_a_deleted_session_ran_on_into_that_is_still_being_saved_is_not_kept(
        tmp_path: Path) -> None:
    from tests.test_tier_planner import fake_worker_saves

    planner = make_planner(tmp_path / "ssd")
    tokens = [*TURN1, 110, 111, 112]  # the session kept TURN1
    try:
        meta = step_of_new_turn(planner, tokens, 12)  # saves chunks 0 to 2
        assert planner.erasure.forget("s1", [TURN1]).result(10) == (0, 0)
        fake_worker_saves(planner, meta.saves)
        planner.step_done({meta.step}, set())
        planner.store.flush()
        for tier in planner.store.tiers:
            assert tier.keys() == []
    finally:
        planner.close()


def test_a_checkpoint_on_its_way_to_ssd_when_its_session_is_deleted_is_erased(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # A session's best-effort turn (its KV in the host tier alone) was checkpointed, its
    # chunks queued for the SSD tier, then stopped and its session deleted: the erasure read
    # the owners before the write-down landed, which then outlived the deletion.
    import threading

    from tests.test_tier_planner import fake_worker_saves

    planner = make_planner(tmp_path / "ssd")
    gate = threading.Event()
    write_through = planner.store.write_through

    def held(*args: object, **kwargs: object) -> bool:
        assert gate.wait(10)
        return write_through(*args, **kwargs)  # type: ignore[arg-type]

    tokens = [*TURN1, 110, 111, 112]
    try:
        view = TokenView("be", tokens, "s1", background=True)
        planner.add_request(view)
        planner.num_new_matched_tokens(view, 0)
        planner.test_blocks["be"] = [7, 8, 9]  # type: ignore[attr-defined]
        planner.plan_load("be", [7, 8, 9], 0, len(tokens))
        meta = planner.build_metadata([("be", 12)])  # chunks 0 to 2, in the host tier
        fake_worker_saves(planner, meta.saves)
        planner.step_done({meta.step}, set())
        monkeypatch.setattr(planner.store, "write_through", held)
        assert planner.checkpoint("be", 12, [7, 8, 9]) == 12  # all written down, later
        planner.request_finished("be", 12, [7, 8, 9])
        threading.Timer(0.3, gate.set).start()
        erased, _ = planner.erasure.forget("s1", [TURN1[:3]]).result(10)  # no chain names them
        planner.store.flush()
        for tier in planner.store.tiers:
            assert tier.keys() == []
        assert erased == 2 * 3 * LAYERS
    finally:
        gate.set()
        planner.close()


def test_a_live_sessions_pruned_chain_leaves_the_tail_of_one_it_still_runs(
        tmp_path: Path) -> None:
    planner = make_planner(tmp_path / "ssd")
    old = [*TURN1]  # dropped
    current = [*TURN1, 110, 111, 112, 113, 114]  # extends it
    try:
        run_turn(planner, "r1", [*TURN1, 110, 111], [7, 8, 9], session="s1")  # tail 108-110
        planner.store.flush()
        assert planner.erasure.forget("s1", [old], keep=[current]).result(10) == (0, 0)
        view = TokenView("r2", current)
        planner.add_request(view)
        assert planner.num_new_matched_tokens(view, 0) == 11
    finally:
        planner.close()


def test_a_live_sessions_old_chain_is_erased_but_what_it_still_runs_is_not(
        tmp_path: Path) -> None:
    planner = make_planner(tmp_path / "ssd")
    current = [*TURN1, 110]  # 2 full chunks and a 3-token tail
    old = [*TURN1[:8], 120, 121, 122]  # an earlier reply: the same 2 chunks, another tail
    try:
        run_turn(planner, "r1", old, [7, 8, 9], session="s1")
        run_turn(planner, "r2", current, [4, 5, 6], session="s1")
        planner.store.flush()
        planner.advise("s1", current, expected_arrival_s=None)

        erased, kept = planner.erasure.forget("s1", [old], keep=[current]).result(10)

        assert (erased, kept) == (2 * LAYERS, 0)  # the old tail, on host and SSD
        assert len(session_keys(planner, 0, current)) == 3 * LAYERS
        assert len(session_keys(planner, 1, current)) == 3 * LAYERS
        assert len(session_keys(planner, 0, old)) == 2 * LAYERS  # the shared chunks
        assert planner.stats()["advisories_live"] == 1  # the session goes on
        planner.store.check_integrity()
    finally:
        planner.close()


def test_a_request_checkpointed_while_an_erasure_waits_keeps_its_chunks(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # The erasure spared the checkpoints of when it was asked for; one taken before its
    # thread ran, sharing chunks with the erased chains (one owner's system prompt), lost
    # them, and its request recomputed them.
    import threading

    from tests.test_tier_planner import fake_worker_saves, preempt_after

    planner = make_planner(tmp_path / "ssd")
    held_back: list[threading.Thread] = []
    try:
        with monkeypatch.context() as patch:
            patch.setattr(threading.Thread, "start", lambda thread: held_back.append(thread))
            done = planner.erasure.forget("old-session", [TURN1[:8]])  # shares 2 chunks with TURN1
        _, meta = preempt_after(planner, "be", [*TURN1, 110], [7, 8, 9], [10],
                                background=True)
        fake_worker_saves(planner, meta.checkpoints)
        planner.step_done({meta.step}, set())
        assert planner.check_integrity() == []
        held_back[0].run()  # the erasure runs now
        planner.store.flush()
        assert done.result(10)[0] == 0
        assert planner.check_integrity() == []
    finally:
        planner.close()


def test_an_erasure_waiting_for_the_ssd_writer_does_not_hold_the_planner(
        tmp_path: Path) -> None:
    # Each SSD removal queues its slot's clearing behind the writer, which blocks while the
    # queue is full; done under the planner's lock, the engine's steps waited for the writer.
    import threading
    import time

    from antiphon.tiering.keys import ChunkKey

    planner = make_planner(tmp_path / "ssd", writer_queue_depth=2)
    ssd = planner.store.tiers[-1]
    chain = list(range(CHUNK * 8))
    try:
        for prefix_hash in prefix_hashes(chain, CHUNK, "test-model"):
            for layer in range(LAYERS):
                ssd.put(ChunkKey("test-model", prefix_hash, 0, layer), b"x" * 64)
        ssd.flush()
        writer_busy, release = threading.Event(), threading.Event()
        real_clear = ssd._file.clear  # type: ignore[attr-defined]

        def slow_clear(slot: int) -> None:  # a busy (niced, fsyncing) writer
            writer_busy.set()
            release.wait(10)
            real_clear(slot)

        ssd._file.clear = slow_clear  # type: ignore[attr-defined]
        done = planner.erasure.forget("s1", [chain])
        assert writer_busy.wait(5)
        time.sleep(0.2)  # the erasure fills the writer's queue meanwhile
        answered = threading.Event()
        threading.Thread(target=lambda: (planner.stats(), answered.set()), daemon=True).start()
        try:
            assert answered.wait(1.0), "a scheduler call waited for the SSD writer"
        finally:
            release.set()
            done.result(10)
        assert session_keys(planner, 1, chain) == []
    finally:
        planner.close()


def test_two_equal_erasures_each_keep_their_own_guard(tmp_path: Path) -> None:
    # An erasure of the same chains issued again (after the server gave up waiting) that
    # ended first took the slow one's guard out, and a checkpoint taken then was erased.
    import threading

    from tests.test_tier_planner import fake_worker_saves, preempt_after

    planner = make_planner(tmp_path / "ssd")
    real_erase, first_in, go_on = planner.erasure._erase, threading.Event(), threading.Event()

    def erase(wanted: set[bytes]) -> tuple[int, int]:
        if not first_in.is_set():
            first_in.set()
            go_on.wait(10)  # the first erasure is slow (a busy SSD writer)
        return real_erase(wanted)

    planner.erasure._erase = erase  # type: ignore[method-assign]
    try:
        slow = planner.erasure.forget("old-session", [TURN1[:8]])
        assert first_in.wait(5)
        planner.erasure.forget("old-session", [TURN1[:8]]).result(10)  # issued again, done first
        _, meta = preempt_after(planner, "be", [*TURN1, 110], [7, 8, 9], [10], background=True)
        fake_worker_saves(planner, meta.checkpoints)
        planner.step_done({meta.step}, set())
        go_on.set()
        slow.result(10)
        planner.store.flush()
        assert planner.check_integrity() == []
    finally:
        go_on.set()
        planner.close()


def test_a_deleted_sessions_advisory_prefetch_leaves_nothing_in_host_ram(
        tmp_path: Path) -> None:
    # After a restart the session's KV is on SSD only; its advisory's prefetch is bringing it
    # up (slowly) when the session is deleted. The stopped prefetch still held what it had
    # brought up pinned: the erasure kept 11 chunk-layers in host RAM, bytes readable.
    tokens = list(range(100, 141))  # 10 full chunks
    first = make_planner(tmp_path / "ssd")
    run_turn(first, "r1", tokens, list(range(1, 12)), session="s1")
    first.close()
    planner = make_planner(tmp_path / "ssd")
    ssd = planner.store.tiers[1]
    real_get, brought_up = ssd.get, threading.Event()

    def slow_get(key: object) -> object:
        brought_up.set()
        time.sleep(0.05)
        return real_get(key)  # type: ignore[arg-type]

    ssd.get = slow_get  # type: ignore[method-assign]
    try:
        assert planner.advise("s1", tokens, None) == 40
        assert brought_up.wait(5)
        time.sleep(0.2)  # a few chunk-layers up and pinned
        assert session_keys(planner, 0, tokens)
        erased, kept = planner.erasure.forget("s1", [tokens]).result(30)
        assert kept == 0 and erased > 10 * LAYERS  # what the host held, and all of SSD
        assert session_keys(planner, 0, tokens) == [] == session_keys(planner, 1, tokens)
    finally:
        planner.close()


def test_a_copy_a_running_turn_loads_from_stays(tmp_path: Path) -> None:
    planner = make_planner(tmp_path / "ssd")
    chain = [*TURN1, 110]
    try:
        run_turn(planner, "r1", chain, [7, 8, 9], session="s1")
        planner.store.flush()
        follow_up = TokenView("r2", [*chain, 111, 112], session="s1b")  # same prefix
        planner.add_request(follow_up)
        assert planner.num_new_matched_tokens(follow_up, 0) == 10
        planner.plan_load("r2", [1, 2, 3], 10, 13)  # its host copies are pinned now
        erased, kept = planner.erasure.forget("s1", [chain]).result(10)
        assert (erased, kept) == (3 * LAYERS, 3 * LAYERS)  # the SSD copies went, not those
        assert len(session_keys(planner, 0, chain)) == 3 * LAYERS
        planner.store.check_integrity()
    finally:
        planner.close()


def test_the_store_keeps_every_chain_a_session_ran_and_queues_their_erasure(
        tmp_path: Path) -> None:
    path = tmp_path / "sessions.sqlite3"
    store = SessionStore(path)
    sid = store.create_session("k1").session_id  # type: ignore[union-attr]
    other = store.create_session("k1").session_id  # type: ignore[union-attr]
    store.append_message(sid, "user", "a", 1)
    store.append_message(sid, "assistant", "b", 1, context_ids=[1, 2, 3])
    store.append_message(sid, "user", "c", 1)
    store.append_message(sid, "assistant", "d", 1, context_ids=[1, 2, 3, 4, 5])  # extends
    assert store.kv_chains(sid) == []
    store.append_message(sid, "assistant", "e", 1, context_ids=[1, 2, 9],  # diverges
                         replaces_reply=True)
    assert store.kv_chains(sid) == [(1, 2, 3, 4, 5)]
    store.append_message(sid, "assistant", "d", 1, context_ids=[1, 2, 3, 4, 5],
                         replaces_reply=True)  # regenerated back and forth: each kept once
    store.append_message(sid, "assistant", "e", 1, context_ids=[1, 2, 9], replaces_reply=True)
    assert store.kv_chains(sid) == [(1, 2, 3, 4, 5), (1, 2, 9)]
    store.move_window(sid, 2)  # the window's cut: the context so far is a chain now
    store.set_context(sid, [7, 8])
    assert store.kv_chains(sid) == [(1, 2, 3, 4, 5), (1, 2, 9)]
    store.append_message(other, "assistant", "x", 1, context_ids=[5, 5])

    assert not store.delete_session("k2", sid, [1, 1])  # someone else's: nothing changes
    assert store.pending_erasures() == []
    assert store.delete_session("k1", sid, [7, 8, 6])
    assert store.kv_chains(sid) == [] and store.context(sid) is None
    store.close()
    store = SessionStore(path)  # the queue survives a restart
    ((erasure_id, session_id, owner, chains),) = store.pending_erasures()
    assert (session_id, owner) == (sid, "k1")
    assert sorted(chains) == sorted([(7, 8), (1, 2, 3, 4, 5), (1, 2, 9), (7, 8, 6)])
    store.finish_erasure(erasure_id)
    assert store.pending_erasures() == []
    assert store.context(other) == (1, (5, 5))
    store.check_integrity()
    store.close()


def test_a_session_keeps_its_newest_chains_and_queues_the_older_for_erasure(
        tmp_path: Path) -> None:
    path = tmp_path / "sessions.sqlite3"
    store = SessionStore(path, kv_chains_kept=2)
    queued: list[int] = []
    store.on_erasure_queued = lambda: queued.append(1)
    sid = store.create_session("k1").session_id  # type: ignore[union-attr]
    store.append_message(sid, "user", "a", 1)
    for reply in range(5):  # a reply regenerated four times, each different
        store.append_message(sid, "assistant", str(reply), 1, context_ids=[1, 2, 10 + reply],
                             replaces_reply=reply > 0)
    assert store.kv_chains(sid) == [(1, 2, 12), (1, 2, 13)]
    assert queued == [1, 1]
    assert [(e[1], e[2], e[3]) for e in store.pending_erasures()] == [
        (sid, "k1", [(1, 2, 10)]), (sid, "k1", [(1, 2, 11)])]
    assert sorted(store.kept_chains(sid) or []) == [(1, 2, 12), (1, 2, 13), (1, 2, 14)]
    store.set_context(sid, [1, 2, 15])  # the REST path prunes the same way
    assert store.kv_chains(sid) == [(1, 2, 13), (1, 2, 14)] and len(queued) == 3
    store.move_window(sid, 1)  # and so does a moved window
    assert store.kv_chains(sid) == [(1, 2, 14), (1, 2, 15)] and len(queued) == 4
    assert store.delete_session("k1", sid)
    assert store.kept_chains(sid) is None  # the deletion's erasure spares nothing
    erasures = store.pending_erasures()
    assert sorted(erasures[-1][3]) == [(1, 2, 14), (1, 2, 15)]
    assert {chain for e in erasures for chain in e[3]} == {(1, 2, 10 + i) for i in range(6)}
    store.close()
    with pytest.raises(ValueError, match="kv_chains_kept"):
        SessionStore(path, kv_chains_kept=0)


async def test_the_server_erases_a_live_sessions_old_chains_sparing_what_it_runs(
        tmp_path: Path) -> None:
    import dataclasses

    import httpx

    config = scripted_config(tmp_path)
    config = dataclasses.replace(
        config, sessions=dataclasses.replace(config.sessions, kv_chains_kept=1))
    engine = ScriptedEngine()
    with live_server(config, engine) as url:
        async with connect(url.replace("http://", "ws://") + "/v1/ws") as ws:
            sid = (await open_session(ws))["session"]["session_id"]
        async with httpx.AsyncClient(base_url=url, timeout=30) as client:
            for text in ("first", "second", "third"):  # each conversation a new one
                reply = await client.post("/v1/chat/completions", json={
                    "model": engine.model_name, "max_tokens": 8,
                    "messages": [{"role": "user", "content": text}],
                    "vllm_xargs": {"session_id": sid}})
                assert reply.status_code == 200, reply.text
        await erasures(engine)
    ((session_id, chains, _),) = engine.forgotten
    (keep,) = engine.kept
    assert session_id == sid
    assert "first" in "".join(map(chr, chains[0]))
    kept = ["".join(map(chr, chain)) for chain in keep or []]
    assert len(kept) == 2  # the context and the one chain kept
    assert any("third" in k for k in kept) and any("second" in k for k in kept)
    assert not any("first" in k for k in kept)


async def test_deleting_a_session_that_stored_no_context_still_erases_what_it_ran(
        tmp_path: Path) -> None:
    # An OpenAI request whose client left mid-reply stored no context, but the engine had
    # saved its prompt's KV under the session's owner tag; the deletion queued no erasure,
    # and that KV stayed in the tiers (found by a review).
    import httpx

    engine = ScriptedEngine(token_delay_s=0.05)
    with live_server(scripted_config(tmp_path), engine) as url:
        async with httpx.AsyncClient(base_url=url, timeout=30) as client:
            sid = (await client.post("/v1/sessions", json={})).json()["session_id"]
            async with client.stream("POST", "/v1/chat/completions", json={
                    "model": engine.model_name, "max_tokens": 50, "stream": True,
                    "messages": [{"role": "user", "content": "a private prompt " * 20}],
                    "vllm_xargs": {"session_id": sid}}) as reply:
                async for line in reply.aiter_lines():
                    if line.startswith("data:"):
                        break  # the client leaves mid-reply
            assert engine.params[-1].session_id == sid
            # The server learns that the client left on the reply's connection, the delete
            # comes on another: until the turn has ended, the session is busy (409), as a
            # client told so retries (a loaded CI host answered it 409 once).
            deadline = time.monotonic() + 10
            while (status := (await client.delete(f"/v1/sessions/{sid}")).status_code) == 409 \
                    and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            assert status == 204
        forgotten = await erasures(engine)
    assert [f[0] for f in forgotten] == [sid]
    assert SessionStore(tmp_path / "sessions.sqlite3").pending_erasures() == []


async def test_a_rest_turn_of_a_session_deleted_while_it_waited_for_the_session_is_refused(
        tmp_path: Path) -> None:
    # The completion checked the session, then claimed it, and did not read it again: a
    # deletion that ran in between left it running as a turn of the deleted session, its KV
    # saved under the session's tag after the erasure ran (found by a review; the sleep only
    # widens the window).
    import httpx

    from tests.liveserver import running_server

    engine = ScriptedEngine()
    with running_server(scripted_config(tmp_path), engine) as (url, server):
        turns = server.config.app.state.ctx.turns
        async with httpx.AsyncClient(base_url=url, timeout=30) as client:
            sid = (await client.post("/v1/sessions", json={})).json()["session_id"]
            get, slowed = turns.get, []

            async def slow_get(owner: str, session_id: str) -> object:
                session = await get(owner, session_id)
                if not slowed:  # the completion's check: it read the session, then waits
                    slowed.append(1)
                    await asyncio.sleep(0.5)
                return session
            turns.get = slow_get
            completion = asyncio.create_task(client.post("/v1/chat/completions", json={
                "model": engine.model_name, "max_tokens": 8,
                "messages": [{"role": "user", "content": "secret stuff"}],
                "vllm_xargs": {"session_id": sid}}))
            await asyncio.sleep(0.1)
            assert (await client.delete(f"/v1/sessions/{sid}")).status_code == 204
            reply = await completion
            assert reply.status_code == 404, reply.text
            assert reply.json()["error"]["code"] == "session_not_found"
            assert not turns.claims.is_held(sid)
        await erasures(engine)
    assert sid not in [params.session_id for params in engine.params]


async def test_an_advisory_that_reaches_the_engine_after_its_sessions_erasure_is_erased_too(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # A typing advisory on one connection, the deletion from another (REST): the advisory
    # reached the engine after the deletion's erasure, and its prefetch brought the deleted
    # session's KV back into host RAM, pinned (found by a review). The sleep widens the
    # window: the advisory's read of the conversation is slowed.
    import httpx

    from antiphon.server.turns import SessionTurns

    engine = ScriptedEngine()
    calls: list[tuple[str, str]] = []
    advise, forget = engine.advise, engine.forget

    async def noted_advise(session_id: str, *args: Any, **kwargs: Any) -> int:
        calls.append(("advise", session_id))
        return await advise(session_id, *args, **kwargs)

    async def noted_forget(session_id: str, *args: Any, **kwargs: Any) -> int | None:
        calls.append(("forget", session_id))
        return await forget(session_id, *args, **kwargs)

    engine.advise, engine.forget = noted_advise, noted_forget  # type: ignore[method-assign]
    history, slowed = SessionTurns._history, []

    def slow_history(self: SessionTurns, session: Any) -> Any:
        seen = history(self, session)
        if not slowed:  # the advisory's read, not the deletion's
            slowed.append(1)
            time.sleep(0.5)
        return seen

    with live_server(scripted_config(tmp_path), engine) as url:
        async with connect(url.replace("http://", "ws://") + "/v1/ws") as ws:
            sid = (await open_session(ws))["session"]["session_id"]
            await chat(ws, sid, "hello there")
            monkeypatch.setattr(SessionTurns, "_history", slow_history)
            await send(ws, type="typing", session_id=sid)
            await asyncio.sleep(0.1)
            async with httpx.AsyncClient(base_url=url) as client:
                assert (await client.delete(f"/v1/sessions/{sid}")).status_code == 204
            await asyncio.sleep(1.5)
    mine = [call for call in calls if call[1] == sid]
    assert mine[-1] == ("forget", sid) and ("advise", sid) in mine
    assert SessionStore(tmp_path / "sessions.sqlite3").pending_erasures() == []


class FailingForget(ScriptedEngine):
    """An engine whose tiers cannot be reached (its `forget` fails)."""

    async def forget(self, session_id: str, chains: object, cache_salt: str | None = None,
                     keep: object = None) -> int | None:
        raise RuntimeError("the engine is not answering")


async def test_deleting_a_session_has_the_engine_erase_its_kv_even_after_a_restart(
        tmp_path: Path) -> None:
    config = scripted_config(tmp_path)
    with live_server(config, FailingForget()) as url:
        async with connect(url.replace("http://", "ws://") + "/v1/ws") as ws:
            sid = (await open_session(ws))["session"]["session_id"]
            first = await chat(ws, sid, "hello")
            await send(ws, type="session.delete", session_id=sid)
            await recv_until(ws, "session.deleted")
        await asyncio.sleep(0.2)
    store = SessionStore(tmp_path / "sessions.sqlite3")
    assert [e[1] for e in store.pending_erasures()] == [sid]  # not lost with the failure
    store.close()

    engine = ScriptedEngine()
    with live_server(config, engine) as url:
        await erasures(engine)
    ((session_id, chains, salt),) = engine.forgotten
    assert (session_id, salt) == (sid, None)
    context = "<user>hello\n<assistant>" + first["done"]["text"]
    assert "".join(map(chr, chains[0])) == context
    store = SessionStore(tmp_path / "sessions.sqlite3")
    assert store.pending_erasures() == []
    store.close()


class ForgetFailingOnce(ScriptedEngine):
    """Its first erasure fails after a while (an engine busy past the erasure's timeout)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    async def forget(self, session_id: str, chains: Any, cache_salt: str | None = None,
                     keep: Any = None) -> int | None:
        self.calls += 1
        if self.calls == 1:
            await asyncio.sleep(0.3)  # (the second deletion is queued meanwhile)
            raise TimeoutError("the erasure did not finish in time")
        return await super().forget(session_id, chains, cache_salt, keep)


async def test_a_failed_erasure_is_tried_again_and_holds_back_none_queued_behind_it(
        tmp_path: Path) -> None:
    """An erasure that failed ended the eraser's run: neither it nor one queued meanwhile was
    tried again until another session was deleted, or the server restarted (the deleted
    conversations' tokens stayed in the erasure queue meanwhile)."""
    engine = ForgetFailingOnce()
    with live_server(scripted_config(tmp_path, kv_erasure_retry_s=0.2), engine) as url:
        async with connect(url.replace("http://", "ws://") + "/v1/ws") as ws:
            sids = []
            for text in ("a first chat", "a second chat"):
                sid = (await open_session(ws))["session"]["session_id"]
                await chat(ws, sid, text)
                sids.append(sid)
            for sid in sids:
                await send(ws, type="session.delete", session_id=sid)
                await recv_until(ws, "session.deleted")
                await asyncio.sleep(0.1)
            for _ in range(100):
                if len(engine.forgotten) == 2:
                    break
                await asyncio.sleep(0.05)
    assert sorted(f[0] for f in engine.forgotten) == sorted(sids)
    store = SessionStore(tmp_path / "sessions.sqlite3")
    assert store.pending_erasures() == []
    store.close()


class ErasureQueue:
    """The store's erasure queue and an engine whose `forget` fails the sessions in `failing`,
    for a `KvEraser` (retrying after 0.1 s)."""

    def __init__(self, sessions: list[str]) -> None:
        from types import SimpleNamespace

        from antiphon.server.kv_eraser import KvEraser

        self.rows = [(i, session, "o", [[1, 2, 3]]) for i, session in enumerate(sessions)]
        self.failing: set[str] = set()
        self.calls: list[str] = []
        store = SimpleNamespace(on_erasure_queued=None, pending_erasures=lambda: list(self.rows),
                                kept_chains=lambda _s: None, finish_erasure=self.finish)
        chat = SimpleNamespace(engine=SimpleNamespace(forget=self.forget),
                               cache_salt=lambda _o: None,
                               config=SimpleNamespace(kv_erasure_retry_s=0.1))
        self.eraser = KvEraser(store, chat)  # type: ignore[arg-type]

    async def forget(self, session_id: str, *args: Any, **kwargs: Any) -> int:
        self.calls.append(session_id)
        if session_id in self.failing or "*" in self.failing:
            raise RuntimeError("the engine is not answering")
        return 1

    def finish(self, erasure_id: int) -> None:
        self.rows[:] = [r for r in self.rows if r[0] != erasure_id]

    def queue(self, session: str) -> None:
        self.rows.append((max((r[0] for r in self.rows), default=0) + 1, session, "o", [[1]]))
        self.eraser.erase_queued()

    def left(self) -> list[str]:
        return [r[1] for r in self.rows]


async def test_an_engine_failing_every_erasure_is_asked_a_few_times_until_the_retry() -> None:
    """Going on past a failed erasure tried the whole queue on every deletion while the
    engine failed them all (500 queued: 500 calls and warnings each time): a pass stops at
    its third failure and none runs before the retry, which then erases them all."""
    from antiphon.server.kv_eraser import KvEraser

    q = ErasureQueue([f"s{i}" for i in range(50)])
    q.failing = {"*"}
    q.eraser.start()
    for _ in range(3):  # sessions deleted meanwhile
        await asyncio.sleep(0.02)
        q.queue("new")
    await asyncio.sleep(0.02)
    assert len(q.calls) == KvEraser.MAX_FAILURES_A_PASS
    q.failing = set()
    for _ in range(100):
        if not q.rows:
            break
        await asyncio.sleep(0.02)
    await q.eraser.stop()
    assert not q.rows


async def test_every_failed_erasure_gets_its_retry_and_holds_back_no_other() -> None:
    """A pass woken by one failed erasure's retry skipped another not due yet and set no
    timer for it (left until another deletion); three that kept failing at the head of the
    queue paused every pass before the erasures behind them."""
    q = ErasureQueue([])
    q.eraser.start()
    q.failing = {"a", "b"}
    q.queue("a")
    await asyncio.sleep(0.05)
    q.queue("b")  # due 50 ms after a
    await asyncio.sleep(0.01)
    q.failing = set()
    await asyncio.sleep(0.5)
    assert q.left() == []
    q.failing = {"x", "y", "z"}  # for good
    q.rows += [(10 + i, session, "o", [[1]]) for i, session in enumerate("xyzw")]
    q.eraser.erase_queued()  # (x, y and z fail: a pause, then w's turn)
    await asyncio.sleep(0.8)
    await q.eraser.stop()
    assert q.left() == ["x", "y", "z"]


@pytest.mark.parametrize("owner_key", [None, "key-0001"])
async def test_the_erasure_names_the_owners_kv(tmp_path: Path, owner_key: str | None) -> None:
    engine = ScriptedEngine()
    config = scripted_config(tmp_path, api_keys=() if owner_key is None else (owner_key,))
    headers = {} if owner_key is None else {"Authorization": f"Bearer {owner_key}"}
    with live_server(config, engine) as url:
        async with connect(url.replace("http://", "ws://") + "/v1/ws",
                           additional_headers=headers) as ws:
            sid = (await open_session(ws))["session"]["session_id"]
            await chat(ws, sid, "hello")
            await send(ws, type="message", session_id=sid, content="a second message")
            await recv_until(ws, "done")
            await send(ws, type="session.delete", session_id=sid)
            await recv_until(ws, "session.deleted")
        await erasures(engine)
    ((_, chains, salt),) = engine.forgotten
    assert (salt is None) == (owner_key is None)
    rendered = ["".join(map(chr, c)) for c in chains]
    # Its context through the last reply, and the prompt of its conversation as it stands.
    assert any(r.endswith("<user>a second message\n<assistant>You said: a second message")
               for r in rendered)
    assert any(r.endswith("You said: a second message\n<assistant>") for r in rendered)


async def test_an_engine_without_kv_tiering_keeps_erasures_while_a_slot_file_is_left(
        tmp_path: Path) -> None:
    """With KV tiering off, `forget` reported nothing to erase and the server finished the
    erasure; a later start with tiering served the deleted session's KV from the SSD file."""
    from antiphon.engine_ext.config import EngineConfig
    from antiphon.engine_ext.vllm_engine import VllmEngine
    from antiphon.tiering.config import TieringConfig
    from antiphon.tiering.slot_file import FILE_NAME
    from tests.test_model_fingerprint import make_model

    model = make_model(tmp_path / "m")
    off = TieringConfig(kv_tiering=False, ssd_dir=tmp_path / "kv")
    engine = VllmEngine(EngineConfig(), model, off)
    assert await engine.forget("s1", [[1, 2, 3]]) is None  # no file: nothing to erase
    (tmp_path / "kv").mkdir()
    (tmp_path / "kv" / FILE_NAME).write_bytes(b"")
    with pytest.raises(ErasureIncomplete, match="not open"):
        await engine.forget("s1", [[1, 2, 3]])


@pytest.mark.parametrize("ssd", ["none", "evicted"])
def test_a_run_on_chunk_the_host_tier_alone_holds_is_erased(tmp_path: Path, ssd: str) -> None:
    # A reply's run-on filled a full chunk no chain names (tokens 108-111, past the 10 the
    # session kept): only its owner finds it, and the host tier kept none. With no SSD tier,
    # or once the SSD tier had evicted its record (the owner with it), it outlived the
    # session's erasure in host RAM (found by a review).
    other = list(range(200, 211))
    probe = make_planner(tmp_path / "probe")
    stride = probe.store.tiers[1].stride
    probe.close()
    planner = make_planner(tmp_path / "ssd", ssd_tier_bytes=0 if ssd == "none" else 8 * stride)
    try:
        run_turn(planner, "r1", [*TURN1, 110, 111, 112, 113], [7, 8, 9, 10], session="s1")
        run_turn(planner, "r2", other, [4, 5, 6], session="s2")
        planner.store.flush()
        planner.erasure.forget("s1", [TURN1]).result(10)
        kept = set(chain_hashes([other], CHUNK, "test-model"))
        left = {(tier.name, key.chunk_index, key.layer) for tier in planner.store.tiers
                for key in tier.keys() if key.prefix_hash not in kept}  # noqa: SIM118
        assert left == set()
        planner.store.check_integrity()
    finally:
        planner.close()


@pytest.mark.parametrize("background_saves", ["through", "checkpoint"])
def test_a_checkpoint_written_down_as_its_session_is_erased_is_erased_too(
        tmp_path: Path, background_saves: str) -> None:
    """A BE request of the session checkpointed, its step landing after the erasure waited
    for the write-downs: its chunks, on their way to SSD (pinned in the host tier), were
    missed in both tiers and kept for good."""
    from antiphon.tiering.keys import owner_tag
    from tests.test_tier_planner import admit, fake_worker_saves, run_step

    planner = make_planner(tmp_path / "ssd", background_saves=background_saves)
    try:
        tokens = [*TURN1, 110]
        admit(planner, TokenView("be", tokens, "sdel", background=True), [7, 8, 9])
        run_step(planner, [("be", 10)])
        planner.checkpoint("be", 10, [7, 8, 9])  # preempted: its copies run in this step
        meta = planner.build_metadata([])
        fake_worker_saves(planner, meta.checkpoints)
        planner.request_finished("be", 10, [7, 8, 9])  # the session deleted: aborted
        release = threading.Event()
        waits = planner.store.wait_for_write_downs
        calls = []

        def wait_then_the_step_lands() -> None:
            waits()
            calls.append(1)
            if len(calls) == 1:
                planner.store._write_down.submit(release.wait)  # the thread busy a while
                threading.Timer(0.3, release.set).start()
                planner.step_done({meta.step}, set())  # the scheduler's, meanwhile

        planner.store.wait_for_write_downs = wait_then_the_step_lands  # type: ignore[method-assign]
        planner.erasure.forget("sdel", [tokens]).result(20)
        planner.store.flush()
        tag = owner_tag("sdel")
        assert not planner.store.tiers[0].owned_by(tag)
        assert not planner.store.tiers[1].owned_by(tag)
    finally:
        planner.close()

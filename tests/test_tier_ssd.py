"""SSD tier: the slot file, write-behind, checksums, damaged records, restart."""

from __future__ import annotations

import gc
import os
import shutil
import threading
import time
from collections.abc import Iterator
from concurrent.futures import Future
from pathlib import Path

import pytest

from antiphon.tiering import slot_file as slot_file_module
from antiphon.tiering.keys import ChunkKey, prefix_hashes
from antiphon.tiering.slot_file import (
    FILE_HEADER_BYTES,
    FILE_NAME,
    RECORD_HEADER_BYTES,
    CorruptChunk,
    SlotFile,
    decode_record_header,
    stride_for,
)
from antiphon.tiering.ssd_tier import SsdTier
from antiphon.tiering.write_behind import WriteBehind

HASHES = prefix_hashes(list(range(64)), 8, "m")
SLOT = 100  # largest payload
STRIDE = stride_for(SLOT)  # what one entry is charged


def key(chunk: int = 0, layer: int = 0) -> ChunkKey:
    return ChunkKey("m", HASHES[chunk], chunk, layer)


def payload(chunk: int = 0, layer: int = 0, size: int = SLOT) -> bytes:
    return bytes((chunk * 31 + layer * 7 + i) % 256 for i in range(size))


def open_tier(directory: Path, num_slots: int = 10, **kwargs: object) -> SsdTier:
    return SsdTier(directory, num_slots * STRIDE, slot_bytes=SLOT, **kwargs)  # type: ignore[arg-type]


def damage(tier_dir: Path, slot: int, offset: int) -> None:
    """Flip one byte `offset` bytes into `slot` of the slot file."""
    with open(tier_dir / FILE_NAME, "r+b") as f:
        f.seek(FILE_HEADER_BYTES + slot * STRIDE + offset)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0xFF]))


@pytest.fixture
def ssd(tmp_path: Path) -> Iterator[SsdTier]:
    tier = open_tier(tmp_path / "kv")
    yield tier
    tier.close()


def test_stride_is_whole_pages() -> None:
    assert stride_for(100) == RECORD_HEADER_BYTES + 4096
    assert stride_for(98304) == RECORD_HEADER_BYTES + 98304
    assert stride_for(98305) == RECORD_HEADER_BYTES + 98304 + 4096


def test_round_trip_write_behind(ssd: SsdTier) -> None:
    future = ssd.put_async(key(0, 0), payload(0, 0))
    assert ssd.put(key(0, 1), payload(0, 1, size=40))  # a partial chunk: a shorter payload
    assert ssd.get(key(0, 0)) == payload(0, 0)  # served from memory or disk, whichever
    assert future.result(timeout=10) is True
    ssd.flush()
    slot = ssd.slot_of(key(0, 1))
    assert slot is not None
    record = ssd._file.read_header(slot)
    assert record is not None and record.key == key(0, 1) and record.payload_len == 40
    assert ssd.get(key(0, 1)) == payload(0, 1, size=40)
    assert ssd.used_bytes == 2 * STRIDE
    assert ssd.stats.hits == 2 and ssd.stats.bytes_in == SLOT + 40
    ssd.check_integrity()


def test_a_bytes_payload_is_queued_without_a_copy(tmp_path: Path) -> None:
    with open_tier(tmp_path) as tier:
        gate = threading.Event()
        tier._submit(lambda: gate.wait(10))  # hold the writer, so the payload stays queued
        data = payload()
        tier.put(key(0, 0), data)
        tier.put(key(0, 1), bytearray(payload(0, 1)))  # mutable: copied
        entries = dict(tier._index.items())
        assert entries[key(0, 0)].location.pending is data
        assert isinstance(entries[key(0, 1)].location.pending, bytes)
        gate.set()


def test_payload_larger_than_a_slot_is_refused(ssd: SsdTier) -> None:
    with pytest.raises(ValueError, match="does not fit"):
        ssd.put(key(0, 0), payload(size=SLOT + 1))
    assert not ssd.contains(key(0, 0)) and ssd.used_bytes == 0


def test_capacity_eviction_reuses_slots(ssd: SsdTier) -> None:
    for layer in range(12):
        assert ssd.put(key(0, layer), payload(0, layer))
    ssd.flush()
    assert ssd.stats.evictions == 2
    assert not ssd.contains(key(0, 0)) and not ssd.contains(key(0, 1))
    assert ssd._file.num_slots_on_disk == 10  # the evicted entries' slots were reused
    assert all(ssd.get(key(0, layer)) == payload(0, layer) for layer in range(2, 12))
    ssd.check_integrity()


def test_the_tier_keeps_the_disk_reserve_free_while_it_runs(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A budget larger than the disk: the slot file stops growing at the reserve, the tier
    evicts instead, and grows again when room comes back."""
    free = {"bytes": 1000 * STRIDE}  # the disk: the reserve plus room for 3 slots, then less
    monkeypatch.setattr("antiphon.tiering.ssd_tier._disk_free", lambda directory: free["bytes"])
    tier = open_tier(tmp_path / "kv", num_slots=10, min_free_disk_bytes=997 * STRIDE)
    try:
        assert tier.capacity_bytes == 3 * STRIDE  # capped at start already
        for layer in range(3):
            assert tier.put(key(0, layer), payload(0, layer))
            free["bytes"] -= STRIDE  # each slot's record takes its room on disk
        assert tier.put(key(0, 3), payload(0, 3))  # no room left above the reserve: evicts
        tier.flush()
        assert tier._file.num_slots_on_disk == 3 and tier.stats.evictions == 1
        assert not tier.contains(key(0, 0)) and tier.get(key(0, 3)) == payload(0, 3)
        free["bytes"] += 100 * STRIDE  # another program freed space: the budget applies again
        for layer in range(4, 12):
            assert tier.put(key(0, layer), payload(0, layer))
        tier.flush()
        assert tier.capacity_bytes == 10 * STRIDE and tier._file.num_slots_on_disk == 10
        tier.check_integrity()
    finally:
        tier.close()


def test_a_disk_without_room_above_the_reserve_stores_nothing(tmp_path: Path) -> None:
    reserve = shutil.disk_usage(tmp_path).free + (1 << 40)  # more than any disk here has
    tier = open_tier(tmp_path / "kv", min_free_disk_bytes=reserve)
    try:
        assert tier.capacity_bytes == 0 and not tier.put(key(), payload())
        assert tier.stats.refused == 1 and tier._file.num_slots_on_disk == 0
    finally:
        tier.close()
    with pytest.raises(ValueError, match="min_free_disk_bytes"):
        open_tier(tmp_path / "other", min_free_disk_bytes=-1)


def test_remove_clears_the_slot_and_a_restart_does_not_find_it(tmp_path: Path) -> None:
    with open_tier(tmp_path) as tier:
        tier.put(key(0, 0), payload())
        tier.put(key(0, 1), payload(0, 1))
        tier.flush()
        slot = tier.slot_of(key(0, 0))
        assert slot is not None and tier.remove(key(0, 0))
        tier.flush()
        assert tier._file.read_header(slot) is None
    with open_tier(tmp_path) as again:
        assert again.keys() == [key(0, 1)]


def test_remove_before_write_writes_nothing(tmp_path: Path) -> None:
    tier = open_tier(tmp_path)
    gate = threading.Event()
    tier._submit(lambda: gate.wait(10))  # hold the writer thread
    tier.put(key(1, 0), payload(1, 0))
    slot = tier.slot_of(key(1, 0))
    assert slot is not None and tier.remove(key(1, 0))
    gate.set()
    tier.flush()
    assert tier._file.num_slots_on_disk == 0 or tier._file.read_header(slot) is None
    tier.check_integrity()
    tier.close()


def test_a_freed_slot_reused_before_its_clear_keeps_the_new_record(tmp_path: Path) -> None:
    with open_tier(tmp_path, num_slots=1) as tier:
        tier.put(key(0, 0), payload(0, 0))
        tier.flush()
        gate = threading.Event()
        tier._submit(lambda: gate.wait(10))
        assert tier.remove(key(0, 0))  # queues the clear of slot 0
        assert tier.put(key(0, 1), payload(0, 1))  # takes slot 0 again, written after it
        gate.set()
        tier.flush()
        assert tier.get(key(0, 1)) == payload(0, 1)
        tier.check_integrity()


def test_a_write_that_fails_is_heard_as_an_eviction(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A record dropped because its write failed (a full disk) went unheard: the host tier
    ranked its copy as backed here and dropped its top layers first, and a checkpoint
    counting on it was not cut."""
    with open_tier(tmp_path, num_slots=4) as tier:
        heard: list[ChunkKey] = []
        tier.on_evict = heard.extend

        def no_space(*args: object, **kwargs: object) -> None:
            raise OSError(28, "No space left on device")

        monkeypatch.setattr(tier._file, "write", no_space)
        assert tier.put(key(0, 0), payload(0, 0))
        tier.flush()
        assert not tier.contains(key(0, 0)) and heard == [key(0, 0)]
        assert tier.stats.write_failed == 1
        monkeypatch.undo()
        tier.check_integrity()


def test_a_reused_slot_whose_new_write_fails_is_cleared_of_the_removed_record(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The clear of a removed key is skipped when its slot is taken again (the new record is
    to replace it); when that write failed, the removed record stayed, and a restart served
    it."""
    with open_tier(tmp_path, num_slots=1) as tier:
        tier.put(key(0, 0), payload(0, 0))
        tier.flush()
        gate = threading.Event()
        tier._submit(lambda: gate.wait(10))  # hold the writer
        removed, slot = tier.remove_later(key(0, 0))
        assert removed and slot == 0
        tier.clear_slots([slot])
        written = tier.put_async(key(0, 1), payload(0, 1))  # slot 0 again: clear skipped

        def no_space(*args: object, **kwargs: object) -> None:
            raise OSError(28, "No space left on device")

        monkeypatch.setattr(tier._file, "write", no_space)
        gate.set()
        assert written.result(5) is False
        tier.flush()
        monkeypatch.undo()
        assert tier._file.read_header(0) is None and tier.uncleared_slots == 0
    with open_tier(tmp_path, num_slots=1) as again:
        assert again.keys() == []


def test_an_erasure_done_leaves_no_record_a_restart_finds(tmp_path: Path) -> None:
    """A removed key's slot taken again after its clear was queued: the clear was skipped, so
    the erasure's barrier resolved with the removed record still on disk (its replacement
    queued behind the barrier): a crash then, or the replacement dropped unwritten, left it
    for a restart to serve."""
    with open_tier(tmp_path, num_slots=1) as tier:
        tier.put(key(0, 0), payload(0, 0), owner=b"deleted")
        tier.flush()
        gate = threading.Event()
        tier._submit(lambda: gate.wait(10))  # the writer busy with earlier saves
        removed, slot = tier.remove_later(key(0, 0))
        assert removed and slot == 0
        tier.clear_slots([slot])
        erased = tier.barrier()  # as the planner's erasure waits for it
        later = threading.Event()
        tier._submit(lambda: later.wait(10))  # the next save's write comes later
        assert tier.put(key(0, 1), payload(0, 1)) and tier.slot_of(key(0, 1)) == slot
        gate.set()
        assert erased.result(5) is True and tier.uncleared_slots == 0
        assert tier._file.read_header(0) is None  # a kill -9 now finds nothing
        assert tier.remove(key(0, 1))  # and the replacement dropped before its write
        later.set()
        tier.flush()
        tier.check_integrity()
    with open_tier(tmp_path, num_slots=1) as again:
        assert again.keys() == []


def test_a_shorter_record_leaves_nothing_of_the_one_before_it_in_its_slot(
        tmp_path: Path) -> None:
    """A deleted session's record whose slot a turn's short tail took before its clear ran
    (the clear then skipped: "its new record replaced the old"), or after its eviction: the
    tail wrote its own bytes only, and the rest of the deleted KV stayed in the file for good
    (found by a review). Also after a restart, where the tier cannot know what a slot held."""
    secret = b"SECRET-KV!" * (SLOT // 10)
    with open_tier(tmp_path, num_slots=1) as tier:
        tier.put(key(0, 0), secret, owner=b"deleted")
        tier.flush()
        removed, slot = tier.remove_later(key(0, 0))
        assert removed
        assert tier.put(key(1, 0), b"t" * 10) and tier.slot_of(key(1, 0)) == slot
        tier.flush()
        tier.clear_slots([slot])
        tier.barrier(sync=True).result(5)
        assert b"SECRET" not in (tmp_path / FILE_NAME).read_bytes()
        assert tier.get(key(1, 0)) == b"t" * 10
        tier.put(key(2, 0), secret)  # evicts the tail
        tier.flush()
    with open_tier(tmp_path, num_slots=1) as again:  # what the slot held, unknown now
        assert again.contains(key(2, 0))
        again.put(key(3, 0), b"u" * 10)  # evicts the full record
        again.flush()
        assert again.get(key(3, 0)) == b"u" * 10
    assert b"SECRET" not in (tmp_path / FILE_NAME).read_bytes()


@pytest.mark.parametrize(("where", "offset"), [("payload", RECORD_HEADER_BYTES + 50),
                                                ("header", 20), ("key", 60)])
def test_damaged_record_is_a_miss_and_cleared(ssd: SsdTier, where: str, offset: int) -> None:
    ssd.put(key(0, 0), payload(0, 0))
    ssd.flush()
    damage(ssd.directory, 0, offset)
    assert ssd.get(key(0, 0)) is None
    ssd.flush()
    assert not ssd.contains(key(0, 0)) and ssd._file.read_header(0) is None
    assert ssd.stats.corrupt_dropped == 1 and ssd.stats.misses == 1
    ssd.check_integrity()


def test_a_damaged_record_dropped_is_told_as_an_eviction(ssd: SsdTier) -> None:
    # (the planner cuts a checkpoint at a chunk no tier holds any more: told nothing, a
    # preemption table kept counting on a chunk the SSD tier had dropped)
    told: list[list[ChunkKey]] = []
    ssd.on_evict = told.append
    ssd.put(key(0, 0), payload(0, 0))
    ssd.flush()
    damage(ssd.directory, 0, RECORD_HEADER_BYTES + 50)
    assert ssd.get(key(0, 0)) is None
    assert told == [[key(0, 0)]]


def test_read_checks_the_key(tmp_path: Path) -> None:
    with open_tier(tmp_path) as tier:
        tier.put(key(0, 0), payload())
        tier.flush()
        with pytest.raises(CorruptChunk, match="another key"):
            tier._file.read(0, key(0, 1))
        with pytest.raises(CorruptChunk, match="empty"):
            tier._file.read(5, key(0, 0))


def test_restart_rebuilds_index_newest_record_first(tmp_path: Path) -> None:
    with open_tier(tmp_path) as tier:
        for layer in range(4):
            tier.put(key(2, layer), payload(2, layer))
        tier.flush()
        tier.put(key(3, 0), payload(3, 0))
        tier.flush()
    damage(tmp_path, 3, 20)  # key(2, 3)'s header
    # key(2, 2) written again in slot 5, later: the newer record wins, the older is superseded
    slot_file = SlotFile(tmp_path, SLOT)
    slot_file.write(5, key(2, 2), memoryview(payload(2, 2)), sequence=100)
    slot_file.close()
    (tmp_path / "README").write_text("left alone")

    with open_tier(tmp_path) as again:
        report = again.scan_report
        assert (report.num_loaded, report.num_corrupt_removed, report.num_superseded) == (
            4, 1, 1)
        assert again.stats.corrupt_dropped == 1
        assert again.slot_of(key(2, 2)) == 5
        stored = again.keys()
        assert sorted((k.chunk_index, k.layer) for k in stored) == [
            (2, 0), (2, 1), (2, 2), (3, 0)]
        assert all(again.get(key(2, layer)) == payload(2, layer) for layer in range(3))
        assert again.used_bytes == 4 * STRIDE
        assert again._file.read_header(3) is None  # the damaged header was cleared
        assert again.put(key(7, 0), payload(7, 0))  # the lowest free slot: the superseded one
        assert again.slot_of(key(7, 0)) == 2
        again.check_integrity()
        assert again._next_sequence > 100  # new writes outrank every record found
    assert (tmp_path / "README").exists()


@pytest.mark.parametrize("newer_first", [False, True])
def test_a_torn_newer_copy_leaves_the_older_whole_one_served(tmp_path: Path,
                                                              newer_first: bool) -> None:
    """A key stored twice (evicted, then saved again into another slot), its newer write torn
    by a crash: the start-up scan, which reads headers only, kept the torn copy and erased
    the whole one as superseded, and the first read then dropped the torn one."""
    old_slot, new_slot = (5, 2) if newer_first else (2, 5)
    slot_file = SlotFile(tmp_path, SLOT)
    slot_file.write(old_slot, key(2, 2), memoryview(payload(2, 2)), sequence=10)
    slot_file.write(new_slot, key(2, 2), memoryview(payload(2, 2)), sequence=20)
    slot_file.close()
    damage(tmp_path, new_slot, RECORD_HEADER_BYTES + 10)  # its payload, torn
    with open_tier(tmp_path) as tier:
        report = tier.scan_report
        assert (report.num_loaded, report.num_corrupt_removed, report.num_superseded) == (
            1, 1, 0)
        assert tier.slot_of(key(2, 2)) == old_slot
        assert tier.get(key(2, 2)) == payload(2, 2)
        assert tier._file.read_header(new_slot) is None  # the torn copy was cleared
        tier.check_integrity()
    with open_tier(tmp_path) as again:
        assert again.get(key(2, 2)) == payload(2, 2)


def test_restart_with_smaller_budget_and_payload_verification(tmp_path: Path) -> None:
    with open_tier(tmp_path) as tier:
        for layer in range(6):
            tier.put(key(4, layer), payload(4, layer))
    damage(tmp_path, 1, RECORD_HEADER_BYTES + 10)  # a payload: found only by verification
    with open_tier(tmp_path, num_slots=3, verify_on_start=True) as small:
        report = small.scan_report
        assert (report.num_loaded, report.num_corrupt_removed, report.num_over_capacity) == (
            2, 1, 3)
        stored = small.keys()
        assert sorted(k.layer for k in stored) == [0, 2]
        assert small._file.num_slots_on_disk == 3  # the file was cut to the new budget
        assert small.stats.evictions == 0
        small.check_integrity()


def test_another_slot_size_empties_the_file(tmp_path: Path) -> None:
    with open_tier(tmp_path) as tier:
        tier.put(key(0, 0), payload())
    with SsdTier(tmp_path, 10 * stride_for(2 * SLOT), slot_bytes=2 * SLOT) as other:
        assert other.scan_report.was_reset and other.keys() == []
        assert other.put(key(0, 0), payload(size=2 * SLOT))
        other.flush()
        other.check_integrity()


def test_records_of_another_model_are_not_served_and_their_slots_are_reused(
        tmp_path: Path) -> None:
    other = ChunkKey("m-old-weights", HASHES[0], 0, 0)
    with open_tier(tmp_path, model_id="m-old-weights") as tier:
        tier.put(other, payload(0, 0))
        tier.put(ChunkKey("m-old-weights", HASHES[1], 1, 0), payload(1, 0))
    with open_tier(tmp_path, num_slots=2, model_id="m") as tier:
        assert tier.scan_report.num_other_model == 2
        assert tier.keys() == [] and tier.get(other) is None
        assert tier.put(key(0, 0), payload(0, 0)) and tier.put(key(1, 0), payload(1, 0))
        tier.flush()
        assert tier.stats.evictions == 0  # both slots were free
        tier.check_integrity()
    with open_tier(tmp_path, num_slots=2) as every_model:  # None keeps every model's records
        stored = every_model.keys()
        assert sorted(k.chunk_index for k in stored) == [0, 1]
        assert every_model.scan_report.num_other_model == 0


@pytest.mark.parametrize("in_fs", [True, False], ids=["zeroed by the fs", "zeros written"])
def test_records_that_can_never_be_served_are_erased_bytes_and_all(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, in_fs: bool) -> None:
    """The erased slots read as zeros, and keep their disk blocks (the tier's free-space
    reserve counts every slot the file reaches as used)."""
    if not in_fs:  # a file system without ZERO_RANGE gets zeros written instead
        monkeypatch.setattr(slot_file_module, "_zero_range", lambda *_: False)
    with open_tier(tmp_path, model_id="m-old-weights") as tier:
        for index in range(3):
            tier.put(ChunkKey("m-old-weights", HASHES[index], index, 0), payload(index, 0))
    with open_tier(tmp_path, model_id="m") as tier:
        tier.put(key(0, 0), payload(0, 0))  # slot 0, reused: written after the erasure
        tier.flush()
    slot_file = SlotFile(tmp_path, SLOT)  # a superseded copy of key(0, 0) in slot 4
    slot_file.write(4, key(0, 0), memoryview(payload(0, 0)), sequence=1)
    slot_file.close()

    blocks = os.stat(tmp_path / "kv-slots.bin").st_blocks
    with open_tier(tmp_path, model_id="m") as tier:
        tier.flush()
        assert os.stat(tier.path).st_blocks >= blocks
        assert tier.scan_report.num_superseded == 1
        assert tier.get(key(0, 0)) == payload(0, 0)
        with open(tier.path, "rb") as f:
            for slot in (1, 2, 4):  # the old model's two left, and the older copy
                f.seek(tier._file.offset(slot))
                held = f.read(STRIDE)  # (the file may end inside the last slot)
                assert held and held == bytes(len(held)), slot
        tier.check_integrity()


def test_a_clear_the_disk_cannot_take_fails_and_the_tier_still_starts(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A full disk: a clear whose zeros were written short counted as done (the payload's
    bytes left behind), and a damaged header the start-up scan could not clear kept the SSD
    tier from starting at all."""
    with open_tier(tmp_path) as tier:
        tier.put(key(0, 0), payload(0, 0))
        tier.put(key(1, 0), payload(1, 0))
    damage(tmp_path, 1, 20)  # key(1, 0)'s header
    monkeypatch.setattr(slot_file_module, "_zero_range", lambda *_: False)
    monkeypatch.setattr(slot_file_module.os, "pwrite", lambda fd, data, offset: 100)
    with pytest.raises(OSError, match="short write"):
        slot_file = SlotFile(tmp_path, SLOT)
        try:
            slot_file.clear(0)
        finally:
            slot_file.close()
    with open_tier(tmp_path) as tier:  # starts, the damaged record left to a later clear
        assert tier.scan_report.num_corrupt_removed == 1 and tier.uncleared_slots == 1
        assert tier.get(key(0, 0)) == payload(0, 0)
        monkeypatch.undo()
        tier.clear_slots([])  # (an erasure's retry)
        tier.barrier().result(5)
        assert tier.uncleared_slots == 0 and tier._file.read_header(1) is None


def test_runs_of_neighbouring_slots() -> None:
    assert list(slot_file_module._runs([0, 1, 2, 5, 7, 8])) == [(0, 3), (5, 1), (7, 2)]
    assert list(slot_file_module._runs([])) == []


def test_files_of_the_old_format_are_removed(tmp_path: Path) -> None:
    shard = tmp_path / "3f"
    shard.mkdir()
    (shard / "3f9a-0-0.kv").write_bytes(b"old chunk file")
    (shard / "3f9a-0-1.kv.tmp").write_bytes(b"half-written")
    (tmp_path / "ab").mkdir()
    (tmp_path / "ab" / "notes.txt").write_text("not ours")
    with open_tier(tmp_path) as tier:
        assert tier.scan_report.num_legacy_removed == 2
    assert not shard.exists() and (tmp_path / "ab" / "notes.txt").exists()


def test_foreign_entries_in_the_folder_are_not_followed_or_fatal(tmp_path: Path) -> None:
    """A link named like an old shard had the .kv files of the folder it names deleted, and a
    folder named like a chunk file stopped the tier from starting."""
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "precious.kv").write_bytes(b"not ours")
    directory = tmp_path / "kv"
    directory.mkdir()
    (directory / "zz").symlink_to(elsewhere)
    (directory / "ab" / "notes.kv").mkdir(parents=True)
    (directory / "gx").mkdir()  # not a shard's name (hexadecimal)
    (directory / "gx" / "index.kv").write_bytes(b"not ours")
    with open_tier(directory) as tier:
        assert tier.scan_report.num_legacy_removed == 0
    assert (elsewhere / "precious.kv").exists() and (directory / "ab" / "notes.kv").is_dir()
    assert (directory / "gx" / "index.kv").exists()


def test_one_tier_per_directory(tmp_path: Path) -> None:
    with open_tier(tmp_path), pytest.raises(RuntimeError, match="in use"):
        open_tier(tmp_path)
    open_tier(tmp_path).close()  # free again after close


def test_a_failed_write_drops_the_entry(tmp_path: Path) -> None:
    """A real write failure: the process's file-size limit stops the file growing."""
    import resource
    import signal

    with open_tier(tmp_path) as tier:
        assert tier.put(key(0, 0), payload())
        tier.flush()
        limit = FILE_HEADER_BYTES + STRIDE  # room for slot 0 only
        previous_handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        previous_limit = resource.getrlimit(resource.RLIMIT_FSIZE)
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, previous_limit[1]))
        try:
            future = tier.put_async(key(0, 1), payload(0, 1))  # slot 1: past the limit
            assert future.result(timeout=10) is False
        finally:
            resource.setrlimit(resource.RLIMIT_FSIZE, previous_limit)
            signal.signal(signal.SIGXFSZ, previous_handler)
        assert not tier.contains(key(0, 1)) and tier.get(key(0, 0)) == payload()
        tier.check_integrity()
        assert tier.put(key(0, 1), payload(0, 1))  # the slot went back to the free list
        tier.flush()
        assert tier.get(key(0, 1)) == payload(0, 1)


def test_the_writer_thread_runs_at_the_nice_value_it_was_given(tmp_path: Path) -> None:
    own = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    with open_tier(tmp_path, writer_nice=19) as tier:
        tier.put(key(0, 0), payload())
        tier.flush()
        assert tier._file.read(0, key(0, 0)) == payload()
        assert tier._writer is not None
        writer = tier._writer._thread.native_id
        assert writer is not None and os.getpriority(os.PRIO_PROCESS, writer) == 19
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == own  # untouched


def test_record_header_round_trip_and_empty_page() -> None:
    from antiphon.tiering.slot_file import encode_record_header

    page = encode_record_header(key(1, 2), memoryview(payload()), 7)
    assert len(page) == RECORD_HEADER_BYTES
    record = decode_record_header(page)
    assert record is not None and (record.key, record.payload_len, record.sequence) == (
        key(1, 2), SLOT, 7)
    assert decode_record_header(bytes(RECORD_HEADER_BYTES)) is None
    with pytest.raises(ValueError, match="does not fit"):
        encode_record_header(ChunkKey("m" * 5000, HASHES[0], 0, 0), memoryview(b""), 1)


def test_a_record_header_keeps_its_owner_and_one_written_before_owners_reads_as_none(
        ) -> None:
    import struct

    from antiphon.tiering.slot_file import _RECORD, _RECORD_MAGIC, check_of, encode_record_header

    page = encode_record_header(key(1, 2), memoryview(payload()), 7, b"o" * 16)
    record = decode_record_header(page)
    assert record is not None and (record.key, record.owner) == (key(1, 2), b"o" * 16)
    damaged = bytearray(page)
    damaged[_RECORD.size + 1 + len(HASHES[1]) + 3] ^= 0xFF  # a byte of the owner
    with pytest.raises(CorruptChunk, match="header checksum"):
        decode_record_header(bytes(damaged))
    # format 3 before owners: the same fields, padding where owner_len is, no owner
    fixed = _RECORD.pack(_RECORD_MAGIC, 3, 1, len(HASHES[1]), 0, 1, 2, SLOT, 7,
                         check_of(payload()), 0)
    body = fixed[:-4] + b"m" + HASHES[1]
    old = fixed[:-4] + struct.pack("<I", check_of(body)) + b"m" + HASHES[1]
    old += bytes(RECORD_HEADER_BYTES - len(old))
    record = decode_record_header(old)
    assert record is not None and (record.key, record.owner) == (key(1, 2), b"")
    assert encode_record_header(key(1, 2), memoryview(payload()), 7) == old
    with pytest.raises(ValueError, match="owner tag"):
        encode_record_header(key(1, 2), memoryview(b""), 1, b"o" * 65)


def test_the_keys_of_an_owner_are_found_also_after_a_restart(tmp_path: Path) -> None:
    tier = open_tier(tmp_path / "kv", num_slots=4)
    a, b = b"a" * 16, b"b" * 16
    try:
        assert tier.put(key(0, 0), payload(0, 0), owner=a)
        assert tier.put(key(0, 1), payload(0, 1), owner=a)
        assert tier.put(key(1, 0), payload(1, 0), owner=b)
        assert tier.put(key(2, 0), payload(2, 0))
        assert tier.put(key(0, 0), payload(0, 0), owner=b)  # stored already: stays a's
        assert set(tier.owned_by(a)) == {key(0, 0), key(0, 1)}
        assert tier.owned_by(b"") == []
        tier.flush()
    finally:
        tier.close()
    tier = open_tier(tmp_path / "kv", num_slots=4)
    try:
        assert set(tier.owned_by(a)) == {key(0, 0), key(0, 1)}
        assert tier.owned_by(b) == [key(1, 0)]
        assert tier.remove(key(0, 0))
        assert tier.put(key(3, 0), payload(3, 0))
        assert tier.put(key(4, 0), payload(4, 0))  # evicts the oldest: key(0, 1)
        assert tier.owned_by(a) == []
        tier.check_integrity()
    finally:
        tier.close()


def test_concurrent_reads_never_see_another_keys_bytes(tmp_path: Path) -> None:
    """Readers race a producer that keeps evicting and reusing slots (4 slots, 24 keys): every
    read is a miss or the exact payload of the key asked for, and no read counts as corrupt."""
    keys = [key(chunk, layer) for chunk in range(8) for layer in range(3)]
    stop = threading.Event()
    errors: list[str] = []

    def read() -> None:
        index = 0
        while not stop.is_set():
            k = keys[index % len(keys)]
            data = tier.get(k)
            if data is not None and bytes(data) != payload(k.chunk_index, k.layer):
                errors.append(f"{k}: wrong bytes")
            index += 7

    with open_tier(tmp_path, num_slots=4, max_pending_writes=2) as tier:
        readers = [threading.Thread(target=read) for _ in range(3)]
        for thread in readers:
            thread.start()
        try:
            for round_ in range(60):
                for k in keys[round_ % 3::3]:
                    tier.put(k, payload(k.chunk_index, k.layer))
                if round_ % 10 == 0:
                    tier.flush()
        finally:
            stop.set()
            for thread in readers:
                thread.join()
        tier.flush()
        assert not errors, errors[:5]
        assert tier.stats.corrupt_dropped == 0
        assert tier.stats.hits > 0 and tier.stats.evictions > 0
        tier.check_integrity()


def test_a_failed_read_is_a_miss_that_keeps_the_record(
        ssd: SsdTier, monkeypatch: pytest.MonkeyPatch) -> None:
    # An I/O error is not damage: the record stays, and reads again once the disk does.
    assert ssd.put(key(0, 0), payload(0, 0))
    ssd.flush()

    def failing(slot: int, expected: ChunkKey) -> memoryview:
        raise OSError(5, "Input/output error")

    with monkeypatch.context() as patched:
        patched.setattr(ssd._file, "read", failing)
        assert ssd.get(key(0, 0)) is None
    assert ssd.contains(key(0, 0))
    assert ssd.get(key(0, 0)) == payload(0, 0)
    ssd.check_integrity()


def _tracked_objects() -> int:
    """How many objects Python's garbage collector tracks (a full collection visits each)."""
    gc.collect()
    return len(gc.get_objects())


def test_a_record_leaves_the_garbage_collector_few_objects_to_track(tmp_path: Path) -> None:
    """The engine's heap holds the index entry of every record the tier has, hundreds of
    thousands: the future of each record's write, kept with its entry, was ten objects more to
    track, and a full collection took ten times as long."""
    keys = [key(chunk, layer) for chunk in range(len(HASHES)) for layer in range(8)]
    tier = open_tier(tmp_path / "kv", num_slots=len(keys))
    before = _tracked_objects()
    for k in keys:
        assert tier.put(k, payload())
    tier.flush()
    # its index entry and slot (and a few objects of the writer thread's, once)
    assert _tracked_objects() - before <= 2 * len(keys) + 32
    tier.close()
    before = _tracked_objects()
    tier = open_tier(tmp_path / "kv", num_slots=len(keys))  # a restart rebuilds the index
    assert len(tier.keys()) == len(keys)
    assert _tracked_objects() - before <= 3 * len(keys) + 32  # and the key it read back
    tier.close()


def test_a_job_submitted_as_the_writer_closes_runs_or_is_refused() -> None:
    """A submit that passed the closed check as `close` ran put its job behind the writer's
    end: the job never ran, its future never resolved, and a `flush` after it (an erasure's
    wait at shutdown) blocked for good (found by a review)."""
    writer = WriteBehind("test", max_pending=4)
    putting, may_put = threading.Event(), threading.Event()
    put = writer._queue.put

    def slow_put(item: object) -> None:  # the submitting thread loses the core here
        if item is not None:
            putting.set()
            may_put.wait(5)
        put(item)  # type: ignore[arg-type]

    writer._queue.put = slow_put  # type: ignore[method-assign]
    submitted: list[Future[bool]] = []
    submitter = threading.Thread(target=lambda: submitted.append(writer.submit(lambda: True)))
    submitter.start()
    assert putting.wait(5)
    closer = threading.Thread(target=writer.close)
    closer.start()
    time.sleep(0.2)
    may_put.set()
    submitter.join(5)
    closer.join(5)
    assert not closer.is_alive()
    assert submitted[0].result(2) is True
    with pytest.raises(RuntimeError, match="closed"):
        writer.submit(lambda: True)


def test_a_short_record_takes_its_whole_slot_on_disk(tmp_path: Path) -> None:
    """The tier counts every slot the file reaches as used disk: a short record (a turn's
    tail) into a new slot, and the slots the file skipped before it, get all their blocks,
    so no hole is left for a later, longer record to fill past the free-space reserve."""
    with SlotFile(tmp_path, SLOT) as slot_file:
        slot_file.write(3, key(), memoryview(b"tail"), sequence=1)
        assert os.fstat(slot_file._fd).st_blocks * 512 >= slot_file.offset(4)
        assert slot_file.read(3, key()) == b"tail"
        slot_file.write(3, key(), memoryview(payload()), sequence=2)  # longer, then shorter
        slot_file.write(3, key(), memoryview(b"t2"), sequence=3)
        assert slot_file.read(3, key()) == b"t2"
        with open(slot_file.path, "rb") as f:
            f.seek(slot_file.offset(3) + RECORD_HEADER_BYTES + 2)
            assert f.read(SLOT - 2) == bytes(SLOT - 2)  # the longer record's bytes are gone
        slot_file.truncate(2)
        slot_file.write(5, key(1), memoryview(b"x"), sequence=4)  # regrown after a truncate
        assert os.fstat(slot_file._fd).st_blocks * 512 >= slot_file.offset(6)


def test_short_records_leave_the_tier_no_holes_past_its_reserve(tmp_path: Path) -> None:
    """Disk the tier holds is disk it has allocated: after short puts, the file's blocks
    cover every slot the tier charged, so the free space it reads is really free."""
    slot_bytes = 8 * 4096  # a chunk-layer of many pages, whose short tails leave most bare
    with SsdTier(tmp_path / "kv", 8 * stride_for(slot_bytes), slot_bytes=slot_bytes) as tier:
        for chunk in range(6):
            tier.put(key(chunk), payload(chunk, size=3))
        tier.flush()
        assert os.stat(tier.path).st_blocks * 512 >= tier._file.offset(tier._file_slots)


@pytest.mark.parametrize("refused", [{"capacity_bytes": -1}, {"max_pending_writes": 0}])
def test_a_refused_argument_leaves_the_folder_free(tmp_path: Path, refused: dict[str, int]) -> None:
    """A tier refused for its arguments releases the slot file and the folder's lock: the
    next tier on the folder opens."""
    arguments: dict[str, int] = {"capacity_bytes": 4 * STRIDE, "max_pending_writes": 8, **refused}
    with pytest.raises(ValueError):
        SsdTier(tmp_path, arguments["capacity_bytes"], slot_bytes=SLOT,
                max_pending_writes=arguments["max_pending_writes"])
    with open_tier(tmp_path) as tier:
        tier.put(key(), payload())


def test_a_file_system_without_fallocate_keeps_its_holes_and_is_not_asked_again(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """(glibc's posix_fallocate writes a byte into every block where the file system cannot
    allocate: two system calls per 4 KiB, round trips on NFS.) Turned down once, it is not
    asked again, and records are written all the same."""
    import errno

    calls: list[int] = []

    def cannot(fd: int, mode: int, offset: int, length: int) -> int:
        calls.append(mode)
        return errno.EOPNOTSUPP

    monkeypatch.setattr(slot_file_module, "_fallocate", cannot)
    with SlotFile(tmp_path, SLOT) as slot_file:
        for slot in range(3):
            slot_file.write(slot, key(slot), memoryview(payload(slot)), sequence=slot + 1)
        assert [slot_file.read(slot, key(slot)) for slot in range(3)] == [
            payload(slot) for slot in range(3)]
    assert calls == [0]

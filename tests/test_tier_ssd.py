"""SSD tier: write-behind files, checksums, corrupt-file handling, restart."""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from antiphon.tiering.chunk_file import CorruptChunk, header_bytes, read_chunk_file
from antiphon.tiering.keys import ChunkKey, prefix_hashes
from antiphon.tiering.ssd_tier import SsdTier

HASHES = prefix_hashes(list(range(64)), 8, "m")


def key(chunk: int = 0, layer: int = 0) -> ChunkKey:
    return ChunkKey("m", HASHES[chunk], chunk, layer)


def payload(chunk: int = 0, layer: int = 0, size: int = 100) -> bytes:
    return bytes((chunk * 31 + layer * 7 + i) % 256 for i in range(size))


FILE_BYTES = header_bytes(key()) + 100  # one 100-byte chunk-layer on disk


@pytest.fixture
def ssd(tmp_path: Path) -> Iterator[SsdTier]:
    tier = SsdTier(tmp_path / "kv", capacity_bytes=10 * FILE_BYTES)
    yield tier
    tier.close()


def test_round_trip_write_behind(ssd: SsdTier) -> None:
    future = ssd.put_async(key(0, 0), payload(0, 0))
    assert ssd.put(key(0, 1), payload(0, 1))
    assert ssd.get(key(0, 0)) == payload(0, 0)  # served from memory or disk, whichever
    assert future.result(timeout=10) is True
    ssd.flush()
    path = ssd.path_for(key(0, 1))
    assert path.exists() and path.parent.name == path.name[:2]
    assert read_chunk_file(path, key(0, 1)) == payload(0, 1)
    assert ssd.get(key(0, 1)) == payload(0, 1)
    assert ssd.used_bytes == 2 * FILE_BYTES
    assert ssd.stats.hits == 2 and ssd.stats.bytes_in == 200
    ssd.check_integrity()


def test_capacity_eviction_deletes_files(ssd: SsdTier) -> None:
    for layer in range(12):
        assert ssd.put(key(0, layer), payload(0, layer))
    ssd.flush()
    assert ssd.stats.evictions == 2
    assert not ssd.contains(key(0, 0)) and not ssd.path_for(key(0, 0)).exists()
    files = list((ssd.directory).glob("*/*.kv"))
    assert len(files) == 10
    assert ssd.remove(key(0, 5)) and not ssd.path_for(key(0, 5)).exists()
    ssd.check_integrity()


def test_remove_before_write_leaves_no_file(tmp_path: Path) -> None:
    tier = SsdTier(tmp_path, capacity_bytes=10 * FILE_BYTES)
    gate = threading.Event()
    tier._writer.submit(lambda: gate.wait(10))  # hold the writer thread
    tier.put(key(1, 0), payload(1, 0))
    assert tier.remove(key(1, 0))
    gate.set()
    tier.flush()
    assert not tier.path_for(key(1, 0)).exists()
    tier.check_integrity()
    tier.close()


@pytest.mark.parametrize("damage", ["flip_payload", "truncate", "flip_header"])
def test_corrupt_file_is_a_miss_and_removed(ssd: SsdTier, damage: str) -> None:
    ssd.put(key(0, 0), payload(0, 0))
    ssd.flush()
    path = ssd.path_for(key(0, 0))
    data = bytearray(path.read_bytes())
    if damage == "flip_payload":
        data[-1] ^= 0x01
    elif damage == "flip_header":
        data[20] ^= 0x01
    else:
        data = data[:-10]
    path.write_bytes(bytes(data))
    assert ssd.get(key(0, 0)) is None
    assert not path.exists() and not ssd.contains(key(0, 0))
    assert ssd.stats.corrupt_dropped == 1 and ssd.stats.misses == 1
    ssd.check_integrity()


def test_key_mismatch_is_corrupt(tmp_path: Path) -> None:
    with SsdTier(tmp_path, capacity_bytes=10 * FILE_BYTES) as tier:
        tier.put(key(0, 0), payload())
        tier.flush()
        path = tier.path_for(key(0, 0))
    with pytest.raises(CorruptChunk, match="another key"):
        read_chunk_file(path, key(0, 1))


def test_restart_rebuilds_index_and_cleans_up(tmp_path: Path) -> None:
    directory = tmp_path / "kv"
    with SsdTier(directory, capacity_bytes=10 * FILE_BYTES) as tier:
        for layer in range(4):
            tier.put(key(2, layer), payload(2, layer))
    shard = tier.path_for(key(2, 0)).parent
    (shard / "junk.kv.tmp").write_bytes(b"half-written")
    truncated = tier.path_for(key(2, 3))
    truncated.write_bytes(truncated.read_bytes()[:-1])
    garbage = tier.path_for(key(3, 0))
    garbage.parent.mkdir(exist_ok=True)
    garbage.write_bytes(b"not a chunk file at all, just text")
    misplaced = directory / "00" / tier.path_for(key(2, 2)).name
    misplaced.parent.mkdir(exist_ok=True)
    misplaced.write_bytes(tier.path_for(key(2, 2)).read_bytes())
    (directory / "README").write_text("left alone")

    with SsdTier(directory, capacity_bytes=10 * FILE_BYTES) as again:
        report = again.scan_report
        assert (report.num_loaded, report.num_temp_removed, report.num_corrupt_removed) == (
            3, 1, 3)
        assert again.stats.corrupt_dropped == 3
        stored = again.keys()
        assert sorted(k.layer for k in stored) == [0, 1, 2]
        assert all(again.get(key(2, layer)) == payload(2, layer) for layer in range(3))
        assert again.used_bytes == 3 * FILE_BYTES
        again.check_integrity()
    remaining = sorted(p.name for p in directory.rglob("*") if p.is_file())
    assert len(remaining) == 3 + 2  # three chunk files, README and .lock
    assert (directory / "README").exists()


def test_restart_with_smaller_budget_and_payload_verification(tmp_path: Path) -> None:
    with SsdTier(tmp_path, capacity_bytes=10 * FILE_BYTES) as tier:
        for layer in range(6):
            tier.put(key(4, layer), payload(4, layer))
    flipped = tier.path_for(key(4, 5))
    data = bytearray(flipped.read_bytes())
    data[-1] ^= 0xFF
    flipped.write_bytes(bytes(data))
    with SsdTier(tmp_path, capacity_bytes=3 * FILE_BYTES, verify_on_start=True) as small:
        assert small.scan_report.num_corrupt_removed == 1
        assert small.scan_report.num_over_capacity == 2
        assert len(small.keys()) == 3 and small.stats.evictions == 0
        small.check_integrity()
    assert len(list(tmp_path.glob("*/*.kv"))) == 3


def test_one_tier_per_directory(tmp_path: Path) -> None:
    with SsdTier(tmp_path, capacity_bytes=FILE_BYTES), pytest.raises(RuntimeError, match="in use"):
        SsdTier(tmp_path, capacity_bytes=FILE_BYTES)
    SsdTier(tmp_path, capacity_bytes=FILE_BYTES).close()  # free again after close


def test_write_failure_drops_the_entry(tmp_path: Path) -> None:
    with SsdTier(tmp_path, capacity_bytes=10 * FILE_BYTES) as tier:
        blocker = tier.path_for(key(5, 0)).parent
        blocker.write_bytes(b"a file where the shard folder should be")
        future = tier.put_async(key(5, 0), payload())
        assert future.result(timeout=10) is False
        assert not tier.contains(key(5, 0))
        tier.check_integrity()
        os.unlink(blocker)


def test_the_writer_thread_runs_at_the_nice_value_it_was_given(tmp_path: Path) -> None:
    own = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    with SsdTier(tmp_path, capacity_bytes=10 * FILE_BYTES, writer_nice=19) as tier:
        tier.put(key(0, 0), payload())
        tier.flush()
        assert read_chunk_file(tier.path_for(key(0, 0)), key(0, 0)) == payload()
        writer = tier._writer._thread.native_id
        assert writer is not None and os.getpriority(os.PRIO_PROCESS, writer) == 19
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == own  # untouched

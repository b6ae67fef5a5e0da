"""Host tier: slot allocator, shared-memory arena (in and across processes), host tier."""

from __future__ import annotations

import gc
import multiprocessing
import os
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from antiphon.tiering.eviction import LayerPriorityPolicy
from antiphon.tiering.host_arena import HostArena
from antiphon.tiering.host_tier import HostTier
from antiphon.tiering.keys import ChunkKey
from antiphon.tiering.slots import SlotAllocator

SLOT = 64


def key(prefix: str, chunk: int = 0, layer: int = 0) -> ChunkKey:
    return ChunkKey("m", prefix.encode(), chunk, layer)


def shm_name() -> str:
    return f"antiphon-test-{uuid.uuid4().hex[:12]}"


@pytest.fixture
def tier() -> Iterator[HostTier]:
    tier = HostTier.create(shm_name(), capacity_bytes=4 * SLOT, slot_bytes=SLOT)
    yield tier
    tier.close()


def test_slot_allocator() -> None:
    slots = SlotAllocator(3)
    taken = [slots.allocate() for _ in range(3)]
    assert sorted(taken) == [0, 1, 2] and not slots.can_allocate()
    with pytest.raises(MemoryError):
        slots.allocate()
    slots.free(1)
    with pytest.raises(ValueError):
        slots.free(1)  # double free
    with pytest.raises(ValueError):
        slots.free(7)
    assert slots.allocate() == 1  # the just-freed slot is reused first
    slots.check_integrity()


def test_arena_geometry_and_bounds() -> None:
    name = shm_name()
    with HostArena.create(name, num_slots=3, slot_bytes=SLOT) as arena:
        arena.write(2, b"abc", offset=5)
        assert arena.read(2, 8) == b"\0" * 5 + b"abc"
        with pytest.raises(ValueError):
            arena.write(0, b"x" * (SLOT + 1))
        with pytest.raises(IndexError):
            arena.read(3)
        with HostArena.attach(name) as other:
            assert (other.num_slots, other.slot_bytes) == (3, SLOT)
            assert other.read(2, 8) == b"\0" * 5 + b"abc"
            other.slot_array(1, np.float32)[:] = 1.5  # writes through a numpy view
            other.check_integrity()
        assert np.all(arena.slot_array(1, np.float32, (4, 4)) == 1.5)
    with pytest.raises(FileNotFoundError):
        HostArena.attach(name)  # the owner unlinked it on close


def _resident_bytes(name: str) -> int:
    """Bytes of shared-memory segment `name` mapped into this process (its `Rss`)."""
    total, inside = 0, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        if "-" in line.split(" ", 1)[0] and ":" not in line.split(" ", 1)[0]:
            inside = line.endswith(f"/dev/shm/{name}")
        elif inside and line.startswith("Rss:"):
            total += int(line.split()[1]) * 1024
    return total


@pytest.mark.skipif(not Path("/proc/self/smaps").exists(), reason="Linux only")
def test_prefaulting_maps_every_page_and_changes_no_byte() -> None:
    """tmpfs zeroes an arena page at its first touch (a VM may only back it then): a step's
    saves into untouched slots took 29-108 ms. The owner touches every page on a background
    thread instead, and the bytes stay as they were."""
    name, slot_bytes = shm_name(), 1 << 16
    with HostArena.create(name, num_slots=128, slot_bytes=slot_bytes) as arena:
        arena.write(7, b"kept")
        assert _resident_bytes(name) < arena.size_bytes // 2  # (not touched yet)
        arena.prefault_in_background()
        deadline = time.monotonic() + 60
        while _resident_bytes(name) < arena.size_bytes and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _resident_bytes(name) >= arena.size_bytes
        assert arena.read(7, 5) == b"kept\0"
        assert arena.read(100) == bytes(slot_bytes)
    big = shm_name()
    with HostArena.create(big, num_slots=1024, slot_bytes=slot_bytes) as arena:
        arena.prefault_in_background()  # closed at once, while it runs: it stops first
    with pytest.raises(FileNotFoundError):
        HostArena.attach(big)


def test_arena_larger_than_shared_memory_fails_at_creation() -> None:
    """The memory is reserved when the arena is created: one larger than /dev/shm's room fails
    there with a typed error naming the fix, not later with SIGBUS in the writing process, and
    leaves no segment behind."""
    from antiphon.tiering.host_arena import ArenaMemoryError

    room = os.statvfs("/dev/shm")
    slots = room.f_blocks * room.f_frsize // SLOT + 1024  # more than the whole file system
    name = shm_name()
    with pytest.raises(ArenaMemoryError, match="--host-tier-bytes"):
        HostArena.create(name, num_slots=slots, slot_bytes=SLOT)
    with pytest.raises(FileNotFoundError):
        HostArena.attach(name)


def test_arena_refuses_foreign_segment_and_cleans_stale() -> None:
    from multiprocessing.shared_memory import SharedMemory

    name = shm_name()
    foreign = SharedMemory(name=name, create=True, size=8192)
    try:
        with pytest.raises(ValueError, match="not a host arena"):
            HostArena.attach(name)
        with pytest.raises(FileExistsError):
            HostArena.create(name, 1, SLOT)
    finally:
        foreign.close()
    assert HostArena.unlink_stale(name)
    assert not HostArena.unlink_stale(name)


def test_round_trip_and_eviction(tier: HostTier) -> None:
    for i in range(6):
        assert tier.put(key(f"k{i}"), bytes([i]) * (SLOT - i))
        tier.check_integrity()
    assert tier.used_bytes == tier.capacity_bytes == 4 * SLOT
    assert tier.stats.evictions == 2
    assert tier.get(key("k0")) is None
    assert tier.get(key("k5")) == bytes([5]) * (SLOT - 5)
    assert tier.stats.hits == 1 and tier.stats.misses == 1
    with pytest.raises(ValueError):
        tier.put(key("big"), b"x" * (SLOT + 1))
    assert tier.remove(key("k5")) and not tier.contains(key("k5"))
    tier.check_integrity()


def test_pin_all_pins_every_key_or_none(tier: HostTier) -> None:
    """A turn pins every layer of a chunk it loads, under one lock: all of them, or none when
    one is gone (the chunk is then recomputed, and nothing of it stays held)."""
    for layer in range(3):
        assert tier.put(key("a", layer=layer), b"x")
    layers = [key("a", layer=layer) for layer in range(3)]
    assert not tier.pin_all([*layers, key("a", layer=3)])
    assert tier.remove(layers[0])  # nothing was left pinned
    assert tier.put(layers[0], b"x")
    assert tier.pin_all(layers)
    assert not tier.remove(layers[1])
    tier.check_integrity()
    tier.unpin_all(layers)
    assert tier.remove(layers[1])
    tier.check_integrity()


def test_reserve_commit_abort(tier: HostTier) -> None:
    slot = tier.reserve(key("a"))
    assert slot is not None
    assert not tier.contains(key("a")) and tier.is_reserved(key("a"))
    assert tier.reserve(key("a")) is None  # already being written
    tier.arena.write(slot, b"written elsewhere")
    tier.check_integrity()
    assert tier.commit(key("a"), len(b"written elsewhere"), pin=True)
    assert tier.get(key("a")) == b"written elsewhere"
    assert tier.slot_of(key("a")) == slot
    assert tier.reserve(key("a")) is None  # already stored
    other = tier.reserve(key("b"))
    assert other is not None and other != slot
    tier.abort(key("b"))
    assert not tier.commit(key("b"))  # aborted
    tier.check_integrity()
    for i in range(3):
        assert tier.reserve(key(f"r{i}")) is not None
    assert tier.reserve(key("full")) is None  # 1 pinned + 3 reserved: nothing evictable
    assert tier.stats.refused == 1
    tier.unpin(key("a"))
    assert tier.reserve(key("full")) is not None  # evicts "a"
    assert not tier.contains(key("a"))
    tier.check_integrity()


def test_a_short_entry_leaves_nothing_of_the_one_before_it_in_its_slot() -> None:
    """A turn's tail (a short entry) in the slot of an evicted full chunk-layer kept the
    rest of that one's KV in shared memory, also after its session's deletion; and removing
    the tail zeroed only its own bytes (found by a review)."""
    secret = b"SECRET-KV!" * (SLOT // 10) + b"SECRET"[:SLOT % 10]
    tier = HostTier.create(shm_name(), capacity_bytes=SLOT, slot_bytes=SLOT)
    try:
        assert tier.put(key("deleted"), secret, owner=b"deleted")
        assert tier.put(key("tail"), b"t" * 20, owner=b"other")  # evicts it, same slot
        assert tier.owned_by(b"deleted") == [] and tier.get(key("tail")) == b"t" * 20
        assert tier.arena.read(0) == b"t" * 20 + bytes(SLOT - 20)
        slot = tier.reserve(key("saved"))  # the save path: evicts the tail
        assert slot == 0
        tier.arena.write(slot, b"s" * 10)
        assert tier.commit(key("saved"), 10)
        assert tier.arena.read(0) == b"s" * 10 + bytes(SLOT - 10)
        assert tier.remove(key("saved"))
        assert tier.arena.read(0) == bytes(SLOT)
        tier.check_integrity()
    finally:
        tier.close()


def test_layer_priority_in_host_tier() -> None:
    tier = HostTier.create(shm_name(), 3 * SLOT, SLOT, policy=LayerPriorityPolicy())
    try:
        for layer in range(3):
            tier.put(key("s", 0, layer), b"x")
        tier.put(key("t", 0, 0), b"y")
        stored = tier.keys()
        assert [k.layer for k in stored if k.prefix_hash == b"s"] == [0, 1]
        tier.check_integrity()
    finally:
        tier.close()


def _worker(name: str, read_slot: int, write_slot: int, out: multiprocessing.Queue) -> None:
    """Child process: attach by name, read one slot, fill another."""
    arena = HostArena.attach(name)
    out.put(arena.read(read_slot, 11))
    arena.write(write_slot, b"from child " + bytes(range(32)))
    arena.close()


def test_cross_process_slots(tier: HostTier) -> None:
    assert tier.put(key("parent"), b"from parent", pin=True)
    read_slot = tier.slot_of(key("parent"))
    write_slot = tier.reserve(key("child"))
    assert read_slot is not None and write_slot is not None
    ctx = multiprocessing.get_context("spawn")
    out: multiprocessing.Queue = ctx.Queue()
    child = ctx.Process(target=_worker, args=(tier.arena.name, read_slot, write_slot, out))
    child.start()
    assert out.get(timeout=60) == b"from parent"
    child.join(60)
    assert child.exitcode == 0
    payload = b"from child " + bytes(range(32))
    assert tier.commit(key("child"), len(payload))
    assert tier.get(key("child")) == payload
    tier.unpin(key("parent"))
    tier.check_integrity()
    # The child's exit must not have unlinked the segment.
    with HostArena.attach(tier.arena.name) as again:
        assert again.read(write_slot, len(payload)) == payload


def test_arenas_of_dead_processes_are_removed_and_live_ones_kept() -> None:
    import signal
    import subprocess
    import sys

    from antiphon.tiering.host_arena import (
        ARENA_PREFIX,
        default_arena_name,
        remove_orphaned_arenas,
    )

    # a process killed with its resource tracker (a process group's kill): untracked arenas
    dead = subprocess.Popen(
        [sys.executable, "-c", "import os, signal\n"
         "from antiphon.tiering.host_arena import ARENA_PREFIX, HostArena\n"
         "for suffix in ('', '-0badf00d'):\n"
         f"    HostArena.create(f'{{ARENA_PREFIX}}{{os.getpid()}}{{suffix}}', 1, {SLOT}, "
         "tracked=False)\n"
         "os.kill(os.getpid(), signal.SIGKILL)"])
    assert dead.wait() == -signal.SIGKILL
    orphans = {f"{ARENA_PREFIX}{dead.pid}", f"{ARENA_PREFIX}{dead.pid}-0badf00d"}
    mine = HostArena.create(default_arena_name(), 1, SLOT)
    # the arena of a dead pid that a live process still uses (a worker that outlived its
    # server) stays
    in_use = HostArena.create(f"{ARENA_PREFIX}{dead.pid}-5eed", 1, SLOT)
    try:
        removed = remove_orphaned_arenas()
        assert orphans <= set(removed) and not {mine.name, in_use.name} & set(removed)
        assert not any(HostArena.unlink_stale(name) for name in orphans)  # already gone
        HostArena.attach(mine.name).close()  # still there
        HostArena.attach(in_use.name).close()
    finally:
        mine.close()  # the owner unlinks it
        in_use.close()


def test_a_restart_under_the_same_pid_is_not_stopped_by_the_arena_left_under_it() -> None:
    # A server killed with -9 leaves its arena; a restart that gets the same pid (pids in a
    # container start alike) found the name taken and could not start, ever.
    from antiphon.tiering.host_arena import default_arena_name

    left = HostArena.create(default_arena_name(), 1, SLOT)
    try:
        again = HostArena.create(default_arena_name(), 1, SLOT)
        again.close()
    finally:
        left.close()


def test_an_arena_left_under_a_pid_that_lives_again_is_swept() -> None:
    # A restarted container's engine gets its killed predecessor's pid: the sweep took the
    # arena that predecessor left for a live one, and a whole host tier of RAM stayed
    # allocated after every such restart.
    import signal
    import subprocess
    import sys

    from antiphon.tiering.host_arena import ARENA_PREFIX, CREATING_S, remove_orphaned_arenas

    name = f"{ARENA_PREFIX}{os.getppid()}-0ldc0de0"  # a live pid, a killed process's arena
    dead = subprocess.Popen(
        [sys.executable, "-c", "import os, signal\n"
         "from antiphon.tiering.host_arena import HostArena\n"
         f"HostArena.create({name!r}, 1, {SLOT}, tracked=False)\n"
         "os.kill(os.getpid(), signal.SIGKILL)"])
    assert dead.wait() == -signal.SIGKILL
    path = Path("/dev/shm") / name
    try:
        assert name not in remove_orphaned_arenas()  # just made: its maker may be locking it
        made = time.time() - 2 * CREATING_S
        os.utime(path, (made, made))
        assert name in remove_orphaned_arenas()
        assert not path.exists()
    finally:
        path.unlink(missing_ok=True)


def test_an_arena_left_under_this_processs_own_pid_is_swept_however_young(
        tmp_path: Path) -> None:
    # The engine sweeps at its start: an arena named with its own pid, not in use, was left
    # by the killed process that had the pid before (a restarted container's). Spared as
    # young, it stayed beside the new arena, and where /dev/shm held only one the start
    # failed (found by a review).
    from antiphon.tiering.host_arena import ARENA_PREFIX, remove_orphaned_arenas

    left = tmp_path / f"{ARENA_PREFIX}{os.getpid()}-deadbeef"
    left.write_bytes(b"AKVARENA")
    assert remove_orphaned_arenas(tmp_path) == [left.name]


def test_a_key_reserved_for_a_copy_is_not_stored_twice(tier: HostTier) -> None:
    # A prefetch bringing a key up from the SSD while a running turn has reserved it for its
    # own save: stored and reserved at once, its commit then failed an assertion (killing the
    # engine core) or, under -O, leaked the slot.
    slot = tier.reserve(key("k"))
    assert slot is not None
    assert not tier.put(key("k"), b"from the ssd", pin=True)  # refused: bytes on their way
    tier.arena.write(slot, b"saved")
    assert tier.commit(key("k"), len(b"saved"))
    assert tier.get(key("k")) == b"saved"
    tier.check_integrity()


def test_an_empty_segment_left_by_a_failed_start_is_swept_and_a_huge_arena_leaves_none(
        tmp_path: Path) -> None:
    """A start that died creating its arena (a size past what the system maps) left an empty
    segment, which cannot be mapped: the sweep of every later start failed on it."""
    from antiphon.tiering.host_arena import ARENA_PREFIX, remove_orphaned_arenas

    dead_pid = 2**22 + 12345  # past pid_max: no such process
    (tmp_path / f"{ARENA_PREFIX}{dead_pid}-0badf00d").touch()  # empty, as the failure left it
    assert remove_orphaned_arenas(tmp_path) == [f"{ARENA_PREFIX}{dead_pid}-0badf00d"]
    assert list(tmp_path.iterdir()) == []
    name = f"{ARENA_PREFIX}{os.getpid()}-huge"
    with pytest.raises(ValueError, match="more than this system can map"):
        HostArena.create(name, 2**62, 2**10)
    assert not (Path("/dev/shm") / name).exists()


SPAWNED_ENGINE = """
import multiprocessing, os, signal, sys
from antiphon.tiering.host_arena import ARENA_PREFIX, HostArena, remove_arenas_of


def engine() -> None:  # creates its arena, tracked, and is killed before it closes it
    HostArena.create(f"{ARENA_PREFIX}{os.getpid()}-0badf00d", 1, 64)
    os.kill(os.getpid(), signal.SIGKILL)


if __name__ == "__main__":
    proc = multiprocessing.get_context("spawn").Process(target=engine, name="EngineCore")
    proc.start()
    proc.join()
    if sys.argv[1] == "remove":
        print(remove_arenas_of({proc.pid}))
"""


@pytest.mark.parametrize("remove", [True, False])
def test_the_arena_an_engine_left_is_removed_without_the_trackers_warning(
        tmp_path: Path, remove: bool) -> None:
    """vLLM kills its engine process before that closes its tiers: the arena stayed for
    multiprocessing's resource tracker to unlink at the server's exit, which warned of
    "leaked shared_memory objects" at every stop."""
    import subprocess
    import sys

    script = tmp_path / "engine.py"
    script.write_text(SPAWNED_ENGINE)
    done = subprocess.run([sys.executable, str(script), "remove" if remove else "keep"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert not list(Path("/dev/shm").glob("antiphon-kv-*-0badf00d"))  # gone either way
    assert ("leaked shared_memory" in done.stderr) is not remove, done.stderr
    assert "Traceback" not in done.stderr
    if remove:
        assert "-0badf00d" in done.stdout


def test_slots_never_handed_out_are_not_listed() -> None:
    """A large tier's allocator starts without a list of every slot (11 million slots took
    420 MiB), and hands slots out in the order a full list did: the lowest free first, a
    just-freed one before it."""
    slots = SlotAllocator(11_000_000, used=[2, 5])
    assert len(slots._free_list) == 4 and slots.num_free == 11_000_000 - 2
    assert [slots.allocate() for _ in range(5)] == [0, 1, 3, 4, 6]
    slots.free(3)
    assert [slots.allocate() for _ in range(2)] == [3, 7]
    assert slots.used_slots() == {0, 1, 2, 3, 4, 5, 6, 7}
    empty = SlotAllocator(0)
    assert not empty.can_allocate() and empty.num_free == 0


def test_an_entry_leaves_the_garbage_collector_one_object_to_track() -> None:
    """The engine's heap holds an index entry per chunk-layer in the tier: its location, a
    NamedTuple, was one object more for every full collection to visit."""
    keys = [key(f"k{i}") for i in range(64)]
    tier = HostTier.create(shm_name(), capacity_bytes=len(keys) * SLOT, slot_bytes=SLOT)
    gc.collect()
    before = len(gc.get_objects())
    for k in keys:
        assert tier.put(k, b"x" * SLOT)
    gc.collect()
    assert len(gc.get_objects()) - before <= len(keys) + 16  # its index entry
    tier.close()

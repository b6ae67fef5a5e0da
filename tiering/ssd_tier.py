"""The SSD tier: chunk-layers in the slots of one file, written behind by a writer thread.

    <directory>/
      .lock            held (flock) while a tier has the directory open
      kv-slots.bin     fixed-size slots, one verified record each (format: `slot_file`)

A `put` takes a slot and enters the index at once, and keeps the payload in memory until the
writer thread has written the record; reads in between are served from memory. Every entry is
charged one slot (`stride` bytes), so capacity is `capacity_bytes // stride` slots. A record
that fails verification on read is dropped (its slot cleared) and the read is a miss. On start
the index is rebuilt from the slots' headers, oldest write first, so LRU order survives a
restart approximately; damaged headers are cleared. An evicted record stays on disk until its
slot is reused, so a restart may find it again: a key names its content, so it is still
right. `remove` and a failed verification clear the slot. Each record keeps the tag of who saved
it (`owner`: a hash of a session's id), and the index lists each owner's keys (`owned_by`), so
a deleted session's KV is found also after a restart.

The disk keeps `min_free_disk_bytes` free while the tier runs, whatever its budget: the slot
file grows only when every slot in it is taken, and then only as far as the disk's free space
above that reserve allows; past it the tier evicts instead, as if its budget were the file's
size. When room comes back, it grows again up to its budget. (Writes still queued are not yet
in the free space, so the reserve may be undercut by up to the writer's queue.)
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import shutil
from collections.abc import Iterable
from concurrent.futures import Future
from pathlib import Path

from antiphon.datalock import record_holder, try_lock
from antiphon.private import private_dir
from antiphon.tiering.eviction import EvictionPolicy, LruPolicy
from antiphon.tiering.index import IndexEntry
from antiphon.tiering.indexed_tier import IndexedTier, OwnerIndex
from antiphon.tiering.keys import ChunkKey
from antiphon.tiering.slot_file import CorruptChunk, SlotFile, key_bytes
from antiphon.tiering.slots import SlotAllocator
from antiphon.tiering.tier import BytesLike, byte_view, done_future
from antiphon.tiering.write_behind import Job, WriteBehind

log = logging.getLogger(__name__)


@dataclasses.dataclass(eq=False, slots=True)
class SsdSlot:
    slot: int
    # Resolves when the record is on disk (False: dropped before); None once it is there. A
    # future holds about ten objects Python's garbage collector tracks: kept for every record,
    # a full collection of the engine's heap took ten times as long.
    written: Future[bool] | None
    pending: bytes | None  # the payload until the record is written, then None
    owner: bytes = b""  # who saved it (`keys.owner_tag`), written into its record header


@dataclasses.dataclass
class ScanReport:
    """What the start-up scan found (counts of records)."""

    num_loaded: int = 0
    num_corrupt_removed: int = 0  # damaged headers (or payloads, with verify_on_start)
    num_superseded: int = 0  # older records of a key found again in a newer slot
    num_over_capacity: int = 0  # valid records beyond a budget that shrank
    num_legacy_removed: int = 0  # files of the old one-file-per-chunk-layer format
    num_other_model: int = 0  # valid records of another model (or weights, or dtype): not used
    was_reset: bool = False  # the slot file had another format or slot size, and was emptied


class SsdTier(IndexedTier[SsdSlot]):
    """One slot file under `directory`; one tier per directory (enforced with a lock file)."""

    def __init__(self, directory: Path, capacity_bytes: int, *, slot_bytes: int,
                 name: str = "ssd", policy: EvictionPolicy | None = None,
                 max_pending_writes: int = 64, fsync: bool = False,
                 verify_on_start: bool = False, writer_nice: int = 0,
                 min_free_disk_bytes: int = 0, model_id: str | None = None) -> None:
        """Open (or create) `directory` and rebuild the index from its slot file.

        `slot_bytes` is the largest payload (one chunk-layer); `max_pending_writes` bounds
        queued writes (and the payload memory they hold); `fsync` makes each record survive
        power loss; `verify_on_start` checks every payload checksum during the scan (reads
        everything) instead of only the headers; `writer_nice` is the writer thread's CPU
        priority (`WriteBehind`); `min_free_disk_bytes` is the disk space the tier leaves free
        (it evicts rather than grow into it). With `model_id`, records stored under another
        model id (other weights or dtype: `ChunkKey.model_id`) can never be served: they are
        erased in the background and their slots reused. None keeps every model's records.
        """
        if min_free_disk_bytes < 0:
            raise ValueError(f"min_free_disk_bytes must be >= 0, got {min_free_disk_bytes}")
        self.directory = private_dir(Path(directory))
        self._lock_fd: int | None = _lock_directory(self.directory)
        self._writer: WriteBehind | None = None
        # Free slots whose old record a clear failed to erase on disk: a restart would serve
        # it again. Each later `clear_slots` tries again; a record written there ends it.
        self._uncleared: set[int] = set()
        # Allocated slots whose record is not yet on disk (its write queued, or dropped): a
        # slot's old record is still there, and a clear queued before the write must erase it.
        self._unwritten_slots: set[int] = set()
        try:  # (a refused argument or a failed scan releases the file and the lock)
            self._file = SlotFile(self.directory, slot_bytes, fsync=fsync)
            num_slots = capacity_bytes // self._file.stride
            super().__init__(name, num_slots * self._file.stride, policy or LruPolicy())
            self._budget_slots = num_slots
            self._min_free_disk_bytes = min_free_disk_bytes
            self._file_slots = 0  # slots the file covers, written or allocated: by `_rebuild`
            self._is_disk_short = False  # capped below the budget by the disk's free space
            self._slots: SlotAllocator  # built by `_rebuild` from the slots found in use
            self._next_sequence = 1  # of the next record written; `_rebuild` moves it on
            self._owners = OwnerIndex()  # (a key's slot keeps its owner's one copy of the tag)
            self._writer = WriteBehind(name, max_pending_writes, nice=writer_nice)
            self.scan_report = self._rebuild(num_slots, verify_on_start, model_id)
        except BaseException:
            self.close()
            raise
        self._fit_to_disk()

    @property
    def slot_bytes(self) -> int:
        """The largest payload the tier takes (one chunk-layer)."""
        return self._file.slot_bytes

    @property
    def stride(self) -> int:
        """Bytes one entry is charged: its slot in the file."""
        return self._file.stride

    @property
    def path(self) -> Path:
        """The slot file."""
        return self._file.path

    def slot_of(self, key: ChunkKey) -> int | None:
        """The slot holding `key`, or None."""
        location = self.location_of(key)
        return None if location is None else location.slot

    def put(self, key: ChunkKey, data: BytesLike, *, pin: bool = False,
            owner: bytes = b"") -> bool:
        """Accept `data` (copied) and queue its write; blocks while the queue is full."""
        return self._accept(key, data, pin, owner) is not None

    def put_async(self, key: ChunkKey, data: BytesLike) -> Future[bool]:
        written = self._accept(key, data, False, b"")
        return done_future(False) if written is None else written

    def owned_by(self, owner: bytes) -> list[ChunkKey]:
        with self._lock:
            return self._owners.keys_of(owner)

    def owner_of(self, key: ChunkKey) -> bytes:
        with self._lock:
            entry = self._index.get(key)
            return b"" if entry is None else entry.location.owner

    def get(self, key: ChunkKey) -> bytes | memoryview | None:
        with self._lock:
            entry = self._index.get(key)
            if entry is None:
                self.stats.misses += 1
                return None
            self._index.touch(key)
            pending = entry.location.pending
        data = pending if pending is not None else self._read_verified(key, entry)
        with self._lock:
            if data is None:
                self.stats.misses += 1
            else:
                self.stats.hits += 1
                self.stats.bytes_out += len(data)
        return data

    def peek(self, key: ChunkKey) -> bytes | memoryview | None:
        with self._lock:
            entry = self._index.get(key)
            if entry is None:
                return None
            pending = entry.location.pending
        return pending if pending is not None else self._read_verified(key, entry)

    def remove(self, key: ChunkKey) -> bool:
        """Delete `key` now; its slot is cleared on disk, so a restart does not find it."""
        removed, slot = self.remove_later(key)
        if slot is not None:
            self.clear_slots([slot])
        return removed

    def remove_later(self, key: ChunkKey) -> tuple[bool, int | None]:
        """Delete `key` from the index now; its slot is cleared on disk by `clear_slots`
        (queuing a clear blocks while the writer's queue is full)."""
        with self._lock:
            entry = self._index.get(key)
            slot = None if entry is None else entry.location.slot
            removed = super().remove(key)
        return removed, slot if removed else None

    def clear_slots(self, slots: Iterable[int]) -> None:
        """Queue the clearing of removed slots on disk (each only if still free then), and
        again of those whose clear failed before."""
        with self._lock:
            retry = {slot for slot in self._uncleared if not self._slots.is_allocated(slot)}
        for slot in sorted(retry.union(slots)):
            self._clear_behind(slot)

    @property
    def uncleared_slots(self) -> int:
        with self._lock:
            return len(self._uncleared)

    def barrier(self, *, sync: bool = False) -> Future[bool]:
        if self._writer is None:
            return done_future(True)

        def reached() -> bool:  # jobs run in order: those before it are done
            if sync:
                self._file.sync()  # (an OSError fails the future)
            return True
        return self._writer.submit(reached)

    def flush(self) -> None:
        if self._writer is not None:
            self._writer.flush()

    def close(self) -> None:
        """Finish queued writes and release the directory."""
        if self._writer is not None:
            self._writer.close()
        if getattr(self, "_file", None) is not None:
            self._file.close()
        if self._lock_fd is not None:
            os.close(self._lock_fd)  # releases the flock
            self._lock_fd = None

    def _accept(self, key: ChunkKey, data: BytesLike, pin: bool,
                owner: bytes) -> Future[bool] | None:
        key_bytes(key, owner)  # ValueError for a tag too long, before anything changes
        entry, is_new = self._put_locked(key, byte_view(data), pin, owner)
        if entry is None:
            return None
        location = entry.location
        written = location.written  # (None: the entry's record is on disk already)
        if is_new:  # outside the lock: a full queue blocks here, and the writer needs the lock
            assert written is not None
            self._submit(lambda: self._write(key, location), written)
        return done_future(True) if written is None else written

    def _submit(self, job: Job, future: Future[bool] | None = None) -> None:
        assert self._writer is not None
        self._writer.submit(job, future)

    def _write(self, key: ChunkKey, location: SsdSlot) -> bool:
        """Writer thread: write `location`'s record unless its entry was dropped meanwhile.

        A slot freed and reused while this runs is safe: its new record's write is queued
        behind this one, and the new entry is served from memory until then."""
        with self._lock:
            entry = self._index.get(key)
            if entry is None or entry.location is not location or location.pending is None:
                return False
            payload = location.pending
            sequence = self._next_sequence
            self._next_sequence += 1
        try:
            self._file.write(location.slot, key, memoryview(payload), sequence, location.owner)
        except OSError as e:
            log.warning("%s: cannot write slot %d (%s); dropping it", self.name, location.slot, e)
            with self._lock:
                if self._drop(key, entry):
                    self.stats.write_failed += 1
            # The slot may still hold the record an erasure skipped clearing because this
            # write was to replace it. A write queued into the slot meanwhile runs after this.
            self._clear_now(location.slot)
            return False
        with self._lock:
            self._uncleared.discard(location.slot)  # the new record replaced the old
            if self._index.get(key) is entry:
                location.pending = None
                location.written = None  # (the writer resolves the future it was given)
                self._unwritten_slots.discard(location.slot)
                return True
            return False

    def _clear_behind(self, slot: int) -> None:
        """Queue the clearing of `slot`'s header, skipped only if a new record for the slot
        is on disk by then. One still queued (behind the clear) is not: the erasure's barrier
        would resolve with the old record on disk, for a restart to serve, and for good if
        the new one were dropped unwritten."""
        def clear() -> bool:
            with self._lock:
                if self._slots.is_allocated(slot) and slot not in self._unwritten_slots:
                    return True  # its new record replaced the old (written, or its failed
                    # write cleared the slot)
            return self._clear_now(slot)
        self._submit(clear)

    def _clear_now(self, slot: int) -> bool:
        """Writer thread: clear `slot`'s header; a failure is kept in `uncleared_slots`."""
        try:
            self._file.clear(slot)
        except OSError as e:
            log.warning("%s: cannot clear slot %d (%s)", self.name, slot, e)
            with self._lock:
                self._uncleared.add(slot)
            return False
        with self._lock:
            self._uncleared.discard(slot)
        return True

    def _erase_stale(self, slots: list[int]) -> bool:
        """Writer thread: erase the slots `_rebuild` found holding records it cannot serve.
        It runs before any write queued after the scan, so a slot reused meanwhile is
        written after it."""
        try:
            self._file.erase(slots)
        except OSError as e:
            log.warning("%s: cannot erase %d stale slots (%s)", self.name, len(slots), e)
            with self._lock:  # (a superseded record would be served once the newer goes)
                self._uncleared.update(slots)
            return False
        return True

    def _read_verified(self, key: ChunkKey, entry: IndexEntry[SsdSlot]) -> memoryview | None:
        """The record's verified payload; None, and the record dropped, when it is damaged.
        A read that fails (an I/O error) is a miss that keeps the record: it may read next
        time, and a damaged one is found then by its checksum."""
        try:
            return self._file.read(entry.location.slot, key)
        except OSError as e:
            log.warning("%s: reading slot %d failed: %s", self.name, entry.location.slot, e)
            return None
        except CorruptChunk as e:
            with self._lock:
                if self._index.get(key) is not entry:  # evicted under our feet: a plain miss
                    return None
                log.warning("%s: dropping slot %d: %s", self.name, entry.location.slot, e)
                self._drop_corrupt(key, entry)
            self._clear_behind(entry.location.slot)
            return None

    def _charge(self, key: ChunkKey, num_payload_bytes: int) -> int:
        if num_payload_bytes > self.slot_bytes:
            raise ValueError(f"{self.name}: a {num_payload_bytes}-byte payload does not fit a "
                             f"{self.slot_bytes}-byte slot")
        # (the key's header size: checked with its owner by `_accept`, the one way in)
        if self._index.used_bytes >= self._file_slots * self.stride:  # the file must grow
            self._fit_to_disk()
        return self.stride

    def _fit_to_disk(self) -> None:
        """Set the capacity to the budget, or lower, to the slots the file has plus those the
        disk's free space above the reserve can take (lock held, or in `__init__`)."""
        if self._file_slots >= self._budget_slots:
            return  # the file never grows again
        free = _disk_free(self.directory)
        growable = max(0, (free - self._min_free_disk_bytes) // self.stride)
        slots = min(self._budget_slots, self._file_slots + growable)
        self._index.capacity_bytes = slots * self.stride
        is_short = slots < self._budget_slots
        if is_short and not self._is_disk_short:
            log.warning("%s: %s has %d bytes free; keeping %d free (--ssd-min-free-bytes), the "
                        "tier holds %d bytes instead of its %d-byte budget, and evicts rather "
                        "than grow", self.name, self.directory, free, self._min_free_disk_bytes,
                        slots * self.stride, self._budget_slots * self.stride)
        elif self._is_disk_short and not is_short:
            log.warning("%s: the disk has room again; back to the %d-byte budget", self.name,
                        self._budget_slots * self.stride)
        self._is_disk_short = is_short

    def _store(self, key: ChunkKey, data: memoryview, owner: bytes) -> SsdSlot:
        # An immutable `bytes` payload (the host tier's copy, on write-through) is kept as it
        # is: copying it again cost the engine's scheduler thread a memcpy per chunk-layer.
        source = data.obj
        payload = source if isinstance(source, bytes) and len(source) == len(data) else bytes(data)
        slot = self._slots.allocate()
        self._file_slots = max(self._file_slots, slot + 1)
        self._unwritten_slots.add(slot)
        return SsdSlot(slot, Future(), payload, self._owners.add(key, owner))

    def _load(self, key: ChunkKey, entry: IndexEntry[SsdSlot]) -> bytes:
        pending = entry.location.pending
        return pending if pending is not None else bytes(self._file.read(entry.location.slot,
                                                                         key))

    def _free(self, key: ChunkKey, entry: IndexEntry[SsdSlot]) -> None:
        self._slots.free(entry.location.slot)  # a pending write sees the entry gone, skips
        self._unwritten_slots.discard(entry.location.slot)
        self._owners.discard(key, entry.location.owner)

    def _check_storage(self) -> None:
        self._slots.check_integrity()
        slots = [entry.location.slot for _, entry in self._index.items()]
        assert len(set(slots)) == len(slots), f"{self.name}: two keys share a slot"
        assert set(slots) == self._slots.used_slots(), f"{self.name}: allocator disagrees"
        unwritten = {entry.location.slot for _, entry in self._index.items()
                     if entry.location.pending is not None}
        assert unwritten == self._unwritten_slots, f"{self.name}: unwritten slots disagree"
        for key, entry in self._index.items():
            location = entry.location
            assert entry.nbytes == self.stride, f"{key} not charged one slot"
            if location.pending is None:
                record = self._file.read_header(location.slot)
                assert record is not None and record.key == key, f"{key}: slot holds another"

    def _rebuild(self, num_slots: int, verify_payload: bool,
                 model_id: str | None) -> ScanReport:
        """Index the records in the slot file; clear what cannot be used, and free the slots
        of records that can never be served (another model's, and older copies of a key),
        erasing them in the writer's first job: a deleted session's KV must not outlive its
        deletion in a slot the index forgot."""
        report = ScanReport(was_reset=self._file.was_reset,
                            num_legacy_removed=_remove_legacy_files(self.directory))
        if report.was_reset:
            log.warning("%s: %s had another format or slot size; emptied it", self.name,
                        self._file.path)
        newest: dict[ChunkKey, tuple[int, int, bytes]] = {}  # key -> (sequence, slot, owner)
        stale: list[int] = []  # slots of records that cannot be served: erased, not just reused
        for slot in range(self._file.num_slots_on_disk):
            try:
                record = self._file.read_header(slot, verify_payload=verify_payload)
            except CorruptChunk as e:
                if slot < num_slots:  # (the slots past the budget are cut off below)
                    log.warning("%s: clearing slot %d: %s", self.name, slot, e)
                    self._clear_found(slot)
                report.num_corrupt_removed += 1
                continue
            if record is None:
                continue
            if slot >= num_slots:
                report.num_over_capacity += 1
                continue
            self._next_sequence = max(self._next_sequence, record.sequence + 1)
            if model_id is not None and record.key.model_id != model_id:
                report.num_other_model += 1
                stale.append(slot)
                continue
            found = (record.sequence, slot, record.owner)
            previous = newest.get(record.key)
            if previous is not None:  # two copies of the key: the newer is served
                newer, older = (previous, found) if previous[0] > found[0] else (found, previous)
                if not verify_payload and not self._is_intact(newer[1]):
                    # Torn (a crash as it was written): the older copy, whole, is kept.
                    log.warning("%s: clearing slot %d: its payload fails its checksum",
                                self.name, newer[1])
                    self._clear_found(newer[1])
                    report.num_corrupt_removed += 1
                    newer = older
                else:
                    report.num_superseded += 1
                    stale.append(older[1])
                found = newer
            newest[record.key] = found
        if report.num_other_model:
            log.warning("%s: %d chunk-layers of KV stored for another model, its weights or "
                        "dtype changed since, can never be used: erasing them",
                        self.name, report.num_other_model)
        self._file.truncate(num_slots)
        if stale:  # the first job of the writer: any write into these slots comes after it
            self._submit(lambda: self._erase_stale(stale))
        self.stats.corrupt_dropped += report.num_corrupt_removed
        used = [slot for _, slot, _ in newest.values()]
        self._slots = SlotAllocator(num_slots, used=used)
        self._file_slots = max([self._file.num_slots_on_disk, *(slot + 1 for slot in used)])
        for key, (_, slot, owner) in sorted(newest.items(), key=lambda item: item[1][0]):
            self._index.insert(key, SsdSlot(slot, None, None, self._owners.add(key, owner)),
                               self.stride)
            report.num_loaded += 1
        return report

    def _clear_found(self, slot: int) -> None:
        """Clear a damaged record the start-up scan found; one that cannot be cleared now (a
        full disk) is left to the next erasure's retry, and the tier starts all the same."""
        try:
            self._file.clear(slot)
        except OSError as e:
            log.warning("%s: cannot clear slot %d yet (%s)", self.name, slot, e)
            self._uncleared.add(slot)

    def _is_intact(self, slot: int) -> bool:
        """The record in `slot` passes its payload's checksum too."""
        try:
            return self._file.read_record(slot) is not None
        except CorruptChunk:
            return False


def _remove_legacy_files(directory: Path) -> int:
    """Delete the chunk files of format version 1 (`<2 hex>/<name>.kv`, `.kv.tmp`) and their
    emptied folders; returns how many files went."""
    removed = 0
    for shard in directory.iterdir():
        # Nothing else is followed or fatal: a link (to a folder elsewhere, whose files are
        # not the tier's) or a folder named like a chunk file is left as it is.
        if (len(shard.name) != 2 or not all(c in "0123456789abcdef" for c in shard.name)
                or shard.is_symlink() or not shard.is_dir()):
            continue
        try:
            for path in shard.iterdir():
                if path.name.endswith((".kv", ".kv.tmp")) and not path.is_dir():
                    path.unlink(missing_ok=True)
                    removed += 1
            if not any(shard.iterdir()):
                shard.rmdir()
        except OSError as exc:
            log.warning("cannot remove the old-format KV files in %s: %s", shard, exc)
    if removed:
        log.warning("removed %d KV files of the old one-file-per-chunk-layer format from %s",
                    removed, directory)
    return removed


def _disk_free(directory: Path) -> int:
    """Bytes free on `directory`'s file system for this user (0 when it cannot be read)."""
    try:
        return shutil.disk_usage(directory).free
    except OSError:
        return 0


def _lock_directory(directory: Path) -> int:
    """Hold an exclusive flock on `<directory>/.lock`; RuntimeError if another tier holds it."""
    fd = try_lock(directory / ".lock", 0o600)
    if fd is None:
        raise RuntimeError(f"{directory} is in use by another SSD tier")
    with contextlib.suppress(OSError):  # whom a server refused names (not on a full disk)
        record_holder(fd)
    return fd

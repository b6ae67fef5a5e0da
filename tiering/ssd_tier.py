"""The SSD tier: one verified file per chunk-layer, written behind by a writer thread.

    <directory>/
      .lock                      held (flock) while a tier has the directory open
      3f/3f9a...e1-0-0.kv        <hex of key hash>-<chunk>-<layer>.kv, sharded by 2 hex digits
      3f/3f9a...e1-0-1.kv

A `put` enters the index at once and keeps the payload in memory until the writer thread has
renamed the finished file into place; reads in between are served from memory. Capacity counts
file bytes (header and payload). A file that fails verification on read is deleted and the read
is a miss. On start the index is rebuilt from the files' headers (oldest modified first, so LRU
order survives a restart approximately); temporary, truncated and damaged files are deleted.
"""

from __future__ import annotations

import dataclasses
import fcntl
import logging
import os
from concurrent.futures import Future
from pathlib import Path

from antiphon.tiering.chunk_file import (
    FILE_SUFFIX,
    TEMP_SUFFIX,
    CorruptChunk,
    header_bytes,
    read_chunk_file,
    scan_chunk_file,
    write_chunk_file,
)
from antiphon.tiering.eviction import EvictionPolicy, LruPolicy
from antiphon.tiering.index import IndexEntry
from antiphon.tiering.indexed_tier import IndexedTier
from antiphon.tiering.keys import ChunkKey
from antiphon.tiering.tier import BytesLike, byte_view, done_future
from antiphon.tiering.write_behind import WriteBehind

log = logging.getLogger(__name__)


@dataclasses.dataclass(eq=False)
class SsdFile:
    path: Path
    written: Future[bool]  # resolves when the file is in place (False: dropped before)
    pending: bytes | None  # the payload until the file is in place, then None


@dataclasses.dataclass
class ScanReport:
    """What the start-up scan found (counts of files)."""

    num_loaded: int = 0
    num_temp_removed: int = 0
    num_corrupt_removed: int = 0
    num_over_capacity: int = 0  # valid files evicted because the budget shrank


class SsdTier(IndexedTier[SsdFile]):
    """Chunk files under `directory`; one tier per directory (enforced with a lock file)."""

    def __init__(self, directory: Path, capacity_bytes: int, *, name: str = "ssd",
                 policy: EvictionPolicy | None = None, max_pending_writes: int = 64,
                 fsync: bool = False, verify_on_start: bool = False,
                 writer_nice: int = 0) -> None:
        """Open (or create) `directory` and rebuild the index from its files.

        `max_pending_writes` bounds queued writes (and the payload memory they hold); `fsync`
        makes each file survive power loss; `verify_on_start` checks every payload checksum
        during the scan (reads everything) instead of only headers and lengths;
        `writer_nice` is the writer thread's CPU priority (`WriteBehind`).
        """
        super().__init__(name, capacity_bytes, policy or LruPolicy())
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.fsync = fsync
        self._lock_fd: int | None = _lock_directory(self.directory)
        self._writer = WriteBehind(name, max_pending_writes, nice=writer_nice)
        try:
            self.scan_report = self._rebuild(verify_on_start)
        except BaseException:
            self.close()
            raise

    def path_for(self, key: ChunkKey) -> Path:
        """Where `key`'s file lives (whether or not it exists)."""
        stem = key.file_stem()
        return self.directory / stem[:2] / (stem + FILE_SUFFIX)

    def put(self, key: ChunkKey, data: BytesLike, *, pin: bool = False) -> bool:
        """Accept `data` (copied) and queue its file write; blocks while the queue is full."""
        return self._accept(key, data, pin) is not None

    def put_async(self, key: ChunkKey, data: BytesLike) -> Future[bool]:
        written = self._accept(key, data, False)
        return done_future(False) if written is None else written

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

    def flush(self) -> None:
        self._writer.flush()

    def close(self) -> None:
        """Finish queued writes and release the directory."""
        self._writer.close()
        if self._lock_fd is not None:
            os.close(self._lock_fd)  # releases the flock
            self._lock_fd = None

    def _accept(self, key: ChunkKey, data: BytesLike, pin: bool) -> Future[bool] | None:
        entry, is_new = self._put_locked(key, byte_view(data), pin)
        if entry is None:
            return None
        location = entry.location
        if is_new:  # outside the lock: a full queue blocks here, and the writer needs the lock
            self._writer.submit(lambda: self._write(key, location), location.written)
        return location.written

    def _write(self, key: ChunkKey, location: SsdFile) -> bool:
        """Writer thread: put `location`'s file in place unless it was dropped meanwhile."""
        with self._lock:
            entry = self._index.get(key)
            if entry is None or entry.location is not location or location.pending is None:
                return False
            payload = location.pending
        try:
            location.path.parent.mkdir(exist_ok=True)
            write_chunk_file(location.path, key, memoryview(payload), fsync=self.fsync)
        except OSError as e:
            log.warning("%s: cannot write %s (%s); dropping it", self.name, location.path, e)
            with self._lock:
                if self._index.get(key) is entry:
                    self._index.remove(key)
            return False
        with self._lock:
            if self._index.get(key) is entry:
                location.pending = None
                return True
            if self._index.get(key) is None:  # removed while being written: an orphan file
                location.path.unlink(missing_ok=True)
            return False  # (a newer entry for the key rewrites the same file after us)

    def _read_verified(self, key: ChunkKey, entry: IndexEntry[SsdFile]) -> bytes | None:
        try:
            return read_chunk_file(entry.location.path, expected=key)
        except (CorruptChunk, OSError) as e:
            with self._lock:
                if self._index.get(key) is entry:  # not just evicted under our feet
                    log.warning("%s: dropping %s: %s", self.name, entry.location.path, e)
                    self._drop_corrupt(key, entry)
            return None

    def _charge(self, key: ChunkKey, num_payload_bytes: int) -> int:
        return header_bytes(key) + num_payload_bytes

    def _store(self, key: ChunkKey, data: memoryview) -> SsdFile:
        return SsdFile(self.path_for(key), Future(), bytes(data))

    def _load(self, key: ChunkKey, entry: IndexEntry[SsdFile]) -> bytes:
        pending = entry.location.pending
        return pending if pending is not None else read_chunk_file(entry.location.path, key)

    def _free(self, key: ChunkKey, entry: IndexEntry[SsdFile]) -> None:
        if entry.location.pending is None:  # else the writer sees the entry gone and skips it
            entry.location.path.unlink(missing_ok=True)

    def _check_storage(self) -> None:
        for key, entry in self._index.items():
            location = entry.location
            assert location.path == self.path_for(key), f"{key} filed at {location.path}"
            if location.pending is not None:
                assert entry.nbytes == header_bytes(key) + len(location.pending), f"{key} size"
            else:
                assert location.path.stat().st_size == entry.nbytes, f"{key}: file size"

    def _rebuild(self, verify_payload: bool) -> ScanReport:
        """Index the chunk files under the directory; delete what cannot be used."""
        report = ScanReport()
        found: list[tuple[float, ChunkKey, int, Path]] = []
        for shard in sorted(self.directory.iterdir()):
            if not (shard.is_dir() and len(shard.name) == 2):
                continue
            for path in shard.iterdir():
                if path.name.endswith(TEMP_SUFFIX):
                    path.unlink(missing_ok=True)
                    report.num_temp_removed += 1
                elif path.name.endswith(FILE_SUFFIX):
                    try:
                        key, size = scan_chunk_file(path, verify_payload=verify_payload)
                        if path != self.path_for(key):
                            raise CorruptChunk("file is in the wrong shard")
                        found.append((path.stat().st_mtime, key, size, path))
                    except (CorruptChunk, OSError) as e:
                        log.warning("%s: removing %s: %s", self.name, path, e)
                        path.unlink(missing_ok=True)
                        report.num_corrupt_removed += 1
        self.stats.corrupt_dropped += report.num_corrupt_removed
        for _, key, size, path in sorted(found, key=lambda item: item[0]):
            if not self._make_room(size):  # larger than the whole budget
                path.unlink(missing_ok=True)
                report.num_over_capacity += 1
                continue
            written: Future[bool] = done_future(True)
            self._index.insert(key, SsdFile(path, written, None), size)
            report.num_loaded += 1
        report.num_over_capacity += self.stats.evictions
        self.stats.evictions = 0  # start-up trimming is reported in the scan, not as evictions
        return report


def _lock_directory(directory: Path) -> int:
    """Hold an exclusive flock on `<directory>/.lock`; RuntimeError if another tier holds it."""
    fd = os.open(directory / ".lock", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise RuntimeError(f"{directory} is in use by another SSD tier") from None
    return fd

"""The SSD tier's on-disk format: one file of fixed-size slots, one chunk-layer record per slot.

    <directory>/kv-slots.bin  (grows as slots are used, each slot given its blocks whole)
      [file header, 4 KiB][slot 0][slot 1] ... [slot n-1]
    file header, little-endian:  magic "AKVF" | version u16 | pad u16 | slot_bytes u64 | crc32 u32
    slot, `stride` = 4 KiB + slot_bytes rounded up to 4 KiB:
      [record header, zero-padded to 4 KiB][payload (payload_len bytes)][unused]
    record header, little-endian:
      magic "AKVC" | version u16 | model_len u16 | prefix_len u16 | owner_len u16 |
      chunk_index u32 | layer u32 | payload_len u64 | sequence u64 | payload_check u32 |
      header_check u32, then model_id (utf-8), prefix_hash and owner
    a check is the low 32 bits of the XXH3-64 hash of the bytes it covers

`owner` is a tag of who saved the record (`keys.owner_tag`: a hash of a session's id, or empty),
so a session's deletion finds, also after a restart, the KV its requests computed past anything
its token chains name (a reply the engine ran on past a stop string or a cancel). Records written
before it was added have `owner_len` 0 in what was padding, and read as owned by no one.

A record is written with one `pwritev` of whole pages into a slot that already exists on disk
after its first use, so a write is a copy into the page cache: no file to create, rename or
allocate (a file per chunk-layer cost 95 µs of CPU against 8 µs here, and slowed the model's
decode steps by 12-20%; docs/benchmarks.md). A slot's first write in a process allocates all of
its blocks (and any the file would skip before it): the SSD tier counts every slot the file
reaches as used disk, and a short record (a turn's tail) left the rest of its slot a hole that
a later, longer record filled past the disk's free-space reserve. `header_check` covers the header bytes before it
and the key and owner bytes, so a damaged header is caught before its lengths are trusted; the
payload has its own checksum, so a torn write (new header, old payload) fails verification. A slot
whose header page is all zeros is empty. `sequence` grows with every write: after a restart
the newest record of a key wins.

The checks are XXH3 (format 3; format 2 used CRC-32): every chunk-layer written or read is checked,
and zlib's CRC-32 took 17 µs per 96 KiB page-layer here against 2 µs, on the fetch path of a
follow-up turn and on cores the model's threads share with the writer (docs/benchmarks.md).
"""

from __future__ import annotations

import ctypes
import errno
import os
import struct
import sys
import zlib
from array import array
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import NamedTuple

import xxhash

from antiphon.tiering.keys import ChunkKey

FILE_NAME = "kv-slots.bin"
PAGE = 4096
FILE_HEADER_BYTES = PAGE
RECORD_HEADER_BYTES = PAGE
FORMAT_VERSION = 3  # 1 kept one file per chunk-layer, 2 checked records with CRC-32
_FILE = struct.Struct("<4sHHQI")
_FILE_MAGIC = b"AKVF"
_RECORD = struct.Struct("<4sHHHHIIQQII")
_RECORD_MAGIC = b"AKVC"
_CHECK_OFFSET = _RECORD.size - 4  # header_check is the last fixed field
_ZERO_PAGE = bytes(PAGE)
MAX_OWNER_BYTES = 64
# `SlotFile`'s per-slot payload ends: 4 bytes a slot (a dict of them took 106 bytes a slot, a
# GiB at a TiB of slots); UNWRITTEN for a slot not written since the file was opened.
_ENDS_TYPE = "I"
UNWRITTEN = 0xFFFFFFFF
MAX_SLOT_BYTES = UNWRITTEN - 1


class CorruptChunk(Exception):
    """A record that must not be used: bad magic or version, failed checksum, impossible
    length, or a key other than the one expected."""


class FormatMismatch(Exception):
    """The slot file was written with another format or slot size."""


class Record(NamedTuple):
    key: ChunkKey
    payload_len: int
    payload_check: int
    sequence: int
    owner: bytes = b""


def check_of(data: bytes | memoryview) -> int:
    """A record's 32-bit check of `data`: the low half of its XXH3-64 hash."""
    return xxhash.xxh3_64_intdigest(data) & 0xFFFFFFFF


def stride_for(slot_bytes: int) -> int:
    """Bytes one slot takes in the file (record header page plus whole payload pages)."""
    return RECORD_HEADER_BYTES + -(-slot_bytes // PAGE) * PAGE


def key_bytes(key: ChunkKey, owner: bytes = b"") -> int:
    """Length of `key`'s record header (owned by `owner`) before padding; ValueError when over
    one page."""
    if len(owner) > MAX_OWNER_BYTES:
        raise ValueError(f"an owner tag of {len(owner)} bytes is over {MAX_OWNER_BYTES}")
    size = _RECORD.size + len(key.model_id.encode()) + len(key.prefix_hash) + len(owner)
    if size > RECORD_HEADER_BYTES:
        raise ValueError(f"a key of {size} bytes does not fit a {RECORD_HEADER_BYTES}-byte "
                         f"record header (model id too long)")
    return size


def encode_record_header(key: ChunkKey, payload: memoryview, sequence: int,
                         owner: bytes = b"") -> bytes:
    """`key`'s record header for `payload`, owned by `owner`, padded to a whole page."""
    key_bytes(key, owner)
    model = key.model_id.encode()
    fixed = _RECORD.pack(_RECORD_MAGIC, FORMAT_VERSION, len(model), len(key.prefix_hash),
                         len(owner), key.chunk_index, key.layer, len(payload), sequence,
                         check_of(payload), 0)
    tail = model + key.prefix_hash + owner
    header = (fixed[:_CHECK_OFFSET] + struct.pack("<I", check_of(fixed[:_CHECK_OFFSET] + tail))
              + tail)
    return header + bytes(RECORD_HEADER_BYTES - len(header))


def decode_record_header(page: bytes | memoryview) -> Record | None:
    """The record a header page describes; None for an empty slot (all zeros).

    Raises CorruptChunk on any damage."""
    page = memoryview(page)[:RECORD_HEADER_BYTES]
    if page == _ZERO_PAGE[:len(page)]:
        return None
    if len(page) < _RECORD.size:
        raise CorruptChunk("truncated record header")
    (magic, version, model_len, prefix_len, owner_len, chunk_index, layer, payload_len,
     sequence, payload_check, header_check) = _RECORD.unpack_from(page)
    if magic != _RECORD_MAGIC:
        raise CorruptChunk("bad magic")
    if version != FORMAT_VERSION:
        raise CorruptChunk(f"record version {version}, expected {FORMAT_VERSION}")
    end = _RECORD.size + model_len + prefix_len + owner_len
    if end > len(page):
        raise CorruptChunk("truncated record header")
    key_part = bytes(page[_RECORD.size:end])
    if check_of(bytes(page[:_CHECK_OFFSET]) + key_part) != header_check:
        raise CorruptChunk("header checksum mismatch")
    try:
        key = ChunkKey(key_part[:model_len].decode(),
                       key_part[model_len:model_len + prefix_len], chunk_index, layer)
    except ValueError as e:  # UnicodeDecodeError is a ValueError
        raise CorruptChunk(f"bad key in header: {e}") from None
    return Record(key, payload_len, payload_check, sequence, key_part[model_len + prefix_len:])


class SlotFile:
    """The open slot file of one SSD tier. Reads and writes are positional (`pread`,
    `pwritev`), so any thread may read while the writer thread writes."""

    def __init__(self, directory: Path, slot_bytes: int, *, fsync: bool = False) -> None:
        """Open `<directory>/kv-slots.bin`, creating it if absent. A file of another format or
        slot size is emptied (`was_reset` says so): its records could not be read."""
        if not 1 <= slot_bytes <= MAX_SLOT_BYTES:
            raise ValueError(f"slot_bytes must be 1 to {MAX_SLOT_BYTES}, got {slot_bytes}")
        self.path = Path(directory) / FILE_NAME
        self.slot_bytes = slot_bytes
        self.stride = stride_for(slot_bytes)
        self.fsync = fsync
        self._zero_slot = b""  # `clear`'s zeros, made on its first use
        # slot -> payload bytes last written there (UNWRITTEN: not since the file was opened)
        self._payload_ends = array(_ENDS_TYPE)
        self._can_allocate = True  # False once the file system turned `fallocate` down
        self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        self.was_reset = False
        try:
            self._check_or_write_header()
        except BaseException:
            os.close(self._fd)
            raise

    @property
    def num_slots_on_disk(self) -> int:
        """Slots the file reaches into (a slot cut short by the end of the file counts)."""
        size = os.fstat(self._fd).st_size
        return max(0, -(-(size - FILE_HEADER_BYTES) // self.stride))

    def offset(self, slot: int) -> int:
        """Where `slot` starts in the file."""
        return FILE_HEADER_BYTES + slot * self.stride

    def write(self, slot: int, key: ChunkKey, payload: memoryview, sequence: int,
              owner: bytes = b"") -> None:
        """Write `key`'s record, owned by `owner`, into `slot` (OSError on a full or failing
        disk)."""
        if len(payload) > self.slot_bytes:
            raise ValueError(f"a {len(payload)}-byte payload does not fit a "
                             f"{self.slot_bytes}-byte slot")
        header = encode_record_header(key, payload, sequence, owner)
        offset = self.offset(slot)
        end = len(payload)
        stale = self._stale_end(slot)
        if self._end_of(slot) == UNWRITTEN:
            self._allocate(slot)
        # A shorter record zeroes what an older, longer one left behind it: the slot of a
        # deleted session's chunk-layer, taken by a turn's short tail before its clear (which
        # it then skips) or after its eviction, kept most of that KV in the file.
        pad = _ZERO_PAGE[:-end % PAGE] if end < stale else b""
        written = os.pwritev(self._fd, [header, payload, pad], offset)
        if written != len(header) + end + len(pad):  # a short write: the disk is full
            raise OSError(f"short write into slot {slot}: {written} bytes")
        if end + len(pad) < stale:
            self._zero(offset + RECORD_HEADER_BYTES + end + len(pad), stale - end - len(pad))
        self._set_end(slot, end)
        if self.fsync:
            os.fdatasync(self._fd)

    def _end_of(self, slot: int) -> int:
        return self._payload_ends[slot] if slot < len(self._payload_ends) else UNWRITTEN

    def _set_end(self, slot: int, end: int) -> None:
        missing = slot + 1 - len(self._payload_ends)
        if missing > 0:
            self._payload_ends.frombytes(b"\xff" * (missing * self._payload_ends.itemsize))
        self._payload_ends[slot] = end

    def _allocate(self, slot: int) -> None:
        """Give `slot`, and the slots between the file's end and it, their disk blocks
        (OSError on a full disk). The slots added are empty: nothing stale to zero."""
        on_disk = self.num_slots_on_disk
        start = min(self.offset(slot), os.fstat(self._fd).st_size)
        if self._can_allocate:
            self._can_allocate = _allocate_range(self._fd, start,
                                                 self.offset(slot) + self.stride - start)
        for added in range(on_disk, slot):
            self._set_end(added, 0)

    def _stale_end(self, slot: int) -> int:
        """How far into `slot`'s payload an older record may reach: what was last written
        there, or (a slot not written since the file was opened) all of it the file holds."""
        end = self._end_of(slot)
        if end == UNWRITTEN:
            reach = os.fstat(self._fd).st_size - self.offset(slot) - RECORD_HEADER_BYTES
            end = max(0, min(self.slot_bytes, reach))
        return end

    def _zero(self, offset: int, length: int) -> None:
        """Zero `length` bytes the file holds at `offset`."""
        if not _zero_range(self._fd, offset, length):
            written = os.pwrite(self._fd, bytes(length), offset)
            if written != length:
                raise OSError(f"short write of zeros at {offset}: {written} bytes")

    def sync(self) -> None:
        """Everything written so far, on the device (`fsync` does this after each write)."""
        os.fdatasync(self._fd)

    def clear(self, slot: int) -> None:
        """Erase `slot`, if the file reaches it: its header and payload zeroed, so neither a
        restart nor a reader of the file finds what it held. Raises OSError where it could
        not (a full disk: zeros written over a torn write's holes need blocks)."""
        self.erase((slot,))

    def _write_zeros(self, slot: int) -> None:
        if not self._zero_slot:
            self._zero_slot = bytes(self.stride)
        written = os.pwrite(self._fd, self._zero_slot, self.offset(slot))
        if written != self.stride:  # (a short write: the disk is full)
            raise OSError(f"short write clearing slot {slot}: {written} bytes")

    def erase(self, slots: Iterable[int]) -> None:
        """Erase many `slots` at once, as `clear` does one: each run of neighbouring slots
        the file reaches is zeroed by the file system (`fallocate`'s ZERO_RANGE: no data
        written, and the blocks stay the file's, so the tier's disk accounting holds), or by
        writing zeros where it cannot."""
        size = os.fstat(self._fd).st_size
        for start, count in _runs(sorted(set(slots))):
            count = min(count, self.num_slots_on_disk - start)
            if count <= 0:
                continue
            offset = self.offset(start)
            if not _zero_range(self._fd, offset, min(count * self.stride, size - offset)):
                for slot in range(start, start + count):
                    self._write_zeros(slot)
            for slot in range(start, start + count):
                self._set_end(slot, 0)
        if self.fsync:
            os.fdatasync(self._fd)

    def read_header(self, slot: int, *, verify_payload: bool = False) -> Record | None:
        """The record in `slot` (None: empty); its payload is read and checked only with
        `verify_payload`. Raises CorruptChunk."""
        if verify_payload:
            found = self.read_record(slot)
            return None if found is None else found[0]
        return self._decode(os.pread(self._fd, RECORD_HEADER_BYTES, self.offset(slot)))

    def read_record(self, slot: int) -> tuple[Record, memoryview] | None:
        """The record in `slot` and its verified payload (None: empty), in one read.
        Raises CorruptChunk."""
        data = os.pread(self._fd, self.stride, self.offset(slot))
        record = self._decode(data)
        if record is None:
            return None
        payload = memoryview(data)[RECORD_HEADER_BYTES:RECORD_HEADER_BYTES + record.payload_len]
        if len(payload) != record.payload_len:
            raise CorruptChunk(f"payload is {len(payload)} bytes, header says "
                               f"{record.payload_len}")
        if check_of(payload) != record.payload_check:
            raise CorruptChunk("payload checksum mismatch")
        return record, payload

    def read(self, slot: int, expected: ChunkKey) -> memoryview:
        """The verified payload `slot` holds for `expected`.

        Raises CorruptChunk on damage, or when the slot is empty or holds another key."""
        found = self.read_record(slot)
        if found is None:
            raise CorruptChunk("the slot is empty")
        if found[0].key != expected:
            raise CorruptChunk("the slot holds another key")
        return found[1]

    def truncate(self, num_slots: int) -> None:
        """Drop every slot from `num_slots` on from the file."""
        if num_slots < self.num_slots_on_disk:
            os.ftruncate(self._fd, self.offset(num_slots))
            del self._payload_ends[num_slots:]

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def __enter__(self) -> SlotFile:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _decode(self, page: bytes) -> Record | None:
        record = decode_record_header(page)
        if record is not None and record.payload_len > self.slot_bytes:
            raise CorruptChunk(f"payload of {record.payload_len} bytes in a "
                               f"{self.slot_bytes}-byte slot")
        return record

    def _check_or_write_header(self) -> None:
        expected = self._file_header()
        found = os.pread(self._fd, FILE_HEADER_BYTES, 0)
        if found == expected:
            return
        if found:  # another format or slot size: no record in it can be read
            self.was_reset = True
            os.ftruncate(self._fd, 0)
        os.pwrite(self._fd, expected, 0)
        os.fsync(self._fd)

    def _file_header(self) -> bytes:
        fixed = _FILE.pack(_FILE_MAGIC, FORMAT_VERSION, 0, self.slot_bytes, 0)
        crc = zlib.crc32(fixed[:-4])
        header = fixed[:-4] + struct.pack("<I", crc)
        return header + bytes(FILE_HEADER_BYTES - len(header))


def _runs(slots: list[int]) -> Iterator[tuple[int, int]]:
    """(first slot, count) of each run of consecutive numbers in sorted `slots`."""
    start = previous = -2
    for slot in slots:
        if slot != previous + 1:
            if previous >= 0:
                yield start, previous - start + 1
            start = slot
        previous = slot
    if previous >= 0:
        yield start, previous - start + 1


_FALLOC_FL_KEEP_SIZE = 0x01
_FALLOC_FL_ZERO_RANGE = 0x10
_libc: ctypes.CDLL | None = None


def _fallocate(fd: int, mode: int, offset: int, length: int) -> int:
    """Linux `fallocate(2)` on `fd`: 0, or its error number (ENOSYS off Linux)."""
    global _libc
    if not sys.platform.startswith("linux"):
        return errno.ENOSYS
    if _libc is None:
        _libc = ctypes.CDLL(None, use_errno=True)
        _libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]
        _libc.fallocate.restype = ctypes.c_int
    return 0 if _libc.fallocate(fd, mode, offset, length) == 0 else ctypes.get_errno()


def _zero_range(fd: int, offset: int, length: int) -> bool:
    """Zero `length` bytes of `fd` at `offset` in the file system (`fallocate` ZERO_RANGE:
    the range reads as zeros and keeps its blocks). False where the platform or the file
    system cannot, whatever the reason: the caller writes zeros instead."""
    return _fallocate(fd, _FALLOC_FL_ZERO_RANGE | _FALLOC_FL_KEEP_SIZE, offset, length) == 0


def _allocate_range(fd: int, offset: int, length: int) -> bool:
    """Give `length` bytes of `fd` at `offset` their blocks (`fallocate` mode 0: the file
    grows to cover them). False where the file system or platform cannot, the range then
    left as it is (glibc's `posix_fallocate` would write a byte into every block instead,
    two system calls per 4 KiB: on NFS, round trips); OSError on a full disk."""
    err = _fallocate(fd, 0, offset, length)
    if err in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
        return False
    if err:
        raise OSError(err, os.strerror(err))
    return True


def stored_slot_bytes(directory: Path) -> int | None:
    """The slot size of the slot file in `directory`; None when there is none, or it is of
    another format."""
    try:
        with open(Path(directory) / FILE_NAME, "rb") as f:
            fixed = f.read(_FILE.size)
    except FileNotFoundError:
        return None
    if len(fixed) != _FILE.size:
        return None
    magic, version, _, slot_bytes, crc = _FILE.unpack(fixed)
    if magic != _FILE_MAGIC or version != FORMAT_VERSION or zlib.crc32(fixed[:-4]) != crc:
        return None
    return int(slot_bytes)

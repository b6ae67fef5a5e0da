"""The on-disk format of one chunk-layer file, and its atomic write and verified read.

    [fixed header 32 B][model_id (utf-8)][prefix_hash][payload]
    fixed header, little-endian:
      magic "AKVC" | version u16 | model_len u16 | prefix_len u16 | pad u16 |
      chunk_index u32 | layer u32 | payload_len u64 | payload_crc32 u32 | header_crc32 u32

`header_crc32` covers every header byte before it plus the model and prefix bytes, so a damaged
header is caught before its lengths are trusted. The key is stored in the header (the SSD
tier's index is rebuilt from it on restart) and must match the file name. Files are written to
`<name>.tmp` and renamed over `<name>.kv`, so a crash leaves either the old file, the new file
or a `.tmp` that the next start removes.
"""

from __future__ import annotations

import os
import struct
import zlib
from pathlib import Path
from typing import BinaryIO

from antiphon.tiering.keys import ChunkKey

FILE_SUFFIX = ".kv"
TEMP_SUFFIX = ".tmp"
FORMAT_VERSION = 1
_MAGIC = b"AKVC"
_FIXED = struct.Struct("<4sHHHHIIQII")
_CRC_OFFSET = _FIXED.size - 4  # header_crc32 is the last fixed field


class CorruptChunk(Exception):
    """A chunk file that must not be used: bad magic or version, wrong length, failed checksum,
    or a key that does not match the file name."""


def header_bytes(key: ChunkKey) -> int:
    """Length of the header for `key` (fixed part plus model id and prefix hash)."""
    return _FIXED.size + len(key.model_id.encode()) + len(key.prefix_hash)


def encode_header(key: ChunkKey, payload: memoryview) -> bytes:
    """The header for `payload` stored under `key`."""
    model = key.model_id.encode()
    fixed = _FIXED.pack(_MAGIC, FORMAT_VERSION, len(model), len(key.prefix_hash), 0,
                        key.chunk_index, key.layer, len(payload), zlib.crc32(payload), 0)
    header_crc = zlib.crc32(fixed[:_CRC_OFFSET] + model + key.prefix_hash)
    return fixed[:_CRC_OFFSET] + struct.pack("<I", header_crc) + model + key.prefix_hash


def write_chunk_file(path: Path, key: ChunkKey, payload: memoryview, *,
                     fsync: bool = False) -> int:
    """Write `payload` for `key` to `path` atomically; returns the file's size in bytes.

    `fsync` makes the file survive power loss (a crash of the process never tears a file).
    """
    header = encode_header(key, payload)
    temp = path.with_name(path.name + TEMP_SUFFIX)
    try:
        with open(temp, "wb") as f:
            f.write(header)
            f.write(payload)
            if fsync:
                f.flush()
                os.fsync(f.fileno())
        os.replace(temp, path)
    except BaseException:
        temp.unlink(missing_ok=True)
        raise
    return len(header) + len(payload)


def _read_header(f: BinaryIO) -> tuple[ChunkKey, int, int]:
    """(key, payload_len, payload_crc) from an open chunk file positioned at 0."""
    fixed = f.read(_FIXED.size)
    if len(fixed) != _FIXED.size:
        raise CorruptChunk("truncated header")
    (magic, version, model_len, prefix_len, _, chunk_index, layer, payload_len, payload_crc,
     header_crc) = _FIXED.unpack(fixed)
    if magic != _MAGIC:
        raise CorruptChunk("bad magic")
    if version != FORMAT_VERSION:
        raise CorruptChunk(f"format version {version}, expected {FORMAT_VERSION}")
    rest = f.read(model_len + prefix_len)
    if len(rest) != model_len + prefix_len:
        raise CorruptChunk("truncated header")
    if zlib.crc32(fixed[:_CRC_OFFSET] + rest) != header_crc:
        raise CorruptChunk("header checksum mismatch")
    try:
        key = ChunkKey(rest[:model_len].decode(), rest[model_len:], chunk_index, layer)
    except ValueError as e:  # UnicodeDecodeError is a ValueError
        raise CorruptChunk(f"bad key in header: {e}") from None
    return key, payload_len, payload_crc


def _check_name(path: Path, key: ChunkKey) -> None:
    if path.name != key.file_stem() + FILE_SUFFIX:
        raise CorruptChunk(f"file name does not match its key {key.file_stem()}")


def read_chunk_file(path: Path, expected: ChunkKey | None = None) -> bytes:
    """The verified payload of the chunk file at `path`.

    Raises CorruptChunk on any damage or when the key is not `expected`, and
    FileNotFoundError when the file is gone.
    """
    with open(path, "rb") as f:
        key, payload_len, payload_crc = _read_header(f)
        payload = f.read(payload_len + 1)  # one extra byte detects trailing garbage
    if expected is not None and key != expected:
        raise CorruptChunk("file holds another key")
    _check_name(path, key)
    if len(payload) != payload_len:
        raise CorruptChunk(f"payload is {len(payload)} bytes, header says {payload_len}")
    if zlib.crc32(payload) != payload_crc:
        raise CorruptChunk("payload checksum mismatch")
    return payload


def scan_chunk_file(path: Path, *, verify_payload: bool = False) -> tuple[ChunkKey, int]:
    """(key, file size) of a chunk file, checking header, name and length (and, with
    `verify_payload`, the payload checksum, which reads the whole file). Raises CorruptChunk."""
    if verify_payload:
        payload = read_chunk_file(path)
        with open(path, "rb") as f:
            key, _, _ = _read_header(f)
        return key, header_bytes(key) + len(payload)
    with open(path, "rb") as f:
        key, payload_len, _ = _read_header(f)
        size = os.fstat(f.fileno()).st_size
    _check_name(path, key)
    if size != header_bytes(key) + payload_len:
        raise CorruptChunk(f"file is {size} bytes, header says {header_bytes(key) + payload_len}")
    return key, size

"""File contents on disk: uploaded batch inputs and generated batch results.

Each file lives at `<directory>/<file_id>.jsonl`, named after its generated id only (never a
user string). A file is written to `<file_id>.part`, flushed to disk, then renamed, so a crash
leaves either the whole file or a `.part` that `sweep` removes at the next start.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Collection, Mapping
from pathlib import Path
from types import TracebackType

from antiphon.private import open_private, private_dir
from antiphon.server.batch_types import FILE_ID_RE
from antiphon.server.errors import ApiError, ErrorCode

_SUFFIX = ".jsonl"
_PART_SUFFIX = ".part"


class FileTooLarge(ApiError):
    """`too_large`: a file, or the upload body carrying it, past the bytes it may take."""

    def __init__(self, max_bytes: int) -> None:
        super().__init__(ErrorCode.TOO_LARGE, f"file exceeds {max_bytes} bytes")
        self.max_bytes = max_bytes


class FileWriter:
    """Appends bytes to a new file, refusing more than `max_bytes`. Use as a context manager:
    leaving it without `commit()` deletes what was written."""

    def __init__(self, path: Path, max_bytes: int | None = None) -> None:
        self.path = path
        self.max_bytes = max_bytes
        self.num_bytes = 0
        self._part = path.with_suffix(_PART_SUFFIX)
        self._file = os.fdopen(open_private(self._part), "wb")
        self._is_committed = False

    def write(self, data: bytes) -> None:
        """Append `data`; raises `too_large` past the limit (and writes none of it)."""
        if self.max_bytes is not None and self.num_bytes + len(data) > self.max_bytes:
            raise FileTooLarge(self.max_bytes)
        self._file.write(data)
        self.num_bytes += len(data)

    def commit(self) -> None:
        """Make the file durable under its final name (blocking: fsync, rename, fsync dir)."""
        self._file.flush()
        os.fsync(self._file.fileno())
        self._file.close()
        os.replace(self._part, self.path)
        fsync_dir(self.path.parent)
        self._is_committed = True

    def __enter__(self) -> FileWriter:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if not self._is_committed:
            try:
                # a close that fails to write the buffered bytes (a full disk: the commit's
                # flush failed the same way) still closes the file, which must go all the same
                with contextlib.suppress(OSError):
                    self._file.close()
            finally:
                self._part.unlink(missing_ok=True)


class UploadReservations:
    """Bytes set aside, per owner, for uploads still streaming in. An upload takes its room
    before its first byte and gives it back once its file is kept or gone, so the uploads of
    one owner in flight together cannot put more than its limit on disk. Event loop only."""

    def __init__(self) -> None:
        self._num_bytes: dict[str, int] = {}  # owner -> bytes reserved, owners with some only

    def num_reserved(self, owner: str) -> int:
        return self._num_bytes.get(owner, 0)

    def reserve(self, owner: str, num_bytes: int) -> None:
        """Hold `num_bytes` for `owner` until `release` gives them back."""
        self._num_bytes[owner] = self.num_reserved(owner) + num_bytes

    def release(self, owner: str, num_bytes: int) -> None:
        left = self._num_bytes.pop(owner) - num_bytes
        assert left >= 0, f"{owner} released more than it reserved"
        if left:
            self._num_bytes[owner] = left


class FileStore:
    def __init__(self, directory: Path) -> None:
        self.directory = private_dir(directory)
        self.uploads_in_flight = UploadReservations()

    def path(self, file_id: str) -> Path:
        """Where the file `file_id` lives; raises ValueError for an id the server cannot have
        generated (so no request string ever becomes a path)."""
        if not FILE_ID_RE.match(file_id):
            raise ValueError(f"not a file id: {file_id!r}")
        return self.directory / (file_id + _SUFFIX)

    def create(self, file_id: str, max_bytes: int | None = None) -> FileWriter:
        return FileWriter(self.path(file_id), max_bytes)

    def sweep(self, keep: Collection[str]) -> list[str]:
        """Delete partial files and files no id in `keep` names (left by a crash between
        writing a file and registering it). Call only while nothing is being written.
        Returns the names deleted."""
        deleted = []
        for entry in self.directory.iterdir():
            is_kept = entry.suffix == _SUFFIX and entry.stem in keep
            if entry.is_file() and not is_kept:
                entry.unlink()
                deleted.append(entry.name)
        return deleted

    def check_integrity(self, sizes: Mapping[str, int]) -> None:
        """Raise AssertionError unless each registered file (id -> bytes) is on disk whole."""
        for file_id, num_bytes in sizes.items():
            path = self.path(file_id)
            assert path.is_file(), f"{file_id} is registered but missing"
            assert path.stat().st_size == num_bytes, f"{file_id} is not {num_bytes} bytes"


def fsync_dir(directory: Path) -> None:
    """Make the names in `directory` durable (a rename into it, say)."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)

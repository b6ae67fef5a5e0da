"""What the server stores (conversations, uploaded documents, their KV) is readable by the
user it runs as alone: folders 0700, files 0600, whatever the umask."""

from __future__ import annotations

import errno
import os
from pathlib import Path

DIR_MODE = 0o700
FILE_MODE = 0o600


def private_dir(path: Path, *, tighten: bool = True) -> Path:
    """Create `path` (with its parents) if missing; it, not its parents, is 0700 then, and
    with `tighten` made so if others could read it (not an operator's own data folder, whose
    contents are private all the same)."""
    if path.exists() and not path.is_dir():  # (mkdir would say "File exists")
        raise NotADirectoryError(errno.ENOTDIR, os.strerror(errno.ENOTDIR), str(path))
    path.mkdir(parents=True, exist_ok=True, mode=DIR_MODE)
    if tighten:
        _tighten(path, DIR_MODE)
    return path


def private_file(path: Path) -> Path:
    """Create `path` empty if missing; it is 0600 then, and tightened to it if others could
    read it (as are SQLite's `-wal` and `-shm` beside it, which take the file's mode)."""
    os.close(os.open(path, os.O_WRONLY | os.O_CREAT, FILE_MODE))
    for each in (path, Path(f"{path}-wal"), Path(f"{path}-shm")):
        if each.exists():
            _tighten(each, FILE_MODE)
    return path


def open_private(path: Path) -> int:
    """A new file at `path` (O_EXCL: it must not exist), 0600, open for writing."""
    return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, FILE_MODE)


def _tighten(path: Path, mode: int) -> None:
    if path.stat().st_mode & 0o077:
        path.chmod(mode)

"""One server per data folder: an exclusive lock on `<data-dir>/.lock`, held while it runs.

Two servers on one folder would run each batch item twice and sweep each other's uploads in
flight as strays; the SSD tier's own lock covers only its folder, and only with tiering on.
"""

from __future__ import annotations

import fcntl
import os
from pathlib import Path


class DataDirInUseError(RuntimeError):
    """Another process holds the data folder."""


def lock_data_dir(data_dir: Path) -> int:
    """Lock `data_dir` (created if missing) for this process; returns the lock's file
    descriptor (closing it, or the process ending, releases the lock). Raises
    DataDirInUseError naming the holder's pid when another process holds it."""
    data_dir.mkdir(parents=True, exist_ok=True)
    fd = os.open(data_dir / ".lock", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
        os.close(fd)
        raise DataDirInUseError(f"{data_dir} is in use by another antiphon server (pid "
                                f"{holder}); give this one its own --data-dir") from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, str(os.getpid()).encode(), 0)
    return fd

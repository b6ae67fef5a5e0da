"""One server per data folder: an exclusive lock on `<data-dir>/.lock`, held while it runs.

Two servers on one folder would run each batch item twice and sweep each other's uploads in
flight as strays; the SSD tier's own lock covers only its folder, and only with tiering on.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import time
from pathlib import Path

from antiphon.engine_ext.orphan import GRACE_S, POLL_S
from antiphon.private import private_dir, private_file

logger = logging.getLogger(__name__)

# How long a start waits for the SSD tier's lock: the engine of a server killed alone holds
# it until it has stopped (it notices within `POLL_S`, and is killed `GRACE_S` after it was
# asked to stop), and a supervisor restarts the server at once (systemd: 100 ms).
SSD_LOCK_WAIT_S = POLL_S + GRACE_S + 4.0


# A backup writes this file into its folder first and removes it last: a folder that holds
# it is a backup that did not finish (killed midway), which no server may start from.
UNFINISHED_BACKUP = "BACKUP-UNFINISHED"


class DataDirInUseError(RuntimeError):
    """Another process holds the data folder."""


class UnfinishedBackupError(RuntimeError):
    """The data folder is a backup that did not finish."""


def check_not_unfinished_backup(data_dir: Path) -> None:
    """Raise UnfinishedBackupError where `data_dir` is a backup that did not finish: some of
    its databases may be missing, and a server started on it would make them anew, empty."""
    if (data_dir / UNFINISHED_BACKUP).exists():
        raise UnfinishedBackupError(
            f"{data_dir} is a backup that did not finish ({UNFINISHED_BACKUP} is in it): back "
            "up again into an empty folder, or start from another")


def try_lock(path: Path, mode: int = 0o644) -> int | None:
    """An exclusive flock on `path` (created if missing) for this process: its file
    descriptor (closing it, or the process ending, releases the lock), or None when another
    process holds it."""
    return _locked(os.open(path, os.O_RDWR | os.O_CREAT, mode))


def _locked(fd: int) -> int | None:
    """`fd`, exclusively flocked for this process; None (closed) where another holds it."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    return fd


def lock_data_dir(data_dir: Path) -> int:
    """Lock `data_dir` (created if missing) for this process; returns the lock's file
    descriptor. Raises DataDirInUseError naming the holder's pid when another process holds
    it."""
    private_dir(data_dir, tighten=False)
    path = private_file(data_dir / ".lock")  # 0600, as every file of the folder
    fd = try_lock(path)
    if fd is None:
        raise DataDirInUseError(f"{data_dir} is in use by another antiphon server (pid "
                                f"{holder(path)}); give this one its own --data-dir")
    with contextlib.suppress(OSError):  # (the pid only names the holder: a full disk may
        record_holder(fd)               # refuse it, and the lock holds all the same)
    return fd


def record_holder(fd: int) -> None:
    """Write this process's pid into the lock file `fd` holds, for `holder` to name."""
    os.ftruncate(fd, 0)
    os.pwrite(fd, str(os.getpid()).encode(), 0)


def holder(path: Path) -> str:
    """The pid the holder of the lock file `path` recorded ("unknown" where none)."""
    return path.read_text(errors="replace").strip()[:32] or "unknown"


def check_ssd_dir_free(ssd_dir: Path, wait_s: float = SSD_LOCK_WAIT_S) -> None:
    """Raise DataDirInUseError when another process's SSD tier holds `ssd_dir` (its
    `.lock`) for `wait_s`: said before the model loads, not by the engine after it (two
    servers given one --ssd-dir). The wait is for the engine of a server killed just before,
    which stops within it. Takes and lets go of the lock; a folder not there yet is free."""
    path = ssd_dir / ".lock"
    if not path.exists():
        return
    deadline = time.monotonic() + wait_s
    waited = False
    while (fd := _probe_lock(path)) is None:
        if time.monotonic() >= deadline:
            raise DataDirInUseError(f"{ssd_dir} is in use by another server's SSD tier (pid "
                                    f"{holder(path)}); give this one its own --ssd-dir")
        if not waited:
            logger.warning("%s is held by pid %s: waiting up to %.0f s for it (the engine of "
                           "a server killed just before stops within that)", ssd_dir,
                           holder(path), wait_s)
            waited = True
        time.sleep(0.2)
    if fd >= 0:
        os.close(fd)


def _probe_lock(path: Path) -> int | None:
    """`try_lock` for a look, read-only (a flock needs no write access): -1 where the file
    cannot be opened at all, a folder on a disk gone read-only for one, which is not another
    server's: the SSD tier finds it unusable when it starts, and serves from the host tier."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError as e:
        logger.warning("cannot look at %s (%s): leaving it to the SSD tier", path, e)
        return -1
    return _locked(fd)

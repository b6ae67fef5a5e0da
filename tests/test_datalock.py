"""One server per data folder."""

from __future__ import annotations

import errno
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from antiphon.datalock import DataDirInUseError, lock_data_dir, try_lock


def test_a_second_holder_is_refused_until_the_first_lets_go(tmp_path: Path) -> None:
    fd = lock_data_dir(tmp_path / "data")
    with pytest.raises(DataDirInUseError, match=f"pid {os.getpid()}"):
        lock_data_dir(tmp_path / "data")
    os.close(fd)
    os.close(lock_data_dir(tmp_path / "data"))
    old_umask = os.umask(0o022)
    try:
        (tmp_path / "old").mkdir(mode=0o700)
        (tmp_path / "old" / ".lock").write_text("1")  # 0644, from before
        os.close(lock_data_dir(tmp_path / "old"))
        os.close(lock_data_dir(tmp_path / "new"))
    finally:
        os.umask(old_umask)
    for folder in ("data", "old", "new"):  # it names the holder's pid: the user's alone
        assert (tmp_path / folder / ".lock").stat().st_mode & 0o777 == 0o600


def test_serve_refuses_a_data_folder_another_server_holds(tmp_path: Path) -> None:
    fd = lock_data_dir(tmp_path)
    try:
        done = subprocess.run([sys.executable, "-m", "antiphon", "serve", "--data-dir",
                               str(tmp_path), "--port", "8199"], capture_output=True, text=True,
                              timeout=120)
    finally:
        os.close(fd)
    assert done.returncode == 2
    assert f"is in use by another antiphon server (pid {os.getpid()})" in done.stderr
    assert not (tmp_path / "sessions.sqlite3").exists()  # refused before opening anything


def test_an_ssd_folder_another_tier_holds_is_refused_before_the_engine(tmp_path: Path) -> None:
    from antiphon.datalock import check_ssd_dir_free
    from antiphon.tiering.ssd_tier import _lock_directory

    check_ssd_dir_free(tmp_path / "none-yet")  # free: nothing there, nothing made
    assert not (tmp_path / "none-yet").exists()
    (tmp_path / "kv").mkdir()
    held = _lock_directory(tmp_path / "kv")  # as a running server's SSD tier holds it
    try:
        started = time.monotonic()
        with pytest.raises(DataDirInUseError, match=f"pid {os.getpid()}.*--ssd-dir"):
            check_ssd_dir_free(tmp_path / "kv", wait_s=0.5)
        assert time.monotonic() - started >= 0.5
    finally:
        os.close(held)
    check_ssd_dir_free(tmp_path / "kv")  # let go: free again


def test_a_start_waits_for_the_ssd_tier_of_an_engine_still_stopping(tmp_path: Path) -> None:
    """A server killed alone leaves its engine stopping for up to about 11 s (it aborts its
    requests; killed 10 s after it was asked to stop), holding the SSD tier's lock: a
    restart then (a supervisor's, 100 ms after) was refused, and systemd gave up after five."""
    from antiphon.datalock import SSD_LOCK_WAIT_S, check_ssd_dir_free

    (tmp_path / "kv").mkdir()
    held = try_lock(tmp_path / "kv" / ".lock")
    assert held is not None
    threading.Timer(1.0, os.close, [held]).start()  # the old engine ends
    started = time.monotonic()
    check_ssd_dir_free(tmp_path / "kv")
    assert 1.0 <= time.monotonic() - started < 2.0
    assert SSD_LOCK_WAIT_S > 11


def test_the_ssd_tier_takes_its_lock_on_a_full_disk(tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """Its pid in the lock file is a courtesy: on a full disk (no block for it) the tier
    still opens, as it did before the pid was written."""
    import errno

    from antiphon.tiering.ssd_tier import _lock_directory

    def full(*args: object) -> int:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "pwrite", full)
    fd = _lock_directory(tmp_path)
    monkeypatch.undo()
    assert try_lock(tmp_path / ".lock") is None  # held
    os.close(fd)


def test_an_ssd_folder_on_a_read_only_disk_is_left_to_the_tier(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A folder used before (its `.lock` there) on a disk gone read-only: the look before the
    engine needs no write access, and does not refuse the start (the SSD tier then finds the
    folder unusable and serves from the host tier)."""
    from antiphon import datalock
    from antiphon.datalock import check_ssd_dir_free

    (tmp_path / "kv").mkdir()
    (tmp_path / "kv" / ".lock").write_text("123")
    real_open = os.open

    def read_only_disk(path: object, flags: int, *args: object) -> int:
        if flags & (os.O_RDWR | os.O_WRONLY | os.O_CREAT):
            raise OSError(errno.EROFS, "Read-only file system", str(path))
        return real_open(path, flags, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(datalock.os, "open", read_only_disk)
    check_ssd_dir_free(tmp_path / "kv", wait_s=0.1)


def test_a_full_disk_refusing_the_pid_still_locks_the_data_folder(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The pid in `.lock` only names the holder: a disk too full to take it leaves the lock
    held and the start going (it failed and left the lock held by a leaked descriptor)."""
    from antiphon import datalock

    def full(*_: object) -> int:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(datalock.os, "pwrite", full)
    fd = lock_data_dir(tmp_path)
    try:
        assert try_lock(tmp_path / ".lock") is None  # held, by this descriptor
    finally:
        os.close(fd)
    again = try_lock(tmp_path / ".lock")
    assert again is not None
    os.close(again)

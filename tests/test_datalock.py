"""One server per data folder."""

from __future__ import annotations

import os
import subprocess
import sys
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

    check_ssd_dir_free(tmp_path / "none-yet")  # free: nothing there, nothing made
    assert not (tmp_path / "none-yet").exists()
    (tmp_path / "kv").mkdir()
    held = try_lock(tmp_path / "kv" / ".lock")  # as a running server's SSD tier holds it
    assert held is not None
    try:
        with pytest.raises(DataDirInUseError, match="--ssd-dir"):
            check_ssd_dir_free(tmp_path / "kv")
    finally:
        os.close(held)
    check_ssd_dir_free(tmp_path / "kv")  # let go: free again

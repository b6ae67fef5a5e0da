"""Shared-memory segments a killed engine left: recorded at start, swept by the next server."""

from __future__ import annotations

import json
import mmap
from pathlib import Path

from antiphon.shmsweep import RECORD_NAME, EngineSegments


def _segment(shm: Path, name: str) -> Path:
    path = shm / name
    path.write_bytes(bytes(4096))
    return path


def test_a_clean_shutdown_leaves_no_record(tmp_path: Path) -> None:
    shm = tmp_path / "shm"
    shm.mkdir()
    segments = EngineSegments(tmp_path, shm)
    before = segments.names()
    _segment(shm, "psm_engine")
    segments.remember(before)
    assert json.loads((tmp_path / RECORD_NAME).read_text())["segments"] == ["psm_engine"]
    segments.forget()
    assert not (tmp_path / RECORD_NAME).exists()
    assert EngineSegments(tmp_path, shm).sweep() == []
    assert (shm / "psm_engine").exists()  # a clean engine unlinks its own; never swept


def test_the_next_start_removes_what_a_killed_engine_left_and_nothing_else(
        tmp_path: Path) -> None:
    shm = tmp_path / "shm"
    shm.mkdir()
    other = _segment(shm, "psm_someone_else")  # there before the engine: not ours
    first = EngineSegments(tmp_path, shm)
    before = first.names()
    left = _segment(shm, "psm_killed")
    in_use = _segment(shm, "psm_orphan_core")
    semaphore = _segment(shm, "sem.mp-killed")
    first.remember(before)  # ... and the server is killed: no `forget`
    unrelated = _segment(shm, "psm_later")  # another program's, after the record

    with open(in_use, "r+b") as f, mmap.mmap(f.fileno(), 4096):  # a live process maps it
        second = EngineSegments(tmp_path, shm)
        assert second.sweep() == ["psm_killed", "sem.mp-killed"]
        assert not semaphore.exists()
        assert not left.exists()
        assert other.exists() and unrelated.exists() and in_use.exists()
        second.remember(second.names())
    # Still mapped at the sweep, so still recorded: the start after removes it.
    assert json.loads((tmp_path / RECORD_NAME).read_text())["segments"] == ["psm_orphan_core"]
    assert EngineSegments(tmp_path, shm).sweep() == ["psm_orphan_core"]
    assert other.exists() and unrelated.exists()


def test_a_damaged_record_is_dropped_and_touches_nothing(tmp_path: Path) -> None:
    shm = tmp_path / "shm"
    shm.mkdir()
    kept = _segment(shm, "psm_x")
    for text in ("{not json", json.dumps({"segments": ["../etc", "/dev/shm/psm_x", 3]})):
        (tmp_path / RECORD_NAME).write_text(text)
        assert EngineSegments(tmp_path, shm).sweep() == []
        assert kept.exists() and not (tmp_path / RECORD_NAME).exists()


def test_no_shm_folder_tracks_nothing(tmp_path: Path) -> None:
    segments = EngineSegments(tmp_path, tmp_path / "missing")
    assert segments.names() == set()
    segments.remember(set())
    assert segments.sweep() == []

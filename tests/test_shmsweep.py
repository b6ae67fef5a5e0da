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


def _lifespan(tmp_path: Path, engine: object) -> None:
    """Run the app's start-up and shutdown over `engine` (no server)."""
    import asyncio

    from antiphon.server.app import create_app
    from tests.conftest import scripted_config

    app = create_app(scripted_config(tmp_path), engine)  # type: ignore[arg-type]

    async def run() -> None:
        async with app.router.lifespan_context(app):
            pass
    asyncio.run(run())


def test_the_segments_are_recorded_while_the_engine_still_starts(tmp_path: Path) -> None:
    # Recorded once the engine's start had returned, after a first start's profiling (up to
    # 2 minutes): a kill then left segments no record named (found by a review).
    import asyncio
    import os

    from antiphon.engine_ext.scripted import ScriptedEngine
    from antiphon.shmsweep import SHM_DIR

    name = f"psm_antiphontest{os.getpid()}"
    seen: list[object] = []

    class Profiling(ScriptedEngine):
        async def start(self) -> None:
            (SHM_DIR / name).write_bytes(b"x")  # vLLM's engine is up
            await asyncio.sleep(1.5)  # the cost model is being profiled
            record = tmp_path / RECORD_NAME  # (a kill now)
            seen.append(json.loads(record.read_text())["segments"] if record.exists() else None)
            await super().start()

    try:
        _lifespan(tmp_path, Profiling())
    finally:
        (SHM_DIR / name).unlink(missing_ok=True)
    assert seen == [[name]]


def test_a_failed_start_keeps_a_predecessors_segments_still_mapped_on_record(
        tmp_path: Path) -> None:
    # `sweep` keeps a killed predecessor's segments its orphaned engine still maps for the
    # next `remember`, which a failed start never reached: no later start removed them.
    import os

    import pytest

    from antiphon.engine_ext.scripted import ScriptedEngine
    from antiphon.shmsweep import SHM_DIR

    class FailingStart(ScriptedEngine):
        async def start(self) -> None:
            raise RuntimeError("Engine core initialization failed")

    name = f"psm_antiphontest{os.getpid()}"
    segment = SHM_DIR / name
    segment.write_bytes(bytes(4096))
    try:
        with segment.open("r+b") as f, mmap.mmap(f.fileno(), 4096):  # the orphan maps it
            (tmp_path / RECORD_NAME).write_text(json.dumps({"pid": 1, "segments": [name]}))
            with pytest.raises(RuntimeError, match="initialization failed"):
                _lifespan(tmp_path, FailingStart())
        assert EngineSegments(tmp_path).sweep() == [name]  # the orphan gone: the next start
    finally:
        segment.unlink(missing_ok=True)

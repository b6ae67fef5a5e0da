"""Shared-memory segments a killed engine left: recorded at start, swept by the next server."""

from __future__ import annotations

import json
import mmap
from pathlib import Path

from antiphon.shmsweep import RECORD_NAME, EngineSegments


def _segment(shm: Path, name: str, held: list[mmap.mmap] | None = None) -> Path:
    """A segment, mapped into this process (as the engine's processes map theirs) and kept
    in `held` where given; else another program's, mapped by none."""
    path = shm / name
    path.write_bytes(bytes(4096))
    if held is not None:
        with open(path, "r+b") as f:
            held.append(mmap.mmap(f.fileno(), 4096))
    return path


def test_a_clean_shutdown_leaves_no_record(tmp_path: Path) -> None:
    shm = tmp_path / "shm"
    shm.mkdir()
    segments = EngineSegments(tmp_path, shm)
    before = segments.names()
    held: list[mmap.mmap] = []
    _segment(shm, "psm_engine", held)
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
    engine: list[mmap.mmap] = []  # the engine's processes' mappings
    left = _segment(shm, "psm_killed", engine)
    semaphore = _segment(shm, "sem.mp-killed", engine)
    core: list[mmap.mmap] = []
    in_use = _segment(shm, "psm_orphan_core", core)
    # Another program's, made while the engine started (a process in another container
    # sharing /dev/shm, or one that made it and handed its name on): it was recorded, and
    # swept from under its owner.
    meanwhile = _segment(shm, "psm_made_meanwhile")
    first.remember(before)  # ... and the server is killed: no `forget`
    for mapping in engine:
        mapping.close()  # (its processes are gone; the orphaned core maps on)
    unrelated = _segment(shm, "psm_later")  # another program's, after the record

    second = EngineSegments(tmp_path, shm)
    assert second.sweep() == ["psm_killed", "sem.mp-killed"]
    assert not semaphore.exists()
    assert not left.exists()
    assert other.exists() and unrelated.exists() and in_use.exists() and meanwhile.exists()
    second.remember(second.names())
    core[0].close()
    # Still mapped at the sweep, so still recorded: the start after removes it.
    assert json.loads((tmp_path / RECORD_NAME).read_text())["segments"] == ["psm_orphan_core"]
    assert EngineSegments(tmp_path, shm).sweep() == ["psm_orphan_core"]
    assert other.exists() and unrelated.exists()


def test_a_damaged_record_is_dropped_and_touches_nothing(tmp_path: Path) -> None:
    shm = tmp_path / "shm"
    shm.mkdir()
    kept = _segment(shm, "psm_x")
    # (a record that parses, but not as a list of names, failed every start: found by a review)
    for text in ("{not json", json.dumps({"segments": ["../etc", "/dev/shm/psm_x", 3]}),
                 json.dumps({"segments": None}), json.dumps({"segments": 5})):
        (tmp_path / RECORD_NAME).write_text(text)
        assert EngineSegments(tmp_path, shm).sweep() == []
        assert kept.exists() and not (tmp_path / RECORD_NAME).exists()


def test_no_shm_folder_tracks_nothing(tmp_path: Path) -> None:
    segments = EngineSegments(tmp_path, tmp_path / "missing")
    assert segments.names() == set()
    segments.remember(set())
    assert segments.sweep() == []


def _lifespan(tmp_path: Path, engine: object, shm: Path) -> None:
    """Run the app's start-up and shutdown over `engine` (no server), its engine's segments
    looked for in `shm` (not /dev/shm: another process's would come and go there)."""
    import asyncio

    import pytest

    from antiphon.server import app as app_module
    from tests.conftest import scripted_config

    class Segments(EngineSegments):
        def __init__(self, data_dir: Path) -> None:
            super().__init__(data_dir, shm)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(app_module, "EngineSegments", Segments)
        app = app_module.create_app(scripted_config(tmp_path), engine)  # type: ignore[arg-type]

        async def run() -> None:
            async with app.router.lifespan_context(app):
                pass
        asyncio.run(run())


def test_the_segments_are_recorded_while_the_engine_still_starts(tmp_path: Path) -> None:
    # Recorded once the engine's start had returned, after a first start's profiling (up to
    # 2 minutes) and vLLM's model load (which blocks the event loop): a kill then left
    # segments no record named (found by a review).
    import threading
    import time

    from antiphon.engine_ext.scripted import ScriptedEngine

    shm = tmp_path / "shm"
    shm.mkdir()
    seen: list[object] = []

    held: list[mmap.mmap] = []

    class Loading(ScriptedEngine):
        async def start(self) -> None:
            _segment(shm, "psm_engine", held)  # vLLM's engine is up
            time.sleep(1.5)  # the model's load blocks the event loop
            record = tmp_path / RECORD_NAME  # (a kill now)
            seen.append(json.loads(record.read_text())["segments"] if record.exists() else None)
            await super().start()

    _lifespan(tmp_path, Loading(), shm)
    assert seen == [["psm_engine"]]
    assert all(t.name != "engine-shm-record" for t in threading.enumerate())  # (joined)


def test_a_failed_start_keeps_a_predecessors_segments_still_mapped_on_record(
        tmp_path: Path) -> None:
    # `sweep` keeps a killed predecessor's segments its orphaned engine still maps for the
    # next `remember`, which a failed start never reached: no later start removed them.
    import pytest

    from antiphon.engine_ext.scripted import ScriptedEngine

    class FailingStart(ScriptedEngine):
        async def start(self) -> None:
            raise RuntimeError("Engine core initialization failed")

    shm = tmp_path / "shm"
    shm.mkdir()
    segment = _segment(shm, "psm_predecessor")
    with segment.open("r+b") as f, mmap.mmap(f.fileno(), 4096):  # the orphan maps it
        (tmp_path / RECORD_NAME).write_text(json.dumps({"pid": 1,
                                                        "segments": ["psm_predecessor"]}))
        with pytest.raises(RuntimeError, match="initialization failed"):
            _lifespan(tmp_path, FailingStart(), shm)
    assert EngineSegments(tmp_path, shm).sweep() == ["psm_predecessor"]  # the next start


def test_a_proc_that_cannot_be_listed_records_nothing_new_and_raises_nothing(
        tmp_path: Path) -> None:
    import pytest

    from antiphon import shmsweep

    def denied(root: int) -> list[int]:
        raise PermissionError(13, "Permission denied", "/proc")

    shm = tmp_path / "shm"
    shm.mkdir()
    segments = EngineSegments(tmp_path, shm)
    before = segments.names()
    held: list[mmap.mmap] = []
    _segment(shm, "psm_engine", held)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(shmsweep, "_process_tree", denied)
        segments.remember(before)  # (it stopped the server's start)
    assert json.loads((tmp_path / RECORD_NAME).read_text())["segments"] == []
    segments.remember(before)  # listed again later: recorded
    assert json.loads((tmp_path / RECORD_NAME).read_text())["segments"] == ["psm_engine"]

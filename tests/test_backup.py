"""`antiphon backup`: a copy of a data folder taken while the server writes to it, that a new
server starts from with every session, message and batch result."""

from __future__ import annotations

import asyncio
import os
import sqlite3
import threading
from pathlib import Path

import httpx
import openai
import pytest
from websockets.asyncio.client import connect

from antiphon import backup_cli, datalock
from antiphon.cli import main
from antiphon.engine_ext.scripted import ScriptedEngine
from tests.conftest import scripted_config
from tests.liveserver import live_server
from tests.test_batches import jsonl, lines_of, submit, wait_finished
from tests.wsclient import chat, open_session


async def converse(url: str, sessions: int, turns: int) -> list[str]:
    async with connect(url.replace("http://", "ws://") + "/v1/ws") as ws:
        ids = []
        for s in range(sessions):
            sid = (await open_session(ws))["session"]["session_id"]
            for t in range(turns):
                await chat(ws, sid, f"session {s} turn {t}")
            ids.append(sid)
        return ids


def test_a_backup_taken_while_the_server_writes_restores_every_session_and_batch(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    data, dest = tmp_path / "data", tmp_path / "backup"
    config = scripted_config(data)
    with live_server(config, ScriptedEngine()) as url:
        sids = asyncio.run(converse(url, 3, 2))
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
        batch_id = submit(client, jsonl(20))
        batch = wait_finished(url, batch_id)
        stop = threading.Event()

        def keep_writing() -> None:  # the server goes on writing during the backup
            while not stop.is_set():
                asyncio.run(converse(url, 1, 1))

        writer = threading.Thread(target=keep_writing)
        writer.start()
        try:
            assert main(["backup", str(dest), "--data-dir", str(data)]) == 0
        finally:
            stop.set()
            writer.join()
        assert main(["backup", str(dest), "--data-dir", str(data)]) == 2  # not over a backup
    out, err = capsys.readouterr()
    assert "is not empty" in err and "sessions.sqlite3: " in out and "files: 2 " in out

    with live_server(scripted_config(dest), ScriptedEngine()) as url:
        listed = {s["session_id"] for s in httpx.get(url + "/v1/sessions").json()["sessions"]}
        assert set(sids) <= listed
        for sid in sids:
            messages = httpx.get(f"{url}/v1/sessions/{sid}").json()["messages"]
            assert [m["content"] for m in messages][:2] == [
                messages[0]["content"], "You said: " + messages[0]["content"]]
            assert len(messages) == 4
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
        restored = client.batches.retrieve(batch_id)
        assert restored.status == "completed" and restored.request_counts.completed == 20
        assert len(lines_of(client, restored.output_file_id)) == 20
        assert restored.output_file_id == batch["output_file_id"]


def test_backup_refuses_a_folder_without_a_database(tmp_path: Path,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["backup", str(tmp_path / "out"), "--data-dir", str(tmp_path)]) == 2
    assert "holds no Antiphon database" in capsys.readouterr().err


def test_a_backup_holds_its_folder_from_servers_and_leaves_it_as_found_when_refused(
        tmp_path: Path) -> None:
    """A server started on the backup's folder as it began made databases the backup's then
    replaced under it: the backup now locks the folder as a server does."""
    from antiphon.datalock import DataDirInUseError, lock_data_dir

    data = tmp_path / "data"
    data.mkdir()
    sqlite3.connect(data / "sessions.sqlite3").close()
    dest = tmp_path / "out"
    fd = lock_data_dir(dest)  # a server holds it (its databases not made yet)
    try:
        with pytest.raises(DataDirInUseError, match="back up into another folder"):
            backup_cli.backup(data, dest)
        assert [p.name for p in dest.iterdir()] == [".lock"]
        assert main(["backup", str(dest), "--data-dir", str(data)]) == 2  # said, no traceback
    finally:
        os.close(fd)
    (dest / ".lock").unlink()
    locked = []
    real_copy = backup_cli._copy_database

    def copy_while_a_server_starts(source: Path, target: Path) -> dict[str, int]:
        fd = datalock.try_lock(dest / ".lock")
        locked.append(fd is not None)
        if fd is not None:
            os.close(fd)
        return real_copy(source, target)

    backup_cli._copy_database = copy_while_a_server_starts  # type: ignore[assignment]
    try:
        backup_cli.backup(data, dest)
    finally:
        backup_cli._copy_database = real_copy  # type: ignore[assignment]
    assert locked == [False]  # the backup held it
    assert (dest / "sessions.sqlite3").is_file()


def test_a_backup_that_cannot_copy_a_file_fails_and_one_deleted_meanwhile_is_marked(
        tmp_path: Path, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    # A full disk gave a traceback and left a truncated copy under the file's own name, which
    # a server started on the backup served; a file deleted after the snapshot stayed listed
    # in the copy's database (counted against its key's room, its content a 404).
    import errno
    import shutil

    from antiphon.server.batch_store import BatchStore
    from antiphon.server.file_store import FileStore

    data = tmp_path / "data"
    with live_server(scripted_config(data), ScriptedEngine()) as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
        batch = wait_finished(url, submit(client, jsonl(3)))
    copyfileobj = shutil.copyfileobj

    def disk_full(src: object, dst: object, *args: object) -> None:
        copyfileobj(src, dst, 16)  # type: ignore[arg-type]
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(shutil, "copyfileobj", disk_full)
    full = tmp_path / "full"
    assert main(["backup", str(full), "--data-dir", str(data)]) == 2
    assert "No space left on device" in capsys.readouterr().err
    assert not full.exists()  # no partial copy, under any name (it made the folder)
    monkeypatch.undo()
    # A database that cannot be copied: the one copied before it went with it (a whole
    # sessions database stayed, beside an empty batch one, and a server started on the
    # folder served it, with every batch job lost).
    copy_database = backup_cli._copy_database

    def batches_full(source: Path, target: Path) -> dict[str, int]:
        if source.name == "batches.sqlite3":
            target.write_bytes(b"")
            raise sqlite3.OperationalError("database or disk is full")
        return copy_database(source, target)

    monkeypatch.setattr(backup_cli, "_copy_database", batches_full)
    empty = tmp_path / "empty"
    empty.mkdir()
    assert main(["backup", str(empty), "--data-dir", str(data)]) == 2
    assert "disk is full" in capsys.readouterr().err
    assert empty.is_dir() and not list(empty.iterdir())  # (the folder was there before)
    monkeypatch.undo()

    gone = FileStore(data / "files").path(batch["output_file_id"])
    gone.unlink()  # as a DELETE /v1/files between the snapshot and the copy leaves it
    dest = tmp_path / "backup"
    assert main(["backup", str(dest), "--data-dir", str(data)]) == 0
    assert "1 deleted meanwhile" in capsys.readouterr().out
    store = BatchStore(dest / "batches.sqlite3")
    try:
        sizes = store.file_sizes()
        assert batch["output_file_id"] not in sizes and batch["input_file_id"] in sizes
        FileStore(dest / "files").check_integrity(sizes)
    finally:
        store.close()


def test_a_backup_killed_between_its_renames_is_no_folder_a_server_starts_from(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A backup killed (SIGKILL, power loss) after the batch database took its name, before
    the sessions one did: a server started on the folder served with every session gone (it
    made a new, empty database). The folder keeps the marker the backup wrote first, and
    `serve` refuses it."""
    import os
    import subprocess
    import sys
    import textwrap

    from tests.conftest import default_model_or_skip

    data, dest = tmp_path / "data", tmp_path / "dest"
    with live_server(scripted_config(data), ScriptedEngine()) as url:
        asyncio.run(converse(url, 1, 1))
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
        wait_finished(url, submit(client, jsonl(2)))
    killed_midway = textwrap.dedent(f"""
        import os
        from pathlib import Path
        from antiphon import backup_cli
        replace, renamed = os.replace, []
        def replace_then_die(source, target):
            replace(source, target)
            renamed.append(target)
            if Path(target).name == "batches.sqlite3":
                os._exit(9)
        backup_cli.os.replace = replace_then_die
        backup_cli.backup(Path({str(data)!r}), Path({str(dest)!r}))
    """)
    done = subprocess.run([sys.executable, "-c", killed_midway], env=os.environ.copy())
    assert done.returncode == 9
    names = {p.name for p in dest.iterdir()}
    assert {"batches.sqlite3", "sessions.sqlite3.part", "BACKUP-UNFINISHED"} <= names
    default_model_or_skip()
    assert main(["serve", "--data-dir", str(dest), "--port", "18998"]) == 2
    assert "is a backup that did not finish" in capsys.readouterr().err
    assert not (dest / "sessions.sqlite3").exists()  # nothing made anew
    # A backup of it is refused too: its copy had no marker, and a server started from it.
    assert main(["backup", str(tmp_path / "copy"), "--data-dir", str(dest)]) == 2
    assert "is a backup that did not finish" in capsys.readouterr().err
    assert not (tmp_path / "copy").exists()
    # A whole backup has no marker: a server starts from it.
    assert main(["backup", str(tmp_path / "whole"), "--data-dir", str(data)]) == 0
    assert "BACKUP-UNFINISHED" not in {p.name for p in (tmp_path / "whole").iterdir()}


def test_a_file_deleted_while_the_backup_copies_is_deleted_in_the_copy_as_the_server_did_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A batch's last result file deleted between the snapshot and the copy: the copy's
    database held only the file marked deleted, not the rest of the deletion (the batch's
    items kept for good; a batch still validating at the snapshot, its input deleted once it
    finished, was failed by a server started on the copy). A newer snapshot holds it all."""
    data, dest = tmp_path / "data", tmp_path / "backup"
    snapshots = []
    copy_database = backup_cli._copy_database
    with live_server(scripted_config(data), ScriptedEngine()) as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
        batch = wait_finished(url, submit(client, jsonl(3)))

        def then_delete(source: Path, target: Path) -> dict[str, int]:
            counts = copy_database(source, target)
            if source.name == "batches.sqlite3":
                snapshots.append(target)
                if len(snapshots) == 1:  # after the snapshot, before the files' copies
                    gone = httpx.delete(f"{url}/v1/files/{batch['output_file_id']}")
                    assert gone.status_code == 200
            return counts

        monkeypatch.setattr(backup_cli, "_copy_database", then_delete)
        summary = backup_cli.backup(data, dest)
    assert len(snapshots) == 2 and summary["files"]["missing"] == []
    assert summary["files"]["copied"] == 1  # the input; the output's copy (none) not kept
    db = sqlite3.connect(dest / "batches.sqlite3")
    try:
        (dropped,) = db.execute("SELECT items_dropped_at FROM batches WHERE batch_id = ?",
                                (batch["id"],)).fetchone()
        (deleted,) = db.execute("SELECT deleted_at FROM files WHERE file_id = ?",
                                (batch["output_file_id"],)).fetchone()
    finally:
        db.close()
    assert dropped is not None and deleted is not None
    assert sorted(p.name for p in (dest / "files").iterdir()) == [
        batch["input_file_id"] + ".jsonl"]

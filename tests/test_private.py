"""What the server stores is readable by its own user alone: the data folder it creates, the
databases (with SQLite's -wal and -shm), batch files and the SSD tier, whatever the umask."""

from __future__ import annotations

import asyncio
import os
import stat
from pathlib import Path

import openai
from websockets.asyncio.client import connect

from antiphon.engine_ext.scripted import ScriptedEngine
from antiphon.private import private_file
from tests.conftest import scripted_config
from tests.liveserver import live_server
from tests.test_batches import jsonl, submit, wait_finished
from tests.wsclient import chat, open_session


def others_can_read(path: Path) -> bool:
    return bool(stat.S_IMODE(path.stat().st_mode) & 0o077)


async def one_turn(url: str) -> None:
    async with connect(url.replace("http://", "ws://") + "/v1/ws") as ws:
        sid = (await open_session(ws))["session"]["session_id"]
        await chat(ws, sid, "a secret")


def test_what_the_server_stores_is_private_to_its_user(tmp_path: Path) -> None:
    data = tmp_path / "new" / "data"
    old_umask = os.umask(0o022)
    try:
        with live_server(scripted_config(data), ScriptedEngine()) as url:
            asyncio.run(one_turn(url))
            client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
            wait_finished(url, submit(client, jsonl(3)))
            stored = [p for p in data.rglob("*") if p.name != ".lock"]
            assert {p.name for p in stored} >= {"sessions.sqlite3", "sessions.sqlite3-wal",
                                                "batches.sqlite3", "files"}
            assert len(list((data / "files").iterdir())) == 2  # the input and the output
            assert [p for p in [data, *stored] if others_can_read(p)] == []
    finally:
        os.umask(old_umask)


def test_files_from_before_are_tightened(tmp_path: Path) -> None:
    db = tmp_path / "old.sqlite3"
    for each in (db, Path(f"{db}-wal")):
        each.write_bytes(b"")
        each.chmod(0o644)
    private_file(db)
    assert not others_can_read(db) and not others_can_read(Path(f"{db}-wal"))

"""A full disk under the sessions database: clients get a typed `storage_full` error (HTTP 507)
that changes nothing, the server goes on, and once space is back everything works again. The
database is made full for real: SQLite's `max_page_count` on the server's own connection makes
every write that needs a new page fail with SQLITE_FULL, as a full disk does."""

from __future__ import annotations

import errno
import json
import sqlite3
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest
from websockets.asyncio.client import connect

from antiphon.engine_ext.scripted import ScriptedEngine
from antiphon.server.app import DrainingServer
from antiphon.server.errors import is_storage_full
from tests.conftest import scripted_config
from tests.liveserver import running_server
from tests.wsclient import open_session, recv, recv_until, send

BIG = "x" * 6000  # more than a database page: storing it needs new pages


def sqlite_full_error() -> sqlite3.OperationalError:
    db = sqlite3.connect(":memory:")
    db.execute("CREATE TABLE t (x)")
    db.execute("PRAGMA max_page_count = 2")
    try:
        db.execute("INSERT INTO t VALUES (zeroblob(100000))")
    except sqlite3.OperationalError as exc:
        return exc
    finally:
        db.close()
    raise AssertionError("SQLite stored 100 kB in two pages")


def test_what_counts_as_a_full_disk() -> None:
    assert is_storage_full(sqlite_full_error())
    assert is_storage_full(OSError(errno.ENOSPC, "No space left on device"))
    assert is_storage_full(OSError(errno.EDQUOT, "Disk quota exceeded"))
    try:
        try:
            raise OSError(errno.ENOSPC, "No space left on device")
        except OSError as exc:
            raise RuntimeError("writing failed") from exc
    except RuntimeError as wrapped:
        assert is_storage_full(wrapped)
    assert not is_storage_full(sqlite3.OperationalError("database is locked"))
    assert not is_storage_full(OSError(errno.EACCES, "Permission denied"))
    assert not is_storage_full(ValueError("no"))


@contextmanager
def server(tmp_path: Path) -> Iterator[tuple[str, DrainingServer, ScriptedEngine]]:
    engine = ScriptedEngine(token_delay_s=0.01, max_model_len=20_000)
    config = scripted_config(tmp_path, max_content_chars=10_000, max_frame_bytes=20_000,
                             max_tokens_limit=4000, default_max_tokens=4000)
    with running_server(config, engine) as (url, srv):
        yield url, srv, engine


def fill_up(srv: DrainingServer, full: bool = True) -> None:
    """Make the sessions database full (no page can be added) or give it room again."""
    with srv.config.app.state.ctx.turns.store._db.locked() as db:  # type: ignore[attr-defined]
        pages = db.execute("PRAGMA page_count").fetchone()[0] if full else 1_073_741_823
        db.execute(f"PRAGMA max_page_count = {pages}")


async def test_a_message_the_full_disk_cannot_keep_is_refused_and_changes_nothing(
        tmp_path: Path) -> None:
    with server(tmp_path) as (url, srv, _engine):
        async with connect(url.replace("http://", "ws://") + "/v1/ws") as ws:
            sid = (await open_session(ws))["session"]["session_id"]
            fill_up(srv)
            await send(ws, type="message", session_id=sid, content=BIG, request_id="r1")
            frame = await recv(ws)
            assert (frame["type"], frame["code"], frame["request_id"]) == (
                "error", "storage_full", "r1")
            assert "disk is full" in frame["message"]
            assert (await open_session(ws, sid))["messages"] == []  # nothing kept
            fill_up(srv, full=False)
            await send(ws, type="message", session_id=sid, content=BIG, request_id="r2")
            done = (await recv_until(ws, "done"))[-1]
            assert done["finish_reason"] == "stop"
            messages = (await open_session(ws, sid))["messages"]
        assert [m["role"] for m in messages] == ["user", "assistant"]


async def test_a_reply_the_full_disk_could_not_keep_is_asked_for_again(tmp_path: Path) -> None:
    with server(tmp_path) as (url, srv, engine):
        engine.reply = lambda turns: " ".join(["word"] * 1500)  # 7,500 characters
        engine.token_delay_s = 0.002  # 3 s a reply
        async with connect(url.replace("http://", "ws://") + "/v1/ws") as ws:
            sid = (await open_session(ws))["session"]["session_id"]
            await send(ws, type="message", session_id=sid, content="hi", request_id="r1")
            await recv_until(ws, "accepted")  # the message is kept
            fill_up(srv)  # before the reply is
            frames = await recv_until(ws, "error")
            assert (frames[-1]["code"], frames[-1]["request_id"]) == ("storage_full", "r1")
            assert "the reply was not saved" in frames[-1]["message"]
            assert [m["role"] for m in (await open_session(ws, sid))["messages"]] == ["user"]
            assert 'antiphon_errors_total{code="storage_full"} 1.0' in httpx.get(
                url + "/metrics").text
            fill_up(srv, full=False)
            await send(ws, type="regenerate", session_id=sid, request_id="r2")
            done = (await recv_until(ws, "done"))[-1]
            messages = (await open_session(ws, sid))["messages"]
        assert [(m["role"], len(m["content"])) for m in messages] == [
            ("user", 2), ("assistant", len(done["text"]))]
        assert len(done["text"]) == 1500 * 5 - 1


def test_rest_answers_507_on_a_full_disk(tmp_path: Path) -> None:
    with server(tmp_path) as (url, srv, _engine):
        fill_up(srv)
        for _ in range(500):  # a new page is needed once the last one has no room left
            r = httpx.post(url + "/v1/sessions", json={"title": "t" * 200})
            if r.status_code != 201:
                break
        else:
            pytest.fail("500 sessions fitted in a database that cannot grow")
        assert r.status_code == 507
        assert r.json()["error"]["code"] == "storage_full"
        listed = httpx.get(url + "/v1/sessions").json()["sessions"]
        fill_up(srv, full=False)
        assert httpx.post(url + "/v1/sessions", json={"title": "after"}).status_code == 201
        assert len(httpx.get(url + "/v1/sessions").json()["sessions"]) == len(listed) + 1


def test_an_upload_the_full_disk_cannot_register_leaves_no_file(tmp_path: Path) -> None:
    # Its bytes were kept on disk, unregistered, until a restart swept them.
    with server(tmp_path) as (url, srv, _engine):
        ctx = srv.config.app.state.ctx  # type: ignore[attr-defined]
        with ctx.batch_store.db.locked() as db:
            pages = db.execute("PRAGMA page_count").fetchone()[0]
            db.execute(f"PRAGMA max_page_count = {pages}")
        line = json.dumps({"custom_id": "a", "method": "POST", "url": "/v1/chat/completions",
                           "body": {"model": "scripted", "messages": [
                               {"role": "user", "content": "x" * 3000}]}}) + "\n"
        for _ in range(200):  # until a row needs a page the database cannot add
            r = httpx.post(url + "/v1/files", data={"purpose": "batch"},
                           files={"file": ("in.jsonl", line.encode())})
            if r.status_code != 200:
                break
        assert r.status_code == 507, r.text
        assert sorted(p.stem for p in ctx.files.directory.iterdir()) == sorted(
            ctx.batch_store.file_sizes())

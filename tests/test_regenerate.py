"""`regenerate`: answer a session's last user message again, over a live server and a scripted
engine, with a real websockets client; and the reply a kill -9 cut short, answered after the
restart."""

from __future__ import annotations

import asyncio
import signal
import sys
from collections.abc import Sequence
from pathlib import Path

import pytest
from websockets.asyncio.client import connect

from antiphon.bench.serverproc import ServerProcess
from antiphon.engine_ext.types import ChatTurn
from antiphon.sessions.store import SessionStore
from tests.conftest import Scripted
from tests.wsclient import chat, open_session, recv, recv_until, send

ROOT = Path(__file__).resolve().parent.parent


class Versioned:
    """Replies "v<version> to <last user message>", the version set by the test."""

    def __init__(self) -> None:
        self.version = 1

    def __call__(self, turns: Sequence[ChatTurn]) -> str:
        return f"v{self.version} to {turns[-1].content}"


def rendered(*turns: tuple[str, str]) -> int:
    """The scripted engine's prompt length for `turns`, with the reply opened."""
    return len("".join(f"<{role}>{content}\n" for role, content in turns) + "<assistant>")


def check_store(data_dir: Path) -> None:
    store = SessionStore(data_dir / "sessions.sqlite3")
    try:
        store.check_integrity()
    finally:
        store.close()


def history(opened: dict[str, object]) -> list[tuple[str, str]]:
    return [(m["role"], m["content"]) for m in opened["messages"]]  # type: ignore[attr-defined]


async def regenerate(ws: object, sid: str, **extra: object) -> list[dict[str, object]]:
    await send(ws, type="regenerate", session_id=sid, **extra)  # type: ignore[arg-type]
    return await recv_until(ws, "done")  # type: ignore[arg-type]


async def test_regenerate_replaces_the_last_reply(scripted: Scripted) -> None:
    scripted.engine.reply = replies = Versioned()
    async with connect(scripted.ws_url) as ws:
        sid = (await open_session(ws))["session"]["session_id"]
        await chat(ws, sid, "one")
        await chat(ws, sid, "two")
        replies.version = 2
        frames = await regenerate(ws, sid, request_id="again")
        opened = await open_session(ws, sid)
    assert [f["type"] for f in frames if f["type"] != "token"] == ["accepted", "done"]
    assert (frames[-1]["request_id"], frames[-1]["text"]) == ("again", "v2 to two")
    # The model saw the conversation up to the user's last message, not the reply replaced.
    assert frames[0]["prompt_tokens"] == rendered(("user", "one"), ("assistant", "v1 to one"),
                                                  ("user", "two"))
    assert history(opened) == [("user", "one"), ("assistant", "v1 to one"),
                               ("user", "two"), ("assistant", "v2 to two")]
    assert opened["session"]["num_messages"] == 4
    check_store(scripted.config.sessions.data_dir)


async def test_the_conversation_goes_on_from_the_regenerated_reply(scripted: Scripted) -> None:
    scripted.engine.reply = replies = Versioned()
    async with connect(scripted.ws_url) as ws:
        sid = (await open_session(ws))["session"]["session_id"]
        await chat(ws, sid, "one")
        replies.version = 2
        await regenerate(ws, sid)
        follow_up = await chat(ws, sid, "three")
    assert follow_up["done"]["text"] == "v2 to three"
    assert follow_up["accepted"]["prompt_tokens"] == rendered(
        ("user", "one"), ("assistant", "v2 to one"), ("user", "three"))


async def test_a_regenerate_stopped_before_its_first_token_keeps_the_old_reply(
        scripted: Scripted) -> None:
    scripted.engine.reply = replies = Versioned()
    async with connect(scripted.ws_url) as ws:
        sid = (await open_session(ws))["session"]["session_id"]
        await chat(ws, sid, "one")
        replies.version = 2
        scripted.engine.token_delay_s = 1.0
        await send(ws, type="regenerate", session_id=sid, request_id="again")
        assert (await recv(ws))["type"] == "accepted"
        await send(ws, type="cancel", request_id="again")
        done = (await recv_until(ws, "done"))[-1]
        assert (done["finish_reason"], done["text"]) == ("cancelled", "")
        scripted.engine.token_delay_s = 0.0
        opened = await open_session(ws, sid)
    assert history(opened) == [("user", "one"), ("assistant", "v1 to one")]


async def test_a_regenerate_stopped_mid_reply_keeps_what_was_shown(scripted: Scripted) -> None:
    scripted.engine.reply = lambda turns: "w " * 100
    async with connect(scripted.ws_url) as ws:
        sid = (await open_session(ws))["session"]["session_id"]
        await chat(ws, sid, "one")
        scripted.engine.token_delay_s = 0.05
        await send(ws, type="regenerate", session_id=sid, request_id="again")
        await recv_until(ws, "token")
        await send(ws, type="cancel", request_id="again")
        done = (await recv_until(ws, "done"))[-1]
        opened = await open_session(ws, sid)
    assert done["finish_reason"] == "cancelled" and done["text"]
    assert history(opened) == [("user", "one"), ("assistant", done["text"])]
    assert opened["messages"][-1]["finish_reason"] == "cancelled"


@pytest.mark.parametrize("how", ["cancel", "disconnect"])
async def test_a_regenerate_cut_while_its_tool_call_was_held_back_keeps_the_old_reply(
        scripted: Scripted, how: str) -> None:
    # The client had nothing of it (a `<tool_call>` block is held back until it closes), yet
    # the old reply was replaced by an empty one (found by a review).
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}}}}]
    async with connect(scripted.ws_url) as ws:
        sid = (await open_session(ws))["session"]["session_id"]
        await chat(ws, sid, "one")
        scripted.engine.reply = lambda turns: (
            '<tool_call> {"name": "get_weather", "arguments": {"city": "Paris"}} '
            + "pad " * 40 + "</tool_call>")
        scripted.engine.token_delay_s = 0.02
        await send(ws, type="regenerate", session_id=sid, request_id="again", tools=tools)
        assert (await recv(ws))["type"] == "accepted"
        await asyncio.sleep(0.3)  # tokens generated, all held back
        if how == "cancel":
            await send(ws, type="cancel", request_id="again")
            frames = await recv_until(ws, "done")
            assert [f["type"] for f in frames] == ["done"]
            assert (frames[0]["finish_reason"], frames[0]["text"]) == ("cancelled", "")
    await asyncio.sleep(0.5)  # (a cut turn keeps what it has in the background)
    scripted.engine.token_delay_s = 0.0
    async with connect(scripted.ws_url) as ws:
        opened = await open_session(ws, sid)
    assert history(opened) == [("user", "one"), ("assistant", "You said: one")]


async def test_regenerate_refusals_change_nothing(scripted: Scripted) -> None:
    async with connect(scripted.ws_url) as ws:
        await send(ws, type="regenerate", session_id="s_nope", request_id="r1")
        frame = await recv(ws)
        assert (frame["code"], frame["request_id"]) == ("session_not_found", "r1")
        sid = (await open_session(ws))["session"]["session_id"]
        await send(ws, type="regenerate", session_id=sid, request_id="r2")
        frame = await recv(ws)
        assert (frame["code"], frame["request_id"]) == ("bad_message", "r2")
        assert "no message to answer again" in frame["message"]
        for bad in ({"max_tokens": "5"}, {"content": "hi"}, {"temperature": 3.0}):
            await send(ws, **{"type": "regenerate", "session_id": sid, **bad})
            assert (await recv(ws))["code"] == "bad_message"
        await chat(ws, sid, "one")
        scripted.engine.token_delay_s = 0.05
        await send(ws, type="regenerate", session_id=sid, request_id="r3")
        await recv_until(ws, "token")
        await send(ws, type="regenerate", session_id=sid, request_id="r4")
        frames = await recv_until(ws, "error")
        assert (frames[-1]["code"], frames[-1]["request_id"]) == ("session_busy", "r4")
        await recv_until(ws, "done")
        opened = await open_session(ws, sid)
    assert history(opened) == [("user", "one"), ("assistant", "You said: one")]


async def test_a_message_whose_reply_failed_is_answered_by_regenerate(
        scripted: Scripted) -> None:
    async with connect(scripted.ws_url) as ws:
        sid = (await open_session(ws))["session"]["session_id"]

        scripted.engine.fail_next_request()
        await send(ws, type="message", session_id=sid, content="a long question",
                   request_id="r1")
        frames = await recv_until(ws, "error")
        assert (frames[-1]["code"], frames[-1]["request_id"]) == ("engine_error", "r1"), frames
        assert history(await open_session(ws, sid)) == [("user", "a long question")]
        done = (await regenerate(ws, sid))[-1]
        opened = await open_session(ws, sid)
    assert done["text"] == "You said: a long question"
    assert history(opened) == [("user", "a long question"),
                               ("assistant", "You said: a long question")]


def test_a_reply_cut_short_by_kill_9_is_answered_after_the_restart(tmp_path: Path) -> None:
    """The user's message survives a kill -9 of the server mid-reply (it was committed when
    it was accepted); after the restart, `regenerate` answers it, and the conversation goes
    on with one reply to it."""
    cmd = [sys.executable, "-m", "tests.batchserver", "--data-dir", str(tmp_path),
           "--token-delay", "0.05"]
    env = {"PYTHONPATH": str(ROOT)}
    question = "tell me a long story " + "w " * 60

    first = ServerProcess(cmd, log_path=tmp_path / "first.log", start_timeout_s=60, env=env)

    async def start_reply_and_kill() -> str:
        async with connect(first.url.replace("http://", "ws://") + "/v1/ws") as ws:
            sid: str = (await open_session(ws))["session"]["session_id"]
            await send(ws, type="message", session_id=sid, content=question)
            frames = await recv_until(ws, "token")
            for _ in range(5):
                frames.append(await recv(ws))
            assert all(f["type"] in ("accepted", "token") for f in frames), frames
            first.stop(signal.SIGKILL)  # still connected: a disconnect would commit the reply
            return sid

    first.start()
    try:
        sid = asyncio.run(start_reply_and_kill())
    finally:
        first.stop(signal.SIGKILL)

    async def after_restart(url: str) -> tuple[list[tuple[str, str]], dict[str, object],
                                               list[tuple[str, str]]]:
        async with connect(url.replace("http://", "ws://") + "/v1/ws") as ws:
            before = history(await open_session(ws, sid))
            done = (await regenerate(ws, sid))[-1]
            after = history(await open_session(ws, sid))
        return before, done, after

    with ServerProcess(cmd, log_path=tmp_path / "second.log", start_timeout_s=60,
                       env=env) as second:
        before, done, after = asyncio.run(after_restart(second.url))
    assert before == [("user", question)]  # accepted, then cut short: no reply
    assert done["finish_reason"] == "stop" and done["text"] == "You said: " + question
    assert after == [("user", question), ("assistant", done["text"])]
    check_store(tmp_path)

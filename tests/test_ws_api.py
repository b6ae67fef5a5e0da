"""The websocket API over a live server and a scripted engine, with a real websockets client."""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed

from antiphon.engine_ext.scripted import ScriptedEngine
from antiphon.server import ws as wsmod
from antiphon.sessions.store import SessionStore
from tests.conftest import Scripted, scripted_config
from tests.liveserver import live_server, running_server
from tests.wsclient import chat, open_session, recv, recv_until, send


async def test_streams_tokens_then_done(scripted: Scripted) -> None:
    async with connect(scripted.ws_url) as ws:
        sid = (await open_session(ws))["session"]["session_id"]
        r = await chat(ws, sid, "hello there", request_id="r-1")
    assert r["accepted"] == {"type": "accepted", "request_id": "r-1", "session_id": sid,
                             "prompt_tokens": r["accepted"]["prompt_tokens"]}
    assert "".join(t["text"] for t in r["tokens"]) == "You said: hello there"
    done = r["done"]
    assert done["finish_reason"] == "stop" and done["text"] == "You said: hello there"
    assert done["usage"]["completion_tokens"] == 4
    assert 0 < done["timings"]["ttft_s"] < done["timings"]["total_s"]
    assert done["timings"]["tpot_s"] > 0


async def test_session_frames_name_the_request_they_answer(scripted: Scripted) -> None:
    """An open, rename or deletion given a request_id is answered, or refused, naming it: a
    page with several in flight told which `session` frame was its new chat's (it took the
    one opened just before), and which error was a rename's (it blanked the chat shown)."""
    async with connect(scripted.ws_url) as ws:
        opened = await open_session(ws, request_id="open-1")
        sid = opened["session"]["session_id"]
        assert opened["request_id"] == "open-1"
        assert "request_id" not in await open_session(ws, sid)  # (none given, none named)
        await send(ws, type="session.rename", session_id=sid, title="t", request_id="rn-1")
        assert (await recv(ws))["request_id"] == "rn-1"
        await send(ws, type="session.delete", session_id=sid, request_id="del-1")
        assert await recv(ws) == {"type": "session.deleted", "session_id": sid,
                                  "request_id": "del-1"}
        for kind, extra in (("rename", {"title": "t"}), ("delete", {})):
            await send(ws, type=f"session.{kind}", session_id=sid, request_id=f"{kind}-2",
                       **extra)
            refused = await recv(ws)
            assert (refused["type"], refused["code"], refused["request_id"]) == (
                "error", "session_not_found", f"{kind}-2")
        await send(ws, type="session.open", session_id=sid, request_id="open-2")
        assert (await recv(ws))["request_id"] == "open-2"


async def test_a_new_sessions_open_sent_again_gets_the_session_it_made(
        scripted: Scripted) -> None:
    """A page whose connection dropped before its new chat's `session` frame came sends the
    open again on reconnecting: a new session each time left the first behind, empty, in
    the list and against the key's session limit (found by a review). The same request id
    gets the session it made, while that exists."""
    async with connect(scripted.ws_url) as ws:
        first = (await open_session(ws, request_id="new-1"))["session"]["session_id"]
    async with connect(scripted.ws_url) as ws:
        again = await open_session(ws, request_id="new-1")
        assert (again["session"]["session_id"], again["request_id"]) == (first, "new-1")
        other = (await open_session(ws, request_id="new-2"))["session"]["session_id"]
        assert other != first
        await send(ws, type="session.delete", session_id=first)
        assert (await recv(ws))["type"] == "session.deleted"
        made = (await open_session(ws, request_id="new-1"))["session"]["session_id"]
        assert made not in (first, other)  # (the one it made is gone: a new one)


async def test_follow_up_sees_history_and_reopen_returns_it(scripted: Scripted) -> None:
    scripted.engine.reply = lambda turns: " ".join(t.content for t in turns if t.role == "user")
    async with connect(scripted.ws_url) as ws:
        sid = (await open_session(ws))["session"]["session_id"]
        await chat(ws, sid, "one")
        second = await chat(ws, sid, "two")
        assert second["done"]["text"] == "one two"
    async with connect(scripted.ws_url) as ws:
        opened = await open_session(ws, sid)
    assert [(m["role"], m["content"]) for m in opened["messages"]] == [
        ("user", "one"), ("assistant", "one"), ("user", "two"), ("assistant", "one two")]
    assert opened["session"]["title"] == "one"


async def test_a_sessions_system_message_is_what_the_model_sees_first(
        scripted: Scripted) -> None:
    """A session opened with a system message (websocket or REST) keeps it: the model sees it
    before the conversation at every turn, it is not one of the session's messages, and it
    is set once, at creation."""
    scripted.engine.reply = lambda turns: "Arr"
    async with connect(scripted.ws_url) as ws:
        opened = await open_session(ws, system="Answer like a pirate.")
        sid = opened["session"]["session_id"]
        assert (opened["session"]["system"], opened["messages"]) == ("Answer like a pirate.", [])
        await send(ws, type="regenerate", session_id=sid, request_id="nothing")
        assert (await recv(ws))["code"] == "bad_message"  # the system message is no message
        await chat(ws, sid, "hello")
        await chat(ws, sid, "where is it?")
        assert [scripted.engine.decode(p) for p in scripted.engine.request_prompts] == [
            "<system>Answer like a pirate.\n<user>hello\n<assistant>",
            "<system>Answer like a pirate.\n<user>hello\n<assistant>Arr\n"
            "<user>where is it?\n<assistant>"]
        reopened = await open_session(ws, sid)
        assert reopened["session"]["system"] == "Answer like a pirate."
        assert [m["role"] for m in reopened["messages"]] == ["user", "assistant"] * 2
        # set once: not for a session that exists; at most a message's length
        await send(ws, type="session.open", session_id=sid, system="Be terse.")
        refused = await recv(ws)
        assert refused["code"] == "bad_message" and "system message" in refused["message"]
        # nor a title, which was dropped without a word (session.rename renames)
        await send(ws, type="session.open", session_id=sid, title="Pirates")
        refused = await recv(ws)
        assert refused["code"] == "bad_message" and "session.rename" in refused["message"]
        await send(ws, type="session.open", system="x" * 1001)
        assert (await recv(ws))["code"] == "too_large"
        plain = await open_session(ws)
        assert plain["session"]["system"] is None
    async with httpx.AsyncClient(base_url=scripted.url) as client:
        made = (await client.post("/v1/sessions", json={"system": "Be terse."})).json()
        assert made["system"] == "Be terse."
        assert (await client.get(f"/v1/sessions/{sid}")).json()["session"]["system"] == \
            "Answer like a pirate."
        # Listings leave system messages out: each may be as long as a message, and a page
        # of 200 reached megabytes (past websockets' 1 MiB default frame limit).
        listed = (await client.get("/v1/sessions")).json()["sessions"]
        assert len(listed) == 3 and not any("system" in s for s in listed)
    async with connect(scripted.ws_url) as ws:
        await send(ws, type="session.list")
        assert not any("system" in s for s in (await recv(ws))["sessions"])


class NoSystemEngine(ScriptedEngine):
    """A model whose chat template refuses a system message (as Gemma's does)."""

    def render_chat(self, turns: Any, **kwargs: Any) -> list[int]:
        from antiphon.engine_ext.engine import EngineRequestError

        if any(t.role == "system" for t in turns):
            raise EngineRequestError("the model's chat template refused the conversation: "
                                     "System role not supported")
        return super().render_chat(turns, **kwargs)


async def test_a_system_message_no_turn_could_use_is_refused_at_creation(
        tmp_path: Path) -> None:
    """A system message is set for good: one the model's chat template refuses, or too long,
    is refused when the session would be made (every turn of it failed after), named as the
    system message; no session is made."""
    with live_server(scripted_config(tmp_path, max_content_chars=100), NoSystemEngine()) as url:
        async with connect(url.replace("http", "ws") + "/v1/ws") as ws:
            await send(ws, type="session.open", system="Be terse.")
            refused = await recv(ws)
            assert refused["code"] == "bad_message" and "System role" in refused["message"]
        async with httpx.AsyncClient(base_url=url) as client:
            r = await client.post("/v1/sessions", json={"system": "x" * 101})
            error = r.json()["error"]
            assert r.status_code == 400 and error["param"] == "system", r.text
            assert error["message"].startswith("the system message has 101 characters")
            assert (await client.get("/v1/sessions")).json()["sessions"] == []
            assert (await client.post("/v1/sessions", json={})).status_code == 201


async def test_several_sessions_in_flight_on_one_connection(scripted: Scripted) -> None:
    async with connect(scripted.ws_url) as ws:
        sids = [(await open_session(ws))["session"]["session_id"] for _ in range(3)]
        for i, sid in enumerate(sids):
            await send(ws, type="message", session_id=sid, content=f"m{i} a b c d e",
                       request_id=f"r{i}")
        done: dict[str, dict[str, object]] = {}
        while len(done) < 3:
            frame = await recv(ws)
            if frame["type"] == "done":
                done[frame["request_id"]] = frame
    assert {rid: f["text"] for rid, f in done.items()} == {
        f"r{i}": f"You said: m{i} a b c d e" for i in range(3)}


@pytest.mark.parametrize("how", ["close", "cancel"])
async def test_a_turn_cut_short_lets_go_of_its_session_for_the_next_at_once(
        scripted: Scripted, monkeypatch: pytest.MonkeyPatch, how: str) -> None:
    """A client cut off mid-reply reconnects and asks again (or deletes the session) at once:
    the turn being cut short keeps what it has, then the next one runs, where it was refused
    with session_busy while the cut-short reply was saved."""
    from antiphon.sessions.store import SessionStore

    save = SessionStore.append_message

    def slow_save(self: SessionStore, *args: Any, **kwargs: Any) -> Any:
        time.sleep(0.5)  # a slow disk: the cut-short reply takes a while to keep
        return save(self, *args, **kwargs)

    scripted.engine.token_delay_s = 0.05
    async with connect(scripted.ws_url) as a:
        sid = (await open_session(a))["session"]["session_id"]
        await send(a, type="message", session_id=sid, content="w " * 60, request_id="long")
        await recv_until(a, "token")
        monkeypatch.setattr(SessionStore, "append_message", slow_save)
        async with connect(scripted.ws_url) as b:
            if how == "close":
                await a.close()
            else:
                await send(a, type="cancel", request_id="long")
            await send(b, type="regenerate", session_id=sid, request_id="again",
                       max_tokens=3)
            frames = await recv_until(b, "done")
            assert frames[0]["type"] == "accepted", frames[0]
            await send(b, type="session.delete", session_id=sid)
            assert (await recv(b))["type"] == "session.deleted"


async def test_a_turn_still_answering_refuses_another_at_once(scripted: Scripted) -> None:
    scripted.engine.token_delay_s = 0.05
    async with connect(scripted.ws_url) as a, connect(scripted.ws_url) as b:
        sid = (await open_session(a))["session"]["session_id"]
        await send(a, type="message", session_id=sid, content="w " * 60, request_id="long")
        await recv_until(a, "token")
        started = asyncio.get_running_loop().time()
        await send(b, type="regenerate", session_id=sid, request_id="again")
        assert (await recv(b))["code"] == "session_busy"
        assert asyncio.get_running_loop().time() - started < 2  # not held for the wait


async def test_cancel_keeps_partial_reply(scripted: Scripted) -> None:
    scripted.engine.token_delay_s = 0.05
    async with connect(scripted.ws_url) as ws:
        sid = (await open_session(ws))["session"]["session_id"]
        await send(ws, type="message", session_id=sid, content="w " * 200, request_id="long")
        await recv_until(ws, "token")
        await send(ws, type="cancel", request_id="long")
        frames = await recv_until(ws, "done")
        assert frames[-1]["finish_reason"] == "cancelled"
        assert frames[-1]["usage"]["completion_tokens"] < 200
        history = (await open_session(ws, sid))["messages"]
    assert history[-1]["role"] == "assistant" and history[-1]["finish_reason"] == "cancelled"
    assert not scripted.engine.active_request_ids


async def test_cancels_sent_again_and_again_end_the_turn_once(
        scripted: Scripted, monkeypatch: pytest.MonkeyPatch) -> None:
    """A stop button clicked again while the cut reply is saved (slowly: a busy disk): each
    cancel cancelled the run again, so with three the turn never sent its `done`, and with
    four the session was let go before the save ended: the next message went in first and
    the cut reply after it."""
    save = SessionStore.append_message

    def slow_save(self: SessionStore, session_id: str, role: str, *args: Any,
                  **kwargs: Any) -> Any:
        if role == "assistant" and "cancelled" in args:
            time.sleep(0.6)
        return save(self, session_id, role, *args, **kwargs)
    monkeypatch.setattr(SessionStore, "append_message", slow_save)
    scripted.engine.token_delay_s = 0.05
    async with connect(scripted.ws_url) as ws:
        sid = (await open_session(ws))["session"]["session_id"]
        await send(ws, type="message", session_id=sid, content="first " + "w " * 50,
                   request_id="r")
        await recv_until(ws, "token")
        for _ in range(4):
            await send(ws, type="cancel", request_id="r")
            await asyncio.sleep(0.1)
        await send(ws, type="message", session_id=sid, content="second", request_id="s")
        frames = await recv_until(ws, "done")
        if frames[-1]["request_id"] == "r":
            frames += await recv_until(ws, "done")
        ends = [(f["type"], f["request_id"]) for f in frames if f["type"] in ("done", "error")]
        assert ends == [("done", "r"), ("done", "s")], frames
        history = (await open_session(ws, sid))["messages"]
    assert [(m["role"], m.get("finish_reason")) for m in history] == [
        ("user", None), ("assistant", "cancelled"), ("user", None), ("assistant", "stop")]
    assert history[2]["content"] == "second"


async def test_disconnect_mid_stream_aborts_generation(scripted: Scripted) -> None:
    scripted.engine.token_delay_s = 0.05
    async with connect(scripted.ws_url) as ws:
        sid = (await open_session(ws))["session"]["session_id"]
        await send(ws, type="message", session_id=sid, content="w " * 200, request_id="gone")
        await recv_until(ws, "token")
        (engine_id,) = scripted.engine.active_request_ids  # the engine's own id, not "gone"
    for _ in range(100):
        if not scripted.engine.active_request_ids:
            break
        await asyncio.sleep(0.02)
    assert not scripted.engine.active_request_ids
    assert engine_id in scripted.engine.finished_request_ids


async def test_clients_choosing_the_same_request_id_do_not_collide(scripted: Scripted) -> None:
    """The engine aborts by id: a client's chosen id must never name another's request."""
    scripted.engine.token_delay_s = 0.02
    async with connect(scripted.ws_url) as a, connect(scripted.ws_url) as b:
        sessions = [(await open_session(ws))["session"]["session_id"] for ws in (a, b)]
        for ws, sid in zip((a, b), sessions, strict=True):
            await send(ws, type="message", session_id=sid, content="same id", request_id="r-1")
        await recv_until(a, "token")
        await send(a, type="cancel", request_id="r-1")  # cancels a's turn, not b's
        assert (await recv_until(a, "done"))[-1]["finish_reason"] == "cancelled"
        done = (await recv_until(b, "done"))[-1]
    assert (done["request_id"], done["finish_reason"], done["text"]) == (
        "r-1", "stop", "You said: same id")


@pytest.mark.parametrize(("message", "code"), [
    ({"session_id": "s_nope", "content": "hi"}, "session_not_found"),
    ({"content": "x" * 1001}, "too_large"),
    ({"content": "   "}, "bad_message"),
    ({"content": "hi", "max_tokens": 101}, "max_tokens_too_large"),
    ({"content": "y" * 950, "max_tokens": 100}, "context_length_exceeded"),
    ({"content": "y" * 999}, "context_length_exceeded"),
])
async def test_bad_messages_get_typed_errors_and_change_nothing(
        scripted: Scripted, message: dict[str, object], code: str) -> None:
    async with connect(scripted.ws_url) as ws:
        sid = (await open_session(ws))["session"]["session_id"]
        await send(ws, type="message", **{"session_id": sid, **message}, request_id="bad")
        frame = await recv(ws)
        assert (frame["type"], frame["code"], frame["request_id"]) == ("error", code, "bad")
        assert (await open_session(ws, sid))["messages"] == []


async def test_oversize_frame_and_unknown_request(scripted: Scripted) -> None:
    async with connect(scripted.ws_url) as ws:
        await ws.send(json.dumps({"type": "session.list", "pad": "x" * 9000}))
        assert (await recv(ws))["code"] == "too_large"
        await send(ws, type="cancel", request_id="never")
        assert (await recv(ws))["code"] == "request_not_found"
        await send(ws, type="session.list")  # the connection still works
        assert (await recv(ws))["type"] == "sessions"


async def test_one_turn_per_session_at_a_time(scripted: Scripted) -> None:
    scripted.engine.token_delay_s = 0.05
    async with connect(scripted.ws_url) as ws:
        sid = (await open_session(ws))["session"]["session_id"]
        await send(ws, type="message", session_id=sid, content="a b c d e f", request_id="r1")
        await recv(ws)  # accepted
        await send(ws, type="message", session_id=sid, content="again", request_id="r2")
        frames = await recv_until(ws, "error")
        assert frames[-1]["code"] == "session_busy" and frames[-1]["request_id"] == "r2"
        await recv_until(ws, "done")


async def test_a_session_opened_elsewhere_says_whether_a_turn_of_it_runs(
        scripted: Scripted) -> None:
    """A second tab showed a message being answered in the first as one left without a reply,
    and offered to retry it (which the server refuses: the session is busy)."""
    scripted.engine.token_delay_s = 0.05
    async with connect(scripted.ws_url) as ws, connect(scripted.ws_url) as other:
        sid = (await open_session(ws))["session"]["session_id"]
        assert (await open_session(other, sid))["replying"] is False
        await send(ws, type="message", session_id=sid, content="a b c d e f", request_id="r1")
        await recv(ws)  # accepted
        assert (await open_session(other, sid))["replying"] is True
        async with httpx.AsyncClient() as http:
            got = (await http.get(f"{scripted.url}/v1/sessions/{sid}")).json()
            assert got["replying"] is True and got["messages"][-1]["role"] == "user"
            await recv_until(ws, "done")
            got = (await http.get(f"{scripted.url}/v1/sessions/{sid}")).json()
            assert got["replying"] is False and got["messages"][-1]["role"] == "assistant"
        assert (await open_session(other, sid))["replying"] is False


async def test_typing_records_an_advisory(scripted: Scripted) -> None:
    async with connect(scripted.ws_url) as ws:
        sid = (await open_session(ws))["session"]["session_id"]
        await send(ws, type="typing", session_id=sid)
        await send(ws, type="typing", session_id="s_unknown")
        assert (await recv(ws))["code"] == "session_not_found"
    import httpx
    wanted = 'antiphon_advisories_total{source="typing"} 1.0'
    deadline = time.monotonic() + 10  # advisories run beside the frames, and outlive a close
    while wanted not in httpx.get(scripted.url + "/metrics").text:
        assert time.monotonic() < deadline, "the typing advisory was not recorded"
        await asyncio.sleep(0.05)


async def test_a_typing_frame_carries_its_advisorys_priority(scripted: Scripted) -> None:
    """Symphony's chatbot advisory has a priority (an app's paying users first): the typing
    frame had none."""
    async with connect(scripted.ws_url) as ws:
        sid = (await open_session(ws))["session"]["session_id"]
        await send(ws, type="message", session_id=sid, content="hello there", request_id="r1")
        await recv_until(ws, "done")
        await send(ws, type="typing", session_id=sid, priority=101)
        assert (await recv(ws))["code"] == "bad_message"
        await send(ws, type="typing", session_id=sid, priority=7)
        deadline = time.monotonic() + 10
        while not scripted.engine.advisory_priorities:
            assert time.monotonic() < deadline, "the typing advisory did not reach the engine"
            await asyncio.sleep(0.05)
    assert scripted.engine.advisory_priorities == [7]


async def test_api_keys_and_session_ownership(tmp_path) -> None:  # type: ignore[no-untyped-def]
    keys = ("alice-key-123", "bob-key-4567")
    config = scripted_config(tmp_path, api_keys=keys)
    with live_server(config, ScriptedEngine()) as url:
        ws_url = url.replace("http://", "ws://") + "/v1/ws"
        async with connect(ws_url) as ws:
            frame = await recv(ws)
            assert frame["code"] == "unauthorized"
            with pytest.raises(ConnectionClosed) as closed:
                await ws.recv()
            assert closed.value.rcvd is not None and closed.value.rcvd.code == 4401
        async with connect(ws_url + "?api_key=" + keys[0]) as ws:
            sid = (await open_session(ws))["session"]["session_id"]
            await chat(ws, sid, "secret")
        async with connect(ws_url, additional_headers={"Authorization": f"Bearer {keys[1]}"}) as ws:
            await send(ws, type="session.open", session_id=sid)
            assert (await recv(ws))["code"] == "session_not_found"
            await send(ws, type="session.list")
            assert (await recv(ws))["sessions"] == []


async def test_restart_loses_no_accepted_message(tmp_path) -> None:  # type: ignore[no-untyped-def]
    config = scripted_config(tmp_path)
    with live_server(config, ScriptedEngine()) as url:
        async with connect(url.replace("http://", "ws://") + "/v1/ws") as ws:
            sid = (await open_session(ws))["session"]["session_id"]
            await chat(ws, sid, "remember me")
    with live_server(config, ScriptedEngine()) as url:
        async with connect(url.replace("http://", "ws://") + "/v1/ws") as ws:
            messages = (await open_session(ws, sid))["messages"]
    assert [m["content"] for m in messages] == ["remember me", "You said: remember me"]


async def test_rename_and_delete_sessions(scripted: Scripted) -> None:
    async with connect(scripted.ws_url) as ws:
        sid = (await open_session(ws))["session"]["session_id"]
        await chat(ws, sid, "first words")
        await send(ws, type="session.rename", session_id=sid, title="  Trip   plans ")
        renamed = await recv(ws)
        assert renamed["type"] == "session.renamed"
        assert renamed["session"]["title"] == "Trip plans"
        for bad in ({"title": ""}, {"title": "x" * 201}, {"session_id": "s_nope", "title": "t"}):
            await send(ws, **{"type": "session.rename", "session_id": sid, "title": "t", **bad})
            assert (await recv(ws))["type"] == "error"
        # A session answering a message is not deleted under its reply.
        await send(ws, type="message", session_id=sid, content="a b c d e f g h i j k l m n o",
                   request_id="r-long")
        await recv_until(ws, "token")
        await send(ws, type="session.delete", session_id=sid)
        frames = await recv_until(ws, "error")
        assert frames[-1]["code"] == "session_busy"
        await recv_until(ws, "done")
        await send(ws, type="session.delete", session_id=sid)
        assert await recv_until(ws, "session.deleted") and True
        await send(ws, type="session.list")
        assert (await recv(ws))["sessions"] == []
        await send(ws, type="session.delete", session_id=sid)
        assert (await recv(ws))["code"] == "session_not_found"


def slow_reply_saves(server: Any, monkeypatch: pytest.MonkeyPatch) -> threading.Event:
    """Make the server's saves of replies take 0.5 s; the event is set as one begins."""
    store = server.ctx.turns.store
    real_append = store.append_message
    saving = threading.Event()

    def slow_append(session_id: str, role: str, *args: Any, **kwargs: Any) -> Any:
        if role == "assistant":
            saving.set()
            time.sleep(0.5)
        return real_append(session_id, role, *args, **kwargs)

    monkeypatch.setattr(store, "append_message", slow_append)
    return saving


async def test_a_disconnect_while_the_reply_is_saved_saves_it_once(
        tmp_path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """A client gone (a page reloaded) just as its reply is being saved: the save runs to its
    end, once. The disconnect's own save of a partial reply used to run as well, and the
    session then held the reply twice."""
    with running_server(scripted_config(tmp_path), ScriptedEngine()) as (url, server):
        saving = slow_reply_saves(server, monkeypatch)
        ws_url = url.replace("http://", "ws://") + "/v1/ws"
        async with connect(ws_url) as ws:
            sid = (await open_session(ws))["session"]["session_id"]
            await send(ws, type="message", session_id=sid, content="a b", request_id="r")
            assert await asyncio.to_thread(saving.wait, 10)
        await asyncio.sleep(1.0)  # the save in flight ends
        async with connect(ws_url) as ws:
            history = (await open_session(ws, sid))["messages"]
    assert [m["role"] for m in history] == ["user", "assistant"]
    assert history[-1]["content"] == "You said: a b"


async def test_a_cancel_while_the_reply_is_saved_still_gets_its_done_frame(
        tmp_path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """A cancel that arrives once the reply is whole, while it is being saved: the save ends,
    once, and the client gets the `done` frame (it used to get nothing)."""
    with running_server(scripted_config(tmp_path), ScriptedEngine()) as (url, server):
        saving = slow_reply_saves(server, monkeypatch)
        async with connect(url.replace("http://", "ws://") + "/v1/ws") as ws:
            sid = (await open_session(ws))["session"]["session_id"]
            await send(ws, type="message", session_id=sid, content="a b", request_id="r")
            assert await asyncio.to_thread(saving.wait, 10)
            await send(ws, type="cancel", request_id="r")
            done = (await recv_until(ws, "done"))[-1]
            assert done["request_id"] == "r" and done["text"] == "You said: a b"
            history = (await open_session(ws, sid))["messages"]
    assert [m["role"] for m in history] == ["user", "assistant"]


async def test_another_clients_refused_turn_with_the_same_id_keeps_the_session_busy(
        scripted: Scripted) -> None:
    """A turn refused on another connection, under the streaming turn's own request id, used
    to let go of that turn's hold on the session: a second turn then ran beside it (the
    stored conversation out of order) and a delete removed the session under it."""
    scripted.engine.token_delay_s = 0.05
    async with connect(scripted.ws_url) as a, connect(scripted.ws_url) as b:
        sid = (await open_session(a))["session"]["session_id"]
        await send(a, type="message", session_id=sid, content="w " * 30, request_id="r1")
        await recv_until(a, "token")
        await send(b, type="message", session_id=sid, content="x" * 5000, request_id="r1")
        assert (await recv(b))["code"] == "too_large"
        await send(b, type="message", session_id=sid, content="second", request_id="r1")
        assert (await recv(b))["code"] == "session_busy"
        await send(b, type="message", session_id=sid, content="third", request_id="r2")
        assert (await recv(b))["code"] == "session_busy"
        await send(b, type="session.delete", session_id=sid)
        assert (await recv(b))["code"] == "session_busy"
        assert (await recv_until(a, "done"))[-1]["finish_reason"] == "stop"
        history = (await open_session(b, sid))["messages"]
    assert [m["role"] for m in history] == ["user", "assistant"]


async def test_a_turn_sent_while_its_session_is_being_deleted_is_refused(
        scripted: Scripted, monkeypatch: pytest.MonkeyPatch) -> None:
    """A delete renders the conversation's last prompt (for the KV erasure) before it deletes:
    a turn that arrived meanwhile was accepted, then lost its session (an internal error after
    `accepted`, and its KV left out of the erasure). It is refused now."""
    from antiphon.server.turns import SessionTurns

    last_prompt = SessionTurns._last_prompt

    def slow(self: SessionTurns, session_id: str) -> list[int] | None:
        time.sleep(0.5)  # a long conversation rendered by a real tokenizer
        return last_prompt(self, session_id)

    monkeypatch.setattr(SessionTurns, "_last_prompt", slow)
    async with connect(scripted.ws_url) as a, connect(scripted.ws_url) as b:
        sid = (await open_session(a))["session"]["session_id"]
        await send(b, type="session.delete", session_id=sid)
        await asyncio.sleep(0.1)
        await send(a, type="message", session_id=sid, content="hello", request_id="r1")
        refused = await recv(a)
        assert (refused["type"], refused["code"]) == ("error", "session_busy")
        assert (await recv(b))["type"] == "session.deleted"


async def accepted_turn(data_dir: Any) -> tuple[Any, Any, Any]:
    """The server's parts over a scripted engine, without a server, and a turn accepted in a
    new session: (context, session, generation)."""
    from antiphon.config import AppConfig
    from antiphon.server import protocol
    from antiphon.server.config import ServerConfig
    from antiphon.server.context import AppContext
    from antiphon.sessions.config import SessionConfig

    ctx = AppContext.build(AppConfig(server=ServerConfig(),
                                     sessions=SessionConfig(data_dir=data_dir)), ScriptedEngine())
    session, _ = await ctx.turns.open("o", None)
    msg = protocol.decode_client_message(json.dumps(
        {"type": "message", "session_id": session.session_id, "content": "hi there"}))
    return ctx, session, await ctx.turns.accept("o", msg, "r1")


async def test_a_turn_refused_for_what_it_asks_leaves_the_advisories_as_they_were(
        tmp_path: Any) -> None:
    # Claimed before its request was checked, a turn refused for a max_tokens past the limit
    # counted as the session's turn having come: its ordered advisory no longer held back the
    # key's later ones (found by a review).
    from antiphon.server import protocol
    from antiphon.server.errors import ApiError

    ctx, _, _ = await accepted_turn(tmp_path)
    first, _ = await ctx.turns.open("o", None)
    second, _ = await ctx.turns.open("o", None)
    await ctx.turns.record_advisory("o", first.session_id, "rest", 20.0, ordered=True)
    refused = protocol.decode_client_message(json.dumps({
        "type": "message", "session_id": first.session_id, "content": "hi",
        "max_tokens": 10_000_000}))
    with pytest.raises(ApiError, match="max_tokens"):
        await ctx.turns.accept("o", refused, "r2")
    assert ctx.store.messages(first.session_id) == []
    assert not ctx.turns.claims.is_held(first.session_id)
    expected = ctx.turns.arrival_order.expected_arrival("o", second.session_id, 1.0)
    assert expected is not None and expected > 19.0  # still after the first's
    ctx.store.close()


async def test_a_cancel_while_the_done_frame_waits_to_be_sent_lets_it_go_out(
        tmp_path: Any) -> None:
    """The `done` frame waits for the connection (another turn's frame ahead of it, a slow
    reader); a cancel that lands then used to end the turn without it, and the client that
    cancelled waited for ever."""
    ctx, session, gen = await accepted_turn(tmp_path)
    held, cancelled = asyncio.Event(), False
    sent: list[str] = []

    async def emit(frame: str) -> None:
        kind = json.loads(frame)["type"]
        if kind == "done" and not held.is_set():
            held.set()
            await asyncio.sleep(0.5)  # the socket drains slowly
        sent.append(kind)

    task = asyncio.create_task(ctx.turns.run(session.session_id, gen, emit, lambda: cancelled))
    await asyncio.wait_for(held.wait(), 10)
    cancelled = True
    task.cancel()
    await asyncio.wait_for(task, 10)
    assert sent.count("done") == 1
    assert [m.role for m in ctx.store.messages(session.session_id)] == ["user", "assistant"]
    ctx.store.close()


async def test_a_reply_whole_when_its_stream_is_closed_keeps_its_finish_reason(
        tmp_path: Any) -> None:
    """A client gone as the last piece of a finished reply is delivered: the reply ended
    ("stop") and is kept so, not as "cancelled"."""
    ctx, _, gen = await accepted_turn(tmp_path)
    pieces = ctx.chat.stream(gen, api="ws")
    async for _ in pieces:
        if gen.finish_reason is not None:
            break  # the last piece: the client goes before the stream's end
    await pieces.aclose()
    assert gen.finish_reason == "stop"
    ctx.store.close()


SCHEMA_FORMAT = {"type": "json_schema",
                 "json_schema": {"name": "x", "schema": {"type": "string"}}}


async def test_a_message_the_engine_refuses_after_accepted_is_taken_back(tmp_path: Path) -> None:
    """vLLM validates a request when it is submitted, after `accepted` went out (a schema its
    grammar backend cannot compile): the message and the title it gave were kept, and every
    retry added one more user message."""
    from tests.test_rest_api import RefusingEngine

    with live_server(scripted_config(tmp_path), RefusingEngine()) as url:
        async with connect(url.replace("http://", "ws://") + "/v1/ws") as ws:
            sid = (await open_session(ws))["session"]["session_id"]
            for i in range(2):
                await send(ws, type="message", session_id=sid, content=f"give json {i}",
                           request_id=f"r{i}", response_format=SCHEMA_FORMAT)
                frames = [await recv(ws), await recv(ws)]
                assert [f["type"] for f in frames] == ["accepted", "error"]
                assert frames[1]["code"] == "bad_message"
                assert "not kept" in frames[1]["message"]
            opened = await open_session(ws, sid)
            assert opened["messages"] == [] and opened["session"]["title"] == "New chat"
            r = await chat(ws, sid, "plain words")  # the session goes on as if never asked
            assert r["done"]["finish_reason"] == "stop"
            opened = await open_session(ws, sid)
            assert [m["role"] for m in opened["messages"]] == ["user", "assistant"]
            assert opened["session"]["title"] == "plain words"


class FailsAfterTwoTokens(ScriptedEngine):
    """The engine client fails mid-reply with an error the server does not map."""

    error: type[Exception] = RuntimeError

    async def generate(self, request_id, prompt_token_ids, params):  # type: ignore[no-untyped-def,override]
        async for n, delta in _numbered(super().generate(request_id, prompt_token_ids, params)):
            yield delta
            if n == 1:
                raise self.error("unexpected failure in the engine client")


async def _numbered(items):  # type: ignore[no-untyped-def]
    n = 0
    async for item in items:
        yield n, item
        n += 1


async def test_an_unexpected_engine_failure_ends_the_turn_with_an_error_frame(
        tmp_path: Path) -> None:
    """A failure other than the engine's own errors ended the turn with no frame: the client
    waited for `done` for ever."""
    with live_server(scripted_config(tmp_path), FailsAfterTwoTokens()) as url:
        async with connect(url.replace("http://", "ws://") + "/v1/ws") as ws:
            sid = (await open_session(ws))["session"]["session_id"]
            await send(ws, type="message", session_id=sid, content="a b c d e f", request_id="r")
            frames = await recv_until(ws, "error")
            assert frames[0]["type"] == "accepted" and frames[-1]["code"] == "internal_error"
            assert frames[-1]["request_id"] == "r"
            opened = await open_session(ws, sid)  # the message stays, for a regenerate
            assert [m["role"] for m in opened["messages"]] == ["user"]
        # counted as a REST request's error is (an alert on it missed every web UI turn)
        import httpx
        metrics = httpx.get(url + "/metrics").text
        assert 'antiphon_errors_total{code="internal_error"} 1.0' in metrics, metrics


async def test_a_failed_turn_does_not_save_its_partial_reply_once_the_session_moved_on(
        tmp_path: Path) -> None:
    """The engine fails a turn mid-reply; the session is free again while its error frame
    waits for a slow socket, another tab sends a message, then the first client leaves: its
    partial reply was saved then, behind the other tab's message."""
    from antiphon.config import AppConfig
    from antiphon.engine_ext.engine import EngineRequestFailedError
    from antiphon.server import protocol
    from antiphon.server.config import ServerConfig
    from antiphon.server.context import AppContext
    from antiphon.sessions.config import SessionConfig

    engine = FailsAfterTwoTokens()
    engine.error = EngineRequestFailedError
    ctx = AppContext.build(AppConfig(server=ServerConfig(),
                                     sessions=SessionConfig(data_dir=tmp_path)), engine)

    def message(sid: str, content: str) -> protocol.ChatMessage:
        msg = protocol.decode_client_message(json.dumps(
            {"type": "message", "session_id": sid, "content": content}))
        assert isinstance(msg, protocol.ChatMessage)
        return msg

    try:
        session, _ = await ctx.turns.open("o", None)
        sid = session.session_id
        gen = await ctx.turns.accept("o", message(sid, "one two three four"), "r1")
        error_waiting = asyncio.Event()

        async def emit(frame: str) -> None:
            if json.loads(frame)["type"] == "error":
                error_waiting.set()
                await asyncio.sleep(10)  # the socket is slow to drain

        task = asyncio.create_task(ctx.turns.run(sid, gen, emit, lambda: False))
        await asyncio.wait_for(error_waiting.wait(), 10)
        second = await ctx.turns.accept("o", message(sid, "second"), "r2")
        task.cancel()  # the first client leaves while its error frame waits
        await asyncio.gather(task, return_exceptions=True)
        rows = [(m.role, m.content) for m in ctx.store.messages(sid)]
        ctx.turns.claims.release(sid, second.session_claim)
        assert rows == [("user", "one two three four"), ("user", "second")]
    finally:
        ctx.store.close()


async def test_a_slow_typing_advisory_does_not_hold_up_a_cancel_behind_it(
        scripted: Scripted) -> None:
    """The engine answers an advisory between two steps, which can take seconds: answered
    inline, a typing frame held up the `cancel` behind it, and the reply streamed on."""
    engine = scripted.engine
    engine.token_delay_s = 0.05
    advise = engine.advise
    advised = asyncio.Event()

    async def slow_advise(*args: Any, **kwargs: Any) -> int | None:
        await asyncio.sleep(3.0)
        held = await advise(*args, **kwargs)
        advised.set()
        return held

    engine.advise = slow_advise  # type: ignore[method-assign]
    async with connect(scripted.ws_url) as ws:
        a = (await open_session(ws))["session"]["session_id"]
        b = (await open_session(ws))["session"]["session_id"]
        await chat(ws, b, "earlier")  # b has a conversation to bring forward
        await send(ws, type="message", session_id=a, content="w " * 300, request_id="long")
        await recv_until(ws, "token")
        await send(ws, type="typing", session_id=b)
        started = time.perf_counter()
        await send(ws, type="cancel", request_id="long")
        frames = await recv_until(ws, "done")
        assert time.perf_counter() - started < 1.5
        assert frames[-1]["finish_reason"] == "cancelled"
        await asyncio.wait_for(advised.wait(), 10)  # the advisory still ran


async def test_a_client_gone_mid_reply_keeps_what_it_saw_when_a_send_fails(
        tmp_path: Path) -> None:
    """A send to a socket already gone raises an ordinary exception (`WebSocketDisconnect`),
    not a cancel: it was taken for the engine's failure, and the partial reply was lost."""
    from starlette.websockets import WebSocketDisconnect

    from antiphon.config import AppConfig
    from antiphon.server import protocol
    from antiphon.server.config import ServerConfig
    from antiphon.server.context import AppContext
    from antiphon.sessions.config import SessionConfig

    ctx = AppContext.build(AppConfig(server=ServerConfig(),
                                     sessions=SessionConfig(data_dir=tmp_path)),
                           ScriptedEngine(token_delay_s=0.01))
    try:
        session, _ = await ctx.turns.open("o", None)
        sid = session.session_id
        msg = protocol.decode_client_message(json.dumps(
            {"type": "message", "session_id": sid, "content": "one two three four five"}))
        assert isinstance(msg, protocol.ChatMessage)
        gen = await ctx.turns.accept("o", msg, "r1")
        sent: list[str] = []

        async def emit(frame: str) -> None:
            if len(sent) == 3:
                raise WebSocketDisconnect(1006)
            sent.append(frame)

        with pytest.raises(WebSocketDisconnect):
            await ctx.turns.run(sid, gen, emit, lambda: False)
        stored = [(m.role, m.finish_reason) for m in ctx.store.messages(sid)]
        assert stored == [("user", None), ("assistant", "cancelled")]
    finally:
        ctx.store.close()


async def test_a_delete_right_behind_a_typing_frame_waits_for_its_advisory(
        scripted: Scripted, monkeypatch: pytest.MonkeyPatch) -> None:
    """Typing advisories run beside the frames: a delete behind one raced it, and the
    advisory's insert failed on the deleted session (an internal_error frame)."""
    from antiphon.sessions.store import SessionStore

    record = SessionStore.record_advisory

    def slow_record(self: SessionStore, *args: Any, **kwargs: Any) -> bool:
        time.sleep(0.3)  # the database is busy
        return record(self, *args, **kwargs)

    monkeypatch.setattr(SessionStore, "record_advisory", slow_record)
    async with connect(scripted.ws_url) as ws:
        sid = (await open_session(ws))["session"]["session_id"]
        await chat(ws, sid, "hello there")
        await send(ws, type="typing", session_id=sid)
        await send(ws, type="session.delete", session_id=sid)
        assert (await recv(ws))["type"] == "session.deleted"
        with pytest.raises(TimeoutError):
            await recv(ws, timeout=1.0)  # and nothing else


def test_an_advisory_for_a_session_deleted_meanwhile_keeps_nothing(tmp_path: Path) -> None:
    from antiphon.sessions.store import SessionStore

    store = SessionStore(tmp_path / "s.db")
    try:
        session = store.create_session("o")
        assert session is not None
        assert store.record_advisory(session.session_id, "typing", 1.0)
        assert store.delete_session("o", session.session_id)
        assert not store.record_advisory(session.session_id, "typing", 2.0)
    finally:
        store.close()


async def test_a_message_whose_accepted_frame_never_went_out_is_not_kept(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A client that left before it heard `accepted` may send the message again: the session
    keeps nothing of it, and the session is free."""
    from starlette.websockets import WebSocketDisconnect

    from antiphon.server import ws as ws_module

    send_frame = ws_module.Connection.send

    async def lose_accepted(self: Any, frame: str) -> None:
        if json.loads(frame)["type"] == "accepted":
            raise WebSocketDisconnect(1006)
        await send_frame(self, frame)

    engine = ScriptedEngine(token_delay_s=0.0)
    with live_server(scripted_config(tmp_path), engine) as url:
        ws_url = url.replace("http", "ws") + "/v1/ws"
        async with connect(ws_url) as ws:
            sid = (await open_session(ws))["session"]["session_id"]
            monkeypatch.setattr(ws_module.Connection, "send", lose_accepted)
            await send(ws, type="message", session_id=sid, content="order #42",
                       request_id="r1")
            with pytest.raises(ConnectionClosed):
                await recv(ws, timeout=10)
        monkeypatch.setattr(ws_module.Connection, "send", send_frame)
        async with connect(ws_url) as ws:
            assert (await open_session(ws, sid))["messages"] == []
            done = (await chat(ws, sid, "order #42"))["done"]  # sent again: once
            assert done["text"] == "You said: order #42"
            roles = [m["role"] for m in (await open_session(ws, sid))["messages"]]
            assert roles == ["user", "assistant"]


async def test_errors_name_the_cancel_they_answer_and_a_client_gone_is_no_error(
        tmp_path: Path) -> None:
    engine = ScriptedEngine(lambda turns: "x " * 3000, token_delay_s=0.0, max_model_len=10**5)
    with live_server(scripted_config(tmp_path, max_tokens_limit=3000), engine) as url:
        ws_url = url.replace("http", "ws") + "/v1/ws"
        async with connect(ws_url) as ws:
            await send(ws, type="cancel", request_id="never")
            frame = await recv(ws)
            assert (frame["code"], frame["request_id"]) == ("request_not_found", "never")
        # A client that stops reading, then leaves, while the server answers its frames.
        ws = await connect(ws_url, max_queue=1, close_timeout=1)
        sid = (await open_session(ws))["session"]["session_id"]
        await send(ws, type="message", session_id=sid, content="long", max_tokens=3000)
        await asyncio.sleep(0.5)
        await send(ws, type="session.list")  # its answer waits behind the reply's tokens
        await asyncio.sleep(0.3)
        ws.transport.abort()
        await asyncio.sleep(1.0)
        import httpx

        errors = [line for line in httpx.get(url + "/metrics").text.splitlines()
                  if line.startswith('antiphon_errors_total{code="internal_error"}')]
        assert errors in ([], ['antiphon_errors_total{code="internal_error"} 0.0']), errors


def test_a_title_from_a_long_first_message_ends_at_a_word() -> None:
    from antiphon.server.session_fields import TITLE_CHARS, title_from

    assert title_from("  What is   the capital\nof France? ") == "What is the capital of France?"
    long = "Please summarise the following meeting notes, keeping every decision and owner"
    assert title_from(long) == "Please summarise the following meeting notes, keeping…"
    assert len(title_from(long)) <= TITLE_CHARS
    unbroken = "x" * 100  # no word to end at: cut at the limit
    assert title_from(unbroken) == "x" * (TITLE_CHARS - 1) + "…"
    exact = "y" * TITLE_CHARS
    assert title_from(exact) == exact


def slow_release(monkeypatch: pytest.MonkeyPatch, delay_s: float) -> None:
    """Make each turn let go of its session `delay_s` late (a slow cut-short turn)."""
    from antiphon.server.session_claims import SessionClaims

    release = SessionClaims.release

    def late(self: SessionClaims, session_id: str, hold: str | None) -> None:
        asyncio.get_running_loop().call_later(delay_s, release, self, session_id, hold)

    monkeypatch.setattr(SessionClaims, "release", late)


async def cut_short_turn(ws: Any, session_id: str) -> None:
    """Start a turn of `session_id` and cancel it: the session waits for it to let go."""
    await send(ws, type="message", session_id=session_id, content="w " * 60, request_id="cut")
    await recv_until(ws, "token")
    await send(ws, type="cancel", request_id="cut")
    assert (await recv_until(ws, "done"))[-1]["finish_reason"] == "cancelled"


async def test_a_turn_waiting_for_its_session_holds_up_no_other_frame(
        scripted: Scripted, monkeypatch: pytest.MonkeyPatch) -> None:
    """A turn that waits for its session's last turn to let go (up to
    --session-free-wait-s) is accepted in a task of its own: the frames behind it on the
    connection, another session's turn or a listing, are answered meanwhile."""
    async with connect(scripted.ws_url) as ws:
        waiting = (await open_session(ws))["session"]["session_id"]
        other = (await open_session(ws))["session"]["session_id"]
        slow_release(monkeypatch, 1.5)
        await cut_short_turn(ws, waiting)
        start = time.monotonic()
        await send(ws, type="regenerate", session_id=waiting, request_id="late")
        await send(ws, type="session.list")
        await send(ws, type="message", session_id=other, content="hi", request_id="other")
        frames = await recv_until(ws, "accepted")
        assert [f["type"] for f in frames] == ["sessions", "accepted"], frames
        assert frames[-1]["request_id"] == "other" and time.monotonic() - start < 1.0
        done = [f for f in await recv_until(ws, "done") + await recv_until(ws, "done")
                if f["type"] == "done"]
        assert sorted(f["request_id"] for f in done) == ["late", "other"]


async def test_a_cancel_for_a_turn_still_being_accepted_stops_it_once_under_way(
        scripted: Scripted, monkeypatch: pytest.MonkeyPatch) -> None:
    """A `cancel` that comes while its turn waits for the session is not lost: the turn is
    accepted, then stopped, and ends with `done` (cancelled); a session's turns are accepted
    in the order they came, the one behind it once it has let go."""
    async with connect(scripted.ws_url) as ws:
        sid = (await open_session(ws))["session"]["session_id"]
        slow_release(monkeypatch, 1.0)
        await cut_short_turn(ws, sid)
        await send(ws, type="message", session_id=sid, content="one", request_id="first")
        await send(ws, type="message", session_id=sid, content="two", request_id="second")
        await send(ws, type="cancel", request_id="first")
        frames = [f for f in await recv_until(ws, "done") + await recv_until(ws, "done")
                  if f["type"] != "token"]
        assert [(f["request_id"], f["type"]) for f in frames] == [
            ("first", "accepted"), ("first", "done"), ("second", "accepted"),
            ("second", "done")], frames
        assert frames[1]["finish_reason"] == "cancelled"
        assert frames[3]["finish_reason"] == "stop"
        messages = (await open_session(ws, sid))["messages"]
        assert [m["content"] for m in messages if m["role"] == "user"][1:] == ["one", "two"]


async def test_a_request_id_used_again_after_its_cancelled_turn_is_a_new_turn(
        scripted: Scripted) -> None:
    """A cancel belongs to the turn it stopped: a turn sent under the same id right after that
    turn's `done` runs to its end (the cancel's mark, kept by id, stopped it in 14 of 20
    tries); and a turn refused while being accepted names the id its frame gave, none
    here."""
    async with connect(scripted.ws_url) as ws:
        sid = (await open_session(ws))["session"]["session_id"]
        for i in range(8):
            await send(ws, type="message", session_id=sid, content="w " * 40, request_id=f"c{i}")
            await recv_until(ws, "token")
            await send(ws, type="cancel", request_id=f"c{i}")
            assert (await recv_until(ws, "done"))[-1]["finish_reason"] == "cancelled"
            await send(ws, type="message", session_id=sid, content="hi", request_id=f"c{i}")
            done = (await recv_until(ws, "done"))[-1]
            assert (done["finish_reason"], done["text"]) == ("stop", "You said: hi")
        await send(ws, type="message", session_id="s_nope", content="hi")
        refused = await recv(ws)
        assert (refused["code"], refused["request_id"]) == ("session_not_found", None)


async def test_a_deletion_waiting_for_its_session_holds_up_no_other_frame(
        scripted: Scripted, monkeypatch: pytest.MonkeyPatch) -> None:
    """A `session.delete` that waits for the session's cut-short turn to let go runs in a task
    of its own, as a turn does: a listing behind it is answered meanwhile; a message for the
    session sent after it still comes after it (session_not_found)."""
    async with connect(scripted.ws_url) as ws:
        sid = (await open_session(ws))["session"]["session_id"]
        slow_release(monkeypatch, 1.5)
        await cut_short_turn(ws, sid)
        start = time.monotonic()
        await send(ws, type="session.delete", session_id=sid)
        await send(ws, type="session.list")
        await send(ws, type="message", session_id=sid, content="hi", request_id="after")
        listed = await recv(ws)
        assert listed["type"] == "sessions" and time.monotonic() - start < 1.0, listed
        deleted, refused = await recv(ws), await recv(ws)
        assert deleted == {"type": "session.deleted", "session_id": sid}
        assert (refused["code"], refused["request_id"]) == ("session_not_found", "after")


async def test_a_typing_advisory_after_a_deletion_waits_for_it(
        scripted: Scripted, monkeypatch: pytest.MonkeyPatch) -> None:
    """A typing advisory sent after a session's deletion (a turn of it between them) waits for
    the deletion: it ran first and brought forward the KV the deletion was about to erase."""
    async with connect(scripted.ws_url) as ws:
        sid = (await open_session(ws))["session"]["session_id"]
        slow_release(monkeypatch, 1.0)
        await cut_short_turn(ws, sid)
        await send(ws, type="session.delete", session_id=sid)
        await send(ws, type="message", session_id=sid, content="hi", request_id="after")
        await send(ws, type="typing", session_id=sid)
        frames = [await recv(ws) for _ in range(3)]
    assert frames[0]["type"] == "session.deleted"
    assert sorted((f["code"], f["request_id"] or "") for f in frames[1:]) == [
        ("session_not_found", ""), ("session_not_found", "after")]
    assert not [a for a in scripted.engine.advisories if a[0] == sid]


async def test_a_reply_cut_by_a_disconnect_is_kept_before_its_session_is_let_go(
        scripted: Scripted, monkeypatch: pytest.MonkeyPatch) -> None:
    """A client cut off while one of its turns streamed and another was being accepted: the
    connection cancelled the streaming turn twice, the second cancel broke into the saving of
    its partial reply, and the session was let go before the reply was kept; the client's
    `regenerate` at once then ran beside the save and the session ended with two replies."""
    from antiphon.sessions.store import SessionStore

    append = SessionStore.append_message

    def slow_append(self: SessionStore, session_id: str, role: str, content: str,
                    *args: Any, **kwargs: Any) -> Any:
        time.sleep(1.0 if role == "assistant" else 0.3 if content == "slow" else 0)
        return append(self, session_id, role, content, *args, **kwargs)

    monkeypatch.setattr(SessionStore, "append_message", slow_append)
    async with connect(scripted.ws_url) as ws:
        streaming = (await open_session(ws))["session"]["session_id"]
        other = (await open_session(ws))["session"]["session_id"]
        await send(ws, type="message", session_id=streaming, content="w " * 80, request_id="a")
        await recv_until(ws, "token")
        await send(ws, type="message", session_id=other, content="slow", request_id="b")
        await asyncio.sleep(0.05)
    await asyncio.sleep(0.6)
    async with connect(scripted.ws_url) as ws:
        await send(ws, type="regenerate", session_id=streaming, request_id="again")
        assert (await recv_until(ws, "done"))[-1]["finish_reason"] == "stop"
        messages = (await open_session(ws, streaming))["messages"]
    assert [(m["role"], m["finish_reason"]) for m in messages] == [
        ("user", None), ("assistant", "stop")]


async def test_disconnect_during_cut_reply_save(tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """A client whose socket fails while a token is sent, then whose connection ends (its
    runs cancelled) while the cut reply is saved (a slow disk): the run holds the session
    until the save ends (it let it go, and the client's next message went in first)."""
    save = SessionStore.append_message

    def slow_save(self: SessionStore, session_id: str, role: str, *args: Any, **kw: Any) -> Any:
        if role == "assistant" and "cancelled" in args:
            time.sleep(0.8)
        return save(self, session_id, role, *args, **kw)
    monkeypatch.setattr(SessionStore, "append_message", slow_save)

    real_send = wsmod.Connection.send
    sent = {"n": 0}

    async def failing_send(self: Any, frame: str) -> None:
        if '"token"' in frame and '"request_id": "r"' in frame.replace('":"', '": "'):
            sent["n"] += 1
            if sent["n"] >= 3:
                raise RuntimeError("the socket is gone (send failed)")
        await real_send(self, frame)
    monkeypatch.setattr(wsmod.Connection, "send", failing_send)

    engine = ScriptedEngine(token_delay_s=0.05, max_model_len=4000)
    with live_server(scripted_config(tmp_path, max_content_chars=1000), engine) as url:
        wsu = url.replace("http://", "ws://") + "/v1/ws"
        async with connect(wsu) as ws:
            sid = (await open_session(ws))["session"]["session_id"]
            await send(ws, type="message", session_id=sid, content="first " + "w " * 50,
                       request_id="r")
            await recv_until(ws, "token")
            await asyncio.sleep(0.3)  # the send failed meanwhile: the run saves its cut reply
        # the socket closed: the connection cancels its runs, while the save is under way
        await asyncio.sleep(0.1)
        async with connect(wsu) as ws:
            await send(ws, type="message", session_id=sid, content="second", request_id="s")
            await recv_until(ws, "done")
            await asyncio.sleep(1.0)
            history = (await open_session(ws, sid))["messages"]
    got = [(m["role"], m["content"][:6]) for m in history]
    assert got[:3] == [("user", "first "), ("assistant", got[1][1]), ("user", "second")], got


async def test_a_turn_whose_client_left_ends_without_an_error_logged(
        caplog: pytest.LogCaptureFixture) -> None:
    """A token sent after the socket closed raises starlette's WebSocketDisconnected (not
    WebSocketDisconnect): the turn was logged as ending with an error, with a traceback."""
    from types import SimpleNamespace

    from starlette.websockets import WebSocketDisconnected

    async def sending_after_the_close() -> None:
        raise WebSocketDisconnected('Cannot call "send" once a close message has been sent.')

    connection = object.__new__(wsmod.Connection)
    connection._tasks = set()
    connection.ctx = SimpleNamespace(turns=SimpleNamespace(
        claims=SimpleNamespace(release=lambda *_: None)))
    task = asyncio.ensure_future(sending_after_the_close())
    await asyncio.gather(task, return_exceptions=True)
    with caplog.at_level(logging.ERROR):
        connection._finish_turn(task, "s_1", "r_1", SimpleNamespace(session_claim=None),
                                lambda: None)
    assert not caplog.records


async def test_a_frame_answered_after_the_client_left_is_no_server_error(
        caplog: pytest.LogCaptureFixture) -> None:
    """Its answer's send raised WebSocketDisconnected: logged as an internal error with a
    traceback, counted, and let out of the connection's loop."""
    from types import SimpleNamespace

    from starlette.websockets import WebSocketDisconnected

    class GoneSocket:
        async def send_text(self, text: str) -> None:
            raise WebSocketDisconnected('Cannot call "send" once a close message has been sent.')

    errors: list[str] = []
    connection = object.__new__(wsmod.Connection)
    connection.ws, connection._send_lock = GoneSocket(), asyncio.Lock()
    connection.ctx = SimpleNamespace(
        config=SimpleNamespace(server=SimpleNamespace(max_frame_bytes=1 << 20)),
        metrics=SimpleNamespace(errors=SimpleNamespace(
            labels=lambda code: SimpleNamespace(inc=lambda: errors.append(code)))))

    async def answer(_msg: object) -> None:
        await connection.send('{"type": "sessions", "sessions": []}')

    connection._dispatch = answer  # type: ignore[method-assign]
    with caplog.at_level(logging.ERROR), pytest.raises(WebSocketDisconnected):
        await connection._handle_frame('{"type": "session.list"}')  # serve() returns on it
    assert not caplog.records and errors == []


async def test_conversations_render_off_the_event_loop(scripted: Scripted,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """A websocket turn rendered its conversation (three times with a stored context, more
    where it cut the window) on the event loop, and so did a REST completion: every stream's
    next token waited (a 40,000-token session held another's tokens for 244 ms; found by a
    review)."""
    threads: list[str] = []
    render = ScriptedEngine.continue_chat

    def recorded(self: ScriptedEngine, *args: Any, **kwargs: Any) -> Any:
        threads.append(threading.current_thread().name)
        return render(self, *args, **kwargs)

    monkeypatch.setattr(ScriptedEngine, "continue_chat", recorded)
    counting: list[str] = []  # (a message's tokens were counted on the loop too)
    count = ScriptedEngine.count_tokens

    def recorded_count(self: ScriptedEngine, text: str) -> int:
        counting.append(threading.current_thread().name)
        return count(self, text)

    monkeypatch.setattr(ScriptedEngine, "count_tokens", recorded_count)
    async with connect(scripted.ws_url) as ws:
        sid = (await open_session(ws, system="Be brief."))["session"]["session_id"]
        await chat(ws, sid, "hello there")
        await chat(ws, sid, "and again")
    assert counting and all(name.startswith("render-rt") for name in counting), counting
    async with httpx.AsyncClient(base_url=scripted.url) as http:
        r = await http.post("/v1/chat/completions", json={
            "model": "scripted", "messages": [{"role": "user", "content": "hi"}]})
        assert r.status_code == 200
        before = len(threads)
        r = await http.post("/tokenize", json={  # (/tokenize rendered on the loop too)
            "model": "scripted", "messages": [{"role": "user", "content": "hi"}]})
        assert r.status_code == 200 and len(threads) == before + 1
    assert len(threads) >= 4 and all(name.startswith("render-rt") for name in threads), threads

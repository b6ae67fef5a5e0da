"""A session turn's last steps (held-back content, its save or withdrawal, its window) under
cancels, refusals and deletions from elsewhere, and the session's length limit: the server's
parts over a scripted engine and a real SQLite store, without a server."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from antiphon.config import AppConfig
from antiphon.engine_ext.engine import EngineRequestError
from antiphon.engine_ext.scripted import ScriptedEngine
from antiphon.engine_ext.types import Delta
from antiphon.server import protocol
from antiphon.server.config import ServerConfig
from antiphon.server.context import AppContext
from antiphon.server.errors import ApiError, ErrorCode
from antiphon.server.turns import SessionTurns
from antiphon.sessions.config import SessionConfig

TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}


class Refusing(ScriptedEngine):
    """Refuses every request once `refuse` is set, as vLLM refuses a schema its grammar backend
    cannot compile, before the first token."""

    refuse = False

    async def generate(self, request_id, prompt_token_ids, params):  # type: ignore[no-untyped-def,override]
        if self.refuse:
            raise EngineRequestError("the grammar backend does not support this schema")
        async for delta in super().generate(request_id, prompt_token_ids, params):
            yield delta


class FailsMidway(ScriptedEngine):
    """Streams a token, then refuses the request (vLLM's grammar rejecting a token, or a
    ValueError raised in vLLM mid-stream)."""

    async def generate(self, request_id, prompt_token_ids, params):  # type: ignore[no-untyped-def,override]
        yield Delta(text="Hel", token_ids=(1,), num_new_tokens=1, finished=False)
        raise EngineRequestError("late refusal")


def build(data_dir: Path, engine: ScriptedEngine | None = None, **server: Any) -> AppContext:
    return AppContext.build(AppConfig(server=ServerConfig(**server),
                                      sessions=SessionConfig(data_dir=data_dir)),
                            engine or ScriptedEngine())


async def accept(ctx: AppContext, session_id: str, kind: str = "message", **fields: Any) -> Any:
    if kind == "message":
        fields.setdefault("content", "hi there")
    msg = protocol.decode_client_message(json.dumps(
        {"type": kind, "session_id": session_id, **fields}))
    return await ctx.turns.accept("o", msg, fields.get("request_id", "r1"))


async def run(ctx: AppContext, session_id: str, gen: Any,
              emit: Callable[[str], Any] | None = None) -> list[dict[str, Any]]:
    frames: list[dict[str, Any]] = []

    async def keep(frame: str) -> None:
        frames.append(json.loads(frame))
    await ctx.turns.run(session_id, gen, emit or keep, lambda: False)
    return frames


def slowed(store: Any, method: str, started: threading.Event, delay_s: float = 0.4) -> None:
    """Make `store.<method>` take `delay_s` (it runs in a thread), setting `started`."""
    real = getattr(store, method)

    def slow(*args: Any, **kwargs: Any) -> Any:
        started.set()
        time.sleep(delay_s)
        return real(*args, **kwargs)
    setattr(store, method, slow)


async def test_a_cancel_while_held_back_content_goes_out_still_gets_done(tmp_path: Path) -> None:
    """A reply that may call tools holds back what looks like a call and sends it once the
    stream has ended; a user's cancel landing while that content waited to be sent (a slow
    reader) ended the turn with no `done` frame, and the client waited for ever."""
    ctx = build(tmp_path, ScriptedEngine(reply=lambda turns: '{"answer": 42}'))
    session, _ = await ctx.turns.open("o", None)
    gen = await accept(ctx, session.session_id, tools=[TOOL])
    sending, cancelled = asyncio.Event(), False
    sent: list[str] = []

    async def emit(frame: str) -> None:
        kind = json.loads(frame)["type"]
        if kind == "token" and gen.finish_reason is not None and not sending.is_set():
            sending.set()
            await asyncio.sleep(0.5)  # the held-back content drains slowly
        sent.append(kind)

    task = asyncio.create_task(ctx.turns.run(session.session_id, gen, emit,
                                             lambda: cancelled))
    await asyncio.wait_for(sending.wait(), 10)
    cancelled = True
    task.cancel()
    await asyncio.wait_for(task, 10)
    assert sent == ["token", "done"]
    stored = ctx.store.messages(session.session_id)
    assert [(m.role, m.content) for m in stored] == [("user", "hi there"),
                                                     ("assistant", '{"answer": 42}')]
    assert not ctx.turns.claims.is_held(session.session_id)
    ctx.store.close()


async def test_a_cancel_while_a_refused_message_is_taken_back_gets_the_error(
        tmp_path: Path) -> None:
    """A user's cancel landing while a refused turn took its message back: no error frame
    went out, and the session was let go before the withdrawal had committed."""
    engine = Refusing()
    ctx = build(tmp_path, engine)
    session, _ = await ctx.turns.open("o", None)
    gen = await accept(ctx, session.session_id)
    engine.refuse = True
    withdrawing, cancelled = threading.Event(), False
    slowed(ctx.store, "withdraw_messages", withdrawing)
    frames: list[dict[str, Any]] = []

    async def emit(frame: str) -> None:
        frames.append(json.loads(frame))

    task = asyncio.create_task(ctx.turns.run(session.session_id, gen, emit,
                                             lambda: cancelled))
    await asyncio.to_thread(withdrawing.wait, 10)
    cancelled = True
    task.cancel()
    await asyncio.wait_for(task, 10)
    assert [(f["type"], f["code"]) for f in frames] == [("error", "bad_message")]
    assert "not kept" in frames[0]["message"]
    assert ctx.store.messages(session.session_id) == []
    ctx.store.close()


async def test_a_client_gone_while_a_refused_message_is_taken_back_holds_the_session(
        tmp_path: Path) -> None:
    """The client left while a refused turn took its message back: the session was let go
    at once, while the withdrawal still ran, and a next turn could interleave with it."""
    engine = Refusing()
    ctx = build(tmp_path, engine)
    session, _ = await ctx.turns.open("o", None)
    gen = await accept(ctx, session.session_id)
    engine.refuse = True
    withdrawing = threading.Event()
    slowed(ctx.store, "withdraw_messages", withdrawing)

    async def emit(frame: str) -> None:
        pass

    task = asyncio.create_task(ctx.turns.run(session.session_id, gen, emit, lambda: False))
    await asyncio.to_thread(withdrawing.wait, 10)
    task.cancel()  # a disconnect
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(task, 10)
    assert ctx.store.messages(session.session_id) == []  # withdrawn before it let go
    assert not ctx.turns.claims.is_held(session.session_id)
    ctx.store.close()


async def test_a_turn_sent_right_after_a_cancel_of_a_reply_being_saved_waits_for_it(
        tmp_path: Path) -> None:
    """A user's cancel of a reply already whole, while it is saved: the next message (sent
    as soon as the user pressed stop) waits for the save, as behind any turn cut short, and
    is not refused `session_busy`."""
    ctx = build(tmp_path)
    session, _ = await ctx.turns.open("o", None)
    sid = session.session_id
    gen = await accept(ctx, sid)
    saving, cancelled = threading.Event(), False
    slowed(ctx.store, "append_message", saving)

    async def emit(frame: str) -> None:
        pass

    task = asyncio.create_task(ctx.turns.run(sid, gen, emit, lambda: cancelled))
    await asyncio.to_thread(saving.wait, 10)
    cancelled = True
    task.cancel()
    await asyncio.sleep(0)  # the cancel lands
    nxt = await accept(ctx, sid, content="and then?", request_id="r2")
    await asyncio.wait_for(task, 10)
    assert [m.role for m in ctx.store.messages(sid)] == ["user", "assistant", "user"]
    ctx.turns.claims.release(sid, nxt.session_claim)
    ctx.store.close()


async def long_session(ctx: AppContext, engine: ScriptedEngine) -> str:
    """A session of 4 turns whose next turn, asking for many tokens, needs a window cut."""
    session, _ = await ctx.turns.open("o", None)
    sid = session.session_id
    for i in range(4):
        gen = await accept(ctx, sid, content=f"message number {i} " + "y" * 30,
                           request_id=f"r{i}")
        await run(ctx, sid, gen)
    return sid


async def test_a_refused_regenerate_leaves_the_sessions_window_where_it_was(
        tmp_path: Path) -> None:
    """A regenerate that leaves messages out moved the session's window when it was accepted:
    refused by the engine, it still cut the model's view and dropped the stored context."""
    engine = Refusing(max_model_len=400)
    ctx = build(tmp_path, engine, max_tokens_limit=300, default_max_tokens=20)
    sid = await long_session(ctx, engine)
    before = (ctx.store.window_start(sid), ctx.store.context(sid))
    engine.refuse = True
    gen = await accept(ctx, sid, "regenerate", max_tokens=250)
    assert (gen.window_moves_to or 0) > before[0]  # the turn's window leaves messages out
    frames = await run(ctx, sid, gen)
    assert [(f["type"], f.get("code")) for f in frames] == [("error", "bad_message")]
    assert (ctx.store.window_start(sid), ctx.store.context(sid)) == before
    ctx.store.close()


async def test_a_refusal_after_the_reply_began_keeps_the_message_and_says_so(
        tmp_path: Path) -> None:
    """`bad_message` after `accepted` tells the client its message was taken back: sent
    after a reply had begun (kept then), the web UI put the message back in its composer, and
    sent again, the session held it twice."""
    ctx = build(tmp_path, FailsMidway())
    session, _ = await ctx.turns.open("o", None)
    sid = session.session_id
    frames = await run(ctx, sid, await accept(ctx, sid))
    assert [(f["type"], f.get("code")) for f in frames] == [("token", None),
                                                           ("error", "engine_error")]
    assert "the message was kept" in frames[-1]["message"]
    assert [(m.role, m.content) for m in ctx.store.messages(sid)] == [("user", "hi there")]
    ctx.store.close()


async def test_a_regenerate_whose_new_reply_is_empty_replaces_the_old(tmp_path: Path) -> None:
    """The model ending a regenerated reply at once (its end of sequence, a stop string at
    the start): `done` gave the empty reply, and the session kept the old one."""
    engine = ScriptedEngine()
    ctx = build(tmp_path, engine)
    session, _ = await ctx.turns.open("o", None)
    sid = session.session_id
    await run(ctx, sid, await accept(ctx, sid))
    engine.reply = lambda turns: ""
    frames = await run(ctx, sid, await accept(ctx, sid, "regenerate", request_id="r2"))
    assert (frames[-1]["type"], frames[-1]["finish_reason"], frames[-1]["text"]) == (
        "done", "stop", "")
    assert [(m.role, m.content) for m in ctx.store.messages(sid)] == [("user", "hi there"),
                                                                     ("assistant", "")]
    ctx.store.close()


async def test_a_regenerate_that_leaves_messages_out_moves_the_window_with_its_reply(
        tmp_path: Path) -> None:
    engine = ScriptedEngine(max_model_len=400)
    ctx = build(tmp_path, engine, max_tokens_limit=300, default_max_tokens=20)
    sid = await long_session(ctx, engine)
    gen = await accept(ctx, sid, "regenerate", max_tokens=250)
    start = gen.window_moves_to
    assert start is not None and ctx.store.window_start(sid) < start  # not moved before it
    frames = await run(ctx, sid, gen)
    assert frames[-1]["type"] == "done" and frames[-1]["context_start"] == start
    assert ctx.store.window_start(sid) == start
    stored = ctx.store.context(sid)
    assert stored is not None and stored[0] == 8  # the new reply's context, over 8 messages
    assert [m.role for m in ctx.store.messages(sid)].count("assistant") == 4
    ctx.store.close()


@pytest.mark.parametrize("kind", ["message", "regenerate"])
async def test_a_turn_whose_session_was_deleted_elsewhere_meanwhile_is_not_found(
        tmp_path: Path, kind: str) -> None:
    """Another connection deleted the session between the turn's look-up and its claim: the
    message failed on a raw foreign-key error (`internal_error`), the regenerate with
    `bad_message`."""
    ctx = build(tmp_path)
    session, _ = await ctx.turns.open("o", None)
    sid = session.session_id
    await run(ctx, sid, await accept(ctx, sid))
    real_get = ctx.turns.get

    async def get_then_deleted(owner: str, session_id: str) -> Any:
        found = await real_get(owner, session_id)
        ctx.turns.get = real_get  # type: ignore[method-assign]
        await ctx.turns.delete(owner, session_id)  # another connection's delete lands here
        return found
    ctx.turns.get = get_then_deleted  # type: ignore[method-assign]
    with pytest.raises(ApiError) as refused:
        await accept(ctx, sid, kind)
    assert refused.value.code == ErrorCode.SESSION_NOT_FOUND
    assert not ctx.turns.claims.is_held(sid)
    await ctx.turns.eraser.stop()  # (the deletion's erasure of its KV)
    ctx.store.close()


async def test_a_session_keeps_at_most_its_limit_of_messages(tmp_path: Path) -> None:
    """Nothing bounded a session's length: every turn read it whole, and one key could fill
    the disk. A turn that would take it past `max_session_messages` is refused and changes
    nothing; a regenerate, which replaces a reply, still runs."""
    ctx = build(tmp_path, max_session_messages=5)
    session, _ = await ctx.turns.open("o", None)
    sid = session.session_id
    for i in range(2):
        await run(ctx, sid, await accept(ctx, sid, content=f"turn {i}", request_id=f"r{i}"))
    with pytest.raises(ApiError) as refused:
        await accept(ctx, sid, content="one more")
    assert refused.value.code == ErrorCode.SESSION_FULL
    assert "--max-session-messages" in refused.value.message
    assert len(ctx.store.messages(sid)) == 4 and not ctx.turns.claims.is_held(sid)
    frames = await run(ctx, sid, await accept(ctx, sid, "regenerate"))
    assert frames[-1]["type"] == "done" and len(ctx.store.messages(sid)) == 4
    ctx.store.close()


def test_the_store_reads_a_sessions_messages_from_a_start(tmp_path: Path) -> None:
    ctx = build(tmp_path)
    session = ctx.store.create_session("o")
    assert session is not None
    for i in range(5):
        ctx.store.add_turn_messages(session.session_id, "user", [(f"m{i}", 1, None)])
    assert [m.content for m in ctx.store.messages(session.session_id, 3)] == ["m3", "m4"]
    assert len(ctx.store.messages(session.session_id)) == 5
    ctx.store.close()


async def test_a_second_deletion_of_a_session_being_deleted_finds_it_gone(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A double click or a client's retry: the second deletion found the first's claim and
    was told to stop a reply there was none of (409, session_busy)."""
    real = SessionTurns._last_prompt

    def slow(self: SessionTurns, session: Any) -> Any:
        time.sleep(0.3)  # a long conversation, rendered by a real tokenizer
        return real(self, session)

    monkeypatch.setattr(SessionTurns, "_last_prompt", slow)
    ctx = build(tmp_path)
    session, _ = await ctx.turns.open("o", None)
    first, second = await asyncio.gather(ctx.turns.delete("o", session.session_id),
                                         ctx.turns.delete("o", session.session_id),
                                         return_exceptions=True)
    assert first is None
    assert isinstance(second, ApiError) and second.code is ErrorCode.SESSION_NOT_FOUND

"""A chat session whose conversation outgrows the model's context goes on: its oldest messages
leave the model's view (not the session), once per cut, and the turns after a cut extend the
cut conversation's exact tokens again. Real websocket clients, a live server, a scripted engine
(one token per character of the prompt)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from websockets.asyncio.client import connect

from antiphon.engine_ext.engine import EngineRequestFailedError
from antiphon.engine_ext.scripted import ScriptedEngine
from tests.conftest import erasures, scripted_config
from tests.liveserver import live_server
from tests.wsclient import open_session, recv, recv_until, send

MAX_MODEL_LEN = 1000


class PromptRecordingEngine(ScriptedEngine):
    def __init__(self) -> None:
        super().__init__(max_model_len=MAX_MODEL_LEN)
        self.prompts: list[str] = []

    async def generate(self, request_id: str, prompt_token_ids: list[int],
                       params: Any) -> Any:
        self.prompts.append(self.decode(prompt_token_ids))
        async for delta in super().generate(request_id, prompt_token_ids, params):
            yield delta


async def talk(url: str, session_id: str | None, first: int, n: int, **opening: Any) -> str:
    async with connect(url.replace("http://", "ws://") + "/v1/ws") as ws:
        sid = (await open_session(ws, session_id, **opening))["session"]["session_id"]
        for i in range(first, first + n):
            await send(ws, type="message", session_id=sid, content=f"message {i} " + "x" * 30)
            done = (await recv_until(ws, "done"))[-1]
            assert done["finish_reason"] == "stop", done
            assert done["context_start"] % 2 == 0 and done["context_start"] <= 2 * i
        return str(sid)


async def test_a_conversation_longer_than_the_context_goes_on(tmp_path: Path) -> None:
    engine = PromptRecordingEngine()
    config = scripted_config(tmp_path, max_content_chars=500, context_refill_frac=0.5)
    with live_server(config, engine) as url:
        sid = await talk(url, None, 0, 14)
        async with connect(url.replace("http://", "ws://") + "/v1/ws") as ws:
            opened = await open_session(ws, sid)
    assert len(opened["messages"]) == 28  # the session keeps every message
    prompts = engine.prompts
    firsts = [int(p.split("message ")[1].split()[0]) for p in prompts]
    assert all(len(p) <= MAX_MODEL_LEN for p in prompts)
    assert firsts[0] == 0 and firsts[-1] > 0  # the model's view moved on
    assert opened["session"]["context_start"] == 2 * firsts[-1]  # message i is number 2i
    cuts = [i for i in range(1, len(firsts)) if firsts[i] != firsts[i - 1]]
    assert 1 <= len(cuts) <= len(prompts) // 3, firsts  # a cut leaves room for several turns
    for i in cuts:
        assert len(prompts[i]) <= MAX_MODEL_LEN * 0.5  # refilled to at most half
    for i in range(1, len(prompts)):
        if i not in cuts:  # the turn extends the last one's exact tokens: its KV is reused
            assert prompts[i].startswith(prompts[i - 1]), (i, firsts)

    engine = PromptRecordingEngine()
    with live_server(config, engine) as url:  # after a restart, the same view
        await talk(url, sid, 14, 1)
    assert engine.prompts[0].startswith(prompts[-1])


async def test_a_large_system_message_leaves_a_cut_more_than_the_newest_message(
        tmp_path: Path) -> None:
    """A cut refills the context the system message leaves (it was counted in the refill
    budget: with 40% of the context in it, every cut left the model the newest message
    alone); one past half the context is refused when the session is created, as no turn
    could use it well."""
    engine = PromptRecordingEngine()
    config = scripted_config(tmp_path, max_content_chars=600, context_refill_frac=0.5)
    with live_server(config, engine) as url:
        await talk(url, None, 0, 12, system="S" * 400)
        async with connect(url.replace("http://", "ws://") + "/v1/ws") as ws:
            await send(ws, type="session.open", system="S" * 550)
            refused = await recv(ws)
    in_view = [p.count("<user>") for p in engine.prompts]
    first_cut = next(i for i in range(1, len(in_view)) if in_view[i] < in_view[i - 1])
    assert min(in_view[first_cut:]) >= 2, in_view
    assert all(len(p) <= MAX_MODEL_LEN for p in engine.prompts)
    assert refused["code"] == "context_length_exceeded" \
        and "system message" in refused["message"]


async def test_the_system_message_stays_in_view_across_cuts(tmp_path: Path) -> None:
    """A session's system message is the first thing the model sees at every turn, before and
    after the oldest messages leave its view, and after a restart; the turns between cuts
    still extend the last one's exact tokens."""
    engine = PromptRecordingEngine()
    config = scripted_config(tmp_path, max_content_chars=500, context_refill_frac=0.5)
    system = "<system>Answer like a pirate.\n"
    with live_server(config, engine) as url:
        sid = await talk(url, None, 0, 14, system="Answer like a pirate.")
    prompts = engine.prompts
    assert all(p.startswith(system) for p in prompts), prompts
    firsts = [int(p.split("message ")[1].split()[0]) for p in prompts]
    cuts = [i for i in range(1, len(firsts)) if firsts[i] != firsts[i - 1]]
    assert cuts and firsts[-1] > 0
    for i in cuts:  # the cut left the system message in view, and refilled the rest of the
        # context to at most half
        assert prompts[i].startswith(f"{system}<user>message {firsts[i]} ")
        assert len(prompts[i]) <= len(system) + (MAX_MODEL_LEN - len(system)) * 0.5
    for i in range(1, len(prompts)):
        if i not in cuts:
            assert prompts[i].startswith(prompts[i - 1]), (i, firsts)
    engine = PromptRecordingEngine()
    with live_server(config, engine) as url:  # (where this turn cuts again)
        await talk(url, sid, 14, 1)
    assert engine.prompts[0].startswith(f"{system}<user>message ")


class NoUserQueryEngine(PromptRecordingEngine):
    """A chat template that refuses a conversation with no user message (as Qwen3's and, with
    tools, Llama 3.1's do)."""

    def render_chat(self, turns: Any, **kwargs: Any) -> list[int]:
        from antiphon.engine_ext.engine import EngineRequestError

        if not any(t.role == "user" for t in turns):
            raise EngineRequestError("the model's chat template refused the conversation: "
                                     "No user query found in messages.")
        return super().render_chat(turns, **kwargs)


async def turn(ws: Any, session_id: str, content: str, **extra: Any) -> dict[str, Any]:
    """A message's last frame: its `done`, or the `error` that refused it."""
    await send(ws, type="message", session_id=session_id, content=content, **extra)
    while (frame := await recv(ws))["type"] not in ("done", "error"):
        pass
    return frame


async def test_a_system_message_alone_is_never_rendered(tmp_path: Path) -> None:
    """The room the system message takes is counted with a user message beside it: rendered
    alone, a template that wants a user message refused it, and every turn of a session with
    a system message failed (internal_error)."""
    engine = NoUserQueryEngine()
    with live_server(scripted_config(tmp_path, max_content_chars=500), engine) as url:
        async with connect(url.replace("http://", "ws://") + "/v1/ws") as ws:
            sid = (await open_session(ws, system="Be terse."))["session"]["session_id"]
            assert (await turn(ws, sid, "hello"))["finish_reason"] == "stop"


async def test_a_reply_asking_for_more_room_than_the_refill_leaves_gets_a_deeper_cut(
        tmp_path: Path) -> None:
    """A cut leaves a turn's explicit max_tokens its room: refilled to half of what the
    system message leaves, a turn asking for 400 of a 1,000-token context was refused
    (context_length_exceeded) where the newest message alone would serve it."""
    engine = PromptRecordingEngine()
    config = scripted_config(tmp_path, max_content_chars=600, context_refill_frac=0.5,
                             max_tokens_limit=1000)
    with live_server(config, engine) as url:
        async with connect(url.replace("http://", "ws://") + "/v1/ws") as ws:
            sid = (await open_session(ws, system="S" * 400))["session"]["session_id"]
            for i in range(2):
                assert (await turn(ws, sid, f"m{i} " + "x" * 56))["type"] == "done"
            third = await turn(ws, sid, "m2 " + "x" * 56, max_tokens=400)
    assert third["type"] == "done", third
    assert engine.prompts[-1].count("<user>") == 1  # the newest message alone


async def test_a_reply_asking_for_min_tokens_moves_the_window_on(tmp_path: Path) -> None:
    """A turn with min_tokens and no max_tokens whose conversation left it too little room
    was refused as a bad message (naming a max_tokens never sent), and the session was stuck:
    every later such turn was refused the same way."""
    engine = PromptRecordingEngine()
    config = scripted_config(tmp_path, max_content_chars=500, context_refill_frac=0.5)
    with live_server(config, engine) as url:
        async with connect(url.replace("http://", "ws://") + "/v1/ws") as ws:
            sid = (await open_session(ws))["session"]["session_id"]
            for i in range(20):
                ended = await turn(ws, sid, f"message {i} " + "x" * 30, min_tokens=200)
                assert ended["type"] == "done", (i, ended)
    assert engine.prompts[-1].count("<user>") < 20  # the window moved on


async def test_a_turn_taken_back_leaves_the_window_and_the_listing_as_they_were(
        tmp_path: Path) -> None:
    """A long message that needed a cut, which the engine then refused: the message went,
    but the window had moved past the whole conversation, for good (a regenerate found no
    message to answer, the next turn's prompt held no history), and the session went to the
    top of the listings."""
    from tests.test_rest_api import RefusingEngine

    schema = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "string"}}}
    engine = RefusingEngine(max_model_len=MAX_MODEL_LEN)
    with live_server(scripted_config(tmp_path, max_content_chars=900), engine) as url:
        sid = await talk(url, None, 0, 3)
        async with connect(url.replace("http://", "ws://") + "/v1/ws") as ws:
            await send(ws, type="session.open")
            other = (await recv(ws))["session"]["session_id"]  # listed first from here on
            before = (await open_session(ws, sid))["session"]
            await send(ws, type="message", session_id=sid, content="L" * 600,
                       response_format=schema)
            assert [f["type"] for f in (await recv(ws), await recv(ws))] == ["accepted", "error"]
            after = (await open_session(ws, sid))["session"]
            assert after == before
            await send(ws, type="session.list")
            assert [s["session_id"] for s in (await recv(ws))["sessions"]] == [other, sid]
            await send(ws, type="regenerate", session_id=sid)
            assert (await recv_until(ws, "done"))[-1]["finish_reason"] == "stop"
        assert "message 0" in engine.decode(engine.request_prompts[-1])


class FailAfterPrompt(ScriptedEngine):
    def __init__(self) -> None:
        super().__init__(max_model_len=MAX_MODEL_LEN)
        self.fail = False

    async def generate(self, request_id: str, prompt_token_ids: list[int], params: Any) -> Any:
        if self.fail:
            self.fail = False
            self.request_prompts.append(list(prompt_token_ids))
            raise EngineRequestFailedError("engine failed mid-turn")
        async for d in super().generate(request_id, prompt_token_ids, params):
            yield d


async def test_failed_cut_turn_then_delete_erases_the_prompt_that_ran(tmp_path: Path) -> None:
    """A turn that cut the window, then failed in the engine after its prompt ran (its KV is
    in the tiers), then the session deleted: the erasure names the prompt that ran (a review
    caught a change that moved the window only with the reply: the erasure missed it)."""
    engine = FailAfterPrompt()
    config = scripted_config(tmp_path, max_content_chars=500, context_refill_frac=0.5)
    with live_server(config, engine) as url:
        async with connect(url.replace("http://", "ws://") + "/v1/ws") as ws:
            sid = (await open_session(ws))["session"]["session_id"]
            for i in range(40):
                engine.fail = True
                await send(ws, type="message", session_id=sid, content=f"message {i} " + "x" * 30)
                await recv_until(ws, "error")
                ran = engine.decode(engine.request_prompts[-1])
                cut = not ran.startswith("<user>message 0 ")
                if cut:
                    break
                # not a cut yet: answer it properly (regenerate) and go on
                await send(ws, type="regenerate", session_id=sid)
                done = (await recv_until(ws, "done"))[-1]
                assert done["context_start"] == 0
            assert cut, "no cut happened"
            await send(ws, type="session.delete", session_id=sid)
            await recv_until(ws, "session.deleted")
        await erasures(engine)
    chains = [engine.decode(c) for c in engine.forgotten[0][1]]
    assert any(c.startswith(ran) for c in chains), "the failed turn's prompt (its KV) is not erased"


async def test_regenerate_cut_cancelled_before_first_token(tmp_path: Path) -> None:
    """A regenerate that cut the window, stopped before its first token (it keeps the old
    reply): its `done` reports the window the session has."""
    engine = ScriptedEngine(max_model_len=1000)
    config = scripted_config(tmp_path, max_content_chars=500, context_refill_frac=0.5)
    with live_server(config, engine) as url:
        async with connect(url.replace("http://", "ws://") + "/v1/ws") as ws:
            sid = (await open_session(ws))["session"]["session_id"]
            for i in range(3):
                await send(ws, type="message", session_id=sid, content=f"message {i} " + "x" * 30)
                assert (await recv_until(ws, "done"))[-1]["context_start"] == 0
            engine.token_delay_s = 0.5
            await send(ws, type="regenerate", session_id=sid, request_id="g", max_tokens=900)
            accepted = await recv(ws)
            assert accepted["type"] == "accepted", accepted
            await send(ws, type="cancel", request_id="g")
            done = (await recv_until(ws, "done"))[-1]
            session = (await open_session(ws, sid))["session"]
    assert done["context_start"] == session["context_start"]

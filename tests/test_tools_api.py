"""Tool calling through `/v1/chat/completions` with the openai client, over a live server and a
scripted engine that calls a tool when it is offered one and answers from the tool's result."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from antiphon.engine_ext.scripted import ScriptedEngine
from antiphon.engine_ext.types import ChatTurn
from tests.conftest import Scripted, scripted_config
from tests.liveserver import live_server
from tests.test_rest_api import client

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}
ASK = [{"role": "user", "content": "Weather in Paris?"}]


def agent_reply(turns: Sequence[ChatTurn]) -> str:
    """Calls get_weather when offered it, and answers from a tool's result once it has one."""
    last = turns[-1].content
    if last.startswith("<tool_response>"):
        return "It is " + last.split("\n")[1] + " in Paris."
    if "get_weather" in turns[0].content:
        return ('Checking. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}'
                "\n</tool_call>")
    return "I cannot look that up."


@pytest.fixture
def agent(scripted: Scripted) -> Scripted:
    scripted.engine.reply = agent_reply
    return scripted


def test_a_tool_is_called_and_its_result_answered(agent: Scripted) -> None:
    app = client(agent)
    out = app.chat.completions.create(model="scripted", messages=ASK, tools=[WEATHER])
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Checking."
    (call,) = choice.message.tool_calls or []
    assert call.type == "function" and call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris"}
    prompt = "".join(map(chr, _last_prompt(agent)))
    assert "<tools>" in prompt and '"name": "get_weather"' in prompt
    # (the calls' tags may be special tokens, which the engine drops from text unless told)
    assert agent.engine.params[-1].keep_tool_tags is True

    messages: list[Any] = [*ASK, choice.message.model_dump(exclude_none=True),
                           {"role": "tool", "tool_call_id": call.id, "content": "18 C"}]
    answer = app.chat.completions.create(model="scripted", messages=messages, tools=[WEATHER])
    assert answer.choices[0].message.content == "It is 18 C in Paris."
    assert answer.choices[0].finish_reason == "stop" and not answer.choices[0].message.tool_calls
    prompt = "".join(map(chr, _last_prompt(agent)))
    assert ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
            in prompt and "<tool_response>\n18 C\n</tool_response>" in prompt)


def test_a_streamed_call_arrives_whole_with_its_index(agent: Scripted) -> None:
    chunks = list(client(agent).chat.completions.create(
        model="scripted", messages=ASK, tools=[WEATHER], stream=True))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert "".join(d.content or "" for d in deltas) == "Checking."
    (entry,) = [e for d in deltas for e in d.tool_calls or ()]
    assert entry.index == 0 and entry.id and entry.function is not None
    assert (entry.function.name, entry.function.arguments) == (
        "get_weather", '{"city": "Paris"}')
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"


def test_a_named_or_required_call_constrains_the_reply(agent: Scripted) -> None:
    app = client(agent)
    agent.engine.reply = lambda turns: '{"city": "Oslo"}'
    named = app.chat.completions.create(
        model="scripted", messages=ASK, tools=[WEATHER],
        tool_choice={"type": "function", "function": {"name": "get_weather"}})
    assert json.loads(agent.engine.params[-1].json_schema or "") == \
        WEATHER["function"]["parameters"]
    (call,) = named.choices[0].message.tool_calls or []
    assert (call.function.name, call.function.arguments) == ("get_weather", '{"city": "Oslo"}')
    assert named.choices[0].finish_reason == "stop" and named.choices[0].message.content is None

    agent.engine.reply = lambda turns: '[{"name": "get_weather", "arguments": {"city": "Rome"}}]'
    required = app.chat.completions.create(model="scripted", messages=ASK, tools=[WEATHER],
                                           tool_choice="required", parallel_tool_calls=False)
    schema = json.loads(agent.engine.params[-1].json_schema or "")
    assert schema["type"] == "array" and schema["maxItems"] == 1
    (call,) = required.choices[0].message.tool_calls or []
    assert json.loads(call.function.arguments) == {"city": "Rome"}
    assert required.choices[0].finish_reason == "tool_calls"


def test_a_response_format_beside_tools_holds_the_reply_to_either(agent: Scripted) -> None:
    """What the OpenAI Agents SDK sends for an agent with an output type and tools."""
    app = client(agent)
    answer = {"type": "json_schema", "json_schema": {"name": "answer", "schema": {
        "type": "object", "properties": {"answer": {"type": "string"}}}}}
    agent.engine.reply = lambda turns: '[{"name": "get_weather", "arguments": {"city": "Oslo"}}]'
    called = app.chat.completions.create(model="scripted", messages=ASK, tools=[WEATHER],
                                         response_format=answer)  # type: ignore[arg-type]
    schema = json.loads(agent.engine.params[-1].json_schema or "")
    assert schema["anyOf"][1] == {"$ref": "#/$defs/content"}
    assert schema["$defs"]["content"]["properties"] == {"answer": {"type": "string"}}
    assert called.choices[0].message.tool_calls and called.choices[0].finish_reason == "tool_calls"
    agent.engine.reply = lambda turns: '{"answer": "sunny"}'
    chunks = list(app.chat.completions.create(model="scripted", messages=ASK, tools=[WEATHER],
                                              response_format=answer, stream=True))  # type: ignore[arg-type]
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert "".join(d.content or "" for d in deltas) == '{"answer": "sunny"}'
    assert not any(d.tool_calls for d in deltas)


def test_a_named_call_cut_short_is_the_same_streamed_or_not(agent: Scripted) -> None:
    agent.engine.reply = lambda turns: '{"city": "Oslo", "unit": "celsius"}'
    named = {"type": "function", "function": {"name": "get_weather"}}
    app = client(agent)
    whole = app.chat.completions.create(model="scripted", messages=ASK, tools=[WEATHER],
                                        tool_choice=named, max_tokens=2)  # type: ignore[arg-type]
    (call,) = whole.choices[0].message.tool_calls or []
    assert call.function.arguments == '{"city": "Oslo",'
    assert whole.choices[0].finish_reason == "length"
    chunks = list(app.chat.completions.create(model="scripted", messages=ASK, tools=[WEATHER],
                                              tool_choice=named, max_tokens=2, stream=True))  # type: ignore[arg-type]
    pieces = [e.function.arguments for c in chunks if c.choices
              for e in c.choices[0].delta.tool_calls or () if e.function]
    assert "".join(p or "" for p in pieces) == '{"city": "Oslo",'
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"


def test_tool_choice_none_hides_the_tools(agent: Scripted) -> None:
    out = client(agent).chat.completions.create(model="scripted", messages=ASK,
                                                tools=[WEATHER], tool_choice="none")
    assert out.choices[0].message.content == "I cannot look that up."
    assert agent.engine.params[-1].json_schema is None
    assert agent.engine.params[-1].keep_tool_tags is False  # no calls to read


def _last_prompt(s: Scripted) -> list[int]:
    return s.engine.request_prompts[-1]


CALLS_C1_C2 = {"role": "assistant", "content": "", "tool_calls": [
    {"id": f"c{i}", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}}
    for i in (1, 2)]}
ANSWER_C1 = {"role": "tool", "tool_call_id": "c1", "content": "18 C"}


@pytest.mark.parametrize(("fields", "words"), [
    ({"tools": [WEATHER, WEATHER]}, "tools must have different names"),
    ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools.0.function.name"),
    ({"tools": [{"type": "retrieval"}]}, "tools.0.type"),
    ({"tool_choice": "required"}, "tool_choice other than none or auto needs tools"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "x"}}},
     "tool_choice names 'x', which is not one of the tools"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "string"}}}]}, "parameters must be the JSON schema of an object"),
    ({"messages": [*ASK, {"role": "tool", "tool_call_id": "c9", "content": "x"}]},
     "tool message answers 'c9', which the assistant message before it did not call"),
    ({"messages": [*ASK, CALLS_C1_C2, ANSWER_C1]},
     "must be followed by a tool message answering each call; 'c2' got none"),
    ({"messages": [*ASK, CALLS_C1_C2, ANSWER_C1, {"role": "user", "content": "and?"}]},
     "'c2' got none"),
    ({"messages": [*ASK, CALLS_C1_C2, ANSWER_C1, ANSWER_C1]}, "or which it answered already"),
    ({"messages": [*ASK, CALLS_C1_C2, ANSWER_C1, {**ANSWER_C1, "tool_call_id": "c2"},
                   {"role": "assistant", "content": "x"}, ANSWER_C1]},
     "tool message answers 'c1', which the assistant message before it did not call"),
    ({"messages": [*ASK, {**CALLS_C1_C2, "tool_calls": [CALLS_C1_C2["tool_calls"][0]] * 2}]},
     "two tool calls of one assistant message have the same id"),
    ({"messages": [*ASK, {"role": "tool", "content": "x"}]}, "needs tool_call_id"),
    ({"messages": [{"role": "user", "content": "a", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}]},
     "only an assistant message has tool_calls"),
    ({"functions": [WEATHER["function"]]}, "functions is not supported"),
])
def test_bad_tool_requests_are_refused(agent: Scripted, fields: dict[str, Any],
                                       words: str) -> None:
    body = {"model": "scripted", "messages": ASK, **fields}
    response = httpx.post(agent.url + "/v1/chat/completions", json=body)
    assert response.status_code == 400 and words in response.json()["error"]["message"], \
        response.text
    assert not agent.engine.params  # nothing reached the engine


def test_each_call_answered_in_any_order_is_a_whole_history(agent: Scripted) -> None:
    body = {"model": "scripted", "tools": [WEATHER], "messages": [
        *ASK, CALLS_C1_C2, {**ANSWER_C1, "tool_call_id": "c2"}, ANSWER_C1,
        {"role": "assistant", "content": "18 C both", "tool_calls": []}]}  # none, as vLLM's
    assert httpx.post(agent.url + "/v1/chat/completions", json=body).status_code == 200
    body["messages"] = [*ASK, CALLS_C1_C2, ANSWER_C1]
    error = httpx.post(agent.url + "/v1/chat/completions", json=body).json()["error"]
    assert error["param"] == "messages.1.tool_calls"  # the message whose call goes unanswered


def test_a_tool_schema_nested_too_deeply_is_refused(tmp_path: Any) -> None:
    from antiphon.engine_ext.scripted import ScriptedEngine
    from tests.conftest import scripted_config
    from tests.liveserver import live_server

    deep: dict[str, Any] = {"type": "object"}
    for _ in range(400):  # within the body's limits, deeper than a recursive walk goes
        deep = {"type": "object", "properties": {"a": deep}}
    tool = {"type": "function", "function": {"name": "deep", "parameters": deep}}
    engine = ScriptedEngine()
    with live_server(scripted_config(tmp_path), engine) as url:
        for fields in ({"tools": [tool]}, {"response_format": {
                "type": "json_schema", "json_schema": {"name": "deep", "schema": deep}}}):
            response = httpx.post(url + "/v1/chat/completions", json={
                "model": "scripted", "messages": ASK, **fields})
            assert response.status_code == 400, response.text
            assert "the schema nests deeper than 100 levels" in response.text
    assert not engine.params


def test_tools_are_limited_in_number(tmp_path: Any) -> None:
    from antiphon.engine_ext.scripted import ScriptedEngine
    from tests.conftest import scripted_config
    from tests.liveserver import live_server

    tools = [{"type": "function", "function": {"name": f"f{i}"}} for i in range(3)]
    with live_server(scripted_config(tmp_path, max_tools=2), ScriptedEngine()) as url:
        app = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
        with pytest.raises(openai.BadRequestError, match="3 tools; the limit is 2"):
            app.chat.completions.create(model="scripted", messages=ASK, tools=tools)  # type: ignore[arg-type]
        app.chat.completions.create(model="scripted", messages=ASK, tools=tools[:2])  # type: ignore[arg-type]


def test_tokenize_renders_the_tools_as_a_completion_does(agent: Scripted) -> None:
    client(agent).chat.completions.create(model="scripted", messages=ASK, tools=[WEATHER])
    tokens = httpx.post(agent.url + "/tokenize", json={"messages": ASK, "tools": [WEATHER]})
    assert tokens.json()["tokens"] == _last_prompt(agent)
    refused = httpx.post(agent.url + "/tokenize", json={"prompt": "a", "tools": [WEATHER]})
    assert refused.status_code == 400 and "tools are for messages" in refused.text


# -- the websocket API ---------------------------------------------------------------------


async def test_a_websocket_turn_calls_a_tool_and_the_session_keeps_the_exchange(
        agent: Scripted) -> None:
    """Tools over `/v1/ws`: the reply's calls come with `done` (its tokens carry the content
    alone), `tool_results` answers them, and the session keeps the calls and the results, as
    a reopen shows and the next prompt renders."""
    from websockets.asyncio.client import connect

    from tests.wsclient import chat, open_session, recv_until, send

    async with connect(agent.ws_url) as ws:
        sid = (await open_session(ws))["session"]["session_id"]
        first = await chat(ws, sid, "Weather in Paris?", tools=[WEATHER])
        done = first["done"]
        assert done["finish_reason"] == "tool_calls" and done["text"] == "Checking."
        assert "".join(t["text"] for t in first["tokens"]) == "Checking."
        (call,) = done["tool_calls"]
        assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}

        # The calls must be answered before the conversation goes on, each once.
        await send(ws, type="message", session_id=sid, content="Hello?", request_id="m")
        assert (await recv_until(ws, "error"))[-1]["code"] == "bad_message"
        for wrong in ([], [{"tool_call_id": "call_other", "content": "x"}],
                      [{"tool_call_id": call["id"], "content": "x"}] * 2):
            await send(ws, type="tool_results", session_id=sid, results=wrong,
                       request_id="w", tools=[WEATHER])
            assert (await recv_until(ws, "error"))[-1]["code"] == "bad_message"

        await send(ws, type="tool_results", session_id=sid, request_id="t", tools=[WEATHER],
                   results=[{"tool_call_id": call["id"], "content": "18 C"}])
        frames = await recv_until(ws, "done")
        assert frames[-1]["text"] == "It is 18 C in Paris."
        assert frames[-1]["finish_reason"] == "stop" and "tool_calls" not in frames[-1]
        prompt = "".join(map(chr, _last_prompt(agent)))
        assert ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
                "</tool_call>" in prompt and "<tool_response>\n18 C\n</tool_response>" in prompt)
        assert "<tools>" in prompt

        messages = (await open_session(ws, sid))["messages"]
        assert [m["role"] for m in messages] == ["user", "assistant", "tool", "assistant"]
        assert messages[1]["tool_calls"] == [call] and messages[1]["content"] == "Checking."
        assert messages[2]["tool_call_id"] == call["id"] and messages[2]["content"] == "18 C"
        assert "tool_calls" not in messages[0] and "tool_call_id" not in messages[3]

        later = await chat(ws, sid, "Thanks!", tools=[WEATHER])  # the session goes on
        assert later["done"]["finish_reason"] in ("stop", "tool_calls")

        # A typing advisory brings forward the tokens the last turn ran, tools and all (the
        # conversation rendered again, without the tools the next turn is not known to use,
        # shared almost none of them).
        await send(ws, type="typing", session_id=sid)
        while not agent.engine.advisories:
            await asyncio.sleep(0.01)
        (_, advised, _), = agent.engine.advisories
        ran = _last_prompt(agent)
        assert "<tools>" in "".join(map(chr, advised)) and advised[:len(ran)] == ran


async def test_a_websocket_turn_with_a_named_function_streams_no_content(
        agent: Scripted) -> None:
    from websockets.asyncio.client import connect

    from tests.wsclient import chat, open_session

    agent.engine.reply = lambda turns: '{"city": "Oslo"}'
    async with connect(agent.ws_url) as ws:
        sid = (await open_session(ws))["session"]["session_id"]
        r = await chat(ws, sid, "Weather in Oslo?", tools=[WEATHER],
                       tool_choice={"type": "function", "function": {"name": "get_weather"}})
    assert r["tokens"] == [] and r["done"]["text"] == ""
    assert r["done"]["finish_reason"] == "stop"
    (call,) = r["done"]["tool_calls"]
    assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Oslo"}'}


async def test_the_agent_sdk_calls_a_tool_over_the_websocket_api(agent: Scripted) -> None:
    from antiphon.agents import AsyncAntiphon

    async with AsyncAntiphon(agent.url) as client:
        sid = (await client.create_session()).session_id
        first = await client.chat(sid, "Weather in Paris?", tools=[WEATHER])
        assert first.finish_reason == "tool_calls" and first.text == "Checking."
        (call,) = first.tool_calls
        assert call["function"]["name"] == "get_weather"
        answer = await client.tool_results(sid, {call["id"]: "18 C"}, tools=[WEATHER])
        assert answer.text == "It is 18 C in Paris." and answer.tool_calls == ()


async def test_a_websocket_reply_cut_inside_a_call_keeps_what_the_client_was_given(
        agent: Scripted) -> None:
    """Cancelled while its `<tool_call>` block was being written: the client was given the
    content before it, and that is what `done` says and the session keeps, not the block's
    half (which the next turn's prompt would show the model)."""
    from websockets.asyncio.client import connect

    from tests.wsclient import open_session, recv, recv_until, send

    agent.engine.token_delay_s = 0.2
    async with connect(agent.ws_url) as ws:
        sid = (await open_session(ws))["session"]["session_id"]
        await send(ws, type="message", session_id=sid, content="Weather in Paris?",
                   tools=[WEATHER], request_id="r")
        while (frame := await recv(ws))["type"] != "token":
            pass
        await asyncio.sleep(0.5)  # the call's first words, held back
        await send(ws, type="cancel", request_id="r")
        frames = await recv_until(ws, "done")
        done = frames[-1]
        given = frame["text"] + "".join(f["text"] for f in frames if f["type"] == "token")
        assert done["finish_reason"] == "cancelled" and "tool_calls" not in done
        assert given == done["text"] == "Checking."
        (_, reply) = (await open_session(ws, sid))["messages"]
        assert (reply["content"], reply.get("tool_calls")) == ("Checking.", None)


def test_a_tool_call_held_back_while_it_streams_still_sends_pings(tmp_path: Any) -> None:
    """A tool call's text is held until it closes: tokens kept coming, so no ping went out,
    and the client got nothing for as long as the call took (a minute of arguments on a
    CPU is past a proxy's idle timeout)."""
    import time

    from antiphon.engine_ext.scripted import ScriptedEngine
    from tests.conftest import scripted_config
    from tests.liveserver import live_server

    words = " ".join(["w"] * 20)
    call = f'<tool_call>\n{{"name": "get_weather", "arguments": {{"city": "{words}"}}}}\n</tool_call>'
    engine = ScriptedEngine(reply=lambda turns: call, token_delay_s=0.05)
    with live_server(scripted_config(tmp_path, sse_ping_s=0.2), engine) as url:
        body = {"model": "scripted", "messages": ASK, "tools": [WEATHER], "stream": True}
        gaps, last, lines = [], time.monotonic(), []
        with httpx.stream("POST", url + "/v1/chat/completions", json=body) as response:
            for line in response.iter_lines():
                if line:
                    now = time.monotonic()
                    gaps.append(now - last)
                    last = now
                    lines.append(line)
    assert ": ping" in lines and lines[-1] == "data: [DONE]"
    calls = [json.loads(line[6:])["choices"][0]["delta"].get("tool_calls")
             for line in lines if line.startswith("data: {")]
    assert any(calls)
    assert max(gaps[1:]) < 0.6, gaps  # (about 1.1 s of silence before)


def test_json_nested_deeper_than_python_walks_is_text_not_a_failure(
        scripted: Scripted, tmp_path: Path) -> None:
    """Its RecursionError went past the parsing that takes unparseable text as text: a reply
    of a thousand "[" with tools offered (a prompt injection writes one) failed the request
    after its whole generation, and so did a history message whose call had such arguments
    (500 internal_error, which the openai client tries twice more)."""
    deep = "[" * 5000
    tool = {"type": "function", "function": {"name": "f"}}
    scripted.engine.reply = lambda turns: deep
    r = httpx.post(scripted.url + "/v1/chat/completions", json={
        "model": "scripted", "messages": [{"role": "user", "content": "hi"}], "tools": [tool]})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"] == deep
    history = [{"role": "user", "content": "hi"},
               {"role": "assistant", "content": None, "tool_calls": [{
                   "id": "c1", "type": "function", "function": {"name": "f", "arguments": deep}}]},
               {"role": "tool", "tool_call_id": "c1", "content": "r"}]
    with live_server(scripted_config(tmp_path), ScriptedEngine(max_model_len=16384)) as url:
        r = httpx.post(url + "/v1/chat/completions",
                       json={"model": "scripted", "messages": history, "tools": [tool]})
    assert r.status_code == 200, r.text

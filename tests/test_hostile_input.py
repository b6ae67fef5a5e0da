"""Hostile and odd input over a live server and a scripted engine: every case gets a typed
error, changes nothing, and leaves the connection and the requests beside it running."""

from __future__ import annotations

import asyncio
import json
import socket
import sqlite3
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from websockets.asyncio.client import connect

from antiphon.engine_ext.model_defaults import model_sampling_defaults
from antiphon.engine_ext.scripted import ScriptedEngine
from antiphon.server.config import ServerConfig
from tests.conftest import Scripted, scripted_config
from tests.liveserver import live_server
from tests.wsclient import open_session, recv, recv_until, send

CHAT = "/v1/chat/completions"
DEEP = "[" * 3000 + "]" * 3000  # deeper than Python's recursion limit, within the size limit


def post(s: Scripted, raw: str, path: str = CHAT) -> httpx.Response:
    return httpx.post(s.url + path, content=raw.encode(),
                      headers={"content-type": "application/json"}, timeout=30)


def chat_body(**fields: Any) -> dict[str, Any]:
    return {"model": "scripted", "messages": [{"role": "user", "content": "hi"}], **fields}


def error_code(response: httpx.Response) -> tuple[int, str]:
    return response.status_code, response.json()["error"]["code"]


@pytest.mark.parametrize(("raw", "status", "code"), [
    # an unpaired surrogate escape: valid JSON, but no tokenizer can encode it
    ('{"model": "scripted", "messages": [{"role": "user", "content": "a\\ud800b"}]}',
     400, "bad_json"),
    ('{"model": "scripted", "messages": [{"role": "user", "content": "hi"}], '
     '"stop": ["\\udfff"]}', 400, "bad_json"),
    (DEEP, 400, "bad_json"),
    ('{"model": "scripted", "messages": [{"role": "user", "content": "hi"}], '
     '"vllm_xargs": {"ttft_slo_s": NaN}}', 400, "bad_json"),
    ('{"model": "scripted", "messages": [{"role": "user", "content": "hi"}], '
     '"temperature": 1e999}', 400, "bad_json"),
    ('{"model": "scripted", "messages": [{"role": "user", "content": "hi"}], "seed": 1'
     + "0" * 5000 + "}", 400, "bad_json"),  # past Python's integer digit limit
])
def test_json_no_part_of_the_server_could_use_is_refused(scripted: Scripted, raw: str,
                                                          status: int, code: str) -> None:
    response = post(scripted, raw)
    assert error_code(response) == (status, code)
    assert "sys.set_int_max_str_digits" not in response.json()["error"]["message"]
    assert not scripted.engine.finished_request_ids  # nothing reached the engine


@pytest.mark.parametrize(("fields", "status", "code", "words"), [
    ({"stop": [""]}, 400, "bad_message", "stop.0: String should have at least 1 character"),
    ({"stop": 5}, 400, "bad_message", "stop: Input should be a valid string"),
    ({"stop": [str(i) for i in range(17)]}, 400, "too_large", "stop sequences"),  # OpenAI's
    ({"stop": ["x" * 1001]}, 400, "too_large", "a stop sequence of 1001 characters"),
    ({"seed": 2**70}, 400, "bad_message", "seed"),
    ({"max_tokens": "5"}, 400, "bad_message", "max_tokens"),
    ({"max_tokens": True}, 400, "bad_message", "max_tokens"),
    ({"stream": "yes"}, 400, "bad_message", "stream"),
    ({"temperature": "0.5"}, 400, "bad_message", "temperature"),
    ({"logit_bias": {"a": 5}}, 400, "bad_message", "logit_bias: keys must be "
     "token ids (decimal integers as text, as in {\"50256\": -100}), not 'a'"),
    ({"logit_bias": {"01": 5}}, 400, "bad_message", "keys must be token ids"),
    ({"logit_bias": {"1": 101}}, 400, "bad_message", "less than or equal to 100"),
    ({"logit_bias": {"1": "5"}}, 400, "bad_message", "logit_bias: Input should be a valid number"),
    ({"logit_bias": {str(i): 1 for i in range(301)}}, 400, "too_large", "logit_bias names 301"),
    ({"logit_bias": {"1114112": -1}}, 400, "bad_message", "outside the model's vocabulary"),
    ({"logprobs": True, "top_logprobs": 21}, 400, "bad_message", "top_logprobs"),
    ({"functions": [{"name": "f"}]}, 400, "bad_message", "functions is not supported"),
    ({"response_format": {"type": "xml"}}, 400, "bad_message", "response_format.type"),
    ({"response_format": {"type": "json_schema"}}, 400, "bad_message",
     "json_schema is required with type json_schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {}}}}, 400,
     "bad_message", "response_format.json_schema.name: Field required"),
    # a misspelt key made the reply any JSON object (the schema was dropped)
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "a", "shema": {}}}},
     400, "bad_message", "response_format.json_schema.shema: Extra inputs are not permitted"),
    ({"response_format": {"type": "json_object", "schema": {"type": "object"}}}, 400,
     "bad_message", "response_format.schema: Extra inputs are not permitted"),
    ({"tool_choice": {"type": "function", "function": {"name": "f", "nmae": "g"}},
      "tools": [{"type": "function", "function": {"name": "f"}}]}, 400, "bad_message",
     "tool_choice.function.nmae: Extra inputs are not permitted"),
    ({"presence_penalty": 2.5}, 400, "bad_message", "presence_penalty"),
    ({"repetition_penalty": 0}, 400, "bad_message", "repetition_penalty"),
    ({"top_k": -2}, 400, "bad_message", "top_k"),
    ({"top_k": 10**30}, 400, "bad_message", "top_k"),
    # strings bounded in length each cost vLLM's one grammar-compiler thread up to seconds
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": {
        "type": "object", "properties": {f"p{i}": {"type": "string", "maxLength": 100 + i}
                                         for i in range(17)}}}}},
     400, "bad_message", "bounds the length of 17 strings"),
    ({"tools": [{"type": "function", "function": {"name": f"f{i}", "parameters": {
        "type": "object", "properties": {"a": {"type": "string", "pattern": "^a{1,9}b{2}$"}}}}}
        for i in range(9)], "tool_choice": "required"},
     400, "bad_message", "bounds the length of 18 strings"),
    ({"min_tokens": 1000}, 400, "bad_message", "min_tokens (1000) exceeds the reply's max_tokens"),
    # what an engine would honour but this server does not: refused, never silently dropped
    ({"guided_choice": ["yes", "no"]}, 400, "bad_message",
     "body: unrecognized request argument: guided_choice"),
    ({"structured_outputs": {"json": {}}, "typo_temprature": 1}, 400, "bad_message",
     "unrecognized request argument: structured_outputs, typo_temprature"),
    ({"best_of": 2}, 400, "bad_message", "best_of is not supported"),
    ({"reasoning_effort": "high"}, 400, "bad_message", "reasoning_effort is not supported"),
    ({"vllm_xargs": {"tpot_slo_s": 1e308 * 10}}, 400, "bad_json", "not valid JSON"),
    ({"vllm_xargs": {"ttft_slo_s": -1}}, 400, "bad_message", "ttft_slo_s"),
    # (1e308 overflowed the engine's planning, which stopped it)
    ({"vllm_xargs": {"ttft_slo_s": 1e308}}, 400, "bad_message", "at most 86400"),
    # a request may not claim step time from every other one with a target tighter than the
    # deployment's (0.1 s per token by default)
    ({"vllm_xargs": {"tpot_slo_s": 1e-9}}, 400, "bad_message",
     "vllm_xargs.tpot_slo_s 1e-09 is tighter than this server allows: at least 0.1 s"),
])
def test_parameters_are_checked_not_coerced_or_ignored(
        scripted: Scripted, fields: dict[str, Any], status: int, code: str, words: str) -> None:
    response = post(scripted, json.dumps(chat_body(**fields)))
    assert error_code(response) == (status, code)
    assert words in response.json()["error"]["message"]


def test_sampling_parameters_reach_the_engine(scripted: Scripted) -> None:
    fields = {"temperature": 0.7, "top_p": 0.9, "top_k": 40, "min_p": 0.05,
              "presence_penalty": 0.5, "frequency_penalty": -0.5, "repetition_penalty": 1.2,
              "min_tokens": 3, "seed": 7, "stop": "x", "max_completion_tokens": 20}
    assert post(scripted, json.dumps(chat_body(**fields))).status_code == 200
    assert post(scripted, json.dumps(chat_body(top_k=-1))).status_code == 200
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    for response_format in ({"type": "json_schema", "json_schema": {"name": "a", "schema": schema,
                                                                     "strict": True}},
                            {"type": "json_object"}, {"type": "text"}):
        body = chat_body(response_format=response_format)
        assert post(scripted, json.dumps(body)).status_code == 200
    chosen, defaults, *formats = scripted.engine.params
    assert [p.json_schema for p in formats] == [json.dumps(schema), '{"type": "object"}', None]
    assert (chosen.temperature, chosen.top_p, chosen.top_k, chosen.min_p, chosen.presence_penalty,
            chosen.frequency_penalty, chosen.repetition_penalty, chosen.min_tokens, chosen.seed,
            chosen.stop, chosen.max_tokens) == (0.7, 0.9, 40, 0.05, 0.5, -0.5, 1.2, 3, 7, ("x",), 20)
    assert (defaults.temperature, defaults.top_p, defaults.top_k, defaults.min_p,
            defaults.repetition_penalty, defaults.min_tokens) == (1.0, 1.0, 0, 0.0, 1.0, 0)


@pytest.mark.parametrize(("server_default", "temperatures"), [
    (None, [0.2, 1.5, 0.0]),  # the model's
    (0.0, [0.0, 1.5, 0.0]),  # the server's, over the model's
])
def test_unset_sampling_parameters_are_the_servers_or_the_models(
        tmp_path: Path, server_default: float | None, temperatures: list[float]) -> None:
    engine = ScriptedEngine()
    engine.sampling_defaults = {"temperature": 0.2, "top_p": 0.9, "repetition_penalty": 1.1}
    config = scripted_config(tmp_path, default_temperature=server_default)
    with live_server(config, engine) as url:
        scripted = Scripted(url, engine, config)
        for fields in ({}, {"temperature": 1.5}, {"temperature": 0, "top_p": 0.5}):
            assert post(scripted, json.dumps(chat_body(**fields))).status_code == 200
    assert [p.temperature for p in engine.params] == temperatures
    assert [p.top_p for p in engine.params] == [0.9, 0.9, 0.5]
    assert {p.repetition_penalty for p in engine.params} == {1.1}


def test_the_models_sampling_defaults_are_read_as_vllm_reads_them(tmp_path: Path) -> None:
    (tmp_path / "generation_config.json").write_text(json.dumps({
        "do_sample": True, "temperature": 0.6, "top_p": 0.95, "top_k": 20, "eos_token_id": 2,
        "max_new_tokens": 100, "repetition_penalty": None}))
    assert dict(model_sampling_defaults(tmp_path)) == {"temperature": 0.6, "top_p": 0.95,
                                                        "top_k": 20}
    assert dict(model_sampling_defaults(tmp_path / "none")) == {}


@pytest.mark.parametrize("fields", [
    {"logprobs": False, "presence_penalty": 0.0, "frequency_penalty": 0, "tool_choice": "none",
     "response_format": {"type": "text"}, "user": "u1", "seed": 2**64 - 1},
    # what OpenAI clients send back as the assistant's earlier turn
    {"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": ""},
                  {"role": "assistant", "content": None}, {"role": "user", "content": "b"}]},
    {"vllm_xargs": {"ttft_slo_s": 5.0, "tpot_slo_s": 0.1}},  # looser, or the deployment's
    # null is the default, as in OpenAI's API; bookkeeping OpenAI keeps is not ours to keep
    {"top_p": None, "n": None, "stream": None, "temperature": None, "ignore_eos": None,
     "stop": None, "seed": None, "max_tokens": None, "best_of": None, "echo": False},
    {"metadata": {"app": "x"}, "store": False, "service_tier": "auto",
     "safety_identifier": "u-1", "prompt_cache_key": "k", "parallel_tool_calls": True},
])
def test_neutral_values_and_bookkeeping_parameters_are_accepted(
        scripted: Scripted, fields: dict[str, Any]) -> None:
    response = post(scripted, json.dumps(chat_body(**fields)))
    assert response.status_code == 200, response.text


def test_a_server_may_allow_tighter_request_targets(tmp_path: Path) -> None:
    config = scripted_config(tmp_path, min_request_slo_frac=0.5)
    with live_server(config, ScriptedEngine()) as url:
        for tpot, status in ((0.05, 200), (0.049, 400)):
            response = httpx.post(url + "/v1/chat/completions", json=chat_body(
                vllm_xargs={"tpot_slo_s": tpot}))
            assert response.status_code == status, response.text
    with pytest.raises(ValueError, match="min_request_slo_frac"):
        ServerConfig(min_request_slo_frac=0)


def test_unknown_routes_and_methods_answer_in_the_error_format(scripted: Scripted) -> None:
    assert error_code(httpx.get(scripted.url + "/v1/nope")) == (404, "not_found")
    assert error_code(httpx.delete(scripted.url + "/v1/models")) == (405, "method_not_allowed")
    assert error_code(httpx.get(scripted.url + "/v1/dashboard?since=nan")) == (400,
                                                                              "bad_message")


def test_an_advisory_cannot_reserve_memory_past_the_lead_limit(scripted: Scripted) -> None:
    sid = httpx.post(scripted.url + "/v1/sessions", json={}).json()["session_id"]
    far = ServerConfig().max_advisory_lead_s + 1
    response = httpx.post(scripted.url + "/v1/advisory",
                          json={"session_id": sid, "expected_arrival": far})
    assert error_code(response) == (400, "bad_message")
    assert not scripted.engine.advisories
    ok = httpx.post(scripted.url + "/v1/advisory", json={"session_id": sid,
                                                         "expected_arrival": 2.5})
    assert ok.status_code == 202


def test_session_titles_are_cleaned_alike_on_create_and_rename(scripted: Scripted) -> None:
    url = scripted.url + "/v1/sessions"
    assert error_code(httpx.post(url, json={"title": "  \n "})) == (400, "bad_message")
    created = httpx.post(url, json={"title": " a\u0000\n  b<script> "}).json()
    assert created["title"] == "a b<script>"
    renamed = httpx.patch(f"{url}/{created['session_id']}", json={"title": "c\u0007  d"})
    assert renamed.json()["title"] == "c d"


async def test_a_websocket_turn_takes_the_sampling_of_a_chat_completion(
        scripted: Scripted) -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    async with connect(scripted.ws_url) as ws:
        sid = (await open_session(ws))["session"]["session_id"]
        await send(ws, type="message", session_id=sid, content="hi", temperature=0.5,
                   top_k=5, repetition_penalty=1.1, stop=["x"], seed=3,
                   response_format={"type": "json_schema",
                                    "json_schema": {"name": "a", "schema": schema}})
        await recv_until(ws, "done")
        await send(ws, type="regenerate", session_id=sid, min_tokens=2,
                   response_format={"type": "json_object"})
        await recv_until(ws, "done")
        for bad, words in (({"top_p": 1.5}, "top_p"), ({"stop": ["s"] * 17}, "stop sequences"),
                           ({"stop": ["s" * 1001]}, "1001 characters"),
                           ({"response_format": {"type": "yaml"}}, "response_format.type"),
                           ({"ignore_eos": True}, "ignore_eos")):  # a benchmark's, REST only
            await send(ws, type="message", session_id=sid, content="again", **bad)
            error = (await recv_until(ws, "error"))[-1]
            assert words in error["message"], error
    message, regenerated = scripted.engine.params
    assert (message.temperature, message.top_k, message.repetition_penalty, message.stop,
            message.seed, message.json_schema) == (0.5, 5, 1.1, ("x",), 3, json.dumps(schema))
    assert (regenerated.min_tokens, regenerated.json_schema) == (2, '{"type": "object"}')


async def test_a_session_is_named_after_its_first_message_as_printed(
        scripted: Scripted) -> None:
    async with connect(scripted.ws_url) as ws:
        named, unnamed = [(await open_session(ws))["session"]["session_id"] for _ in range(2)]
        for sid, content in ((named, "\u0000hello\n\tworld\u001b"), (unnamed, "\u0000\u0001")):
            await send(ws, type="message", session_id=sid, content=content)
            await recv_until(ws, "done")
        titles = {s["session_id"]: s["title"]
                  for s in httpx.get(scripted.url + "/v1/sessions").json()["sessions"]}
    assert (titles[named], titles[unnamed]) == ("hello world", "New chat")


async def test_a_bad_frame_answers_an_error_and_the_replies_beside_it_go_on(
        scripted: Scripted) -> None:
    scripted.engine.token_delay_s = 0.02
    async with connect(scripted.ws_url) as ws:
        busy = (await open_session(ws))["session"]["session_id"]
        other = (await open_session(ws))["session"]["session_id"]
        await send(ws, type="message", session_id=busy, content="w " * 30, request_id="long")
        await recv(ws)  # accepted
        surrogate = json.dumps({"type": "message", "session_id": other, "content": "a\ud800b",
                                "request_id": "sur"})  # json.dumps writes it as an escape
        frames = [surrogate,
                  '{"type": "session.open", "title": ' + DEEP + "}"]
        for frame in frames:
            await ws.send(frame)
        errors = [f for f in await recv_until(ws, "done") if f["type"] == "error"]
        # the request id the undecodable frame carried is still named
        assert [(e["code"], e["request_id"]) for e in errors] == [("bad_json", "sur"),
                                                                   ("bad_json", None)]
        await send(ws, type="message", session_id=other, content="still here")
        done = (await recv_until(ws, "done"))[-1]
        assert done["text"] == "You said: still here"
        assert (await open_session(ws, busy))["messages"][-1]["finish_reason"] == "stop"


async def test_a_failed_message_names_its_request(scripted: Scripted) -> None:
    async with connect(scripted.ws_url) as ws:
        sid = (await open_session(ws))["session"]["session_id"]
        await send(ws, type="message", session_id=sid, content="hi", max_tokens="5",
                   request_id="mine")
        frame = await recv(ws)
        assert (frame["code"], frame["request_id"]) == ("bad_message", "mine")
        # its own request_id, not one a schema inside it names (found first by the text's
        # search, in the order the SDK writes a frame: the error went to another turn)
        schema = {"type": "object", "examples": [{"request_id": "someone-elses"}]}
        await send(ws, type="message", session_id=sid, content="hi", temperature=5.0,
                   response_format={"type": "json_schema",
                                    "json_schema": {"name": "x", "schema": schema}},
                   request_id="mine-too")
        frame = await recv(ws)
        assert (frame["code"], frame["request_id"]) == ("bad_message", "mine-too")
        await send(ws, type="message", session_id=sid, content="hi", temperature=5.0,
                   response_format={"type": "json_schema",
                                    "json_schema": {"name": "x", "schema": schema}})
        frame = await recv(ws)
        assert (frame["code"], frame["request_id"]) == ("bad_message", None)


async def test_the_frame_limit_counts_bytes(scripted: Scripted) -> None:
    limit = scripted.config.server.max_frame_bytes
    async with connect(scripted.ws_url) as ws:
        sid = (await open_session(ws))["session"]["session_id"]
        # fewer characters than the limit, more bytes: each is two bytes in UTF-8
        await ws.send(json.dumps({"type": "message", "session_id": sid, "request_id": "big",
                                  "content": "é" * (limit // 2 + 10)}, ensure_ascii=False))
        frame = await recv(ws)
        assert (frame["code"], frame["request_id"]) == ("too_large", "big")


async def test_a_cancel_right_behind_its_message_ends_the_turn(scripted: Scripted) -> None:
    """Both frames in one write: the cancel arrives before the turn's task has run."""
    scripted.engine.token_delay_s = 0.02
    async with connect(scripted.ws_url) as ws:
        sid = (await open_session(ws))["session"]["session_id"]
        for i in range(5):
            await send(ws, type="message", session_id=sid, content="w " * 20,
                       request_id=f"r{i}")
            await send(ws, type="cancel", request_id=f"r{i}")
            frames = await recv_until(ws, "done", timeout=10)
            assert frames[-1]["finish_reason"] == "cancelled"
        await send(ws, type="message", session_id=sid, content="then this")
        assert (await recv_until(ws, "done"))[-1]["text"] == "You said: then this"


async def test_an_unexpected_failure_answers_internal_error_and_the_connection_goes_on(
        scripted: Scripted, monkeypatch: pytest.MonkeyPatch) -> None:
    async def broken(*_args: object) -> None:
        raise RuntimeError("the engine's advisory channel broke")

    async with connect(scripted.ws_url) as ws:
        sid = (await open_session(ws))["session"]["session_id"]
        await send(ws, type="message", session_id=sid, content="first")
        await recv_until(ws, "done")  # a conversation to bring forward
        monkeypatch.setattr(scripted.engine, "advise", broken)
        await send(ws, type="typing", session_id=sid)
        assert (await recv(ws))["code"] == "internal_error"
        await send(ws, type="session.list")
        assert (await recv(ws))["type"] == "sessions"
    metrics = httpx.get(scripted.url + "/metrics").text
    assert 'antiphon_errors_total{code="internal_error"} 1.0' in metrics


async def test_typing_advisories_of_a_session_count_once_per_interval(tmp_path: Path) -> None:
    engine = ScriptedEngine()
    config = scripted_config(tmp_path, typing_interval_s=60.0)
    with live_server(config, engine) as url:
        await _type_away(url.replace("http://", "ws://") + "/v1/ws")
        metrics = httpx.get(url + "/metrics").text
    assert len(engine.advisories) == 1
    assert 'antiphon_advisories_total{source="typing"} 1.0' in metrics


async def _type_away(ws_url: str) -> None:
    async with connect(ws_url) as ws:
        sid = (await open_session(ws))["session"]["session_id"]
        await send(ws, type="message", session_id=sid, content="first")
        await recv_until(ws, "done")
        for _ in range(200):  # a client sending one per keystroke
            await send(ws, type="typing", session_id=sid)
        await send(ws, type="session.list")
        assert (await recv(ws))["type"] == "sessions"  # answered after all of them


async def test_a_rest_turn_waits_for_a_websocket_turn_of_its_session(
        scripted: Scripted) -> None:
    scripted.engine.token_delay_s = 0.02
    async with connect(scripted.ws_url) as ws:
        sid = (await open_session(ws))["session"]["session_id"]
        await send(ws, type="message", session_id=sid, content="w " * 30)
        await recv(ws)  # accepted: the session is answering
        async with httpx.AsyncClient() as client:
            response = await client.post(scripted.url + CHAT, json=chat_body(
                vllm_xargs={"session_id": sid}))
            assert error_code(response) == (409, "session_busy")
            await recv_until(ws, "done")
            response = await client.post(scripted.url + CHAT, json=chat_body(
                vllm_xargs={"session_id": sid}))
            assert response.status_code == 200
            # the REST turn holds the session too, streaming or not, and lets it go after
            async with client.stream("POST", scripted.url + CHAT, json=chat_body(
                    stream=True, messages=[{"role": "user", "content": "w " * 30}],
                    vllm_xargs={"session_id": sid})) as stream:
                lines = stream.aiter_lines()
                await anext(lines)
                await send(ws, type="message", session_id=sid, content="now?")
                assert (await recv(ws))["code"] == "session_busy"
                async for _ in lines:
                    pass
        await send(ws, type="message", session_id=sid, content="now")
        assert (await recv_until(ws, "done"))[-1]["text"] == "You said: now"


async def test_a_client_that_leaves_a_non_streaming_completion_aborts_it(
        scripted: Scripted) -> None:
    scripted.engine.token_delay_s = 0.05
    async with httpx.AsyncClient() as client:
        with pytest.raises(httpx.ReadTimeout):
            await client.post(scripted.url + CHAT, timeout=0.5, json=chat_body(
                messages=[{"role": "user", "content": "w " * 60}]))
    for _ in range(100):
        if not scripted.engine.active_request_ids:
            break
        await asyncio.sleep(0.02)
    assert not scripted.engine.active_request_ids
    assert len(scripted.engine.finished_request_ids) == 1


def test_the_default_reply_length_fits_a_lower_token_limit() -> None:
    assert ServerConfig(max_tokens_limit=256).reply_max_tokens == 256
    assert ServerConfig().reply_max_tokens == 512
    with pytest.raises(ValueError, match=r"default_max_tokens \(300\) must not exceed"):
        ServerConfig(max_tokens_limit=256, default_max_tokens=300)


async def test_session_listings_page_past_the_most_recent(tmp_path: Path) -> None:
    config = scripted_config(tmp_path, max_sessions_listed=3)
    with live_server(config, ScriptedEngine()) as url:
        for n in range(7):
            httpx.post(url + "/v1/sessions", json={"title": f"s{n}"})
            listed = httpx.get(url + "/v1/sessions").json()
            assert (len(listed["sessions"]), listed["has_more"]) == (min(n + 1, 3), n >= 3)
        titles, before = [], None  # REST, page by page
        while True:
            page = httpx.get(url + "/v1/sessions",
                             params={} if before is None else {"before": before}).json()
            titles += [s["title"] for s in page["sessions"]]
            before = page["next_before"]
            if before is None:
                break
        assert titles == [f"s{n}" for n in range(6, -1, -1)]  # each once, newest first
        async with connect(url.replace("http://", "ws://") + "/v1/ws") as ws:
            await send(ws, type="session.list")
            first = await recv(ws)
            await send(ws, type="session.list", before=first["next_before"])
            second = await recv(ws)
            await send(ws, type="session.list", before="1e999|s")
            refused = await recv(ws)
        assert [s["title"] for s in first["sessions"]] == ["s6", "s5", "s4"]
        assert first["has_more"] is True and first["before"] is None
        assert [s["title"] for s in second["sessions"]] == ["s3", "s2", "s1"]
        assert second["before"] == first["next_before"] and second["has_more"] is True
        assert refused["code"] == "bad_message"
        for cursor in ("nope", "1.5|bad id", "nan|x", "|"):
            r = httpx.get(url + "/v1/sessions", params={"before": cursor})
            assert (r.status_code, r.json()["error"]["code"]) == (400, "bad_message")


async def test_sessions_are_limited_per_key(tmp_path: Path) -> None:
    """Past --max-sessions-per-key a new session is refused and nothing is written; deleting
    one makes room. Each key counts its own."""
    keys = ("key-one-0123", "key-two-0123")
    config = scripted_config(tmp_path, max_sessions_per_key=2, api_keys=keys)
    with live_server(config, ScriptedEngine()) as url:
        def create(key: str) -> httpx.Response:
            return httpx.post(url + "/v1/sessions", json={"title": "t"},
                              headers={"authorization": f"Bearer {key}"})

        first, _ = create(keys[0]).json(), create(keys[0])
        refused = create(keys[0])
        assert error_code(refused) == (429, "too_many_sessions")
        assert "--max-sessions-per-key" in refused.json()["error"]["message"]
        assert create(keys[1]).status_code == 201  # another key's sessions are its own
        ws_url = url.replace("http://", "ws://") + f"/v1/ws?api_key={keys[0]}"
        async with connect(ws_url) as ws:
            await send(ws, type="session.open", session_id=None, title="over")
            assert (await recv(ws))["code"] == "too_many_sessions"
        listed = httpx.get(url + "/v1/sessions",
                           headers={"authorization": f"Bearer {keys[0]}"}).json()
        assert len(listed["sessions"]) == 2  # nothing written for the refused ones
        httpx.delete(url + f"/v1/sessions/{first['session_id']}",
                     headers={"authorization": f"Bearer {keys[0]}"})
        assert create(keys[0]).status_code == 201


async def test_a_reply_that_cannot_be_saved_ends_with_an_error_not_a_hang(
        scripted: Scripted, monkeypatch: pytest.MonkeyPatch) -> None:
    """As on a failing disk: the store refuses the reply (a full one: test_storage_full)."""
    from antiphon.sessions.store import SessionStore
    real = SessionStore.append_message

    def append(self: SessionStore, session_id: str, role: str, *args: Any,
               **kwargs: Any) -> Any:
        if role == "assistant":
            raise sqlite3.OperationalError("disk I/O error")
        return real(self, session_id, role, *args, **kwargs)

    monkeypatch.setattr(SessionStore, "append_message", append)
    async with connect(scripted.ws_url) as ws:
        sid = (await open_session(ws))["session"]["session_id"]
        await send(ws, type="message", session_id=sid, content="hi", request_id="lost")
        frame = (await recv_until(ws, "error", timeout=10))[-1]
        assert (frame["code"], frame["request_id"]) == ("internal_error", "lost")
        monkeypatch.setattr(SessionStore, "append_message", real)
        await send(ws, type="message", session_id=sid, content="again")  # not left busy
        assert (await recv_until(ws, "done"))[-1]["text"] == "You said: again"


def test_schemas_the_engine_does_not_compile_bound_what_they_like() -> None:
    """Tools offered under "auto" (no grammar: the reply is free text) were refused for the
    length bounds of their parameters, as were values and names that only look like them."""
    from antiphon.server.completions import ChatCompletionRequest

    tools = [{"type": "function", "function": {"name": f"f{i}", "parameters": {
        "type": "object", "properties": {"maxLength": {"type": "string", "maxLength": 9,
                                                       "default": "a{2}"}}}}}
        for i in range(17)]
    ChatCompletionRequest.model_validate(chat_body(tools=tools))
    named = {"type": "function", "function": {"name": "f0"}}  # one tool compiled: 1 bound
    ChatCompletionRequest.model_validate(chat_body(tools=tools, tool_choice=named))
    with pytest.raises(ValueError, match="bounds the length of 17 strings"):
        ChatCompletionRequest.model_validate(chat_body(tools=tools, tool_choice="required"))
    # nor do values and escapes hide them: a `$ref` into a default, a backslash before `{`
    hidden = {"type": "object",
              "properties": {f"p{i}": {"$ref": f"#/default/d{i}"} for i in range(17)},
              "default": {f"d{i}": {"type": "string", "maxLength": 300} for i in range(17)}}
    for schema in (hidden, {"type": "string", "pattern": "\\\\{1,300}" * 17}):
        form = {"type": "json_schema", "json_schema": {"name": "n", "schema": schema}}
        with pytest.raises(ValueError, match="bounds the length of 17 strings"):
            ChatCompletionRequest.model_validate(chat_body(response_format=form))


def test_a_client_gone_while_its_body_is_read_is_no_server_error(
        scripted: Scripted, caplog: pytest.LogCaptureFixture) -> None:
    """It was counted and logged as an internal error, with a traceback: every client cut
    off mid-upload (or closed by --body-timeout-s) looked like a server fault."""
    port = int(scripted.url.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port)) as raw:
        raw.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                    b"Content-Type: application/json\r\nContent-Length: 100\r\n\r\n"
                    b'{"model":')
        time.sleep(0.3)
    time.sleep(0.3)
    metrics = httpx.get(scripted.url + "/metrics").text
    assert 'antiphon_errors_total{code="internal_error"}' not in metrics
    assert "ClientDisconnect" not in caplog.text

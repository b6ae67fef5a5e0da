"""REST endpoints over a live server and a scripted engine, with httpx and the openai client."""

from __future__ import annotations

import gc
import json
import time
from pathlib import Path

import httpx
import openai
import pytest

from antiphon.engine_ext.scripted import ScriptedEngine
from antiphon.engine_ext.types import GenerationParams
from antiphon.server.chat import Generation, total_usage
from tests.conftest import Scripted, scripted_config
from tests.liveserver import live_server


def client(s: Scripted) -> openai.OpenAI:
    return openai.OpenAI(base_url=s.url + "/v1", api_key="unused", max_retries=0)


def test_a_stop_string_ends_the_reply_before_it(scripted: Scripted) -> None:
    app = client(scripted)
    out = app.chat.completions.create(model="scripted", max_tokens=10, stop=["pong", "ping"],
                                      messages=[{"role": "user", "content": "ping pong"}])
    assert out.choices[0].message.content == "You said: "
    assert out.choices[0].finish_reason == "stop"
    chunks = list(app.chat.completions.create(
        model="scripted", max_tokens=10, stop="pong", stream=True,
        messages=[{"role": "user", "content": "ping pong"}]))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == (
        "You said: ping ")


def test_models_lists_the_served_model(scripted: Scripted) -> None:
    models = client(scripted).models.list()
    assert [m.id for m in models.data] == ["scripted"]


def test_an_alias_names_the_served_model(tmp_path: Path) -> None:
    """An app written for another model works unchanged: it may use its model's name."""
    config = scripted_config(tmp_path, model_aliases=("gpt-4o-mini", "scripted"))
    with live_server(config, ScriptedEngine()) as url:
        app = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
        assert [m.id for m in app.models.list().data] == ["scripted", "gpt-4o-mini"]
        assert app.models.retrieve("gpt-4o-mini").id == "gpt-4o-mini"
        out = app.chat.completions.create(model="gpt-4o-mini", max_tokens=10,
                                          messages=[{"role": "user", "content": "ping"}])
        assert out.model == "gpt-4o-mini" and out.choices[0].message.content == "You said: ping"
        with pytest.raises(openai.NotFoundError, match="'gpt-4' is not served here"):
            app.chat.completions.create(model="gpt-4", messages=[{"role": "user", "content": "a"}])
        session = httpx.post(url + "/v1/sessions", json={}).json()["session_id"]
        advised = httpx.post(url + "/v1/advisory", json={"session_id": session,
                                                         "model_id": "gpt-4o-mini"})
        assert advised.status_code == 202, advised.text


def test_the_schema_is_served_and_no_page_that_needs_a_cdn(scripted: Scripted) -> None:
    schema = httpx.get(scripted.url + "/openapi.json").json()
    assert "/v1/chat/completions" in schema["paths"] and "/v1/batches" in schema["paths"]
    for page in ("/docs", "/redoc"):  # FastAPI's, drawn by scripts from a CDN the CSP refuses
        assert httpx.get(scripted.url + page).status_code == 404


def test_chat_completion(scripted: Scripted) -> None:
    out = client(scripted).chat.completions.create(
        model="scripted", messages=[{"role": "system", "content": "be brief"},
                                    {"role": "user", "content": "ping pong"}], max_tokens=10)
    assert out.choices[0].message.content == "You said: ping pong"
    assert out.choices[0].finish_reason == "stop"
    assert out.usage is not None and out.usage.completion_tokens == 4


def test_streaming_chat_completion(scripted: Scripted) -> None:
    stream = client(scripted).chat.completions.create(
        model="scripted", messages=[{"role": "user", "content": "a b c"}], stream=True,
        stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == "You said: a b c"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 5
    # the `openai` client's include_obfuscation=False asks for nothing (it was refused);
    # true asks for padding Antiphon does not send
    options = {"include_usage": True, "include_obfuscation": False}
    assert list(client(scripted).chat.completions.create(
        model="scripted", messages=[{"role": "user", "content": "a"}], stream=True,
        stream_options=options))[-1].usage is not None  # type: ignore[arg-type]
    with pytest.raises(openai.BadRequestError, match="include_obfuscation"):
        client(scripted).chat.completions.create(
            model="scripted", messages=[{"role": "user", "content": "a"}], stream=True,
            stream_options={"include_obfuscation": True})
    # every chunk has usage, null but in the last, as OpenAI's; none without include_usage
    for include, expected in ((True, {"usage": None}), (False, {}), (None, {})):
        with httpx.stream("POST", scripted.url + "/v1/chat/completions", json={
                "model": "scripted", "messages": [{"role": "user", "content": "a"}],
                "stream": True, "stream_options": {"include_usage": include}}) as r:
            events = [json.loads(line[6:]) for line in r.iter_lines()
                      if line.startswith("data: {")]
        assert len(events) > 2 and all(
            {k: v for k, v in e.items() if k == "usage"} == expected for e in events[:-1])


def test_length_finish_reason(scripted: Scripted) -> None:
    out = client(scripted).chat.completions.create(
        model="scripted", messages=[{"role": "user", "content": "a b c d"}], max_tokens=2)
    assert out.choices[0].finish_reason == "length"
    assert out.choices[0].message.content == "You said:"


@pytest.mark.parametrize(("kwargs", "status", "code"), [
    ({"model": "gpt-9"}, 404, "model_not_found"),
    ({"max_tokens": 1000}, 400, "max_tokens_too_large"),
    # a field past a limit: a 400 (BadRequestError) as OpenAI's; a body too large is a 413
    ({"messages": [{"role": "user", "content": "x" * 1001}]}, 400, "too_large"),
    ({"messages": [{"role": "user", "content": "x"}] * 257}, 400, "too_large"),  # 256 at most
    ({"messages": []}, 400, "bad_message"),
    ({"extra_body": {"vllm_xargs": {"request_class": "urgent"}}}, 400, "bad_message"),
    # misspelt: it ran as a plain request, without its session (nothing said so)
    ({"extra_body": {"vllm_xargs": {"sesion_id": "s1"}}}, 400, "bad_message"),
])
def test_bad_requests_get_typed_errors(scripted: Scripted, kwargs: dict[str, object],
                                       status: int, code: str) -> None:
    args: dict[str, object] = {"model": "scripted",
                               "messages": [{"role": "user", "content": "hi"}], **kwargs}
    with pytest.raises(openai.APIStatusError) as info:
        client(scripted).chat.completions.create(**args)  # type: ignore[call-overload]
    assert info.value.status_code == status
    assert info.value.body["code"] == code  # type: ignore[index]


@pytest.mark.parametrize(("fields", "param"), [
    ({"max_tokens": 1000}, "max_tokens"),
    ({"max_completion_tokens": 1000}, "max_completion_tokens"),  # (was named max_tokens)
    ({"messages": [{"role": "user", "content": "x"}] * 257}, "messages"),
    ({"n": 17}, "n"),
    ({"stop": [str(i) for i in range(17)]}, "stop"),
])
def test_a_field_past_a_limit_is_named(scripted: Scripted, fields: dict[str, object],
                                       param: str) -> None:
    body = {"model": "scripted", "messages": [{"role": "user", "content": "hi"}], **fields}
    r = httpx.post(scripted.url + "/v1/chat/completions", json=body)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_malformed_and_oversize_bodies(scripted: Scripted) -> None:
    r = httpx.post(scripted.url + "/v1/chat/completions", content=b"{oops",
                   headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["code"] == "bad_json"
    r = httpx.post(scripted.url + "/v1/chat/completions", content=b"x" * 9000)
    assert r.status_code == 413 and r.json()["error"]["code"] == "too_large"


def test_sessions_advisory_health_and_metrics(scripted: Scripted) -> None:
    base = scripted.url
    sid = httpx.post(base + "/v1/sessions", json={"title": "t"}).json()["session_id"]
    assert httpx.get(base + f"/v1/sessions/{sid}").json()["session"]["title"] == "t"
    assert httpx.get(base + "/v1/sessions").json()["sessions"][0]["session_id"] == sid
    assert httpx.patch(base + f"/v1/sessions/{sid}", json={"title": "renamed"}).json()[
        "title"] == "renamed"
    r = httpx.patch(base + f"/v1/sessions/{sid}", json={"title": ""})
    assert r.status_code == 400 and r.json()["error"]["code"] == "bad_message"
    assert httpx.get(base + f"/v1/sessions/{sid}").json()["session"]["title"] == "renamed"
    r = httpx.post(base + "/v1/advisory", json={"session_id": sid, "expected_arrival": 2.5})
    assert r.status_code == 202
    r = httpx.post(base + "/v1/advisory", json={"session_id": "s_x"})
    assert r.status_code == 404 and r.json()["error"]["code"] == "session_not_found"
    for wrong_type in ({"expected_arrival": "3"}, {"ordered": "yes"}, {"priority": "1"}):
        r = httpx.post(base + "/v1/advisory", json={"session_id": sid, **wrong_type})
        assert r.status_code == 400 and r.json()["error"]["code"] == "bad_message", wrong_type
    assert httpx.delete(base + f"/v1/sessions/{sid}").status_code == 204
    untitled = httpx.post(base + "/v1/sessions")  # no body: every field is optional
    assert untitled.status_code == 201 and untitled.json()["title"] == "New chat", untitled.text
    assert httpx.post(base + "/v1/sessions", content=b"[]").status_code == 400
    assert httpx.get(base + f"/v1/sessions/{sid}").status_code == 404
    assert httpx.get(base + "/healthz").json()["status"] == "ok"

    client(scripted).chat.completions.create(
        model="scripted", messages=[{"role": "user", "content": "x y"}])
    metrics = httpx.get(base + "/metrics").text
    assert 'antiphon_requests_total{api="openai",outcome="ok",request_class="rt"} 1.0' in metrics
    assert 'antiphon_ttft_seconds_count{request_class="rt"} 1.0' in metrics
    assert "antiphon_tpot_seconds_bucket" in metrics
    assert 'antiphon_normalized_latency_seconds_count{request_class="rt"} 1.0' in metrics
    assert 'antiphon_rt_slo_requests_total{met="true",target="ttft"} 1.0' in metrics
    assert 'antiphon_rt_slo_requests_total{met="true",target="tpot"} 1.0' in metrics


def test_metrics_without_the_engines_share_when_it_refuses_them(
        scripted: Scripted, monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM's engine answers no utility calls while it drains on a signal that reached it (one
    to the server's whole process group): /metrics failed with a 500 then; it now serves the
    server's own metrics and leaves the engine's out."""
    async def refused() -> dict[str, object]:
        raise RuntimeError("[shutdown] EngineCore: rejecting utility call")

    monkeypatch.setattr(scripted.engine, "scheduler_stats", refused)
    r = httpx.get(scripted.url + "/metrics")
    assert r.status_code == 200
    assert "antiphon_requests_total" in r.text and "antiphon_scheduler" not in r.text


def test_metrics_give_the_engines_queues_by_class(
        scripted: Scripted, monkeypatch: pytest.MonkeyPatch) -> None:
    """The scheduler's waiting and running requests reached /v1/engine/stats alone, and with
    no class: a scraper could not see RT turns queue."""
    from antiphon.server.rest import scheduler_metrics_text

    stats = {"num_steps": 1, "schedule_s": 0.0, "num_preemptions": {}, "recomputed_tokens": {},
             "queues": {"waiting": {"rt": 2, "be": 5}, "running": {"rt": 1, "be": 3}}}

    async def sched() -> dict[str, object]:
        return stats

    monkeypatch.setattr(scripted.engine, "scheduler_stats", sched)
    text = httpx.get(scripted.url + "/metrics").text
    for state, counts in stats["queues"].items():  # type: ignore[attr-defined]
        for c, n in counts.items():
            assert f'antiphon_engine_requests{{state="{state}",request_class="{c}"}} {n}' in text
    assert "antiphon_engine_requests" not in scheduler_metrics_text(
        {**stats, "queues": None}).decode()


def test_a_stream_reads_line_by_line_whatever_line_breaks_the_model_writes(
        scripted: Scripted) -> None:
    """JSON leaves U+2028, U+2029 and U+0085 raw, and httpx's `aiter_lines` (as
    str.splitlines) breaks lines there: a model's one cut a `data:` line in two, and a client
    reading the stream so failed on its JSON (the project's own benchmark clients too)."""
    text = "one\u2028two\u2029three\x85four"
    scripted.engine.reply = lambda turns: text
    body = {"model": "scripted", "stream": True,
            "messages": [{"role": "user", "content": "hi"}]}
    got = ""
    with httpx.stream("POST", scripted.url + "/v1/chat/completions", json=body) as r:
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                delta = json.loads(line[len("data: "):])["choices"][0]["delta"]
                got += delta.get("content") or ""
    assert got == text


def test_logprobs_in_completions_and_streams(scripted: Scripted) -> None:
    """OpenAI's logprobs and top_logprobs: per output token, its text, log probability and
    UTF-8 bytes, and its most likely alternatives, in a completion and spread over a stream's
    chunks; refused past 20 alternatives or without logprobs (the scripted engine is certain
    of each word: log probability 0)."""
    c = client(scripted)
    messages = [{"role": "user", "content": "a b"}]
    out = c.chat.completions.create(model="scripted", messages=messages,  # type: ignore[arg-type]
                                    logprobs=True, top_logprobs=2)
    content = out.choices[0].logprobs.content  # type: ignore[union-attr]
    assert "".join(t.token for t in content) == out.choices[0].message.content
    assert [t.logprob for t in content] == [0.0] * len(content)
    assert content[1].bytes == list(content[1].token.encode())
    assert [len(t.top_logprobs) for t in content] == [2] * len(content)
    assert content[0].top_logprobs[1].logprob < content[0].top_logprobs[0].logprob
    plain = c.chat.completions.create(model="scripted", messages=messages)  # type: ignore[arg-type]
    assert plain.choices[0].logprobs is None

    stream = c.chat.completions.create(model="scripted", messages=messages,  # type: ignore[arg-type]
                                       logprobs=True, stream=True)
    text, tokens = "", []
    for chunk in stream:
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
            logprobs = chunk.choices[0].logprobs
            tokens += [t.token for t in (logprobs.content or [])] if logprobs else []
    assert "".join(tokens) == text and text

    for bad in ({"logprobs": True, "top_logprobs": 21}, {"top_logprobs": 2},
                {"logprobs": "yes"}):
        r = httpx.post(scripted.url + "/v1/chat/completions",
                       json={"model": "scripted", "messages": messages, **bad})
        assert r.status_code == 400 and r.json()["error"]["code"] == "bad_message", bad


def test_text_completions_take_a_plain_prompt(scripted: Scripted) -> None:
    """`/v1/completions` (what `vllm bench serve` and other tools send): the prompt as given,
    no chat template, in a response, a stream, and with legacy logprobs (token texts, their
    log probabilities, the likeliest alternatives with the chosen one, and text offsets)."""
    c = client(scripted)
    out = c.completions.create(model="scripted", prompt="a b c")
    assert out.object == "text_completion" and out.id.startswith("cmpl-")
    assert out.choices[0].text == "You said: a b c" and out.choices[0].finish_reason == "stop"
    assert out.usage is not None and out.usage.prompt_tokens == len("a b c")
    assert scripted.engine.params[-1].request_class.value == "rt"
    assert scripted.engine.params[-1].max_tokens == 16  # unset: OpenAI's and vLLM's default

    by_ids = c.completions.create(model="scripted", prompt=[ord(ch) for ch in "a b c"])
    assert by_ids.choices[0].text == out.choices[0].text

    pieces, finish, usage = [], None, None
    for chunk in c.completions.create(model="scripted", prompt="x y", stream=True,
                                      stream_options={"include_usage": True}):
        if chunk.choices:
            assert chunk.object == "text_completion"
            pieces.append(chunk.choices[0].text)
            finish = chunk.choices[0].finish_reason or finish
        usage = chunk.usage or usage
    assert "".join(pieces) == "You said: x y" and finish == "stop" and len(pieces) > 2
    assert usage is not None and usage.completion_tokens == 4  # words

    lp = c.completions.create(model="scripted", prompt="a b", logprobs=2).choices[0]
    assert lp.logprobs is not None and lp.logprobs.tokens is not None
    assert "".join(lp.logprobs.tokens) == lp.text
    assert lp.logprobs.tokens == ["You", " said:", " a", " b"]
    assert lp.logprobs.text_offset == [0, 3, 9, 11]
    assert lp.logprobs.top_logprobs is not None
    for token, top in zip(lp.logprobs.tokens, lp.logprobs.top_logprobs, strict=True):
        assert token in top and len(top) <= 3


def test_text_completions_with_several_prompts_and_choices(scripted: Scripted) -> None:
    """Several prompts (texts or token ids) and `n` choices each, as OpenAI and vLLM number
    them (prompt by prompt); each prompt's tokens counted once in the usage. A stream
    interleaves the choices' chunks, each choice ending with its finish reason."""
    c = client(scripted)
    out = c.completions.create(model="scripted", prompt=["a b", "c"], n=2, seed=7)
    assert [ch.index for ch in out.choices] == [0, 1, 2, 3]
    assert [ch.text for ch in out.choices] == ["You said: a b"] * 2 + ["You said: c"] * 2
    assert out.usage is not None and out.usage.prompt_tokens == len("a b") + len("c")
    assert out.usage.completion_tokens == 4 + 4 + 3 + 3
    assert [p.seed for p in scripted.engine.params[-4:]] == [7, 8, 7, 8]  # seed + choice
    by_ids = c.completions.create(model="scripted",  # the same prompts, as token ids
                                  prompt=[[ord(ch) for ch in "a b"], [ord("c")]])
    assert [ch.text for ch in by_ids.choices] == ["You said: a b", "You said: c"]

    texts: dict[int, str] = {}
    finished: dict[int, str] = {}
    for chunk in c.completions.create(model="scripted", prompt=["x", "y z"], n=2,
                                      stream=True):
        for ch in chunk.choices:
            texts[ch.index] = texts.get(ch.index, "") + ch.text
            if ch.finish_reason:
                finished[ch.index] = ch.finish_reason
    assert texts == {0: "You said: x", 1: "You said: x", 2: "You said: y z",
                     3: "You said: y z"}
    assert finished == {i: "stop" for i in range(4)}

    scripted.engine.token_delay_s = 0.02  # a short reply's end comes before a long one's
    order = [(ch.index, ch.finish_reason) for chunk in c.completions.create(
        model="scripted", prompt=["short", "a long reply " * 4], stream=True)
        for ch in chunk.choices]
    last_text_of_1 = max(k for k, (i, reason) in enumerate(order) if i == 1 and not reason)
    assert order.index((0, "stop")) < last_text_of_1

    c.completions.create(model="scripted", prompt="s", n=3, seed=2**64 - 1)
    assert [p.seed for p in scripted.engine.params[-3:]] == [  # wrapped in the engine's range
        2**64 - 1, -2**63, -2**63 + 1]


def test_usage_counts_each_prompt_once_and_what_was_cached_before() -> None:
    """A prompt's tokens are counted once however many choices it has, and its cached tokens
    are what its least-served choice found: the others find what the first computed."""
    first = Generation("r", [1, 2, 3, 4], GenerationParams(max_tokens=4))
    first.num_output_tokens, first.num_cached_tokens = 3, 0
    second = first.another_choice(1)
    second.num_output_tokens, second.num_cached_tokens = 4, 4  # found the first's KV
    other = Generation("r", [5, 6], GenerationParams(max_tokens=4), index=2, prompt_index=1)
    other.num_output_tokens, other.num_cached_tokens = 1, 2
    usage = total_usage([first, second, other])
    assert (usage["prompt_tokens"], usage["completion_tokens"], usage["total_tokens"]) == (
        4 + 2, 3 + 4 + 1, 6 + 8)
    assert usage["prompt_tokens_details"] == {"cached_tokens": 0 + 2}
    assert "tier_prompt_tokens" not in usage  # an engine without KV tiers says nothing
    first.tier_tokens, second.tier_tokens, other.tier_tokens = (0, 0), (3, 1), (2, 0)
    assert total_usage([first, second, other])["tier_prompt_tokens"] == {  # least-served's
        "host": 0 + 2, "ssd": 0}


def test_chat_completions_with_several_choices(scripted: Scripted) -> None:
    """`n` chat choices, in a response and a stream (each choice opening with the assistant's
    role); n > 1 is refused in a session turn, which keeps one reply."""
    c = client(scripted)
    messages = [{"role": "user", "content": "a b"}]
    out = c.chat.completions.create(model="scripted", messages=messages, n=3)  # type: ignore[arg-type]
    assert [(ch.index, ch.message.content) for ch in out.choices] == [
        (i, "You said: a b") for i in range(3)]
    assert out.usage is not None and out.usage.prompt_tokens == len(
        "<user>a b\n<assistant>") and out.usage.completion_tokens == 3 * 4
    roles, texts = {}, {}
    for chunk in c.chat.completions.create(model="scripted", messages=messages,  # type: ignore[arg-type]
                                           n=2, stream=True):
        for ch in chunk.choices:
            if ch.delta.role:
                roles[ch.index] = ch.delta.role
            texts[ch.index] = texts.get(ch.index, "") + (ch.delta.content or "")
    assert roles == {0: "assistant", 1: "assistant"}
    assert texts == {0: "You said: a b", 1: "You said: a b"}
    session = httpx.post(scripted.url + "/v1/sessions", json={}).json()["session_id"]
    r = httpx.post(scripted.url + "/v1/chat/completions", json={
        "model": "scripted", "messages": messages, "n": 2,
        "vllm_xargs": {"session_id": session}})
    assert r.status_code == 400 and "n must be 1 in a session turn" in r.text


def test_a_choice_that_fails_fails_the_request_and_aborts_the_others(
        scripted: Scripted) -> None:
    """One choice the engine fails ends the request with its error, in a response and in a
    stream, and the other choices are aborted, not left generating."""
    scripted.engine.token_delay_s = 0.05
    body = {"model": "scripted", "prompt": "one two three four five six", "n": 3}
    scripted.engine.fail_next_request()
    r = httpx.post(scripted.url + "/v1/completions", json=body)
    assert r.status_code == 500 and r.json()["error"]["code"] == "engine_error", r.text
    scripted.engine.fail_next_request()  # before any event: the stream's status says it
    r = httpx.post(scripted.url + "/v1/completions", json={**body, "stream": True})
    assert r.status_code == 500 and r.json()["error"]["code"] == "engine_error", r.text
    assert not scripted.engine.active_request_ids


def test_an_echo_gives_the_prompt_and_its_logprobs_first(scripted: Scripted) -> None:
    """`echo` (lm-evaluation-harness's loglikelihood request: token ids, echo, logprobs 1,
    max_tokens 1): each choice's text begins with its prompt, and its logprobs with the
    prompt tokens' (the first one's null), which the engine is asked to compute; the text
    offsets point into the choice's text. In a stream the prompt comes with the first chunk."""
    c = client(scripted)
    plain = c.completions.create(model="scripted", prompt="hi there", echo=True)
    assert plain.choices[0].text == "hi thereYou said: hi there"
    assert plain.choices[0].logprobs is None
    assert scripted.engine.params[-1].prompt_logprobs is None

    out = c.completions.create(model="scripted", prompt=[[ord(ch) for ch in "ab c"]],
                               echo=True, logprobs=1, max_tokens=1, temperature=0)
    choice = out.choices[0]
    assert scripted.engine.params[-1].prompt_logprobs == 1
    assert choice.text == "ab cok" and choice.logprobs is not None  # "ok": a prompt of ids
    lp = choice.logprobs
    assert lp.tokens == ["a", "b", " ", "c", "ok"]
    assert lp.token_logprobs == [None, 0.0, 0.0, 0.0, 0.0]
    assert lp.top_logprobs is not None and lp.top_logprobs[0] is None
    assert lp.top_logprobs[1] == {"b": 0.0}  # the chosen token, and its one alternative
    assert lp.text_offset is not None
    for token, offset in zip(lp.tokens, lp.text_offset, strict=True):
        assert choice.text[offset:offset + len(token)] == token

    alone_out = c.completions.create(model="scripted", prompt="ab", echo=True, logprobs=0,
                                     max_tokens=0)  # the prompt alone, no reply
    alone = alone_out.choices[0]
    assert alone_out.usage is not None and alone_out.usage.completion_tokens == 0
    assert alone.text == "ab" and alone.logprobs is not None
    assert alone.logprobs.tokens == ["a", "b"] and alone.logprobs.token_logprobs == [None, 0.0]
    r = httpx.post(scripted.url + "/v1/completions",
                   json={"model": "scripted", "prompt": "ab", "max_tokens": 0})
    assert r.status_code == 400 and "only with echo" in r.text

    text, tokens = "", []
    for chunk in c.completions.create(model="scripted", prompt="x y", echo=True, logprobs=0,
                                      stream=True):
        for ch in chunk.choices:
            text += ch.text
            tokens += ch.logprobs.tokens if ch.logprobs and ch.logprobs.tokens else []
    assert text == "x yYou said: x y" and "".join(tokens) == text
    text = "".join(ch.text for chunk in c.completions.create(
        model="scripted", prompt="x y", echo=True, max_tokens=0, stream=True,
        stream_options={"include_usage": True}) for ch in chunk.choices)
    assert text == "x y"


def test_prompt_logprobs_are_limited_in_length(tmp_path: Path) -> None:
    """The logprobs of a prompt longer than --max-prompt-logprobs-tokens are refused (they
    are computed at once, over the vocabulary); its echo alone, or its reply's logprobs, are
    not."""
    with live_server(scripted_config(tmp_path, max_prompt_logprobs_tokens=4),
                     ScriptedEngine()) as url:
        body = {"model": "scripted", "prompt": ["abcd", "abcde"], "max_tokens": 1}
        r = httpx.post(url + "/v1/completions", json={**body, "echo": True, "logprobs": 0})
        assert r.status_code == 400 and "prompt 1 is 5 tokens" in r.text, r.text
        # short prompts, too many of them: each computes its logprobs
        r = httpx.post(url + "/v1/completions", json={**body, "prompt": ["ab", "cd", "ef"],
                                                      "echo": True, "logprobs": 0})
        assert r.status_code == 400 and "prompt 2 is 2 tokens, its logprobs computed after 4 tokens " \
            "of the prompts before it" in r.text, r.text
        r = httpx.post(url + "/v1/completions", json={**body, "prompt": ["ab", "cd"],
                                                      "echo": True, "logprobs": 0})
        assert r.status_code == 200, r.text
        for fine in ({"echo": True}, {"logprobs": 0}):
            assert httpx.post(url + "/v1/completions",
                              json={**body, **fine}).status_code == 200, fine


def test_tokenize_and_detokenize_as_vllm_serves_them(scripted: Scripted) -> None:
    """vLLM's /tokenize (a prompt, or messages through the chat template) and /detokenize,
    which `vllm bench serve` asks to check its tokenizer; bad input gets a typed 400."""
    url = scripted.url
    r = httpx.post(url + "/tokenize", json={"model": "scripted", "prompt": "hi"})
    assert r.json() == {"count": 2, "max_model_len": 1000, "tokens": [104, 105],
                        "token_strs": None}
    r = httpx.post(url + "/tokenize", json={"prompt": "hi", "return_token_strs": True})
    assert r.json()["token_strs"] == ["h", "i"]
    r = httpx.post(url + "/tokenize", json={"messages": [{"role": "user", "content": "hi"}],
                                            "add_special_tokens": False})  # vLLM's default
    assert r.status_code == 200, r.text
    r = httpx.post(url + "/tokenize", json={"messages": [{"role": "user", "content": "hi"}]})
    assert r.json()["tokens"] == [ord(c) for c in "<user>hi\n<assistant>"]
    r = httpx.post(url + "/tokenize", json={"messages": [{"role": "user", "content": "hi"}],
                                            "add_generation_prompt": False})
    assert r.json()["count"] == len("<user>hi\n")
    assert httpx.post(url + "/detokenize", json={"tokens": [104, 105]}).json() == {
        "prompt": "hi"}
    for path, body, words in [
            ("/tokenize", {}, "give either prompt or messages"),
            ("/tokenize", {"prompt": "a", "messages": [{"role": "user", "content": "a"}]},
             "give either prompt or messages"),
            ("/tokenize", {"messages": [{"role": "user", "content": "a"}],
                           "add_special_tokens": True}, "add_special_tokens is for a prompt"),
            ("/tokenize", {"prompt": "a" * 1001}, "the limit is 1000"),
            ("/tokenize", {"prompt": "a", "extra": 1}, "extra"),
            ("/detokenize", {"tokens": [1114112]}, "outside the model's vocabulary"),
            ("/detokenize", {"tokens": ["a"]}, "tokens"),
    ]:
        r = httpx.post(url + path, json=body)
        assert r.status_code == 400 and words in r.json()["error"]["message"], (body, r.text)
    r = httpx.post(url + "/tokenize", json={"model": "other", "prompt": "a"})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"


@pytest.mark.parametrize(("fields", "words"), [
    ({"prompt": ""}, "empty"),
    ({"prompt": ["fine", ""]}, "empty"),
    ({"prompt": []}, "prompt"),
    ({"prompt": [[104], []]}, "prompt"),
    ({"prompt": [1114112]}, "outside the model's vocabulary"),
    ({"prompt": [[104], [1114112]]}, "outside the model's vocabulary"),
    ({"prompt": [-1]}, "prompt"),
    ({"prompt": ["a", "b", "c", "d", "e"], "n": 4}, "20 choices (n, times the prompts); the "
     "limit is 16"),
    ({"prompt": "hello " * 100, "n": 16, "echo": True, "logprobs": 0},
     "its logprobs computed for each of 16 choices"),
    ({"n": 0}, "n"),
    ({"echo": "yes"}, "echo"),
    ({"suffix": "end"}, "suffix is not supported"),
    ({"best_of": 2}, "best_of is not supported"),
    ({"logprobs": 21}, "logprobs"),
    ({"messages": []}, "unrecognized request argument: messages"),
    ({"vllm_xargs": {"session_id": "s1"}}, "use /v1/chat/completions"),
    ({"vllm_xargs": {"request_class": "x"}}, "request_class"),
    ({"vllm_xargs": {"ttft_slo": 0.5}}, "does not know: 'ttft_slo'; it takes request_class"),
])
def test_text_completions_refuse_what_they_cannot_do(
        scripted: Scripted, fields: dict[str, object], words: str) -> None:
    body = {"model": "scripted", "prompt": "hello", **fields}
    r = httpx.post(scripted.url + "/v1/completions", json=body)
    assert r.status_code == 400 and words in r.json()["error"]["message"], r.text
    assert not scripted.engine.finished_request_ids  # nothing reached the engine


@pytest.mark.parametrize(("path", "fields"), [
    ("/v1/completions", {"prompt": " "}),
    ("/v1/completions", {"prompt": ["fine", "\n"]}),
    ("/v1/completions", {"prompt": "hello", "vllm_xargs": {"session_id": None}}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a"}], "n": 2,
                              "vllm_xargs": {"session_id": None}})])
def test_blank_prompts_and_no_session_are_taken_as_openai_takes_them(
        scripted: Scripted, path: str, fields: dict[str, object]) -> None:
    """A blank text prompt is a prompt (it was refused: "message content is empty"), and a
    session_id of null names no session (n=2 was refused as a session turn)."""
    r = httpx.post(scripted.url + path, json={"model": "scripted", "max_tokens": 2, **fields})
    assert r.status_code == 200, r.text


def test_a_message_in_text_parts_reads_as_vllm_joins_them(scripted: Scripted) -> None:
    """Text parts were joined with nothing between them ("a", "b" read "ab"); vLLM's server
    puts a line break between them."""
    r = httpx.post(scripted.url + "/v1/chat/completions", json={
        "model": "scripted", "max_tokens": 2, "messages": [{"role": "user", "content": [
            {"type": "text", "text": "first part"}, {"type": "text", "text": "second"}]}]})
    assert r.status_code == 200, r.text
    prompt = "".join(map(chr, scripted.engine.request_prompts[-1]))  # (a token a character)
    assert "first part\nsecond" in prompt


def test_a_chat_stream_opens_with_its_first_token(scripted: Scripted) -> None:
    """The role chunk goes out with the first token, not before the engine has one (as vLLM's
    and OpenAI's streams): a client timing its first chunk (vllm bench serve's TTFT) times the
    first token. Scripted: the first token takes 1 s."""
    scripted.engine.token_delay_s = 1.0
    body = {"model": "scripted", "messages": [{"role": "user", "content": "a b"}],
            "stream": True, "max_tokens": 1}
    started = time.monotonic()
    with httpx.stream("POST", scripted.url + "/v1/chat/completions", json=body) as r:
        lines = r.iter_lines()
        first = next(line for line in lines if line.startswith("data:"))
        waited = time.monotonic() - started
        rest = [line for line in lines if line.startswith("data:")]
    assert waited >= 0.9, waited
    assert json.loads(first[5:])["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert json.loads(rest[0][5:])["choices"][0]["delta"] == {"content": "You"}
    assert rest[-1] == "data: [DONE]"


def test_a_stream_waiting_for_its_tokens_sends_pings(tmp_path: Path) -> None:
    """While a stream waits (here 1 s a token), it sends SSE comments every --sse-ping-s,
    which the OpenAI client skips; a client that leaves during the wait aborts the
    generation."""
    engine = ScriptedEngine(token_delay_s=1.0)
    with live_server(scripted_config(tmp_path, sse_ping_s=0.2), engine) as url:
        body = {"model": "scripted", "messages": [{"role": "user", "content": "a b"}],
                "stream": True, "max_tokens": 2}
        with httpx.stream("POST", url + "/v1/chat/completions", json=body) as r:
            lines = [line for line in r.iter_lines() if line]
        first_data = next(i for i, line in enumerate(lines) if line.startswith("data:"))
        assert first_data >= 3 and set(lines[:first_data]) == {": ping"}
        assert lines[-1] == "data: [DONE]"
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
        stream = client.completions.create(model="scripted", prompt="x y", stream=True,
                                           max_tokens=2)
        assert "".join(c.choices[0].text for c in stream if c.choices) == "You said:"

        with httpx.stream("POST", url + "/v1/chat/completions", json=body) as r:
            assert next(line for line in r.iter_lines() if line) == ": ping"
        for _ in range(100):  # the client left while the stream waited
            if not engine.active_request_ids:
                break
            time.sleep(0.02)
        assert not engine.active_request_ids


def test_logit_bias_reaches_the_engine_as_token_ids(scripted: Scripted) -> None:
    """OpenAI's logit_bias (token ids as text, biases -100 to 100) goes to the engine as
    (token id, bias) pairs; a request without it sends none."""
    messages = [{"role": "user", "content": "a b"}]
    client(scripted).chat.completions.create(model="scripted", messages=messages,  # type: ignore[arg-type]
                                             logit_bias={"98": -100, "7": 2.5})
    assert scripted.engine.params[-1].logit_bias == ((7, 2.5), (98, -100.0))
    client(scripted).chat.completions.create(model="scripted", messages=messages)  # type: ignore[arg-type]
    assert scripted.engine.params[-1].logit_bias == ()


def test_chat_completions_in_a_session_keep_its_context_for_advisories(
        scripted: Scripted) -> None:
    base, engine = scripted.url, scripted.engine
    sid = httpx.post(base + "/v1/sessions", json={"title": "agent"}).json()["session_id"]
    r = httpx.post(base + "/v1/advisory", json={"session_id": sid})
    assert r.status_code == 202 and engine.advisories == []  # nothing said yet: nothing to move
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "x y"}]
    client(scripted).chat.completions.create(
        model="scripted", messages=messages,  # type: ignore[arg-type]
        extra_body={"vllm_xargs": {"session_id": sid}})
    assert httpx.post(base + "/v1/advisory",
                      json={"session_id": sid, "expected_arrival": 1.5}).status_code == 202
    advised_sid, tokens, arrival = engine.advisories[-1]
    assert (advised_sid, arrival) == (sid, 1.5)
    assert engine.decode(tokens) == "<system>be brief\n<user>x y\n<assistant>You said: x y"

    stream = client(scripted).chat.completions.create(
        model="scripted", messages=[{"role": "user", "content": "a b"}], stream=True,
        extra_body={"vllm_xargs": {"session_id": sid}})
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == \
        "You said: a b"
    httpx.post(base + "/v1/advisory", json={"session_id": sid})
    assert engine.decode(engine.advisories[-1][1]) == "<user>a b\n<assistant>You said: a b"
    # The client keeps the messages; the session lists none.
    assert httpx.get(base + f"/v1/sessions/{sid}").json()["messages"] == []

    for xargs, status, code in [({"session_id": "s_missing"}, 404, "session_not_found"),
                                ({"session_id": "no spaces"}, 400, "bad_message"),
                                ({"session_id": 7}, 400, "bad_message")]:
        with pytest.raises(openai.APIStatusError) as info:
            client(scripted).chat.completions.create(
                model="scripted", messages=[{"role": "user", "content": "hi"}],
                extra_body={"vllm_xargs": xargs})
        assert info.value.status_code == status
        assert info.value.body["code"] == code  # type: ignore[index]


def test_pages_are_served(scripted: Scripted) -> None:
    for path in ("/", "/dashboard", "/batches"):
        r = httpx.get(scripted.url + path)
        assert r.status_code == 200 and "<html" in r.text.lower(), path


def test_dashboard_samples_requests_as_they_finish(scripted: Scripted) -> None:
    base = scripted.url
    first = httpx.get(base + "/v1/dashboard").json()
    assert first["targets"] == {"ttft_s": 1.0, "tpot_s": 0.1}
    assert first["interval_s"] == scripted.config.server.dashboard_interval_s
    since = max((p["t"] for p in first["points"]), default=0.0)
    for _ in range(3):
        client(scripted).chat.completions.create(
            model="scripted", messages=[{"role": "user", "content": "a b c"}])
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        points = httpx.get(base + "/v1/dashboard", params={"since": since}).json()["points"]
        if sum(p["rt_finished"] for p in points) == 3:
            break
        time.sleep(0.05)
    assert all(p["t"] > since for p in points)
    busy = [p for p in points if p["rt_per_s"] > 0]
    assert busy and all(p["rt_ttft_p50_s"] > 0 and p["rt_slo_attainment"] == 1.0 for p in busy)
    assert sum(p["rt_tokens_per_s"] for p in points) > 0
    assert httpx.get(base + "/v1/dashboard", params={"since": "x"}).status_code == 400


class RefusingEngine(ScriptedEngine):
    """Refuses a request with a reply schema when it is submitted, as vLLM refuses a schema
    its grammar backend cannot compile (`VllmEngine.generate` raises EngineRequestError)."""

    async def generate(self, request_id, prompt_token_ids, params):  # type: ignore[no-untyped-def,override]
        from antiphon.engine_ext.engine import EngineRequestError

        if params.json_schema is not None:
            raise EngineRequestError("the grammar backend does not support this schema")
        async for delta in super().generate(request_id, prompt_token_ids, params):
            yield delta


def test_a_streamed_request_the_engine_refuses_is_a_400_as_unstreamed(tmp_path: Path) -> None:
    """It was a 200 with an error event (no [DONE]): the openai client's create() returned,
    and iterating raised a bare APIError instead of BadRequestError."""
    schema = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "string"}}}
    messages = [{"role": "user", "content": "hi"}]
    with live_server(scripted_config(tmp_path), RefusingEngine()) as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
        for stream in (False, True):
            with pytest.raises(openai.BadRequestError) as refused:
                client.chat.completions.create(model="scripted", messages=messages,  # type: ignore[call-overload]
                                               response_format=schema, stream=stream)
            assert refused.value.code == "bad_message"
            assert "does not support" in refused.value.message
        # the refused requests gave their slots back: others run
        reply = client.chat.completions.create(model="scripted", messages=messages,
                                               stream=True)
        assert "".join(c.choices[0].delta.content or "" for c in reply if c.choices)


def test_an_engine_failure_mid_stream_is_an_error_event_then_done(tmp_path: Path) -> None:
    engine = ScriptedEngine(token_delay_s=0.1)
    body = {"model": "scripted", "messages": [{"role": "user", "content": "a b c d e f g"}],
            "stream": True}
    with live_server(scripted_config(tmp_path), engine) as url, \
            httpx.stream("POST", url + "/v1/chat/completions", json=body) as stream:
        assert stream.status_code == 200
        lines = stream.iter_lines()
        assert next(line for line in lines if line.startswith("data:"))  # under way
        engine.die()
        frames = [line for line in lines if line.startswith("data:")]
    error = json.loads(frames[-2].removeprefix("data: "))["error"]
    assert (error["code"], error["type"]) == ("engine_error", "server_error")
    assert frames[-1] == "data: [DONE]"


def test_empty_messages_are_taken_as_openai_takes_them(scripted: Scripted) -> None:
    # Chat UIs send an empty system prompt when none is set: every such request was a 400.
    reply = client(scripted).chat.completions.create(model="scripted", messages=[
        {"role": "system", "content": ""}, {"role": "user", "content": "hi"}])
    assert reply.choices[0].finish_reason == "stop"


@pytest.mark.parametrize(("extra", "refused"), [
    ({"user": 123}, "user: Input should be a valid string"),
    ({"store": "yes"}, "store: Input should be a valid boolean"),
    ({"metadata": "x"}, "metadata: Input should be a valid dictionary"),
    ({"metadata": {f"k{i}": "v" for i in range(17)}}, "metadata: Dictionary should have at most"),
    ({"user": "u-1", "metadata": {"run": "7"}, "store": False, "service_tier": "auto",
      "prompt_cache_key": None}, None),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "bad name!"}}},
     "String should match pattern"),
    ({"stream_options": {"include_usage": True}}, "only allowed with stream"),
    ({"stream": True, "stream_options": {"continuous_usage_stats": True}}, "continuous_usage"),
    ({"stream": True, "stream_options": {"include_usge": True}}, "include_usge"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "any"}}}, None),
])
def test_options_bookkeeping_and_a_schemaless_json_schema_as_openai_takes_them(
        scripted: Scripted, extra: dict[str, object], refused: str | None) -> None:
    """Stream options are checked like every field (an unknown one was dropped silently, and
    they were taken without a stream); OpenAI's bookkeeping parameters, not used, have their
    types (any was taken); a json_schema format without a schema is any JSON object, as
    OpenAI has it (it was a 400), and its name is OpenAI's kind of name."""
    body = {"model": "scripted", "messages": [{"role": "user", "content": "hi"}], **extra}
    r = httpx.post(scripted.url + "/v1/chat/completions", json=body)
    if refused is None:
        assert r.status_code == 200, r.text
        if "response_format" in extra:
            assert scripted.engine.params[-1].json_schema == '{"type": "object"}'
    else:
        assert r.status_code == 400 and refused in r.json()["error"]["message"], r.text


def test_top_p_zero_takes_the_likeliest_token_as_openai_does(scripted: Scripted) -> None:
    r = httpx.post(scripted.url + "/v1/chat/completions", json={
        "model": "scripted", "messages": [{"role": "user", "content": "hi"}], "top_p": 0})
    assert r.status_code == 200, r.text  # vLLM refuses 0
    params = scripted.engine.params[-1]
    assert (params.top_p, params.top_k) == (1.0, 1)


@pytest.mark.parametrize("stream", [True, False])
def test_a_session_turn_whose_client_left_lets_the_retry_in(
        scripted: Scripted, monkeypatch: pytest.MonkeyPatch, stream: bool) -> None:
    """A client cut off mid-reply sends the session's turn again at once: it waits for the
    turn being cut short to let go of the session (slow here: each release takes 0.5 s),
    where it got a 409 session_busy."""
    import asyncio

    from antiphon.server.session_claims import SessionClaims

    release = SessionClaims.release

    def slow_release(self: SessionClaims, session_id: str, hold: str | None) -> None:
        asyncio.get_running_loop().call_later(0.5, release, self, session_id, hold)

    url = scripted.url
    sid = httpx.post(url + "/v1/sessions", json={}).json()["session_id"]
    scripted.engine.token_delay_s = 0.05
    monkeypatch.setattr(SessionClaims, "release", slow_release)
    body = {"model": "scripted", "messages": [{"role": "user", "content": "w " * 60}],
            "vllm_xargs": {"session_id": sid}, "stream": stream}
    if stream:
        with httpx.stream("POST", url + "/v1/chat/completions", json=body) as r:
            next(r.iter_lines())  # under way; then the client leaves
    else:
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(url + "/v1/chat/completions", json=body, timeout=0.5)
    retry = httpx.post(url + "/v1/chat/completions", json={**body, "stream": False,
                                                           "max_tokens": 2})
    assert retry.status_code == 200, retry.text


def test_a_stream_whose_client_leaves_before_its_first_token_is_aborted(
        scripted: Scripted) -> None:
    """The response waits for the first token (a refusal is then a 400); a client gone
    meanwhile left the request running, and holding its slot of the key's limit, until then:
    each client timeout and retry added one more."""
    scripted.engine.token_delay_s = 3.0
    body = {"model": "scripted", "stream": True,
            "messages": [{"role": "user", "content": "a b c d e f g h"}]}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(scripted.url + "/v1/chat/completions", json=body, timeout=0.5)
    deadline = time.monotonic() + 2.0  # well before the first token, at 3 s
    while scripted.engine.active_request_ids:
        assert time.monotonic() < deadline, "the request ran on after its client left"
        time.sleep(0.05)


def test_created_is_when_the_request_came_streamed_or_not(scripted: Scripted) -> None:
    scripted.engine.token_delay_s = 0.4
    app = client(scripted)
    ask = [{"role": "user", "content": "one two three four"}]
    sent = time.time()
    whole = app.chat.completions.create(model="scripted", messages=ask)
    assert time.time() - sent > 1.5 and abs(whole.created - sent) <= 1
    sent = time.time()
    chunks = list(app.chat.completions.create(model="scripted", messages=ask, stream=True))
    assert all(abs(c.created - sent) <= 1 for c in chunks)


def test_logprobs_of_tokens_structured_output_masked_are_finite() -> None:
    """vLLM reports -inf for tokens a grammar masks: the response failed to encode (a 500),
    or a stream carried -Infinity, which strict JSON parsers refuse. Clamped as vLLM's own
    server clamps them."""
    from types import SimpleNamespace

    from antiphon.engine_ext.logprobs import MIN_LOGPROB, ranked

    candidates = {7: SimpleNamespace(logprob=0.0, rank=1, decoded_token="{"),
                  9: SimpleNamespace(logprob=float("-inf"), rank=2, decoded_token="x")}
    chosen = ranked(candidates, 7, 2)
    assert chosen.top == (("{", 0.0), ("x", MIN_LOGPROB))
    assert ranked(candidates, 9, 0).logprob == MIN_LOGPROB


def test_a_refused_field_is_named_in_param_without_pydantic_union_tags(
        scripted: Scripted) -> None:
    url = scripted.url + "/v1"
    bad = httpx.post(url + "/chat/completions", json={
        "model": "scripted", "stop": 5, "messages": [{"role": "user", "content": "hi"}]})
    assert bad.status_code == 400
    assert bad.json()["error"]["param"] == "stop"
    assert bad.json()["error"]["message"].startswith("stop: ")
    bad = httpx.post(url + "/completions", json={"model": "scripted", "prompt": {"a": 1}})
    error = bad.json()["error"]
    assert bad.status_code == 400 and error["param"] == "prompt"
    assert ".str" not in error["message"], error
    bad = httpx.post(url + "/chat/completions", json={
        "model": "scripted", "messages": [{"role": "user", "content": 5}]})
    assert bad.json()["error"]["param"] == "messages.0.content"


def test_an_advisory_over_an_unchanged_conversation_repeats_the_last(tmp_path: Path) -> None:
    """REST advisories are rate-limited by what they bring: while a session's conversation
    is unchanged, one within --advisory-repeat-interval-s of the last is answered as that one
    was, without reading, rendering or hashing the conversation again; a new exchange, or the
    interval's end, lets the next one through."""
    engine = ScriptedEngine(token_delay_s=0.0)
    with live_server(scripted_config(tmp_path, advisory_repeat_interval_s=1.5), engine) as url:
        sid = httpx.post(url + "/v1/sessions", json={}).json()["session_id"]
        app = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)

        def exchange(text: str) -> None:
            app.chat.completions.create(model="scripted", max_tokens=10,
                                        messages=[{"role": "user", "content": text}],
                                        extra_body={"vllm_xargs": {"session_id": sid}})

        def advise() -> dict[str, object]:
            r = httpx.post(url + "/v1/advisory", json={"session_id": sid,
                                                       "expected_arrival": 1.0})
            assert r.status_code == 202, r.text
            return r.json()  # type: ignore[no-any-return]

        exchange("a b")
        first = advise()
        assert first["repeat"] is False and len(engine.advisories) == 1
        for _ in range(20):  # a client advising in a loop
            again = advise()
            assert again["repeat"] is True
            assert again["context_tokens_held"] == first["context_tokens_held"]
        assert len(engine.advisories) == 1
        exchange("c d")  # the agent's next call: its advisory goes through at once
        assert advise()["repeat"] is False and len(engine.advisories) == 2
        assert engine.decode(engine.advisories[-1][1]).endswith("You said: c d")
        time.sleep(1.6)
        assert advise()["repeat"] is False and len(engine.advisories) == 3
        metrics = httpx.get(url + "/metrics").text
        assert 'antiphon_advisory_repeats_total{source="rest"} 20.0' in metrics
        assert 'antiphon_advisories_total{source="rest"} 3.0' in metrics


def test_an_advisorys_priority_and_order_reach_the_engine(tmp_path: Path) -> None:
    """Symphony's `priority` and `ordered` were accepted and dropped: a prioritised session's
    advisory went as any other, and an ordered one could be fetched before the one its
    client had said comes first. Null priority is Symphony's agents' format."""
    engine = ScriptedEngine(token_delay_s=0.0)
    with live_server(scripted_config(tmp_path, advisory_repeat_interval_s=60.0), engine) as url:
        app = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
        sids = []
        for _ in range(3):
            sid = httpx.post(url + "/v1/sessions", json={}).json()["session_id"]
            app.chat.completions.create(model="scripted", max_tokens=10,
                                        messages=[{"role": "user", "content": "a b"}],
                                        extra_body={"vllm_xargs": {"session_id": sid}})
            sids.append(sid)

        def advise(sid: str, **fields: object) -> httpx.Response:
            return httpx.post(url + "/v1/advisory", json={"session_id": sid, **fields})

        for out_of_range in (101, -101):
            r = advise(sids[0], priority=out_of_range)
            assert r.status_code == 400 and r.json()["error"]["code"] == "bad_message"
        assert engine.advisories == []  # (refused: nothing sent)
        assert advise(sids[0], expected_arrival=5.0, priority=None).status_code == 202
        # the same advisory again with a higher priority is no repeat: it goes ahead
        assert advise(sids[0], expected_arrival=5.0, priority=None).json()["repeat"] is True
        assert advise(sids[0], expected_arrival=5.0, priority=3).json()["repeat"] is False
        assert engine.advisory_priorities == [0, 3]
        # ordered: the second's turn comes after the first's, whatever it says
        assert advise(sids[1], expected_arrival=20.0, ordered=True).status_code == 202
        assert advise(sids[2], expected_arrival=1.0, ordered=True).status_code == 202
        (_, _, first), (_, _, second) = engine.advisories[-2:]
        assert first == 20.0 and second is not None and 19.0 < second <= 20.0
        # an unordered one is not held back by them
        assert advise(sids[0], expected_arrival=1.0).json()["repeat"] is False
        assert engine.advisories[-1][2] == 1.0
        # once their turns have come, they hold back no later one
        for sid in sids:
            app.chat.completions.create(model="scripted", max_tokens=10,
                                        messages=[{"role": "user", "content": "a b"}],
                                        extra_body={"vllm_xargs": {"session_id": sid}})
        assert advise(sids[1], expected_arrival=0.5, ordered=True).json()["repeat"] is False
        assert engine.advisories[-1][2] == 0.5
        # and a session's own later ordered advisory may move its turn sooner
        assert advise(sids[0], expected_arrival=120.0, ordered=True).status_code == 202
        assert advise(sids[0], expected_arrival=0.25, ordered=True).json()["repeat"] is False
        assert engine.advisories[-1][2] is not None and engine.advisories[-1][2] < 1.0


def test_the_start_up_heap_is_frozen_while_serving(tmp_path: Path) -> None:
    """The collector's oldest generation walked every object start-up made (600,000 with
    vLLM and torch): each full collection stopped the event loop, every stream with it, for
    0.15-0.3 s on two cores. Frozen while serving; let go at shutdown."""
    with live_server(scripted_config(tmp_path), ScriptedEngine()) as url:
        assert httpx.get(url + "/healthz").json()["status"] == "ok"
        assert gc.get_freeze_count() > 0
    assert gc.get_freeze_count() == 0


def test_an_advisory_during_the_sessions_turn_is_no_repeat(tmp_path: Path) -> None:
    """A turn uses its session's advisory up in the engine before it changes the
    conversation (an OpenAI-API exchange is kept at its end): an advisory for the next call,
    sent while it streams, is sent to the engine."""
    engine = ScriptedEngine(token_delay_s=0.02)
    with live_server(scripted_config(tmp_path, advisory_repeat_interval_s=60.0), engine) as url:
        sid = httpx.post(url + "/v1/sessions", json={}).json()["session_id"]
        app = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
        app.chat.completions.create(model="scripted", max_tokens=10,
                                    messages=[{"role": "user", "content": "a b"}],
                                    extra_body={"vllm_xargs": {"session_id": sid}})
        advise = {"session_id": sid, "expected_arrival": 5.0}
        assert httpx.post(url + "/v1/advisory", json=advise).json()["repeat"] is False
        stream = app.chat.completions.create(
            model="scripted", stream=True, max_tokens=30,
            messages=[{"role": "user", "content": " ".join(["w"] * 30)}],
            extra_body={"vllm_xargs": {"session_id": sid}})
        next(iter(stream))  # the turn runs: it has taken the advisory
        assert httpx.post(url + "/v1/advisory", json=advise).json()["repeat"] is False
        list(stream)
        assert len(engine.advisories) == 2


def test_a_text_completion_naming_no_max_tokens_fits_a_lower_token_limit(
        tmp_path: Path) -> None:
    """Unset, a text completion's max_tokens is OpenAI's 16: under --max-tokens-limit 8 it
    was refused for a max_tokens the client never sent (a chat completion's default is kept
    under the limit)."""
    config = scripted_config(tmp_path, max_tokens_limit=8)
    with live_server(config, ScriptedEngine()) as url:
        r = httpx.post(url + "/v1/completions", json={"model": "scripted", "prompt": "a b c"})
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] <= 8


def test_flags_are_json_booleans_and_null_is_the_default(scripted: Scripted) -> None:
    """A tool's "strict": "yes" was taken as true (every other flag is a JSON boolean), and
    /tokenize refused `add_generation_prompt: null` (null is the default everywhere else)."""
    r = httpx.post(scripted.url + "/v1/chat/completions", json={
        "model": "scripted", "messages": [{"role": "user", "content": "hi"}],
        "tools": [{"type": "function", "function": {"name": "f", "strict": "yes"}}]})
    assert r.status_code == 400 and "strict" in r.text, r.text
    messages = [{"role": "user", "content": "hi"}]
    null = httpx.post(scripted.url + "/tokenize", json={
        "messages": messages, "add_generation_prompt": None})
    default = httpx.post(scripted.url + "/tokenize", json={"messages": messages})
    assert null.status_code == 200, null.text
    assert null.json()["tokens"] == default.json()["tokens"]
    closed = httpx.post(scripted.url + "/tokenize", json={
        "messages": messages, "add_generation_prompt": False})
    assert closed.json()["tokens"] != default.json()["tokens"]

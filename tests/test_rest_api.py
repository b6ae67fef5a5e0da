"""REST endpoints over a live server and a scripted engine, with httpx and the openai client."""

from __future__ import annotations

import httpx
import openai
import pytest

from tests.conftest import Scripted


def client(s: Scripted) -> openai.OpenAI:
    return openai.OpenAI(base_url=s.url + "/v1", api_key="unused", max_retries=0)


def test_models_lists_the_served_model(scripted: Scripted) -> None:
    models = client(scripted).models.list()
    assert [m.id for m in models.data] == ["scripted"]


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


def test_length_finish_reason(scripted: Scripted) -> None:
    out = client(scripted).chat.completions.create(
        model="scripted", messages=[{"role": "user", "content": "a b c d"}], max_tokens=2)
    assert out.choices[0].finish_reason == "length"
    assert out.choices[0].message.content == "You said:"


@pytest.mark.parametrize(("kwargs", "status", "code"), [
    ({"model": "gpt-9"}, 404, "model_not_found"),
    ({"max_tokens": 1000}, 400, "max_tokens_too_large"),
    ({"messages": [{"role": "user", "content": "x" * 1001}]}, 413, "too_large"),
    ({"messages": []}, 400, "bad_message"),
    ({"extra_body": {"vllm_xargs": {"request_class": "urgent"}}}, 400, "bad_message"),
])
def test_bad_requests_get_typed_errors(scripted: Scripted, kwargs: dict[str, object],
                                       status: int, code: str) -> None:
    args: dict[str, object] = {"model": "scripted",
                               "messages": [{"role": "user", "content": "hi"}], **kwargs}
    with pytest.raises(openai.APIStatusError) as info:
        client(scripted).chat.completions.create(**args)  # type: ignore[call-overload]
    assert info.value.status_code == status
    assert info.value.body["code"] == code  # type: ignore[index]


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
    r = httpx.post(base + "/v1/advisory", json={"session_id": sid, "expected_arrival": 2.5})
    assert r.status_code == 202
    r = httpx.post(base + "/v1/advisory", json={"session_id": "s_x"})
    assert r.status_code == 404 and r.json()["error"]["code"] == "session_not_found"
    assert httpx.delete(base + f"/v1/sessions/{sid}").status_code == 204
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


def test_index_page_is_served(scripted: Scripted) -> None:
    r = httpx.get(scripted.url + "/")
    assert r.status_code == 200 and "<html" in r.text.lower()

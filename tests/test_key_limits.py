"""Limits per API key: one key cannot hold every connection or flood the engine while another
key waits; real websocket and HTTP clients against a live server (scripted engine)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import threading
from pathlib import Path
from typing import Any

import httpx
import pytest
from starlette.datastructures import QueryParams
from websockets.asyncio.client import connect

from antiphon.engine_ext.scripted import ScriptedEngine
from antiphon.server.auth import RedactApiKeys, redact_api_key_params
from tests.conftest import scripted_config
from tests.liveserver import live_server, running_server
from tests.wsclient import open_session, recv, recv_until, send

A, B = "tenant-a-key-1", "tenant-b-key-2"


def completion(key: str, content: str = "hi", stream: bool = False) -> dict[str, object]:
    return {"url": "/v1/chat/completions", "headers": {"Authorization": f"Bearer {key}"},
            "json": {"model": "scripted", "stream": stream, "max_tokens": 40,
                     "messages": [{"role": "user", "content": content}]}}


async def test_one_key_cannot_hold_every_connection(tmp_path: Path) -> None:
    config = scripted_config(tmp_path, api_keys=(A, B), max_connections_per_key=2)
    with live_server(config, ScriptedEngine()) as url:
        ws_url = url.replace("http://", "ws://") + "/v1/ws?api_key="
        async with contextlib.AsyncExitStack() as stack:
            for _ in range(2):
                await stack.enter_async_context(connect(ws_url + A))
            async with connect(ws_url + A) as third:
                refused = json.loads(await third.recv())
                await third.wait_closed()
            assert refused["code"] == "too_many_requests"
            assert "--max-connections-per-key" in refused["message"]
            assert third.close_code == 1013  # try again later
            async with connect(ws_url + B) as other:  # another key still gets in
                await send(other, type="session.list")
                assert (await recv(other))["type"] == "sessions"
        async with connect(ws_url + A) as again:  # A's connections closed: room again
            await send(again, type="session.list")
            assert (await recv(again))["type"] == "sessions"


async def test_one_key_cannot_flood_the_engine(tmp_path: Path) -> None:
    config = scripted_config(tmp_path, api_keys=(A, B), max_inflight_per_key=1)
    with live_server(config, ScriptedEngine(token_delay_s=0.05)) as url:
        async with httpx.AsyncClient(base_url=url, timeout=30) as client:
            first = asyncio.create_task(client.post(**completion(A, "one two three " * 5)))
            await asyncio.sleep(0.3)  # generating now
            second = await client.post(**completion(A))
            other = await client.post(**completion(B))
            assert (second.status_code, second.json()["error"]["code"]) == (
                429, "too_many_requests")
            assert other.status_code == 200
            assert (await first).status_code == 200
            async with client.stream(**completion(A, stream=True), method="POST") as r:
                assert r.status_code == 200  # the slot came back
                body = "".join([chunk async for chunk in r.aiter_text()])
            assert body.endswith("data: [DONE]\n\n")
            # A websocket turn takes the key's slot too.
            ws_url = url.replace("http://", "ws://") + f"/v1/ws?api_key={A}"
            async with connect(ws_url) as ws:
                sid = (await open_session(ws))["session"]["session_id"]
                await send(ws, type="message", session_id=sid, content="long " * 30)
                await recv_until(ws, "token")
                refused = await client.post(**completion(A))
                await recv_until(ws, "done")
            assert refused.status_code == 429
            assert (await client.post(**completion(A))).status_code == 200


class CountedRenders(ScriptedEngine):
    """An engine that counts its chat renders, and can hold one until `release` is set."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.renders = 0
        self.hold = threading.Event()
        self.holding = threading.Event()
        self.release = threading.Event()

    def render_chat(self, *args: Any, **kwargs: Any) -> Any:
        self.renders += 1
        if self.hold.is_set():
            self.holding.set()
            self.release.wait(10)
        return super().render_chat(*args, **kwargs)


async def test_a_key_at_its_limit_renders_nothing_it_is_refused(tmp_path: Path) -> None:
    """The key's slots were taken after the request's render: a key at its limit still had
    every refused request rendered, on the thread every other key's renders wait for (found
    by a review: 40 refused requests held another key's reply 2.6 s)."""
    config = scripted_config(tmp_path, api_keys=(A, B), max_inflight_per_key=1)
    engine = CountedRenders(token_delay_s=0.05)
    with live_server(config, engine) as url:
        async with httpx.AsyncClient(base_url=url, timeout=30) as client:
            first = asyncio.create_task(client.post(**completion(A, "one two three " * 5)))
            await asyncio.sleep(0.3)  # generating now
            renders = engine.renders
            refused = await client.post(**completion(A))
            text = await client.post(url="/v1/completions", headers={
                "Authorization": f"Bearer {A}"}, json={"model": "scripted", "prompt": "hi"})
            assert (refused.status_code, text.status_code) == (429, 429)
            assert engine.renders == renders
            assert (await first).status_code == 200
            assert (await client.post(**completion(A))).status_code == 200  # slot back


async def test_one_key_cannot_queue_tokenize_renders_without_limit(tmp_path: Path) -> None:
    """/tokenize and /detokenize run on the render thread chat turns use, and took no slot of
    the key: one key's many held every other key's replies up."""
    config = scripted_config(tmp_path, api_keys=(A, B), max_inflight_per_key=1)
    engine = CountedRenders()
    with live_server(config, engine) as url:
        async with httpx.AsyncClient(base_url=url, timeout=30) as client:
            tokenize = {"url": "/tokenize", "headers": {"Authorization": f"Bearer {A}"},
                        "json": {"messages": [{"role": "user", "content": "hi"}]}}
            engine.hold.set()
            held = asyncio.create_task(client.post(**tokenize))
            assert await asyncio.to_thread(engine.holding.wait, 10)
            engine.hold.clear()
            again = await client.post(**tokenize)
            detokenize = await client.post(url="/detokenize", headers={
                "Authorization": f"Bearer {A}"}, json={"tokens": [104, 105]})
            assert (again.status_code, again.json()["error"]["code"]) == (
                429, "too_many_requests")
            assert "--max-inflight-per-key" in again.json()["error"]["message"]
            assert detokenize.status_code == 429
            engine.release.set()
            assert (await held).status_code == 200
            assert (await client.post(**tokenize)).status_code == 200  # the slot came back


class SlowAdvise(ScriptedEngine):
    """An engine that answers an advisory after a step's while (between two steps)."""

    def __init__(self) -> None:
        super().__init__()
        self.num_advising = self.peak_advising = 0

    async def advise(self, *args: object, **kwargs: object) -> int:
        self.num_advising += 1
        self.peak_advising = max(self.peak_advising, self.num_advising)
        try:
            await asyncio.sleep(0.5)
            return await super().advise(*args, **kwargs)  # type: ignore[arg-type]
        finally:
            self.num_advising -= 1


async def test_one_key_cannot_flood_the_engine_with_advisories(tmp_path: Path) -> None:
    # Each REST advisory is an engine call; a key's 12 at once all reached the engine
    config = scripted_config(tmp_path, api_keys=(A, B), max_inflight_per_key=2)
    engine = SlowAdvise()
    with live_server(config, engine) as url:
        async with httpx.AsyncClient(base_url=url, timeout=30) as client:
            sessions = []
            for key in (A,) * 12 + (B,):
                auth = {"Authorization": f"Bearer {key}"}
                sid = (await client.post("/v1/sessions", json={}, headers=auth)).json()[
                    "session_id"]
                request = completion(key)
                request["json"]["vllm_xargs"] = {"session_id": sid}  # type: ignore[index]
                assert (await client.post(**request)).status_code == 200
                sessions.append((sid, auth))
            answers = await asyncio.gather(*(
                client.post("/v1/advisory", json={"session_id": sid}, headers=auth)
                for sid, auth in sessions[:12]))
            codes = sorted(r.status_code for r in answers)
            assert codes.count(202) >= 2 and codes.count(429) >= 8, codes
            assert engine.peak_advising <= 2
            assert all("--max-inflight-per-key" in r.json()["error"]["message"]
                       for r in answers if r.status_code == 429)
            sid, auth = sessions[-1]  # another key still advises
            assert (await client.post("/v1/advisory", json={"session_id": sid},
                                      headers=auth)).status_code == 202


async def test_each_choice_takes_a_slot_of_the_key(tmp_path: Path) -> None:
    """A completion with n choices generates n replies: it takes n of the key's slots, and
    one that would go past the limit is refused whole, the slots it did not take left free."""
    config = scripted_config(tmp_path, api_keys=(A,), max_inflight_per_key=3)
    with live_server(config, ScriptedEngine(token_delay_s=0.05)) as url:
        async with httpx.AsyncClient(base_url=url, timeout=30) as client:
            def several(n: int) -> dict[str, object]:
                request = completion(A, "one two three " * 5)
                return {**request, "json": {**request["json"], "n": n}}  # type: ignore[dict-item]

            first = asyncio.create_task(client.post(**several(2)))
            await asyncio.sleep(0.3)  # generating now: 2 of 3 slots held
            refused = await client.post(**several(2))
            assert refused.status_code == 429
            assert "2 more" in refused.json()["error"]["message"]
            assert (await client.post(**completion(A))).status_code == 200  # the third slot
            assert len((await first).json()["choices"]) == 2
            assert (await client.post(**several(3))).status_code == 200
            too_many = await client.post(**several(4))  # could never run: no retry helps
            assert too_many.status_code == 400, too_many.text
            assert too_many.json()["error"]["code"] == "too_large"


async def test_a_best_effort_keys_requests_all_run_as_be(tmp_path: Path) -> None:
    """A key of --best-effort-api-keys (an evaluation harness that cannot set vllm_xargs)
    gets every request run as BE: chat and text completions and websocket turns; asking for
    rt is refused. Another key's requests stay RT; BE is still asked for by name."""
    evals = "eval-harness-key"
    config = scripted_config(tmp_path, api_keys=(A,), best_effort_api_keys=(evals,))
    engine = ScriptedEngine()
    with live_server(config, engine) as url:
        async with httpx.AsyncClient(base_url=url, timeout=30) as client:
            assert (await client.post(**completion(evals))).status_code == 200
            text = {"url": "/v1/completions", "headers": {"Authorization": f"Bearer {evals}"},
                    "json": {"model": "scripted", "prompt": "hi", "max_tokens": 2}}
            assert (await client.post(**text)).status_code == 200
            as_be = completion(evals)
            as_be["json"] = {**as_be["json"], "vllm_xargs": {"request_class": "be"}}  # type: ignore[dict-item]
            assert (await client.post(**as_be)).status_code == 200
            assert [p.request_class.value for p in engine.params] == ["be"] * 3
            as_rt = completion(evals)
            as_rt["json"] = {**as_rt["json"], "vllm_xargs": {"request_class": "rt"}}  # type: ignore[dict-item]
            refused = await client.post(**as_rt)
            assert refused.status_code == 400 and "--best-effort-api-keys" in refused.text
            async with connect(url.replace("http://", "ws://") + f"/v1/ws?api_key={evals}") as ws:
                sid = (await open_session(ws))["session"]["session_id"]
                await send(ws, type="message", session_id=sid, content="hello")
                await recv_until(ws, "done")
            assert engine.params[-1].request_class.value == "be"
            assert (await client.post(**completion(A))).status_code == 200
            assert engine.params[-1].request_class.value == "rt"
            assert (await client.post(**completion("not-a-key"))).status_code == 401


async def test_best_effort_work_renders_on_the_batch_items_thread(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A best-effort key's requests (chat and text completions, /tokenize, websocket turns)
    and a request that asks for be are rendered on BE's render thread: an evaluation
    harness's renders queued ahead of chat turns' on RT's. Other requests render on RT's."""
    threads: list[str] = []

    def recorded(method: Any) -> Any:
        def call(self: ScriptedEngine, *args: Any, **kwargs: Any) -> Any:
            threads.append(threading.current_thread().name.rsplit("_", 1)[0])
            return method(self, *args, **kwargs)
        return call

    for name in ("render_chat", "encode_prompt", "count_tokens"):
        monkeypatch.setattr(ScriptedEngine, name, recorded(getattr(ScriptedEngine, name)))
    evals = "eval-harness-key"
    config = scripted_config(tmp_path, api_keys=(A,), best_effort_api_keys=(evals,))

    def rendered_on() -> set[str]:
        on = set(threads)
        threads.clear()
        return on

    with live_server(config, ScriptedEngine()) as url:
        async with httpx.AsyncClient(base_url=url, timeout=30) as client:
            assert (await client.post(**completion(evals))).status_code == 200
            assert rendered_on() == {"render-be"}
            text = {"url": "/v1/completions", "headers": {"Authorization": f"Bearer {evals}"},
                    "json": {"model": "scripted", "prompt": "hi", "max_tokens": 2}}
            assert (await client.post(**text)).status_code == 200
            assert rendered_on() == {"render-be"}
            tokenize = {"url": "/tokenize", "headers": {"Authorization": f"Bearer {evals}"},
                        "json": {"model": "scripted", "prompt": "hi"}}
            assert (await client.post(**tokenize)).status_code == 200
            assert rendered_on() == {"render-be"}
            async with connect(url.replace("http://", "ws://") + f"/v1/ws?api_key={evals}") as ws:
                sid = (await open_session(ws, system="Be brief."))["session"]["session_id"]
                await send(ws, type="message", session_id=sid, content="hello")
                await recv_until(ws, "done")
                await send(ws, type="typing", session_id=sid)  # (its context rendered)
                await send(ws, type="message", session_id=sid, content="again")
                await recv_until(ws, "done")
            assert rendered_on() == {"render-be"}
            as_be = completion(A)
            as_be["json"] = {**as_be["json"], "vllm_xargs": {"request_class": "be"}}  # type: ignore[dict-item]
            assert (await client.post(**as_be)).status_code == 200
            assert rendered_on() == {"render-be"}
            assert (await client.post(**completion(A))).status_code == 200
            assert rendered_on() == {"render-rt"}


async def test_without_keys_only_the_server_wide_limits_apply(tmp_path: Path) -> None:
    config = scripted_config(tmp_path, max_inflight_per_key=1, max_connections_per_key=1)
    with live_server(config, ScriptedEngine(token_delay_s=0.02)) as url:
        async with httpx.AsyncClient(base_url=url, timeout=30) as client:
            replies = await asyncio.gather(*(client.post(**completion("unused", "x y z"))
                                             for _ in range(3)))
        assert [r.status_code for r in replies] == [200, 200, 200]


async def test_each_keys_kv_is_salted_apart(tmp_path: Path) -> None:
    """Every engine request and advisory carries its key's salt (the key's fingerprint, never
    the key): one key's cached KV is never served to, or timed by, another. Without keys, or
    with --share-kv-across-keys, nothing is salted."""
    from antiphon.server.auth import Authenticator

    engine = ScriptedEngine()
    with live_server(scripted_config(tmp_path, api_keys=(A, B)), engine) as url:
        async with connect(url.replace("http://", "ws://") + "/v1/ws?api_key=" + A) as ws:
            session = (await open_session(ws))["session"]["session_id"]
            await send(ws, type="message", session_id=session, content="hello")
            await recv_until(ws, "done")
            await send(ws, type="typing", session_id=session)
            await asyncio.sleep(0.3)  # the advisory reaches the engine
        async with httpx.AsyncClient(base_url=url, timeout=30) as client:
            assert (await client.post(**completion(B))).status_code == 200
    salt_a, salt_b = Authenticator.fingerprint(A), Authenticator.fingerprint(B)
    assert engine.cache_salts == [salt_a, salt_a, salt_b]  # turn, advisory, completion
    assert salt_a != salt_b and A not in salt_a

    for config in (scripted_config(tmp_path / "nokeys"),
                   scripted_config(tmp_path / "shared", api_keys=(A, B),
                                   share_kv_across_keys=True)):
        engine = ScriptedEngine()
        with live_server(config, engine) as url, httpx.Client(base_url=url) as client:
            assert client.post(**completion(A)).status_code == 200
        assert engine.cache_salts == [None]


def test_metrics_need_a_key_when_keys_are_set(tmp_path: Path) -> None:
    """/metrics counts every key's load, so it is behind the keys like /v1/engine/stats;
    /healthz (a load balancer's probe) is not; --public-metrics opens /metrics for a scraper
    without credentials."""
    with live_server(scripted_config(tmp_path, api_keys=(A,)), ScriptedEngine()) as url:
        assert httpx.get(url + "/metrics").status_code == 401
        assert httpx.get(url + "/metrics", headers={"Authorization": "Bearer wrong-key-1"}
                         ).status_code == 401
        keyed = httpx.get(url + "/metrics", headers={"Authorization": f"Bearer {A}"})
        assert keyed.status_code == 200 and "antiphon_" in keyed.text
        assert httpx.get(url + "/healthz").status_code == 200
    config = scripted_config(tmp_path, api_keys=(A,), public_metrics=True)
    with live_server(config, ScriptedEngine()) as url:
        assert httpx.get(url + "/metrics").status_code == 200


def test_every_api_route_needs_the_key(tmp_path: Path) -> None:
    """Every `/v1/` route the app has (and vLLM's `/tokenize` and `/detokenize`), whatever its
    method, answers 401 without a key: a route added later without `authorize` fails here."""
    from antiphon.server.app import create_app

    config = scripted_config(tmp_path, api_keys=(A,))
    routes = [(method, route.path) for route in create_app(config, ScriptedEngine()).routes
              if (route.path.startswith("/v1/") or route.path in ("/tokenize", "/detokenize"))
              and hasattr(route, "methods")
              for method in sorted(route.methods)]
    assert len(routes) >= 15 and ("POST", "/v1/chat/completions") in routes
    assert ("POST", "/tokenize") in routes and ("POST", "/v1/completions") in routes
    with live_server(config, ScriptedEngine()) as url:
        for method, path in routes:
            concrete = path.replace("{", "x").replace("}", "")  # any id: the key comes first
            reply = httpx.request(method, url + concrete, json={})
            assert reply.status_code == 401, (method, path, reply.status_code, reply.text)
            assert reply.headers["www-authenticate"].startswith("Bearer ")


async def test_the_servers_limits_name_their_options(tmp_path: Path) -> None:
    """A refusal past `--max-connections` or `--max-inflight-per-connection` names the option
    an operator would raise (they said "too many open connections", "(limit 1)")."""
    config = scripted_config(tmp_path, max_connections=1, max_inflight_per_connection=1)
    with live_server(config, ScriptedEngine(token_delay_s=0.05)) as url:
        ws_url = url.replace("http://", "ws://") + "/v1/ws"
        async with connect(ws_url) as first:
            async with connect(ws_url) as second:
                refused = json.loads(await second.recv())
            assert "--max-connections: 1" in refused["message"], refused
            await send(first, type="session.open")
            sid = (await recv(first))["session"]["session_id"]
            await send(first, type="session.open")
            sid2 = (await recv(first))["session"]["session_id"]
            await send(first, type="message", session_id=sid, content="a b c d e f g h")
            await send(first, type="message", session_id=sid2, content="x", request_id="r2")
            while (frame := await recv(first))["type"] != "error":
                pass
            assert "--max-inflight-per-connection: 1" in frame["message"], frame


async def test_a_key_in_a_percent_encoded_query_name_stays_out_of_the_logs(
        tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    """The server reads `?api%5Fkey=KEY` (or `?%61pi_key=`) as `?api_key=KEY` and lets it in;
    uvicorn logs the query as sent, and the redaction matched `api_key=` only."""
    config = scripted_config(tmp_path, api_keys=(A,))
    with running_server(config, ScriptedEngine(), log_level="info") as (url, _server):
        for name in ("api%5Fkey", "%61pi_key", "api%5fkey"):
            assert httpx.get(f"{url}/v1/models?limit=1&{name}={A}").status_code == 200
        ws_url = url.replace("http://", "ws://") + f"/v1/ws?api%5Fkey={A}"
        async with connect(ws_url) as ws:
            await send(ws, type="session.list")
            assert (await recv(ws))["type"] == "sessions"
    logged = capfd.readouterr()
    log = logged.out + logged.err
    assert "/v1/models?limit=1&api%5Fkey=*** HTTP/1.1" in log
    assert '"WebSocket /v1/ws?api%5Fkey=***"' in log
    assert A not in log, [line for line in log.splitlines() if A in line]


def test_only_parameters_read_as_api_key_are_redacted() -> None:
    """Names compare as the server decodes them ('+' is a space, then %XX), in the logged
    URL and in an already formatted message."""
    assert redact_api_key_params("/v?a=1&api%5Fkey=K&b=2") == "/v?a=1&api%5Fkey=***&b=2"
    assert redact_api_key_params("/v?api+key=K&api_keys=K&xapi_key=K") == (
        "/v?api+key=K&api_keys=K&xapi_key=K")  # other names: the server does not read them
    # an earlier "name=value" (a "?" in its value, an "&b=c" in the path) swallowed the key
    assert redact_api_key_params("/v1/ws?x=a?api_key=K") == "/v1/ws?x=a?api_key=***"
    assert redact_api_key_params("/v1/a&b=c?api%5Fkey=K") == "/v1/a&b=c?api%5Fkey=***"
    # a key holding a "?" authenticates whole (values run to the next "&"): hidden whole
    assert QueryParams("api_key=tenant?a-key-1")["api_key"] == "tenant?a-key-1"
    assert redact_api_key_params("/v1/ws?api_key=tenant?a-key-1") == "/v1/ws?api_key=***"
    assert redact_api_key_params("/v?api_key=?a-key-1&b=2") == "/v?api_key=***&b=2"
    record = logging.LogRecord("uvicorn.error", logging.INFO, "x", 1,
                               f'1.2.3.4:5 - "WebSocket /v1/ws?%61pi_key={A}" [accepted]',
                               None, None)
    RedactApiKeys().filter(record)
    assert record.getMessage() == '1.2.3.4:5 - "WebSocket /v1/ws?%61pi_key=***" [accepted]'
    record = logging.LogRecord("uvicorn.error", logging.INFO, "x", 1,
                               '1.2.3.4:5 - "WebSocket /v1/ws?api_key=k?ey-1234" [accepted]',
                               None, None)
    RedactApiKeys().filter(record)
    assert record.getMessage() == '1.2.3.4:5 - "WebSocket /v1/ws?api_key=***" [accepted]'

"""A server without API keys refuses other web sites' pages (cross-site websockets, CSRF) and
foreign Host names (DNS rebinding); real websocket and HTTP clients against a live server."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosedError, InvalidStatus

from antiphon.engine_ext.scripted import ScriptedEngine
from antiphon.server.origin import BrowserGuard, host_name
from tests.conftest import scripted_config
from tests.liveserver import live_server, running_server

EVIL = "http://evil.example"


async def list_titles(url: str, origin: str | None, key: str | None = None) -> list[str]:
    ws_url = url.replace("http://", "ws://") + "/v1/ws" + (f"?api_key={key}" if key else "")
    async with connect(ws_url, origin=origin) as ws:  # type: ignore[arg-type]
        await ws.send(json.dumps({"type": "session.list"}))
        return [s["title"] for s in json.loads(await ws.recv())["sessions"]]


async def test_other_sites_pages_cannot_use_a_server_without_keys(tmp_path: Path) -> None:
    config = scripted_config(tmp_path, allowed_origins=("http://app.example:3000",))
    with live_server(config, ScriptedEngine()) as url:
        httpx.post(url + "/v1/sessions", json={"title": "private"})
        # Cross-site websocket hijacking: refused before the upgrade.
        with pytest.raises(InvalidStatus) as refused:
            await list_titles(url, EVIL)
        assert refused.value.response.status_code == 403
        # The server's own pages, an allowed origin, and clients that send no Origin pass.
        for origin in (url, "http://app.example:3000", None):
            assert await list_titles(url, origin) == ["private"]
        # A cross-site form post (no preflight): refused, and nothing created.
        r = httpx.post(url + "/v1/sessions", content=b'{"title": "csrf"}',
                       headers={"Origin": EVIL, "Content-Type": "text/plain"})
        assert (r.status_code, r.json()["error"]["code"]) == (403, "forbidden_origin")
        # DNS rebinding: a page on a domain that resolves to 127.0.0.1 names itself as Host.
        r = httpx.get(url + "/v1/sessions", headers={"Host": "rebind.evil.example:8000"})
        assert (r.status_code, r.json()["error"]["code"]) == (403, "forbidden_origin")
        port = url.rsplit(":", 1)[1]
        r = httpx.get(url + "/v1/sessions", headers={"Host": f"localhost:{port}",
                                                     "Origin": f"http://localhost:{port}"})
        assert [s["title"] for s in r.json()["sessions"]] == ["private"]
        assert 'antiphon_errors_total{code="forbidden_origin"} 3.0' in httpx.get(
            url + "/metrics").text


async def test_api_keys_in_urls_stay_out_of_the_request_log(
        tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    config = scripted_config(tmp_path, api_keys=("secret-key-42",))
    with running_server(config, ScriptedEngine(), log_level="info") as (url, _server):
        assert await list_titles(url, None, key="secret-key-42") == []  # what the UI does
        assert httpx.get(url + "/v1/sessions?limit=1&api_key=secret-key-42").status_code == 200
        assert httpx.get(url + "/v1/models?api_key=wrong-guess-1").status_code == 401
    logged = capfd.readouterr()
    log = logged.out + logged.err
    assert '"WebSocket /v1/ws?api_key=***"' in log
    assert "/v1/sessions?limit=1&api_key=*** HTTP/1.1" in log
    assert "secret-key-42" not in log and "wrong-guess-1" not in log


async def test_with_api_keys_the_key_is_what_counts(tmp_path: Path) -> None:
    config = scripted_config(tmp_path, api_keys=("browser-app-key",))
    with live_server(config, ScriptedEngine()) as url:
        assert await list_titles(url, EVIL, key="browser-app-key") == []  # an app elsewhere
        with pytest.raises(ConnectionClosedError) as closed:
            await list_titles(url, EVIL)  # no key: closed with 4401
        assert closed.value.rcvd is not None and closed.value.rcvd.code == 4401


def test_host_names_and_origins() -> None:
    assert [host_name(h) for h in ("localhost:8000", "[::1]:8000", "127.0.0.1", "::1")] == [
        "localhost", "::1", "127.0.0.1", "::1"]
    guard = BrowserGuard(lambda *a: None, allowed_hosts=("chat.lan",),  # type: ignore[arg-type,return-value]
                         allowed_origins=("https://app.example/",))
    assert guard.refusal("chat.lan:8000", None) is None
    assert guard.refusal("127.0.0.2:8000", "http://127.0.0.2:8000") is None
    assert guard.refusal("[::1]:8000", "http://[::1]:8000") is None
    assert guard.refusal("localhost:8000", "https://APP.example") is None
    assert guard.refusal(None, None) is None  # HTTP/1.0 without Host: no browser
    for host, origin in (("evil.example", None), ("localhost:8000", "null"),
                         ("localhost:8000", "http://localhost:8001"),
                         ("localhost:8000", "file://localhost:8000")):
        assert guard.refusal(host, origin) is not None, (host, origin)


def test_allowed_origins_and_hosts_match_as_browsers_send_them() -> None:
    """An origin given with its scheme's default port (as the option's help once showed it)
    never matched, since browsers leave that port out; nor did a host given with a port, or
    an IPv6 address in brackets. Entries that can never match are refused."""
    from antiphon.server.config import ServerConfig

    guard = BrowserGuard(lambda *a: None,  # type: ignore[arg-type,return-value]
                         allowed_hosts=("chat.lan:8000", "[fe80::1]"),
                         allowed_origins=("https://chat.lan:443", "http://chat.lan:8080"))
    assert guard.refusal("chat.lan:8000", "https://chat.lan") is None
    assert guard.refusal("[fe80::1]:8000", "http://chat.lan:8080") is None
    assert guard.refusal("chat.lan", "https://chat.lan:8443") is not None
    # other schemes' origins (an extension's, an app shell's) and a file page's, as given
    others = BrowserGuard(lambda *a: None,  # type: ignore[arg-type,return-value]
                          allowed_origins=("chrome-extension://AbC", "tauri://localhost"))
    for origin in ("chrome-extension://abc", "tauri://localhost"):
        assert others.refusal("localhost:8000", origin) is None, origin
    assert ServerConfig(allowed_origins=("chrome-extension://abc",))
    # null: file:// pages, but also any site's sandboxed frames
    for origins, hosts in ((("chat.lan",), ()), (("https://chat.lan/app",), ()),
                           (("null",), ()), ((), ("https://chat.lan",)), ((), ("",))):
        with pytest.raises(ValueError, match="allowed_"):
            ServerConfig(allowed_origins=origins, allowed_hosts=hosts)

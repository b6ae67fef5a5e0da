"""HTTP connections that do not send their requests in time are closed (server/http_deadlines.py):
one that sends nothing, trickles its headers, or stops sending a declared body. Connections
idle between requests (keep-alive) and websockets are not. A connection, HTTP or websocket,
whose client takes nothing of what the server sends it is closed too."""

from __future__ import annotations

import asyncio
import json
import socket
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from urllib.parse import urlparse

import pytest
from websockets.asyncio.client import connect

from antiphon.engine_ext.scripted import ScriptedEngine
from antiphon.engine_ext.types import ChatTurn
from antiphon.server.config import ServerConfig
from antiphon.server.http_deadlines import DeadlineHttpProtocol, DeadlineWebSocketProtocol
from tests import wsclient
from tests.conftest import scripted_config
from tests.liveserver import live_server

TIMEOUT_S = 0.5  # every deadline in these tests


@pytest.fixture
def url(tmp_path: Path) -> Iterator[str]:
    engine = ScriptedEngine(token_delay_s=0.01, max_model_len=1000)
    config = scripted_config(tmp_path, header_timeout_s=TIMEOUT_S, body_timeout_s=TIMEOUT_S,
                             keep_alive_s=5.0)
    with live_server(config, engine) as base:
        yield base


def _connect(url: str) -> socket.socket:
    parsed = urlparse(url)
    sock = socket.create_connection((parsed.hostname, parsed.port), timeout=10)
    return sock


def _closed_within(sock: socket.socket, seconds: float) -> float | None:
    """Seconds until the server closed `sock` (reading whatever it sent), or None if it was
    still open after `seconds`."""
    start = time.monotonic()
    sock.settimeout(0.05)
    while time.monotonic() - start < seconds:
        try:
            if sock.recv(65536) == b"":
                return time.monotonic() - start
        except TimeoutError:
            continue
        except ConnectionResetError:
            return time.monotonic() - start
    return None


def _get(sock: socket.socket, path: str = "/healthz") -> bytes:
    sock.sendall(f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n".encode())
    sock.settimeout(10)
    data = b""
    while b"\r\n\r\n" not in data:
        data += sock.recv(65536)
    head, _, body = data.partition(b"\r\n\r\n")
    length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                  if line.lower().startswith(b"content-length:"))
    while len(body) < length:
        body += sock.recv(65536)
    return head.split(b"\r\n")[0]


def test_a_connection_that_sends_nothing_is_closed(url: str) -> None:
    with _connect(url) as sock:
        closed = _closed_within(sock, 5.0)
    assert closed is not None and closed < 3.0


def test_headers_sent_a_byte_at_a_time_are_cut_off(url: str) -> None:
    head = b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: " + b"a" * 60 + b"\r\n\r\n"
    with _connect(url) as sock:
        start = time.monotonic()
        closed = False
        for byte in head:  # a byte every 50 ms: 3.5 s for the head, each gap within the limit
            try:
                sock.sendall(bytes([byte]))
            except (BrokenPipeError, ConnectionResetError):
                closed = True
                break
            if _closed_within(sock, 0.05) is not None:
                closed = True
                break
        assert closed, "the server waited for the whole trickled head"
        assert time.monotonic() - start < 3.0


def test_a_body_that_stops_coming_closes_the_connection(url: str) -> None:
    with _connect(url) as sock:
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                     b"Content-Type: application/json\r\nContent-Length: 400\r\n\r\n{\"model\"")
        closed = _closed_within(sock, 5.0)
    assert closed is not None and closed < 3.0


def test_a_slow_body_that_keeps_coming_is_served(url: str) -> None:
    body = json.dumps({"model": "scripted", "max_tokens": 3,
                       "messages": [{"role": "user", "content": "hello there"}]}).encode()
    with _connect(url) as sock:
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                     b"Content-Type: application/json\r\nContent-Length: "
                     + str(len(body)).encode() + b"\r\n\r\n")
        pieces = [body[i:i + 8] for i in range(0, len(body), 8)]
        for piece in pieces:  # longer than the deadline in all, each gap within it
            time.sleep(TIMEOUT_S / 4)
            sock.sendall(piece)
        assert len(pieces) * TIMEOUT_S / 4 > TIMEOUT_S
        sock.settimeout(10)
        assert sock.recv(65536).startswith(b"HTTP/1.1 200")


def test_a_request_pipelined_behind_a_streaming_reply_cuts_nothing(url: str) -> None:
    # uvicorn stops reading at a second pipelined request's headers until the reply ahead
    # of it ends: the third request's head waits unread in the socket, and its deadline cut
    # the streaming reply (its generation was not even released).
    body = json.dumps({"model": "scripted", "stream": True, "max_tokens": 100,
                       "messages": [{"role": "user", "content": "word " * 100}]}).encode()
    with _connect(url) as sock:
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                     b"Content-Type: application/json\r\nContent-Length: "
                     + str(len(body)).encode() + b"\r\n\r\n" + body)
        time.sleep(0.3)  # streaming
        sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n"
                     b"GET /healthz HTTP/1.1\r\n")
        time.sleep(0.05)
        sock.sendall(b"Host: 127.0.0.1\r\n\r\n")
        data, deadline = b"", time.monotonic() + 20
        sock.settimeout(20)
        while data.count(b"HTTP/1.1 200") < 3 and time.monotonic() < deadline:
            chunk = sock.recv(65536)
            assert chunk, f"closed: {data[-200:]!r}"
            data += chunk
        assert b"data: [DONE]" in data and data.count(b"HTTP/1.1 200") == 3


def test_keep_alive_and_websockets_outlive_the_deadlines(url: str) -> None:
    with _connect(url) as sock:
        assert _get(sock) == b"HTTP/1.1 200 OK"
        time.sleep(3 * TIMEOUT_S)  # idle between requests: the keep-alive's 5 s govern
        assert _get(sock) == b"HTTP/1.1 200 OK"

    async def chat() -> str:
        async with connect(url.replace("http://", "ws://") + "/v1/ws") as ws:
            await asyncio.sleep(3 * TIMEOUT_S)
            await ws.send(json.dumps({"type": "session.open"}))
            return json.loads(await ws.recv())["type"]

    assert asyncio.run(chat()) == "session"


def _a_long_reply(turns: Sequence[ChatTurn]) -> str:
    return " ".join(["y" * 2000] * 3000)  # 6 MB: more than a socket's buffers hold


@pytest.fixture
def long_replies(tmp_path: Path) -> Iterator[str]:
    engine = ScriptedEngine(reply=_a_long_reply, max_model_len=100_000)
    config = scripted_config(tmp_path, send_timeout_s=TIMEOUT_S, max_tokens_limit=5000)
    with live_server(config, engine) as base:
        yield base


def _a_socket_read_slowly(url: str) -> socket.socket:
    """A connected socket whose receive buffer is small: a client that stops reading it soon
    leaves the server's writes stuck in its own buffers."""
    parsed = urlparse(url)
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect((parsed.hostname, parsed.port))
    return sock


def test_a_websocket_client_that_stops_reading_lets_go_of_its_session(long_replies: str) -> None:
    # Its turn's frames stuck behind a full socket, the turn held the session busy for as
    # long as the connection lived: forever for a client with no keepalive of its own.
    ws_url = long_replies.replace("http://", "ws://") + "/v1/ws"

    async def stall_then_retry() -> float:
        stalled = await connect(ws_url, sock=_a_socket_read_slowly(long_replies), max_queue=1,
                                max_size=None, ping_interval=None)
        session_id = (await wsclient.open_session(stalled))["session"]["session_id"]
        await wsclient.send(stalled, type="message", session_id=session_id, content="hi",
                            max_tokens=3000)  # and reads nothing of the reply
        start = time.monotonic()
        async with connect(ws_url) as other:
            while time.monotonic() - start < 20:
                await asyncio.sleep(0.2)
                await wsclient.send(other, type="message", session_id=session_id,
                                    content="again", max_tokens=2)
                frame = await wsclient.recv(other)
                while frame["type"] not in ("done", "error"):
                    frame = await wsclient.recv(other)
                if frame["type"] == "done":
                    return time.monotonic() - start
                assert frame["code"] == "session_busy", frame
        raise AssertionError("the session stayed busy behind the stalled client")

    assert asyncio.run(stall_then_retry()) < 10


def test_a_streaming_reply_to_a_client_that_stops_reading_is_cut_off(long_replies: str) -> None:
    body = json.dumps({"model": "scripted", "stream": True, "max_tokens": 3000,
                       "messages": [{"role": "user", "content": "hi"}]}).encode()
    with _a_socket_read_slowly(long_replies) as sock:
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                     b"Content-Type: application/json\r\nContent-Length: "
                     + str(len(body)).encode() + b"\r\n\r\n" + body)
        time.sleep(8 * TIMEOUT_S)  # reading nothing
        data, ended = b"", False
        sock.settimeout(10)
        try:
            while chunk := sock.recv(1 << 20):
                data += chunk
            ended = True
        except ConnectionResetError:
            ended = True
    assert ended and b"data: [DONE]" not in data  # closed, not streamed to its end


def test_serve_uses_the_configured_deadlines() -> None:
    options = ServerConfig(header_timeout_s=7.0, body_timeout_s=9.0,
                           send_timeout_s=11.0).uvicorn_options()
    protocol = options["http"]
    assert issubclass(protocol, DeadlineHttpProtocol)
    assert (protocol.header_timeout_s, protocol.body_timeout_s) == (7.0, 9.0)
    assert protocol.send_timeout_s == 11.0
    assert issubclass(options["ws"], DeadlineWebSocketProtocol)
    assert options["ws"].send_timeout_s == 11.0
    with pytest.raises(ValueError, match="header_timeout_s"):
        ServerConfig(header_timeout_s=0)

"""Connections that must send their requests, and take their replies, in time.

uvicorn times a connection out only while it is idle between two requests
(`--keep-alive-s`): one that connects and sends nothing, or sends a request's headers a
byte at a time, or declares a body and stops sending it, stays open for as long as the client
likes, holding a socket, a file descriptor and (for a body) the handler that waits for it. A
few thousand such connections, no API key needed, exhaust the server's file descriptors. This
protocol gives each connection two deadlines, as a reverse proxy would (nginx's
`client_header_timeout` and `client_body_timeout`):

    connect / first byte of a request --- headers complete ---- body bytes ... ---- complete
    |<------- header_timeout_s ------->|<- body_timeout_s ->|<- body_timeout_s ->|

A connection that misses one is closed: a handler reading the body sees the client gone.
Bytes the server is not reading yet (uvicorn paused the socket: a handler behind, a request
pipelined behind a reply) are not the client's delay, and the deadline starts again; one that
expires while a reply streams closes the connection after that reply. A websocket upgrade
leaves both off.

The other way round, a client that takes none of what the server sends it for
`send_timeout_s` (its socket's buffers and the transport's stay full: it stopped reading, or
its network went away) has its connection aborted, HTTP or websocket (nginx's `send_timeout`).
Until then a streaming reply's next write waits, and with it the reply: a websocket turn kept
its session busy for as long as such a connection lived, which, for a client with no
keepalive of its own, was forever (uvicorn's keepalive ping sees the client gone but only
closes the transport, which waits to send what it holds first).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
from uvicorn.protocols.websockets.websockets_sansio_impl import WebSocketsSansIOProtocol

logger = logging.getLogger(__name__)


class _SendDeadline:
    """Aborts the connection once its transport has stayed paused for writing (over its
    high-water mark) for `send_timeout_s`. Mixed in before a uvicorn protocol."""

    send_timeout_s = 60.0
    loop: asyncio.AbstractEventLoop
    transport: asyncio.Transport
    client: tuple[str, int] | None
    _send_deadline: asyncio.TimerHandle | None = None

    def pause_writing(self) -> None:
        super().pause_writing()  # type: ignore[misc]
        self._disarm_send()
        self._send_deadline = self.loop.call_later(self.send_timeout_s, self._send_expired)

    def resume_writing(self) -> None:
        self._disarm_send()
        super().resume_writing()  # type: ignore[misc]

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm_send()
        super().connection_lost(exc)  # type: ignore[misc]

    def _disarm_send(self) -> None:
        if self._send_deadline is not None:
            self._send_deadline.cancel()
            self._send_deadline = None

    def _send_expired(self) -> None:
        self._send_deadline = None
        logger.info("closed a connection to %s: it took nothing the server sent for %g s "
                    "(--send-timeout-s)", _address(self.client), self.send_timeout_s)
        self.transport.abort()  # (a close would wait to send what the transport holds)


class DeadlineWebSocketProtocol(_SendDeadline, WebSocketsSansIOProtocol):
    """uvicorn's websockets protocol with the send deadline above (`send_timeout_s`, set by
    `deadline_protocols`)."""


class DeadlineHttpProtocol(_SendDeadline, HttpToolsProtocol):
    """uvicorn's httptools protocol with the deadlines above (class attributes, set by
    `deadline_protocols`)."""

    header_timeout_s = 30.0
    body_timeout_s = 60.0

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._deadline: asyncio.TimerHandle | None = None
        self._waiting_for = ""  # what the deadline waits for: "headers" or "body"

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm("headers")

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._arm("headers")  # from the request's first byte

    def on_headers_complete(self) -> None:
        self._arm("body")
        super().on_headers_complete()

    def on_body(self, body: bytes) -> None:
        self._arm("body")
        super().on_body(body)

    def on_message_complete(self) -> None:
        self._disarm()
        super().on_message_complete()

    def handle_websocket_upgrade(self) -> None:
        self._disarm()  # the transport is the websocket's from here on
        super().handle_websocket_upgrade()

    def _arm(self, waiting_for: str) -> None:
        self._disarm()
        self._waiting_for = waiting_for
        self._deadline = self.loop.call_later(self._timeout_s(), self._expired)

    def _timeout_s(self) -> float:
        return self.header_timeout_s if self._waiting_for == "headers" else self.body_timeout_s

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _expired(self) -> None:
        self._deadline = None
        if self.transport.is_closing():
            return
        if self.flow.read_paused:  # the server is behind (a body not read yet, a request
            # pipelined behind a reply), not the client: the bytes wait unread in the socket
            self._arm(self._waiting_for)
            return
        cycle = self.cycle
        if cycle is not None and cycle.response_started and not cycle.response_complete:
            # A reply streams to this client (the next request's head is what is late): it
            # ends, then the connection closes (closed now, the reply was cut short).
            cycle.keep_alive = False
            return
        if self._waiting_for == "headers":
            logger.info("closed a connection from %s: no request headers within %g s "
                        "(--header-timeout-s)", _address(self.client), self.header_timeout_s)
        else:
            logger.info("closed a connection from %s: its request body sent nothing for %g s "
                        "(--body-timeout-s)", _address(self.client), self.body_timeout_s)
        self.transport.close()


def deadline_protocols(header_timeout_s: float, body_timeout_s: float, send_timeout_s: float
                       ) -> tuple[type[DeadlineHttpProtocol], type[DeadlineWebSocketProtocol]]:
    """The protocol classes (uvicorn's `http` and `ws` options) with these deadlines, in
    seconds."""
    http = type("DeadlineHttpProtocol", (DeadlineHttpProtocol,),
                {"header_timeout_s": header_timeout_s, "body_timeout_s": body_timeout_s,
                 "send_timeout_s": send_timeout_s})
    ws = type("DeadlineWebSocketProtocol", (DeadlineWebSocketProtocol,),
              {"send_timeout_s": send_timeout_s})
    return http, ws


def _address(client: tuple[str, int] | None) -> str:
    return f"{client[0]}:{client[1]}" if client else "a client"

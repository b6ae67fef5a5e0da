"""HTTP connections that must send their requests in time.

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
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

logger = logging.getLogger(__name__)


class DeadlineHttpProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with the header and body deadlines above (class
    attributes, set by `deadline_protocol`)."""

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


def deadline_protocol(header_timeout_s: float, body_timeout_s: float
                      ) -> type[DeadlineHttpProtocol]:
    """The protocol class (uvicorn's `http` option) with these deadlines, in seconds."""
    return type("DeadlineHttpProtocol", (DeadlineHttpProtocol,),
                {"header_timeout_s": header_timeout_s, "body_timeout_s": body_timeout_s})


def _address(client: tuple[str, int] | None) -> str:
    return f"{client[0]}:{client[1]}" if client else "a client"

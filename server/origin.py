"""Other web sites may not use a server that has no API keys, through the user's browser.

A server without API keys (it binds to loopback only) trusts whoever reaches it, and the
user's browser reaches it on behalf of every page it shows:
- any page may open `ws://127.0.0.1:8000/v1/ws` (websockets have no same-origin policy) and
  read every session, or post a form or a `text/plain` body to the REST API (no preflight);
- a page on a domain that resolves to 127.0.0.1 (DNS rebinding) is even same-origin with the
  server, and reads REST answers too.

Two checks close this, for HTTP requests and websocket upgrades alike:
- **Host**: the `Host` header must name `localhost` or a loopback address (or one of
  `--allowed-hosts`); a rebinding page's requests name its own domain.
- **Origin**: a request that carries an `Origin` (browsers send one on every websocket upgrade
  and on every POST) must come from the server's own origin or one of `--allowed-origins`.

Clients that are not browsers (curl, the OpenAI client, the SDK) send no `Origin` and a
loopback `Host`, and pass. With API keys a page cannot authenticate, so neither check applies.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from urllib.parse import urlsplit

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from antiphon.server.config import host_name, is_loopback, web_origin
from antiphon.server.errors import ApiError, ErrorCode
from antiphon.server.http import error_response


class BrowserGuard:
    """ASGI middleware refusing cross-site browser requests and foreign `Host` names."""

    def __init__(self, app: ASGIApp, *, allowed_origins: Sequence[str] = (),
                 allowed_hosts: Sequence[str] = (),
                 on_refused: Callable[[], None] = lambda: None) -> None:
        self.app = app
        self.allowed_origins = {web_origin(origin) for origin in allowed_origins} - {None}
        self.allowed_hosts = {host_name(host) for host in allowed_hosts}
        self.on_refused = on_refused

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket"):
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in scope["headers"]
                   if k in (b"host", b"origin")}
        reason = self.refusal(headers.get("host"), headers.get("origin"))
        if reason is None:
            await self.app(scope, receive, send)
            return
        self.on_refused()
        if scope["type"] == "websocket":  # closed before accepting: the upgrade gets 403
            await send({"type": "websocket.close", "code": 1008, "reason": reason[:120]})
            return
        await error_response(ApiError(ErrorCode.FORBIDDEN_ORIGIN, reason))(scope, receive, send)

    def refusal(self, host: str | None, origin: str | None) -> str | None:
        """Why a request with these headers is refused, or None."""
        if host is not None:
            name = host_name(host)
            if not (is_loopback(name) or name in self.allowed_hosts):
                return (f"Host {host!r} is not this server's: a server without API keys "
                        "answers only to localhost or a loopback address (see --allowed-hosts)")
        if origin is None:
            return None
        if web_origin(origin) in self.allowed_origins:
            return None
        origin = origin.strip().rstrip("/").lower()
        parts = urlsplit(origin)
        if host is not None and parts.scheme in ("http", "https") and (
                parts.netloc == host.strip().lower()):
            return None  # the server's own pages
        return (f"requests from the web page at {origin!r} are refused: a server without API "
                "keys serves only its own pages (see --allowed-origins)")


# Sent with every HTTP response: no MIME sniffing (a JSONL download is never run as a page), no
# framing by other sites (a framed chat page could be clicked through), no referrer sent on, and
# for the pages a policy that lets them load and connect only to this server.
SECURITY_HEADERS = [
    (b"x-content-type-options", b"nosniff"),
    (b"x-frame-options", b"DENY"),
    (b"referrer-policy", b"no-referrer"),
    (b"content-security-policy",
     b"default-src 'self'; img-src 'self' data:; connect-src 'self'; frame-ancestors 'none'; "
     b"base-uri 'none'; form-action 'self'"),
]


class SecurityHeaders:
    """ASGI middleware adding `SECURITY_HEADERS` to every HTTP response."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def send_with_headers(message: Message) -> None:
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", []), *SECURITY_HEADERS]
            await send(message)

        await self.app(scope, receive, send_with_headers)

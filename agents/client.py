"""Async client for Antiphon's websocket and REST APIs (needs only httpx and websockets).

    async with AsyncAntiphon("http://127.0.0.1:8000", api_key=None) as client:
        session = await client.create_session("notes")
        await client.advise(session.session_id, expected_arrival=2.0)
        reply = await client.chat(session.session_id, "Hello!", on_token=print)

Chat turns stream over one shared websocket (several turns may be in flight on it). The socket
is opened on first use and reopened by the next call after it drops (up to `connect_attempts`
tries with backoff); a turn whose connection drops mid-reply raises `ConnectionLostError` with
the text received so far, which is also what the server keeps as the session's reply, so the
session stays consistent; where the server itself went down (a crash), it keeps the message
without a reply, and `regenerate` asks for one. A reply a server's shutdown cuts short (past
its `--drain-timeout-s`) comes back as it was kept, with finish_reason "cancelled". Sessions, advisories, Batch API jobs and OpenAI-style completions
(`complete`: the whole conversation each call, tools too) go over REST.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import inspect
import json
import logging
import math
import os
import re
import secrets
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any
from urllib.parse import quote, urlencode

import httpx
from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed, InvalidStatus, WebSocketException
from websockets.protocol import State

from antiphon.agents.errors import (
    AntiphonError,
    ConnectionLostError,
    InvalidRequestError,
    NotFoundError,
    RequestTimeoutError,
    error_for,
)


class _RedactAuthorization(logging.Filter):
    """Logs the websocket handshake's headers (at debug level) with the API key left out."""

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args
        if isinstance(args, tuple) and len(args) == 2 and \
                str(args[0]).lower() == "authorization":
            record.args = (args[0], "[redacted]")
        return True


# The websocket connection's log (websockets logs every handshake header at debug level);
# the API key never appears in it.
WS_LOGGER = logging.getLogger("antiphon.agents.websocket")
WS_LOGGER.addFilter(_RedactAuthorization())

FINAL_BATCH_STATUSES = frozenset({"completed", "failed", "cancelled", "expired"})
# Answers of a server down or starting (a proxy's before it, or its own as it stops)
GATEWAY_STATUSES = frozenset({502, 503, 504})
CLOSE_UNAUTHORIZED = 4401  # the server's close code for a missing or wrong API key
CLOSE_TRY_AGAIN = 1013  # and for a connection over its limits
# Close code -> (error code, message where the close gives no reason).
REFUSALS = {CLOSE_UNAUTHORIZED: ("unauthorized", "missing or wrong API key"),
            CLOSE_TRY_AGAIN: ("too_many_requests",
                              "the server is at its connection limit: try again later")}
# Error frames without a request id that refuse the connection itself.
CONNECTION_ERRORS = frozenset({"unauthorized", "too_many_requests", "shutting_down"})
# The frames that end a turn (`_closed`: its socket closed).
FINAL_FRAMES = frozenset({"done", "error", "_closed"})


@dataclasses.dataclass(frozen=True)
class Session:
    session_id: str
    title: str | None
    created_at: float
    updated_at: float
    num_messages: int
    # the system message the model sees first (None in `list_sessions`: listings leave it
    # out; `get_session` has it)
    system: str | None = None

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Session:
        return cls(data["session_id"], data.get("title"), data["created_at"],
                   data["updated_at"], data["num_messages"], data.get("system"))


@dataclasses.dataclass(frozen=True)
class ChatReply:
    request_id: str
    session_id: str
    text: str
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    ttft_s: float
    """Server-side time to first token."""
    tpot_s: float | None
    total_s: float
    client_ttft_s: float
    """Time from sending the message to receiving the first token, as this client saw it."""
    tool_calls: tuple[dict[str, Any], ...] = ()
    """The reply's calls of the tools the turn offered (OpenAI's shape: `id`, `type`,
    `function` with `name` and `arguments`); answer them with `tool_results`."""


@dataclasses.dataclass
class _Turn:
    # (the socket it came on, the frame): a turn reads only its socket's frames (`ws`)
    queue: asyncio.Queue[tuple[ClientConnection, dict[str, Any]]]
    text: list[str] = dataclasses.field(default_factory=list)
    ws: ClientConnection | None = None  # the socket it was last sent on
    is_sent: bool = False  # the message has gone out on `ws`
    is_cancel_asked: bool = False  # `cancel` came before that: the cancel follows it
    # set by `cancel` while the turn waits for its place in flight (it is then never sent)
    cancelled_queued: asyncio.Event = dataclasses.field(default_factory=asyncio.Event)


class AsyncAntiphon:
    def __init__(self, base_url: str = "http://127.0.0.1:8000", api_key: str | None = None, *,
                 timeout_s: float = 120.0, connect_attempts: int = 5,
                 max_frame_bytes: int = 1 << 22, max_inflight: int = 16,
                 max_send_bytes: int = 1 << 20) -> None:
        """`timeout_s` bounds every REST call and the wait for each streamed token;
        `connect_attempts` bounds the tries to (re)open the websocket; `max_inflight` turns
        at most are in flight on it (the server's --max-inflight-per-connection, 16 by
        default), and more wait here for their turn. A message over `max_send_bytes` is
        refused here (`InvalidRequestError` too_large): the server closes the connection on
        one over four times its --max-frame-bytes (256 KiB by default), failing every turn
        on it. Callbacks (`on_token`) run on the client's event loop; an async one is awaited
        before the next piece is read."""
        if connect_attempts < 1 or max_inflight < 1:
            raise ValueError("connect_attempts and max_inflight must be at least 1")
        self.base_url = base_url.rstrip("/")
        self.api_key = api_key
        self.timeout_s = timeout_s
        self.connect_attempts = connect_attempts
        self.max_frame_bytes = max_frame_bytes
        self.max_send_bytes = max_send_bytes
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._http = httpx.AsyncClient(base_url=self.base_url, headers=headers,
                                       timeout=timeout_s)
        self._ws: ClientConnection | None = None
        self._reader: asyncio.Task[None] | None = None
        self._connect_lock = asyncio.Lock()
        self._turns: dict[str, _Turn] = {}
        self._inflight = asyncio.Semaphore(max_inflight)
        # Turns given up on (cancelled, timed out) that hold their place in flight until the
        # server has ended them: it counts them until then (`_settle`)
        self._settling: set[asyncio.Task[None]] = set()
        self._is_closed = False
        self._model: str | None = None  # the served model's name, once asked (`complete`)
        self.num_reconnects = 0

    async def __aenter__(self) -> AsyncAntiphon:
        return self

    async def __aexit__(self, *_exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        """Close the websocket and the HTTP client; later calls raise ConnectionLostError."""
        self._is_closed = True
        if self._ws is not None:
            await self._ws.close()
        if self._reader is not None:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._reader
        await asyncio.gather(*self._settling, return_exceptions=True)  # ended by the close
        await self._http.aclose()

    # -- REST ------------------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._is_closed:
            raise ConnectionLostError("the client is closed")

    async def _get(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        """The response, whatever its status; raises the SDK's errors when there is none."""
        self._check_open()
        try:
            return await self._http.request(method, path, **kwargs)
        except httpx.TimeoutException as exc:
            raise RequestTimeoutError(f"{method} {path}: no answer in {self.timeout_s} s") \
                from exc
        except httpx.HTTPError as exc:
            raise ConnectionLostError(f"{method} {path}: cannot reach {self.base_url}: {exc}") \
                from exc

    async def _request(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        r = await self._get(method, path, **kwargs)
        if r.is_success:
            return r
        try:
            error = r.json()["error"]
            code, message = str(error["code"]), str(error["message"])
        except (ValueError, KeyError, TypeError):
            code, message = f"http_{r.status_code}", r.text[:300]
        raise error_for(code, message, r.status_code)

    async def _json(self, method: str, path: str, **kwargs: Any) -> dict[str, Any]:
        result: dict[str, Any] = (await self._request(method, path, **kwargs)).json()
        return result

    async def _post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        """POST `body` as JSON (`_encode`'s: bad text is an `InvalidRequestError`)."""
        return await self._json("POST", path, content=_encode(body),
                                headers={"content-type": "application/json"})

    async def health(self) -> dict[str, Any]:
        """The server's `/healthz`: `status` "ok", or "unavailable" (503) with a `detail`;
        `ServerError` for an answer that is no health report (a proxy's 502 page while the
        server restarts)."""
        r = await self._get("GET", "/healthz")
        try:
            result = r.json()
        except ValueError:
            result = None
        if isinstance(result, dict) and "status" in result:
            return result
        raise error_for(f"http_{r.status_code}", r.text[:300], max(r.status_code, 500))

    async def models(self) -> list[str]:
        return [m["id"] for m in (await self._json("GET", "/v1/models"))["data"]]

    async def create_session(self, title: str | None = None,
                             system: str | None = None) -> Session:
        """A new session; with `system`, the system message its model sees before the
        conversation at every turn."""
        body = {"title": title} if system is None else {"title": title, "system": system}
        return Session.from_json(await self._post("/v1/sessions", body))

    async def list_sessions(self) -> list[Session]:
        """Every session of this API key, most recent first (the server lists them a page at
        a time)."""
        sessions: list[Session] = []
        path = "/v1/sessions"
        while True:
            data = await self._json("GET", path)
            sessions += [Session.from_json(s) for s in data["sessions"]]
            if not data.get("next_before"):
                return sessions
            path = f"/v1/sessions?{urlencode({'before': data['next_before']})}"

    async def get_session(self, session_id: str) -> tuple[Session, list[dict[str, Any]]]:
        """The session and its messages (`role`, `content`, `finish_reason`, ...)."""
        data = await self._json("GET", f"/v1/sessions/{_segment(session_id)}")
        return Session.from_json(data["session"]), data["messages"]

    async def delete_session(self, session_id: str) -> None:
        await self._request("DELETE", f"/v1/sessions/{_segment(session_id)}")

    async def advise(self, session_id: str, expected_arrival: float | None = None, *,
                     ordered: bool = False, priority: int = 0) -> int | None:
        """Announce that `session_id` will send a turn in about `expected_arrival` seconds
        (None: soon, unknown when), so the server brings its KV cache forward: ahead of
        advisories of lower `priority` (-100 to 100), and, `ordered`, no sooner than the
        ordered ones this client sent before (its turn comes after theirs). Returns the
        context tokens the server's KV tiers hold for the session (None: it keeps no tiers).
        An advisory over a conversation unchanged since the last one, soon after it, is
        answered as that one was without reaching the engine (`--advisory-repeat-interval-s`)."""
        if expected_arrival is not None and not math.isfinite(expected_arrival):
            raise InvalidRequestError("bad_message", "expected_arrival must be finite")
        body = {"session_id": session_id, "expected_arrival": expected_arrival,
                "ordered": ordered, "priority": priority}
        held: int | None = (await self._post("/v1/advisory", body))["context_tokens_held"]
        return held

    async def complete(self, messages: list[dict[str, Any]], *, session_id: str | None = None,
                       tools: list[dict[str, Any]] | None = None,
                       tool_choice: str | dict[str, Any] | None = None,
                       model: str | None = None, **params: Any) -> dict[str, Any]:
        """A chat completion over REST (`/v1/chat/completions`), not streamed: the whole
        conversation as OpenAI messages, with `tools` (OpenAI's; the calls come in the
        reply's `message.tool_calls`) and any other OpenAI parameter (`max_tokens`,
        `temperature`, `response_format`, ...). Returns the `chat.completion` object.

        With `session_id`, the call runs as a turn of that session: the server keeps the
        exchange's tokens as the session's context, which `advise` brings forward before
        the next call. It stores none of the messages: the caller keeps the conversation
        (`chat` turns of the same session do not see these, nor these them). `model`: the
        served model unless given."""
        if params.get("stream"):
            raise InvalidRequestError("bad_message", "complete() does not stream; use chat() "
                                      "for a streamed turn")
        if model is None:
            if self._model is None:
                self._model = (await self.models())[0]
            model = self._model
        body: dict[str, Any] = {"model": model, "messages": messages, **params}
        if tools is not None:
            body["tools"] = tools
        if tool_choice is not None:
            body["tool_choice"] = tool_choice
        if session_id is not None:
            body["vllm_xargs"] = {**(body.get("vllm_xargs") or {}), "session_id": session_id}
        return await self._post("/v1/chat/completions", body)

    async def stats(self) -> dict[str, Any]:
        """The engine's scheduler and KV-tier counters (`/v1/engine/stats`)."""
        return await self._json("GET", "/v1/engine/stats")

    # -- Batch API -------------------------------------------------------------------------

    async def upload_batch_file(self, lines: str | os.PathLike[str] | bytes,
                                filename: str = "batch.jsonl") -> dict[str, Any]:
        """Upload a JSONL of Batch API requests (a path, or the file's bytes); returns the
        file. A path that cannot be read is an `InvalidRequestError`."""
        if not isinstance(lines, bytes):
            path = Path(lines)
            try:
                filename, lines = path.name, path.read_bytes()
            except (OSError, ValueError) as exc:  # JSONL text given as a path, say
                raise InvalidRequestError("invalid_file", f"cannot read the batch file "
                                          f"{str(path)[:80]!r}: {exc} (pass the file's bytes "
                                          "to upload them)") from exc
        return await self._json("POST", "/v1/files", data={"purpose": "batch"},
                                files={"file": (filename, lines, "application/jsonl")})

    async def create_batch(self, input_file_id: str,
                           metadata: dict[str, str] | None = None, *,
                           endpoint: str = "/v1/chat/completions") -> dict[str, Any]:
        """A batch of the file's requests to `endpoint` (`/v1/chat/completions` or
        `/v1/completions`, the url of every line)."""
        return await self._post("/v1/batches", {
            "input_file_id": input_file_id, "endpoint": endpoint,
            "completion_window": "24h", "metadata": metadata})

    async def get_batch(self, batch_id: str) -> dict[str, Any]:
        return await self._json("GET", f"/v1/batches/{_segment(batch_id)}")

    async def cancel_batch(self, batch_id: str) -> dict[str, Any]:
        return await self._json("POST", f"/v1/batches/{_segment(batch_id)}/cancel")

    async def wait_batch(self, batch_id: str, poll_s: float = 1.0,
                         on_progress: Callable[[dict[str, Any]], None] | None = None,
                         max_unreachable_s: float = 600.0) -> dict[str, Any]:
        """Poll until the batch is completed, failed, cancelled or expired; returns it. A
        server out of reach (restarting: its batches go on after it; no answer, none in time,
        or a proxy's 502, 503 or 504 before it) is polled again, for at most
        `max_unreachable_s` in a row, as `antiphon batch status --wait` does; then the last
        error (`ConnectionLostError`, `RequestTimeoutError` or `ServerError`)."""
        out_of_reach_since: float | None = None
        while True:
            try:
                batch = await self.get_batch(batch_id)
            except AntiphonError as exc:
                if not isinstance(exc, (ConnectionLostError, RequestTimeoutError)) \
                        and exc.status not in GATEWAY_STATUSES:
                    raise  # the server's own answer: the batch's end is not waited for
                now = time.monotonic()
                out_of_reach_since = out_of_reach_since or now
                if now - out_of_reach_since >= max_unreachable_s or self._is_closed:
                    raise  # (closed, it is no server restart to ride out)
                await asyncio.sleep(poll_s)
                continue
            out_of_reach_since = None
            if on_progress is not None:
                on_progress(batch)
            if batch["status"] in FINAL_BATCH_STATUSES:
                return batch
            await asyncio.sleep(poll_s)

    async def batch_results(self, batch: dict[str, Any]) -> list[dict[str, Any]]:
        """The output lines, then the error lines, of a finished batch, parsed."""
        rows: list[dict[str, Any]] = []
        for file_id in (batch.get("output_file_id"), batch.get("error_file_id")):
            if file_id:
                text = (await self._request("GET", f"/v1/files/{_segment(file_id)}/content")).text
                rows += [json.loads(line) for line in text.splitlines() if line.strip()]
        return rows

    # -- websocket chat --------------------------------------------------------------------

    @property
    def ws_url(self) -> str:
        return self.base_url.replace("http://", "ws://", 1).replace("https://", "wss://", 1) \
            + "/v1/ws"

    async def _socket(self) -> ClientConnection:
        self._check_open()
        async with self._connect_lock:
            if self._ws is not None and self._reader is not None and not self._reader.done():
                return self._ws
            was_connected = self._ws is not None
            headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else None
            last: Exception | None = None
            for attempt in range(self.connect_attempts):
                if attempt:
                    await asyncio.sleep(min(0.2 * 2 ** attempt, 5.0))
                    self._check_open()  # (`close` ran meanwhile)
                try:
                    ws = await asyncio.wait_for(
                        connect(self.ws_url, additional_headers=headers, compression=None,
                                max_size=self.max_frame_bytes, logger=WS_LOGGER),
                        self.timeout_s)
                except InvalidStatus as exc:
                    refused = _refused_upgrade(exc)
                    if refused is not None:
                        raise refused from None
                    last = exc
                    continue
                except (OSError, TimeoutError, WebSocketException) as exc:
                    last = exc
                    continue
                if self._is_closed:  # `close` ran while this connected
                    await ws.close()
                    raise ConnectionLostError("the client is closed")
                self._ws = ws
                self._reader = asyncio.create_task(self._read(ws))
                self.num_reconnects += was_connected
                return ws
            raise ConnectionLostError(f"cannot open {self.ws_url} after "
                                      f"{self.connect_attempts} tries: {last}")

    async def _read(self, ws: ClientConnection) -> None:
        """Route frames to their turns; when the socket closes, tell every turn in flight."""
        closed: dict[str, Any] = {"type": "_closed", "message": "the connection closed"}
        # An error frame that may refuse the connection (a wrong key, a connection limit) does
        # only if it is the socket's first and the socket closes right behind it: the same
        # codes answer single frames too (a typing advisory over the connection's limit), and
        # the connection goes on (a refused typing frame before a dropped connection made
        # the turns in flight a BusyError, though the server had kept their messages).
        refusal: dict[str, Any] | None = None
        is_first = True
        try:
            async for raw in ws:
                frame = json.loads(raw)
                turn = self._turns.get(frame.get("request_id") or "")
                refusal = None
                if turn is not None:
                    turn.queue.put_nowait((ws, frame))
                elif is_first and frame.get("type") == "error" \
                        and frame.get("code") in CONNECTION_ERRORS:
                    refusal = frame
                is_first = False
        except ConnectionClosed as exc:
            try:
                _raise_if_refused(exc)
            except AntiphonError as err:
                closed.update(code=err.code, message=err.message)
            else:
                closed["message"] = f"the connection closed ({exc})"
                if refusal is not None:
                    closed.update(code=refusal["code"], message=str(refusal.get("message")))
        finally:
            for turn in self._turns.values():
                if turn.ws is ws:  # (one sent on a newer socket since goes on there)
                    turn.queue.put_nowait((ws, closed))

    async def _send(self, payload: dict[str, Any], turn: _Turn | None = None) -> bool:
        """Send `payload` (for `turn`, whose frames are then read from the socket it went
        on); False, sending nothing, when the turn was cancelled while the socket opened."""
        frame = _encode(payload)
        if len(frame) > self.max_send_bytes // 4 and len(frame.encode()) > self.max_send_bytes:
            raise InvalidRequestError("too_large", f"the message is over {self.max_send_bytes} "
                                      "bytes (max_send_bytes)")
        ws = await self._socket()
        try:
            if turn is not None:
                if turn.is_cancel_asked:
                    return False
                turn.ws = ws
            await ws.send(frame)
        except ConnectionClosed as exc:
            _raise_if_refused(exc)
            # The socket died between use and send: one fresh socket, then give up.
            ws = await self._socket()
            try:
                if turn is not None:
                    if turn.is_cancel_asked:
                        return False
                    turn.ws = ws
                await ws.send(frame)
            except ConnectionClosed as exc:
                _raise_if_refused(exc)
                raise ConnectionLostError(f"cannot send to {self.ws_url}: {exc}") from exc
        return True

    async def typing(self, session_id: str) -> None:
        """The user started typing in `session_id` (a websocket advisory; fire and forget)."""
        await self._send({"type": "typing", "session_id": session_id})

    async def chat(self, session_id: str, content: str, *, max_tokens: int | None = None,
                   temperature: float | None = None,
                   on_token: Callable[[str], Any] | None = None,
                   request_id: str | None = None, **sampling: Any) -> ChatReply:
        """Send one user message to a session and return the whole reply; `on_token` sees
        each streamed piece. The session keeps the exchange for the next turn. `request_id`
        (default: a fresh one) is what `cancel` takes; cancelling this call cancels the turn
        on the server too. `sampling` takes the turn's other sampling fields, as a chat
        completion's (`top_p`, `stop`, `seed`, `response_format`, ...: `protocol.Sampling`)."""
        return await self._turn({"type": "message", "session_id": session_id,
                                 "content": content}, request_id, on_token,
                                max_tokens=max_tokens, temperature=temperature, **sampling)

    async def regenerate(self, session_id: str, *, max_tokens: int | None = None,
                         temperature: float | None = None,
                         on_token: Callable[[str], Any] | None = None,
                         request_id: str | None = None, **sampling: Any) -> ChatReply:
        """Answer the session's last user message again: the new reply replaces the last one
        once it is kept, when it ends or is cut short (a cancel, a dropped connection) with
        some of its text (one stopped before its first token leaves the old one), and a
        message left without a reply (the server went down while answering it) gets one."""
        return await self._turn({"type": "regenerate", "session_id": session_id}, request_id,
                                on_token, max_tokens=max_tokens, temperature=temperature,
                                **sampling)

    async def tool_results(self, session_id: str,
                           results: Mapping[str, str] | Sequence[tuple[str, str]], *,
                           max_tokens: int | None = None, temperature: float | None = None,
                           on_token: Callable[[str], Any] | None = None,
                           request_id: str | None = None, **sampling: Any) -> ChatReply:
        """Answer the calls of the session's last reply (its `tool_calls`): each call's id
        with what its tool returned, all of them at once; returns the reply that reads them.
        `sampling` as `chat`'s, `tools` included (offered again, as in the OpenAI API)."""
        items = results.items() if isinstance(results, Mapping) else results
        return await self._turn(
            {"type": "tool_results", "session_id": session_id,
             "results": [{"tool_call_id": call_id, "content": content}
                         for call_id, content in items]},
            request_id, on_token, max_tokens=max_tokens, temperature=temperature, **sampling)

    async def _turn(self, payload: dict[str, Any], request_id: str | None,
                    on_token: Callable[[str], Any] | None, **fields: Any) -> ChatReply:
        """Run one turn: `payload` with the `fields` set (not None) and a request id."""
        request_id = request_id or "sdk_" + secrets.token_hex(8)
        if not REQUEST_ID.fullmatch(request_id):  # (it waited out timeout_s for an answer)
            raise InvalidRequestError("bad_message", f"request_id {request_id[:80]!r} must be 1 "
                                      "to 64 letters, digits or _ . : -")
        payload = {**payload, **{k: v for k, v in fields.items() if v is not None}}
        if request_id in self._turns:
            raise InvalidRequestError("duplicate_request",
                                      f"request {request_id} is in flight on this client")
        # Known while it waits for its place in flight, for `cancel` (a stop button's, from
        # another thread: it found no such turn, and the turn then ran to its end).
        turn = self._turns[request_id] = _Turn(asyncio.Queue())
        try:
            if not await self._take_place(turn):
                self._turns.pop(request_id, None)
                return ChatReply(request_id, payload["session_id"], "", "cancelled", 0, 0,
                                 0.0, None, 0.0, 0.0)
        except BaseException:
            self._turns.pop(request_id, None)
            raise
        return await self._chat(payload, request_id, turn, on_token)

    async def _take_place(self, turn: _Turn) -> bool:
        """Wait for a place in flight (given back once the server has ended the turn); False,
        holding none, when `cancel` came first."""
        if not self._inflight.locked():
            await self._inflight.acquire()
            return True
        taking = asyncio.ensure_future(self._inflight.acquire())
        stopping = asyncio.ensure_future(turn.cancelled_queued.wait())
        try:
            await asyncio.wait((taking, stopping), return_when=asyncio.FIRST_COMPLETED)
        except BaseException:  # this call cancelled: a place taken meanwhile goes back
            stopping.cancel()
            if not taking.cancel() and not taking.cancelled():
                self._inflight.release()
            raise
        stopping.cancel()
        # Still waiting: cancelled, `acquire` gives back a place it was just given (no await
        # here: a cancel of this call meanwhile was swallowed with taking's)
        if taking.cancel() or taking.cancelled():
            return False
        if turn.cancelled_queued.is_set():  # (both at once: the place goes back)
            self._inflight.release()
            return False
        return True

    async def _chat(self, payload: dict[str, Any], request_id: str, turn: _Turn,
                    on_token: Callable[[str], Any] | None) -> ChatReply:
        """Run the registered `turn`; unregisters it and gives its place in flight back once
        the server has ended it (at once, or after a cancel: `_settle`)."""
        session_id = payload["session_id"]
        payload = {**payload, "request_id": request_id}
        sent = ended = accepted = False  # the message went out; the turn ended; the server took it
        settling = False  # given up on, and left to `_settle`
        try:
            sent_at = time.perf_counter()
            if not await self._send(payload, turn):
                return ChatReply(request_id, session_id, "", "cancelled", 0, 0, 0.0, None,
                                 0.0, 0.0)
            sent = turn.is_sent = True
            if turn.is_cancel_asked:  # (lost, the turn ran to its end)
                await self._cancel_on_its_socket(request_id, turn)
            first_token_at: float | None = None
            prompt_tokens = 0
            while True:
                try:
                    # asyncio.timeout, not wait_for: on Python 3.11 wait_for drops a cancel
                    # that lands as the frame arrives, and the turn would run on.
                    async with asyncio.timeout(self.timeout_s):
                        source, frame = await turn.queue.get()
                except TimeoutError:
                    raise RequestTimeoutError(f"no reply frame for {self.timeout_s} s "
                                              f"(request {request_id})") from None
                if source is not turn.ws:
                    continue  # an older socket's, closing as the turn went out on a new one
                kind = frame["type"]
                if kind == "error" and frame["code"] == "request_not_found":
                    # Only a cancel is answered so: that of an earlier turn of this id, which
                    # had ended as the cancel went out (no answer to this one, nor its end)
                    continue
                ended = kind in FINAL_FRAMES
                if kind == "accepted":
                    accepted = True
                    prompt_tokens = frame["prompt_tokens"]
                elif kind == "token":
                    if first_token_at is None:
                        first_token_at = time.perf_counter()
                    turn.text.append(frame["text"])
                    if on_token is not None:
                        called = on_token(frame["text"])
                        if inspect.isawaitable(called):  # an async callback
                            await called
                elif kind == "done":
                    end = time.perf_counter()
                    timings, usage = frame["timings"], frame["usage"]
                    return ChatReply(
                        request_id, session_id, frame["text"], frame["finish_reason"],
                        usage.get("prompt_tokens", prompt_tokens),
                        usage.get("completion_tokens", 0), timings["ttft_s"],
                        timings.get("tpot_s"), timings["total_s"],
                        (first_token_at or end) - sent_at, tuple(frame.get("tool_calls") or ()))
                elif kind == "error":
                    raise error_for(frame["code"], frame["message"])
                elif kind == "_closed":
                    if "code" in frame:
                        raise error_for(frame["code"], frame["message"])
                    raise ConnectionLostError(frame["message"], "".join(turn.text), request_id,
                                              accepted=accepted)
        except BaseException as exc:
            # Cancelled, timed out, or `on_token` raised: stop the turn on the server too, or
            # it runs on, keeps a reply nobody read and holds the session (harmless if done).
            if not ended and (sent or isinstance(exc, asyncio.CancelledError)):
                await asyncio.shield(self._cancel_on_its_socket(request_id, turn))
                if sent:  # the server counts it in flight until the cancel has ended it
                    task = asyncio.create_task(self._settle(request_id, turn))
                    self._settling.add(task)
                    task.add_done_callback(self._settling.discard)
                    settling = True
            raise
        finally:
            if not settling:
                self._end(request_id)

    async def _settle(self, request_id: str, turn: _Turn) -> None:
        """Wait for the server to end a turn given up on (its `done` or `error`, or its
        socket closing; at most `timeout_s`), then give its place in flight back: given back
        at once, the next turn waiting for one was refused (too many in flight)."""
        try:
            async with asyncio.timeout(self.timeout_s):
                while True:
                    source, frame = await turn.queue.get()
                    # (the server's answer to the cancel, request_not_found, may come before
                    # the turn's own end: taken for it, a retry under the same request id was
                    # given this turn's `done`)
                    if source is turn.ws and frame["type"] in FINAL_FRAMES \
                            and frame.get("code") != "request_not_found":
                        return
        except TimeoutError:
            pass
        finally:
            self._end(request_id)

    def _end(self, request_id: str) -> None:
        self._turns.pop(request_id, None)
        self._inflight.release()

    @staticmethod
    async def _cancel_on_its_socket(request_id: str, turn: _Turn) -> None:
        """Stop the turn on the server, over the socket it was sent on, if still open: a
        request id is its connection's, so a cancel on a new socket stops nothing (and
        opening one, against a server gone, took minutes of reconnects)."""
        ws = turn.ws
        if ws is None or ws.state is not State.OPEN:
            return  # never sent, or the server already ended it with its socket
        with contextlib.suppress(ConnectionClosed):
            await ws.send(_encode({"type": "cancel", "request_id": request_id}))

    async def cancel(self, request_id: str) -> None:
        """Stop a turn in flight on this client; its `chat` returns finish_reason
        "cancelled" with the text so far (none, and the message not sent, for a turn still
        waiting for its place in flight). Raises `NotFoundError` when no turn of this
        client's has that request id (finished, or never asked for)."""
        turn = self._turns.get(request_id)
        if turn is None:
            raise NotFoundError("request_not_found", f"no request {request_id} in flight on "
                                "this client")
        if turn.ws is None and not turn.is_sent and not turn.is_cancel_asked:
            turn.cancelled_queued.set()  # (waiting for its place: never sent; else no-op)
        if not turn.is_sent:  # still connecting: sent now, the cancel would come first
            turn.is_cancel_asked = True
            return
        await self._cancel_on_its_socket(request_id, turn)


def _raise_if_refused(exc: ConnectionClosed) -> None:
    """Raise the typed error if the server closed the socket to refuse it: AuthenticationError
    for the API key, BusyError at a connection limit."""
    if exc.rcvd is not None and exc.rcvd.code in REFUSALS:
        code, default = REFUSALS[exc.rcvd.code]
        raise error_for(code, exc.rcvd.reason or default)


def _segment(identifier: str) -> str:
    """An id as one path segment: unencoded, `a/../b` named another session, and
    `../files/x` a file (httpx resolves dot segments)."""
    if identifier in ("", ".", ".."):
        raise InvalidRequestError("bad_message", f"{identifier!r} is not an id")
    return quote(str(identifier), safe="")


def _encode(payload: dict[str, Any]) -> str:
    """`payload` as JSON; NaN and Infinity, which JSON has not (the server refuses them), and
    text no UTF-8 can carry (an unpaired surrogate, as `json.loads('"\\ud83d"')` or a
    `surrogateescape` decoding leaves: sent, it failed the websocket under every turn on it,
    and REST raised a bare UnicodeEncodeError) are `InvalidRequestError`s here."""
    try:
        # As UTF-8, as the server counts a frame's bytes (escaped, text in other scripts than
        # Latin's took 3 to 6 times its size, and hit --max-frame-bytes far sooner).
        text = json.dumps(payload, allow_nan=False, ensure_ascii=False)
        text.encode()
    except UnicodeEncodeError as exc:
        raise InvalidRequestError("bad_message", "the request's text is not valid Unicode: "
                                  f"{exc.reason} at character {exc.start} of its JSON") from None
    except ValueError as exc:
        raise InvalidRequestError("bad_message", str(exc)) from None
    return text


def _refused_upgrade(exc: InvalidStatus) -> AntiphonError | None:
    """The typed error of a websocket upgrade the server (or a proxy) refuses for good: a
    4xx but 408 and 429 (a Host it does not serve, a missing key), which trying again does
    not change; None for one worth trying again. (Retried, it came as `ConnectionLostError`
    after 6 s, where the same refusal over REST is typed at once.)"""
    status = exc.response.status_code
    if not 400 <= status < 500 or status in (408, 429):
        return None
    body = bytes(exc.response.body or b"")
    try:
        error = json.loads(body)["error"]
        code, message = str(error["code"]), str(error["message"])
    except (ValueError, KeyError, TypeError):
        code, message = f"http_{status}", body.decode(errors="replace")[:200]
    return error_for(code, message, status)


# The ids a client may choose, as the server checks them (`server.protocol.ID_PATTERN`): one
# it refuses comes back in an error frame without its id, which no turn waits for.
REQUEST_ID = re.compile(r"[A-Za-z0-9_.:-]{1,64}")

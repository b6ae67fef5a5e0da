"""The websocket chat API, `/v1/ws`: one `Connection` per client socket.

The connection validates each frame, answers typed errors, and accepts and runs each turn in a
task of its own, so several sessions and requests can be in flight on one socket. Closing the
socket cancels its turns, which aborts their generations and frees their KV pages.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import secrets
from collections.abc import Callable

from fastapi import WebSocket, WebSocketDisconnect
from starlette.websockets import WebSocketDisconnected

from antiphon.server import protocol
from antiphon.server.auth import key_from_headers
from antiphon.server.chat import Generation
from antiphon.server.context import AppContext
from antiphon.server.errors import ApiError, ErrorCode, unexpected_error
from antiphon.server.limits import Slot

logger = logging.getLogger(__name__)

CLOSE_UNAUTHORIZED = 4401
CLOSE_TRY_AGAIN = 1013


def frame_bytes(data: str | bytes) -> int:
    """A frame's size in bytes as it came over the wire (UTF-8 for a text frame)."""
    if isinstance(data, bytes) or data.isascii():
        return len(data)
    return len(data.encode("utf-8", "surrogatepass"))


TurnMessage = protocol.ChatMessage | protocol.Regenerate | protocol.ToolResults


def _answering(msg: protocol.SessionOpen | protocol.SessionRename | protocol.SessionDelete
               ) -> dict[str, str]:
    """The field that names the frame an answer answers, where it named itself."""
    return {} if msg.request_id is None else {"request_id": msg.request_id}


# What a send raises once the client has gone: starlette's for a socket it saw close, and for
# one closed meanwhile (a send after the close), which is no error of the server's either.
CLIENT_GONE = (WebSocketDisconnect, WebSocketDisconnected)


@dataclasses.dataclass(eq=False)
class _Turn:
    """A turn on the connection, from its frame until its work ends: accepted in one task,
    then run in another."""

    session_id: str
    starter: asyncio.Task[None] = dataclasses.field(init=False)  # accepts it, starts its run
    run: asyncio.Task[None] | None = None  # once the starter has started it
    is_cancelled: bool = False  # by its client's `cancel`, or a shutdown's cut

    def cancel(self) -> None:
        """Stop the turn as a `cancel` does: its run at once, or, while it is being accepted,
        once it is under way (a refused turn has nothing to stop). Once: a run cancelled again
        (a stop button clicked again and again) broke into the saving of its cut reply, and
        gave the session up before the save ended."""
        if self.is_cancelled:
            return
        self.is_cancelled = True
        if self.run is not None:
            self.run.cancel()


class Connection:
    def __init__(self, ws: WebSocket, ctx: AppContext, owner: str) -> None:
        self.ws = ws
        self.ctx = ctx
        self.owner = owner
        self._send_lock = asyncio.Lock()
        self._turns: dict[str, _Turn] = {}  # by request id, until their work ends
        self._tasks: set[asyncio.Task[None]] = set()  # every turn's, until its last frame
        self._advising: dict[str, asyncio.Task[None]] = {}  # session -> its typing advisory
        # Each session's latest frame still being answered in a task of its own (a turn being
        # accepted, waiting, say, for the session's last turn to let go; a deletion): the
        # session's next turn or deletion waits for it.
        self._ahead: dict[str, asyncio.Task[None]] = {}
        self._deletions: set[asyncio.Task[None]] = set()  # until each is answered
        self._deleting: dict[str, asyncio.Task[None]] = {}  # session -> its latest deletion
        self._unstarted: set[asyncio.Task[None]] = set()  # runs before their first step

    async def send(self, frame: str) -> None:
        async with self._send_lock:
            await self.ws.send_text(frame)

    async def serve(self) -> None:
        cutter = asyncio.create_task(self._cut_short_at_shutdown())
        try:
            while True:
                raw = await self.ws.receive()
                if raw["type"] == "websocket.disconnect":
                    return
                data = raw.get("text") if raw.get("text") is not None else raw.get("bytes")
                await self._handle_frame(data or "")
        except CLIENT_GONE:
            return
        finally:
            cutter.cancel()
            await self._cancel_all()

    async def _cut_short_at_shutdown(self) -> None:
        """Once a shutdown's drain ends, stop the connection's turns still streaming as a
        `cancel` would: each keeps what it has and sends its `done` before the socket
        closes."""
        await self.ctx.chat.cut_short.wait()
        for turn in list(self._turns.values()):
            turn.cancel()

    async def _handle_frame(self, data: str | bytes) -> None:
        """Answer one frame; whatever goes wrong with it, the connection and the other
        requests on it go on."""
        request_id: str | None = None
        msg: protocol.ClientMessage | None = None
        size = frame_bytes(data)
        try:
            if size > self.ctx.config.server.max_frame_bytes:
                raise ApiError(ErrorCode.TOO_LARGE, f"message of {size} bytes exceeds the "
                               f"limit of {self.ctx.config.server.max_frame_bytes}")
            msg = protocol.decode_client_message(data)
            request_id = getattr(msg, "request_id", None)
            await self._dispatch(msg)
        except CLIENT_GONE:
            raise  # the client left: nobody to tell, and no error of the server's
        except Exception as exc:
            if msg is None:  # the frame did not decode: name the request its text carries
                request_id = protocol.find_request_id(
                    data, parse=size <= self.ctx.config.server.max_frame_bytes)
            await self._send_error(exc, request_id, msg.type if msg else "frame")

    async def _send_error(self, exc: Exception, request_id: str | None, what: str) -> None:
        """Tell the client what went wrong with a frame (`what`): an `ApiError` as it is,
        anything else as an internal error (logged)."""
        err = exc if isinstance(exc, ApiError) else unexpected_error(exc, f"websocket {what}")
        self.ctx.metrics.errors.labels(err.code.value).inc()
        await self.send(protocol.error_frame(err, request_id))

    async def _dispatch(self, msg: protocol.ClientMessage) -> None:
        turns = self.ctx.turns
        if isinstance(msg, protocol.SessionOpen):
            session, messages = await turns.open(self.owner, msg.session_id, msg.title,
                                                 msg.system, msg.request_id)
            await self.send(protocol.encode("session", session=session.to_json(),
                                            messages=[m.to_json() for m in messages],
                                            replying=turns.is_replying(session.session_id),
                                            **_answering(msg)))
        elif isinstance(msg, protocol.SessionList):
            sessions, next_before = await turns.list_recent(self.owner, msg.before)
            await self.send(protocol.encode(
                "sessions", sessions=[s.to_json(listed=True) for s in sessions], before=msg.before,
                has_more=next_before is not None, next_before=next_before))
        elif isinstance(msg, protocol.SessionRename):
            session = await turns.rename(self.owner, msg.session_id, msg.title)
            await self.send(protocol.encode("session.renamed", session=session.to_json(),
                                            **_answering(msg)))
        elif isinstance(msg, protocol.SessionDelete):
            self._start_deletion(msg)
        elif isinstance(msg, protocol.Typing):
            self._advise(msg.session_id, msg.priority or 0)
        elif isinstance(msg, protocol.Cancel):
            turn = self._turns.get(msg.request_id)
            if turn is None:
                raise ApiError(ErrorCode.REQUEST_NOT_FOUND,
                               f"no request {msg.request_id} in flight on this connection")
            turn.cancel()
        else:
            self._start_turn(msg)

    def _start_deletion(self, msg: protocol.SessionDelete) -> None:
        """Delete the session in a task of its own: it waits for what the connection sent
        about the session before it (a typing advisory, which would else bring forward the KV
        the deletion erases; a turn being accepted, whose message would else land in a
        session gone), then for a turn of it being cut short (up to `--session-free-wait-s`),
        and the frames behind it, for other sessions or a `cancel`, must not wait."""
        session_id = msg.session_id
        limit = self.ctx.config.server.max_inflight_per_connection
        if len(self._deletions) >= limit:
            raise ApiError(ErrorCode.TOO_MANY_REQUESTS, "too many session deletions in flight "
                           f"on this connection (--max-inflight-per-connection: {limit})")
        ahead = [t for t in (self._advising.get(session_id), self._ahead.get(session_id))
                 if t is not None]
        task = asyncio.create_task(self._delete(msg, ahead))
        self._ahead[session_id] = self._deleting[session_id] = task
        self._deletions.add(task)

        def answered(_task: asyncio.Task[None]) -> None:
            self._deletions.discard(task)
            for pending in (self._ahead, self._deleting):
                if pending.get(session_id) is task:
                    del pending[session_id]
        task.add_done_callback(answered)

    async def _delete(self, msg: protocol.SessionDelete, ahead: list[asyncio.Task[None]]
                      ) -> None:
        try:
            if ahead:
                await asyncio.wait(ahead)
            await self.ctx.turns.delete(self.owner, msg.session_id)
            await self.send(protocol.encode("session.deleted", session_id=msg.session_id,
                                            **_answering(msg)))
        except Exception as exc:
            with contextlib.suppress(Exception):  # the client may have left meanwhile
                await self._send_error(exc, msg.request_id, "session.delete")

    def _advise(self, session_id: str, priority: int) -> None:
        """Record a typing advisory in a task of its own: the engine answers it between two
        steps, which can take seconds, and the frames behind it (a `cancel`) must not wait.
        One per session at a time (a typing frame meanwhile says nothing new: dropped), and at
        most `max_inflight_per_connection` in all."""
        if session_id in self._advising:
            return
        limit = self.ctx.config.server.max_inflight_per_connection
        if len(self._advising) >= limit:
            raise ApiError(ErrorCode.TOO_MANY_REQUESTS, "too many typing advisories in flight "
                           f"on this connection (--max-inflight-per-connection: {limit})")
        task = asyncio.create_task(self._record_typing(session_id, priority,
                                                       self._deleting.get(session_id)))
        self._advising[session_id] = task
        task.add_done_callback(lambda _t: self._advising.pop(session_id, None))

    async def _record_typing(self, session_id: str, priority: int,
                             deleting: asyncio.Task[None] | None) -> None:
        """Record the advisory, after the session's deletion sent before it (`deleting`)."""
        try:
            if deleting is not None:
                await asyncio.wait([deleting])
            await self.ctx.turns.record_advisory(self.owner, session_id, "typing",
                                                 priority=priority)
        except Exception as exc:
            with contextlib.suppress(Exception):  # the client may have left meanwhile
                await self._send_error(exc, None, "typing")

    def _start_turn(self, msg: TurnMessage) -> None:
        """Check a turn's limits, then accept and run it in tasks of its own: accepting can
        wait (up to `--session-free-wait-s` for the session's last turn to let go), and the
        frames behind it, for other sessions or a `cancel`, must not. A session's turns are
        accepted in the order they came."""
        self.ctx.chat.check_open()
        request_id = msg.request_id or "r_" + secrets.token_urlsafe(9)
        if request_id in self._turns:
            raise ApiError(ErrorCode.DUPLICATE_REQUEST, f"request {request_id} is in flight")
        if len(self._turns) >= self.ctx.config.server.max_inflight_per_connection:
            raise ApiError(ErrorCode.TOO_MANY_REQUESTS, "too many requests in flight on this "
                           "connection (--max-inflight-per-connection: "
                           f"{self.ctx.config.server.max_inflight_per_connection})")
        slot = self.ctx.inflight_per_key.take(self.owner)
        turn = _Turn(msg.session_id)
        turn.starter = asyncio.create_task(self._accept_and_start(
            msg, request_id, turn, slot, self._ahead.get(msg.session_id)))
        self._turns[request_id] = turn
        self._ahead[msg.session_id] = turn.starter
        self._tasks.add(turn.starter)

    async def _accept_and_start(self, msg: TurnMessage, request_id: str, turn: _Turn,
                                slot: Slot, ahead: asyncio.Task[None] | None) -> None:
        """Accept the turn (after the session's turn `ahead` of it), tell the client, and start
        its run; a refusal is told as an error frame. A `cancel` (or a shutdown's cut)
        meanwhile stops the run once it is under way."""
        run = None
        try:
            run = await self._accept_and_run(msg, request_id, turn, slot, ahead)
        finally:  # (no await from here on: a cancel finds `turn.run` set, or is seen below)
            turn.run = run
            if self._ahead.get(turn.session_id) is turn.starter:
                del self._ahead[turn.session_id]
            self._tasks.discard(turn.starter)
            if run is None and self._turns.get(request_id) is turn:  # refused
                del self._turns[request_id]
        if run is not None and turn.is_cancelled:
            run.cancel()

    async def _accept_and_run(self, msg: TurnMessage, request_id: str, turn: _Turn, slot: Slot,
                              ahead: asyncio.Task[None] | None) -> asyncio.Task[None] | None:
        try:
            if ahead is not None:
                await asyncio.wait([ahead])
            gen = await self.ctx.turns.accept(self.owner, msg, request_id)
        except BaseException as exc:  # refused: nothing is held
            slot.release()
            if not isinstance(exc, Exception):
                raise
            with contextlib.suppress(Exception):  # the client may have left meanwhile
                await self._send_error(exc, msg.request_id, msg.type)
            return None
        try:
            await self.send(protocol.encode("accepted", request_id=request_id,
                                            session_id=msg.session_id,
                                            prompt_tokens=len(gen.prompt_token_ids)))
        except BaseException as exc:  # the client left before it heard "accepted": it may
            # send the message again (on its next connection), so the session keeps nothing
            slot.release()
            try:
                await asyncio.shield(self.ctx.turns.take_back(msg.session_id, gen))
            finally:
                self.ctx.turns.claims.release(msg.session_id, gen.session_claim)
            if not isinstance(exc, Exception):
                raise
            if not isinstance(exc, CLIENT_GONE):
                logger.error("websocket: sending accepted for %s failed", request_id,
                             exc_info=exc)
            with contextlib.suppress(Exception):  # (a socket that cannot send is done for)
                await self.ws.close()
            return None
        return await self._start_run(msg, request_id, turn, slot, gen)

    async def _start_run(self, msg: TurnMessage, request_id: str, turn: _Turn, slot: Slot,
                         gen: Generation) -> asyncio.Task[None]:
        def finished() -> None:
            """The turn's work is over, before its last frame goes out: a client that sends
            its next turn the moment it reads `done` finds its place on the connection free
            (it was freed once the frame was out: a race the client could lose)."""
            slot.release()
            if self._turns.get(request_id) is turn:
                del self._turns[request_id]

        task = asyncio.create_task(self.ctx.turns.run(
            msg.session_id, gen, self.send, is_user_cancel=lambda: turn.is_cancelled,
            finished=finished))
        self._tasks.add(task)
        task.add_done_callback(lambda t: self._finish_turn(t, msg.session_id, request_id, gen,
                                                           finished))
        # Let the turn start before it may be cancelled: a task cancelled before its first
        # step never runs its body, and would end with no `done` frame and nothing committed.
        self._unstarted.add(task)
        try:
            await asyncio.sleep(0)
        finally:
            self._unstarted.discard(task)
        return task

    def _finish_turn(self, task: asyncio.Task[None], session_id: str, request_id: str,
                     gen: Generation, finished: Callable[[], None]) -> None:
        exc = None if task.cancelled() else task.exception()
        if exc is not None and not isinstance(exc, CLIENT_GONE):
            logger.error("session %s: turn %s ended with an error", session_id, request_id,
                         exc_info=exc)
        finished()  # (again: safe; its place on the connection, whatever way the turn ended)
        self._tasks.discard(task)
        self.ctx.turns.claims.release(session_id, gen.session_claim)  # whatever way the turn ended

    async def _cancel_all(self) -> None:
        """Cancel the connection's turns; its typing advisories run to their end (short, and
        the turn they announce may come over the client's next connection), as do its
        deletions (asked for) and the turns being accepted (their `accepted` cannot reach the
        client: each takes its message back). Runs are stopped first, not after those
        waits."""
        starters = [turn.starter for turn in self._turns.values() if turn.run is None]
        runs = self._tasks.difference(starters, self._unstarted)
        for task in runs:
            task.cancel()
        await asyncio.gather(*starters, return_exceptions=True)
        # Only the runs those started: cancelled again, a run keeping its reply (shielded)
        # let its session go before the reply was saved.
        late = self._tasks.difference(runs)
        for task in late:
            task.cancel()
        await asyncio.gather(*runs, *late, *self._advising.values(), *self._deletions,
                             return_exceptions=True)


async def websocket_endpoint(ws: WebSocket) -> None:
    ctx: AppContext = ws.app.state.ctx
    await ws.accept()
    try:
        owner = ctx.auth.owner_for(
            key_from_headers(ws.headers.get("authorization"), ws.query_params.get("api_key")))
    except ApiError as err:
        await ws.send_text(protocol.error_frame(err))
        await ws.close(code=CLOSE_UNAUTHORIZED, reason=err.message)
        return
    try:
        if ctx.num_connections >= ctx.config.server.max_connections:
            raise ApiError(ErrorCode.TOO_MANY_REQUESTS, "too many open connections "
                           f"(--max-connections: {ctx.config.server.max_connections})")
        slot = ctx.connections_per_key.take(owner)
    except ApiError as err:
        await ws.send_text(protocol.error_frame(err))
        await ws.close(code=CLOSE_TRY_AGAIN, reason=err.message)
        return
    ctx.num_connections += 1
    ctx.metrics.connections.inc()
    try:
        await Connection(ws, ctx, owner).serve()
    finally:
        slot.release()
        ctx.num_connections -= 1
        ctx.metrics.connections.dec()


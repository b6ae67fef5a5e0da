"""Chat turns of persistent sessions: history in, reply out, both committed to the store.

A turn is accepted once its user message is committed; from then on it is never lost. One turn
per session is in flight at a time, so the conversation has a single order.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from contextlib import aclosing
from typing import Any, NamedTuple, TypeVar

from antiphon.engine_ext.engine import EngineRequestError
from antiphon.engine_ext.types import ChatContext, ChatTurn, ToolCall, ToolSpec
from antiphon.server import protocol
from antiphon.server.advisories import Advised, AdvisoryFilter, ArrivalOrder
from antiphon.server.chat import ChatService, Generation
from antiphon.server.errors import ApiError, ErrorCode, unexpected_error
from antiphon.server.kv_eraser import KvEraser
from antiphon.server.metrics import ServerMetrics
from antiphon.server.session_claims import SessionClaims
from antiphon.server.session_fields import clean_title, parse_cursor, session_cursor, title_from
from antiphon.server.tools import ToolStream, reply_message
from antiphon.sessions.store import Message, Session, SessionStore

logger = logging.getLogger(__name__)

Emit = Callable[[str], Awaitable[None]]
T = TypeVar("T")
# Session creates remembered by the client's request id (`SessionTurns.open`): a page re-sends
# its open after a reconnect within seconds; 4,096 covers that many opens in between.
OPENS_REMEMBERED = 4096


async def _through_user_cancel(work: asyncio.Future[T], is_user_cancel: Callable[[], bool],
                               on_user_cancel: Callable[[], None] | None = None) -> T:
    """Wait for `work`, which a user's cancel landing meanwhile does not stop (nor this wait):
    the turn's last steps (the content it held back, its save or withdrawal, its last frame)
    run once, and the client that cancelled gets its `done`; `on_user_cancel` is called for
    each such cancel. Any other cancel (a disconnect, a shutdown) stops the wait, not
    `work`."""
    while True:
        try:
            return await asyncio.shield(work)
        except asyncio.CancelledError:
            if not is_user_cancel():
                raise
            asyncio.current_task().uncancel()  # type: ignore[union-attr]
            if on_user_cancel is not None:
                on_user_cancel()


async def _send_through_user_cancel(sending: Awaitable[None], is_user_cancel: Callable[[], bool],
                                    on_user_cancel: Callable[[], None] | None = None) -> None:
    """Send a turn's last frames through a user's cancel that lands while they wait to be sent
    (a slow reader, another turn's frames ahead of them); any other cancel stops the send."""
    task = asyncio.ensure_future(sending)
    try:
        await _through_user_cancel(task, is_user_cancel, on_user_cancel)
    finally:
        task.cancel()  # (done already, unless the wait was stopped)


async def _emit_final(emit: Emit, frame: str, is_user_cancel: Callable[[], bool]) -> None:
    """Send a turn's last frame (`done`, or its error), through a user's cancel."""
    await _send_through_user_cancel(emit(frame), is_user_cancel)


class SessionTurns:
    def __init__(self, store: SessionStore, chat: ChatService, metrics: ServerMetrics,
                 advisory_ttl_s: float | None = None) -> None:
        """`advisory_ttl_s`: how long the engine keeps an advisory past its expected
        arrival (`--advisory-ttl-s`; None: unknown, no bound on repeats)."""
        self.store = store
        self.chat = chat
        self.metrics = metrics
        self.advisories = AdvisoryFilter(chat.config.typing_interval_s,
                                         chat.config.advisory_repeat_interval_s, advisory_ttl_s)
        self.arrival_order = ArrivalOrder()
        self.claims = SessionClaims(chat.config.session_free_wait_s, chat.check_open)
        self.eraser = KvEraser(store, chat)
        self._deleting: dict[str, asyncio.Event] = {}  # session id -> set once deleted
        # (owner, the client's request id) -> the session that open created, newest last
        self._opened: collections.OrderedDict[tuple[str, str], str] = collections.OrderedDict()

    def turn_began(self, session_id: str) -> None:
        """A turn of `session_id` (or its deletion) claimed it, and is going to the engine:
        it uses up the session's advisory, whether or not it changes the conversation (one
        that commits at its end, or fails: the next is no repeat), and holds back no later
        ordered one. Not a turn refused for what it asks (it changes nothing)."""
        self.advisories.forget(session_id)
        self.arrival_order.arrived(session_id)

    async def open(self, owner: str, session_id: str | None, title: str | None = None,
                   system: str | None = None, request_id: str | None = None
                   ) -> tuple[Session, list[Message]]:
        """Create a session (no id), whose model sees `system` first, or load one of
        `owner`'s. A create named by the client's `request_id` is done once: the same request
        again (sent again after a connection dropped before the answer came) gets the
        session the first made, while it exists (`OPENS_REMEMBERED` at most). Raises
        `session_not_found`, `bad_message` for a system message given for a session that
        exists (its conversation was had under its own) or one the chat template refuses, or
        a title given for one (`session.rename` renames), `too_large` or
        `context_length_exceeded` for one too long."""
        if session_id is not None and system is not None:
            raise ApiError(ErrorCode.BAD_MESSAGE, "a session's system message is set when it "
                           "is created: open a new session for another", param="system")
        if session_id is not None and title is not None:  # (it was dropped without a word)
            raise ApiError(ErrorCode.BAD_MESSAGE, "a title given when a session is opened "
                           "names a new one: session.rename renames this one", param="title")
        if system is not None:
            self.chat.check_content(system, may_be_empty=True, what="the system message",
                                    param="system")
            system = system if system.strip() else None
        if system is not None:
            await self.chat.off_loop(self._check_system, system,  # (a render)
                                     request_class=self.chat.render_class(owner))
        if session_id is None and request_id is not None:
            made = self._opened.get((owner, request_id))
            if made is not None:
                with contextlib.suppress(ApiError):  # (deleted since: a new one)
                    return await self.open(owner, made)
        if session_id is None:
            title = "New chat" if title is None else clean_title(title)
            limit = self.chat.config.max_sessions_per_key
            session = await asyncio.to_thread(self.store.create_session, owner, title, limit,
                                              system)
            if session is None:
                raise ApiError(ErrorCode.TOO_MANY_SESSIONS, (
                    f"this API key has {limit} sessions, the most it may keep "
                    "(--max-sessions-per-key): delete some first"))
            if request_id is not None:
                self._opened[(owner, request_id)] = session.session_id
                while len(self._opened) > OPENS_REMEMBERED:
                    self._opened.popitem(last=False)
            return session, []
        session = await self.get(owner, session_id)
        return session, await asyncio.to_thread(self.store.messages, session_id)

    async def _count_tokens(self, owner: str, contents: Sequence[str]) -> list[int]:
        """The tokens of each of `owner`'s `contents`, counted off the event loop (a 256 KiB
        frame of tool results took 290 ms of it), on its class's render thread."""
        count = self.chat.engine.count_tokens
        return await self.chat.off_loop(lambda: [count(content) for content in contents],
                                        request_class=self.chat.render_class(owner))

    def _check_system(self, system: str) -> None:
        """A system message every turn of a session can use, which is set for good: the
        model's chat template takes it, and it leaves at least half the model's context to
        the conversation. Raises `bad_message` or `context_length_exceeded`."""
        try:
            num_tokens = self._render_lead([ChatTurn("system", system)], ())
        except EngineRequestError as exc:
            raise ApiError(ErrorCode.BAD_MESSAGE, f"the system message cannot be used: {exc}",
                           param="system") from exc
        most = self.chat.engine.max_model_len // 2
        if num_tokens > most:
            raise ApiError(ErrorCode.CONTEXT_LENGTH_EXCEEDED, (
                f"the system message takes {num_tokens} tokens with an empty message; at most "
                f"half the model's context ({most} tokens) may go to it"), param="system")

    def is_replying(self, session_id: str) -> bool:
        """A turn of the session is running (from any connection or API): its last message
        is being answered."""
        return self.claims.is_held(session_id)

    async def list_recent(self, owner: str,
                          before: str | None = None) -> tuple[list[Session], str | None]:
        """`owner`'s most recent sessions (after the `before` cursor, when given), at most
        `max_sessions_listed`, and the cursor of the next page (None: no more)."""
        limit = self.chat.config.max_sessions_listed
        sessions = await asyncio.to_thread(self.store.list_sessions, owner, limit + 1,
                                           None if before is None else parse_cursor(before))
        listed = sessions[:limit]
        return listed, session_cursor(listed[-1]) if len(sessions) > limit else None

    async def get(self, owner: str, session_id: str) -> Session:
        session = await asyncio.to_thread(self.store.get_session, owner, session_id)
        if session is None:
            raise ApiError(ErrorCode.SESSION_NOT_FOUND, f"no session {session_id}")
        return session

    async def rename(self, owner: str, session_id: str, title: str) -> Session:
        """Retitle one of `owner`'s sessions; raises `session_not_found` or `bad_message`."""
        if not await asyncio.to_thread(self.store.rename_session, owner, session_id,
                                       clean_title(title)):
            raise ApiError(ErrorCode.SESSION_NOT_FOUND, f"no session {session_id}")
        return await self.get(owner, session_id)

    async def delete(self, owner: str, session_id: str) -> None:
        """Delete one of `owner`'s sessions with its messages. Refused (`session_busy`, nothing
        changed) while a reply of it is streaming: stop that first."""
        session = await self.get(owner, session_id)  # another's stays "not found"
        # A deletion of it already running (a second click, a client's retry) is waited for:
        # it found the session claimed, and was told to stop a reply there was none of.
        while (deleting := self._deleting.get(session_id)) is not None:
            await deleting.wait()
            session = await self.get(owner, session_id)  # gone now, unless that one failed
        done = self._deleting[session_id] = asyncio.Event()
        try:
            await self.claims.wait_for_ending_turn(session_id)
            if self.claims.is_held(session_id):
                raise ApiError(ErrorCode.SESSION_BUSY, f"session {session_id} is answering a "
                               "message; stop the reply before deleting the session")
            hold = self.claims.claim(session_id)  # no turn starts while the deletion runs
            self.turn_began(session_id)
            try:
                last_prompt = await asyncio.to_thread(self._last_prompt, session)
                if not await asyncio.to_thread(self.store.delete_session, owner, session_id,
                                               last_prompt):
                    raise ApiError(ErrorCode.SESSION_NOT_FOUND, f"no session {session_id}")
            finally:
                self.claims.release(session_id, hold)
        finally:
            del self._deleting[session_id]
            done.set()
        self.eraser.erase_queued()

    def _last_prompt(self, session: Session) -> list[int] | None:
        """The prompt the session's conversation renders to now (that of a turn whose reply
        was never stored, if one is pending), for the erasure of its KV."""
        seen = self._history(session)
        if not seen.history:
            return None
        try:
            return self.chat.engine.continue_chat(seen.turns, seen.context)
        except Exception:  # a delete goes on: the stored contexts are erased all the same
            logger.exception("session %s: its conversation did not render",
                             session.session_id)
            return None

    async def record_advisory(self, owner: str, session_id: str, source: str,
                              expected_arrival_s: float | None = None, *, priority: int = 0,
                              ordered: bool = False) -> Advised:
        """Record that `session_id` is about to send a turn (typing, agent hook, REST) and
        have the engine bring its KV forward, ahead of advisories of lower `priority` (and,
        `ordered`, after the ordered ones `owner` sent before: `ArrivalOrder`), unless it
        repeats the session's last advisory (`AdvisoryFilter`: then it is answered as that
        one was, and neither kept nor sent)."""
        session = await self.get(owner, session_id)
        if source == "typing" and self.advisories.is_typing_repeat(session_id):
            return Advised(None, repeat=True)
        gone = ApiError(ErrorCode.SESSION_NOT_FOUND, f"session {session_id} was deleted")
        revision = await asyncio.to_thread(self.store.revision, session_id)
        if revision is None:
            raise gone
        if ordered:
            expected_arrival_s = self.arrival_order.expected_arrival(owner, session_id,
                                                                     expected_arrival_s)
        repeat = self.advisories.repeat_of(session_id, revision, expected_arrival_s, priority)
        if repeat is not None:
            self.metrics.advisory_repeats.labels(source).inc()
            return repeat
        if not await asyncio.to_thread(self.store.record_advisory, session_id, source,
                                       time.time()):
            raise gone
        self.metrics.advisories.labels(source).inc()
        seen = await asyncio.to_thread(self._history, session)
        context = seen.context
        if context is not None and context.num_messages in (0, len(seen.turns)):
            # The exact tokens the tiers hold: the last exchange of an OpenAI-API client, or
            # a conversation through its last reply. (Rendered again, a conversation held
            # with tools would differ: the next turn's tools are not known yet.)
            tokens = list(context.token_ids)
        elif seen.history:
            tokens = await self.chat.off_loop(self.chat.engine.continue_chat, seen.turns,
                                              context, open_reply=False,
                                              request_class=self.chat.render_class(owner))
        else:
            tokens = []  # a new session: no conversation to bring forward yet
        held = 0 if not tokens else await self.chat.engine.advise(
            session_id, tokens, expected_arrival_s, self.chat.cache_salt(owner), priority)
        deleted = bool(tokens) and await asyncio.to_thread(
            self.store.erase_if_deleted, owner, session_id, [tokens])
        if deleted:
            # deleted meanwhile (from another connection, or REST): its erasure may have
            # run before this advisory reached the engine, whose prefetch brings the KV back
            self.eraser.erase_queued()
            raise gone
        self.advisories.sent(session_id, revision, expected_arrival_s, held, priority)
        return Advised(held)

    async def record_exchange(self, gen: Generation) -> None:
        """Keep a finished chat completion of a session (`/v1/chat/completions` with
        `vllm_xargs.session_id`) as the session's context; the client keeps the messages."""
        session_id = gen.params.session_id
        if session_id is None or not gen.output_token_ids:
            return
        tokens = self.chat.engine.context_tokens(gen.prompt_token_ids, gen.output_token_ids)
        if gen.tool_use is not None and gen.tool_use.read(
                gen.text, ended=gen.finish_reason == "stop")[1]:
            # The next request writes the calls back its own way (`tool_calls`, rendered
            # again), never as the tokens generated: its prompt extends this one's alone.
            tokens = tuple(gen.prompt_token_ids)
        await asyncio.to_thread(self.store.set_context, session_id, tokens)

    async def accept(self, owner: str, msg: protocol.TurnRequest, request_id: str) -> Generation:
        """Validate a turn, commit its user message and mark the session busy. A `regenerate`
        commits nothing here: its reply replaces the session's last one when it is committed.

        Raises `ApiError` (nothing changed) when the session is unknown or busy, or the message
        breaks a limit. The caller must follow up with `run`, which clears the busy mark.
        """
        if isinstance(msg, protocol.ChatMessage):
            self.chat.check_content(msg.content)
        elif isinstance(msg, protocol.ToolResults):
            for result in msg.results:
                self.chat.check_content(result.content, may_be_empty=True)
        self.chat.check_tools(len(msg.tools or ()))
        await self.get(owner, msg.session_id)  # (before the claim: not another's, busy)
        hold = await self.claims.claim_soon(msg.session_id)
        try:
            # Read again once claimed: a deletion from another connection may have run while
            # this turn waited for the session (the claim keeps it from running now).
            session = await self.get(owner, msg.session_id)
            seen = await asyncio.to_thread(self._history, session)
            turns, start = seen.turns, seen.start
            calls = unanswered_calls(seen.history)
            replaces_reply = False
            if isinstance(msg, protocol.ChatMessage):
                if calls:
                    raise ApiError(ErrorCode.BAD_MESSAGE, f"the session's last reply called "
                                   f"{len(calls)} tool(s): send their results (tool_results) "
                                   "first, or regenerate the reply")
                turns.append(ChatTurn("user", msg.content))
            elif isinstance(msg, protocol.ToolResults):
                check_results(msg.results, calls)
                turns += [ChatTurn("tool", r.content, tool_call_id=r.tool_call_id)
                          for r in msg.results]
            elif turns and turns[-1].role == "assistant":
                turns.pop()  # its stored context, which covers it, no longer applies
                replaces_reply = True
            if len(turns) == seen.lead:
                raise ApiError(ErrorCode.BAD_MESSAGE, f"session {msg.session_id} has no "
                               "message to answer again")
            self._check_room(session, len(turns) - seen.lead - len(seen.history) + 1)
            gen, cut = await self.chat.off_loop(self._prepare_in_window, owner, msg,
                                                request_id, turns, seen.lead, seen.context,
                                                request_class=self.chat.render_class(owner))
            gen.tool_use = msg.tool_use()
            gen.context_start = start + cut
            gen.replaces_reply = replaces_reply
            gen.session_claim = hold
            window = start + cut if cut else None
            if cut:
                logger.info("session %s outgrew the model's context: the model sees it from "
                            "message %d on", msg.session_id, start + cut)
            title = None  # (a session's first message names it)
            messages: list[tuple[str, int, str | None]] | None = None
            if isinstance(msg, protocol.ToolResults):
                counts = await self._count_tokens(owner, [r.content for r in msg.results])
                role, messages = "tool", [(r.content, n, r.tool_call_id)
                                          for r, n in zip(msg.results, counts, strict=True)]
            elif isinstance(msg, protocol.ChatMessage):
                (num_tokens,) = await self._count_tokens(owner, [msg.content])
                role, messages = "user", [(msg.content, num_tokens, None)]
                title = None if seen.history else title_from(msg.content) or None
            else:  # a regenerate adds no message: the window moves with its reply, if the
                # engine takes the turn and it has one (a refused turn changes nothing, and
                # one stopped before its first token keeps the old reply and window)
                gen.window_moves_to = window
                gen.context_start = start  # (until the reply is committed)
            if messages is not None:
                gen.committed_undo = await asyncio.to_thread(
                    self.store.add_turn_messages, msg.session_id, role, messages, title,
                    window)
                gen.committed = (role, tuple(content for content, _, _ in messages))
        except BaseException:
            self.claims.release(msg.session_id, hold)
            raise
        self.turn_began(msg.session_id)
        return gen

    async def run(self, session_id: str, gen: Generation, emit: Emit,
                  is_user_cancel: Callable[[], bool],
                  finished: Callable[[], None] | None = None) -> None:
        """Stream an accepted turn to `emit`, then commit the reply and emit `done`.

        A cancel (the task is cancelled and `is_user_cancel()` is true) commits the partial
        reply and emits `done` with finish_reason "cancelled"; a disconnect commits it too.
        The session is free again, and `finished` called, before the last frame goes out: a
        client that sends its next turn the moment it reads `done` finds the session free.
        """
        self.claims.held_by_this_task(session_id, gen.session_claim)
        with self.chat.live(gen):  # a shutdown waits for the `done` frame, not only the tokens
            await self._run(session_id, gen, emit, is_user_cancel, finished)

    async def _run(self, session_id: str, gen: Generation, emit: Emit,
                   is_user_cancel: Callable[[], bool],
                   finished: Callable[[], None] | None) -> None:
        rid = gen.request_id
        # the reply's save, or the refused turn's withdrawal of its message, once begun: it
        # runs to its end whatever cancels land meanwhile, and holds the session until then
        store_work: asyncio.Future[Any] | None = None
        settled = False

        def settle() -> None:  # the turn's work is over (safe to call twice)
            nonlocal settled
            settled = True
            self.claims.release(session_id, gen.session_claim)
            if finished is not None:
                finished()

        def cut_short() -> None:  # a user's cancel: a turn asking for the session waits
            self.claims.mark_ending(gen.session_claim)
        # A reply that may call tools streams its content alone; the calls come with `done`.
        calls = None if gen.tool_use is None else ToolStream(gen.tool_use)

        async def send_tokens(texts: Sequence[str]) -> None:
            for text in texts:
                await emit(protocol.encode("token", request_id=rid, session_id=session_id,
                                           text=text))
        emitting = False  # a send fails when the client left: not the engine's failure
        try:
            try:
                async with aclosing(self.chat.stream(gen, api="ws")) as pieces:
                    async for text in pieces:
                        emitting = True
                        await send_tokens([text] if calls is None else
                                          _contents(calls.feed(text)))
                        emitting = False
            except asyncio.CancelledError:
                cut_short()  # what it has is kept below
                if not is_user_cancel():
                    raise
                asyncio.current_task().uncancel()  # type: ignore[union-attr]
            except Exception as exc:  # the engine refused or failed the turn
                if emitting:
                    raise  # the client left: what it saw is kept below
                err = exc if isinstance(exc, ApiError) else unexpected_error(
                    exc, f"session {session_id}: answering {rid}",
                    "the message was kept (regenerate asks for its reply again)")
                store_work = asyncio.ensure_future(self._withdraw_refused(session_id, gen, err))
                if await _through_user_cancel(store_work, is_user_cancel, cut_short):
                    err = ApiError(err.code, f"{err.message} (the message was not kept)")
                elif err.code == ErrorCode.BAD_MESSAGE and gen.committed is not None:
                    # refused once its reply had begun: the message stays, which
                    # `bad_message` would deny (a client takes it back and sends it again,
                    # and the session holds it twice)
                    err = ApiError(ErrorCode.ENGINE_ERROR, f"{err.message} (the message was "
                                   "kept: regenerate asks for its reply again)")
                settle()
                self.metrics.errors.labels(err.code.value).inc()  # (as a REST request's)
                await _emit_final(emit, protocol.error_frame(err, rid), is_user_cancel)
                return
            if calls is not None:  # what it held back, while it might have been calls (a
                # reply cut short drops it: the session keeps what the client was given)
                await _send_through_user_cancel(send_tokens(_contents(calls.finish(
                    gen.finish_reason, cut=gen.finish_reason == "cancelled")[0])),
                    is_user_cancel, cut_short)
            reply = _reply(gen, calls)
            try:
                if _replaces(gen, reply):
                    # a regenerate stopped before the client had any of it keeps the old (one
                    # that ended with no text is its new reply). Shielded: a disconnect while
                    # it runs must not save the reply a second time below.
                    # A cancel of a reply already whole: it is saved, and `done` says so.
                    store_work = asyncio.ensure_future(
                        self._commit_reply(session_id, gen, reply))
                    await _through_user_cancel(store_work, is_user_cancel, cut_short)
            except Exception as exc:  # the store failed (a full disk): say so, do not hang
                settle()
                failure = unexpected_error(exc, f"session {session_id}: saving the reply to "
                                           f"{rid}", "the reply was not saved (regenerate asks "
                                           "for it again)")
                self.metrics.errors.labels(failure.code.value).inc()
                await _emit_final(emit, protocol.error_frame(failure, rid), is_user_cancel)
                return
            settle()
            content, tool_calls, finish_reason = reply
            await _emit_final(emit, protocol.encode(
                "done", request_id=rid, session_id=session_id, finish_reason=finish_reason,
                text=content, usage=gen.usage(), timings=gen.timings(),
                context_start=gen.context_start,
                **({} if tool_calls is None else {"tool_calls": tool_calls})), is_user_cancel)
        except BaseException:
            # Disconnected or shut down mid-reply: keep what the user already saw.
            if store_work is None and gen.pieces and not settled:  # (no save begun: none
                # was due unless the reply has pieces; once settled, the session may hold a
                # later turn's messages)
                gen.finish_reason = gen.finish_reason or "cancelled"
                reply = _reply(gen, calls)
                if _replaces(gen, reply):
                    store_work = asyncio.ensure_future(
                        self._commit_reply(session_id, gen, reply))
            if store_work is not None:  # done, or being done: let it end, whatever cancels
                try:  # land meanwhile (the session is let go after it, below)
                    while not store_work.done():
                        with contextlib.suppress(asyncio.CancelledError):
                            await asyncio.shield(store_work)
                    store_work.result()
                except Exception:
                    logger.exception("session %s: saving the reply to %s failed", session_id,
                                     rid)
            raise
        finally:
            settle()

    async def _withdraw_refused(self, session_id: str, gen: Generation, err: ApiError) -> bool:
        """A turn the engine refused before its first token (`bad_message`: its request is
        invalid, say a schema the grammar backend cannot compile) takes back the messages it
        committed, so that bad input changes nothing; True when it did. A turn the engine
        failed keeps them, for a regenerate to answer."""
        if err.code != ErrorCode.BAD_MESSAGE or gen.pieces or gen.output_token_ids:
            return False
        return await self.take_back(session_id, gen)

    async def take_back(self, session_id: str, gen: Generation) -> bool:
        """Withdraw the messages `accept` committed for `gen` (and the title they gave the
        session), while the session is still claimed for it: a turn refused, or whose client
        never heard it was accepted. True when they were withdrawn; a store that fails keeps
        them (logged), as for a failed turn."""
        if gen.committed is None:
            return False
        try:
            return await asyncio.to_thread(self.store.withdraw_messages, session_id,
                                           *gen.committed, gen.committed_undo)
        except Exception:
            logger.exception("session %s: withdrawing the message of turn %s failed",
                             session_id, gen.request_id)
            return False

    def _prepare_in_window(self, owner: str, msg: protocol.TurnRequest, request_id: str,
                           turns: list[ChatTurn], lead: int, context: ChatContext | None,
                           ) -> tuple[Generation, int]:
        """The turn's generation, and how many of the first messages after `turns[:lead]`
        (the system message, which the model always sees) it had to leave out of the model's
        view: none while the reply gets the room it asks for (`max_tokens`, or the server's
        default), else the fewest whose removal (at a user message) leaves the rest within
        `context_refill_frac` of the model's context. Raises `context_length_exceeded` when
        the new message alone leaves no room."""
        tools = msg.tool_specs()

        def prepare(window: list[ChatTurn], ctx: ChatContext | None) -> Generation:
            return self.chat.prepare(request_id, window, msg.max_tokens,
                                     session_id=msg.session_id, context=ctx, owner=owner,
                                     tools=tools, **msg.sampling())

        max_model_len, frac = self.chat.engine.max_model_len, self.chat.config.context_refill_frac
        asked = msg.max_tokens or self.chat.config.reply_max_tokens
        starts = [i for i in range(lead + 1, len(turns)) if turns[i].role == "user"]
        gen = None
        try:
            gen = prepare(turns, context)
            if gen.params.max_tokens >= asked or not starts:  # or nothing to leave out
                return gen, 0
        except ApiError as err:
            if err.code != ErrorCode.CONTEXT_LENGTH_EXCEEDED or not starts:
                raise
        # The system message (and the tools the template writes into it) stays at every cut:
        # the budgets are shares of what it leaves (counted in them, a large one left a cut
        # the newest message alone, and every other turn cut again).
        lead_tokens = self._lead_tokens(turns[:lead], tools)
        room = max_model_len - lead_tokens
        # A reply short of its room cuts only when it has less than half what a cut leaves
        # free: the conversation then grows by the other half before the next cut, instead of
        # every turn cutting (and recomputing) again.
        if gen is not None and gen.params.max_tokens >= min(asked, int(room * (1 - frac) / 2)):
            return gen, 0
        budget = lead_tokens + room * frac
        needed = max(msg.max_tokens or 0, msg.min_tokens or 0)
        if needed:  # a reply that asks for more room than the refill leaves gets it
            budget = min(budget, max_model_len - needed)
        lo, hi = 0, len(starts) - 1  # the last start, the new message alone, always counts
        while lo < hi:  # the first start whose window fits the budget
            mid = (lo + hi) // 2
            window = [*turns[:lead], *turns[starts[mid]:]]
            if len(self.chat.engine.render_chat(window, tools=tools)) <= budget:
                hi = mid
            else:
                lo = mid + 1
        return prepare([*turns[:lead], *turns[starts[lo]:]], None), starts[lo] - lead

    def _lead_tokens(self, lead: list[ChatTurn], tools: Sequence[ToolSpec]) -> int:
        """About the tokens the system message (and the tools a template writes into it)
        take: rendered with an empty user message, as some templates (Qwen3's, Llama 3.1's
        with tools) refuse a conversation with no user message; 0 without one, or where the
        template refuses it even so."""
        if not lead:
            return 0
        try:
            return self._render_lead(lead, tools)
        except EngineRequestError:
            return 0

    def _check_room(self, session: Session, adding: int) -> None:
        """Refuse (`session_full`) a turn that would take the session past
        `max_session_messages` with its messages and reply, `adding` in all (a regenerate's
        reply replaces one)."""
        limit = self.chat.config.max_session_messages
        if session.num_messages + adding > limit:
            raise ApiError(ErrorCode.SESSION_FULL, (
                f"session {session.session_id} holds {session.num_messages} messages and may "
                f"keep {limit} (--max-session-messages): go on in a new session"))

    def _render_lead(self, lead: list[ChatTurn], tools: Sequence[ToolSpec]) -> int:
        """The tokens of `lead` (the system message) with an empty user message after it;
        raises `EngineRequestError` where the chat template refuses it."""
        return len(self.chat.engine.render_chat([*lead, ChatTurn("user", "")],
                                                open_reply=False, tools=tools))

    def _history(self, session: Session) -> Seen:
        """What the model sees of the session's conversation (its system message, set at
        creation, as `session` has it)."""
        session_id = session.session_id
        start = self.store.window_start(session_id)
        history = self.store.messages(session_id, start)
        lead = [] if session.system is None else [ChatTurn("system", session.system)]
        turns = [*lead, *(_turn(m) for m in history)]
        stored = self.store.context(session_id)
        if stored is None or (stored[0] and stored[0] <= start):
            return Seen(history, turns, len(lead), None, start)
        num_messages, token_ids = stored
        context = ChatContext(num_messages - start + len(lead) if num_messages else 0, token_ids)
        return Seen(history, turns, len(lead), context, start)

    async def _commit_reply(self, session_id: str, gen: Generation, reply: Reply) -> None:
        content, tool_calls, finish_reason = reply
        context = self.chat.engine.context_tokens(gen.prompt_token_ids, gen.output_token_ids)
        await asyncio.to_thread(self.store.append_message, session_id, "assistant", content,
                                gen.num_output_tokens, finish_reason, context,
                                replaces_reply=gen.replaces_reply, tool_calls=tool_calls,
                                window=gen.window_moves_to)
        if gen.window_moves_to is not None:
            gen.context_start = gen.window_moves_to  # (what `done` reports)


class Seen(NamedTuple):
    """What the model sees of a session's conversation (`SessionTurns._history`)."""

    history: list[Message]  # its messages from the first the model sees
    turns: list[ChatTurn]  # the system message (if it has one), then `history`
    lead: int  # turns before `history`: 1 with a system message, else 0
    context: ChatContext | None  # the exact tokens through the last reply, over `turns`
    start: int  # the index of `history[0]` among the session's messages


# A reply as the session keeps it: its content, its calls of tools (None: it made none), and
# its finish reason.
Reply = tuple[str, list[dict[str, Any]] | None, str | None]


def _reply(gen: Generation, given: ToolStream | None = None) -> Reply:
    """`gen`'s reply as the session keeps it; one cut short (cancelled) that may call tools:
    what `given` gave the client, not a `<tool_call>` block it left open."""
    if gen.tool_use is None:
        return gen.text, None, gen.finish_reason
    if (given is not None and gen.finish_reason == "cancelled"
            and gen.tool_use.mode != "function"):
        return "".join(given.content), given.calls or None, gen.finish_reason
    message, finish_reason = reply_message(gen.text, gen.finish_reason, gen.tool_use)
    return message["content"] or "", message.get("tool_calls"), finish_reason


def _replaces(gen: Generation, reply: Reply) -> bool:
    """Whether `gen`'s `reply` is to be kept: not when a regenerate was cut short before the
    client had any of it (what the model wrote may be held back: a `<tool_call>` block not
    closed yet, which a cut reply drops), as the old reply is still what the user sees."""
    content, tool_calls, _ = reply
    return not gen.replaces_reply or gen.finish_reason != "cancelled" or bool(
        content or tool_calls)


def _contents(deltas: Sequence[dict[str, Any]]) -> list[str]:
    """The content pieces of `ToolStream` deltas (their calls come with `done`)."""
    return [d["content"] for d in deltas if d.get("content")]


def _turn(m: Message) -> ChatTurn:
    """A stored message as the chat template sees it."""
    calls = tuple(ToolCall(c["id"], c["function"]["name"], c["function"]["arguments"])
                  for c in m.tool_calls or ())
    return ChatTurn(m.role, m.content, calls, m.tool_call_id)


def unanswered_calls(history: Sequence[Message]) -> list[str]:
    """The ids of the calls of tools the conversation's last reply made, if it is the last
    message (none answered yet)."""
    last = history[-1] if history else None
    if last is None or last.role != "assistant" or not last.tool_calls:
        return []
    return [call["id"] for call in last.tool_calls]


def check_results(results: Sequence[protocol.ToolResult], calls: Sequence[str]) -> None:
    """Raises `bad_message` unless `results` answer each of `calls` once."""
    if not calls:
        raise ApiError(ErrorCode.BAD_MESSAGE, "the session's last reply called no tools: "
                       "there is nothing for tool_results to answer")
    given = [r.tool_call_id for r in results]
    if sorted(given) != sorted(calls):
        shown = ", ".join(repr(c) for c in calls[:8])
        raise ApiError(ErrorCode.BAD_MESSAGE, f"tool_results must answer each call of the "
                       f"last reply once: {shown}{' ...' if len(calls) > 8 else ''}")

"""One turn (or deletion) per session at a time: the claims that keep a conversation in one order.

A claim's hold is a token of the server's, never a client's request id, so that no other
request can let go of it. A turn being cut short (cancelled, or its client gone) still holds its
session while it keeps what it has; a turn or deletion that asks for the session meanwhile waits
for it to let go (`claim_soon`), at most `free_wait_s`, before it is refused `session_busy`.
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import time
from collections.abc import Callable
from typing import Any

from antiphon.server.errors import ApiError, ErrorCode


class SessionClaims:
    def __init__(self, free_wait_s: float, check_open: Callable[[], None]) -> None:
        """`free_wait_s`: how long `claim_soon` waits for a turn being cut short
        (`--session-free-wait-s`); `check_open` raises once a shutdown began."""
        self.free_wait_s = free_wait_s
        self._check_open = check_open
        self._busy: dict[str, str] = {}  # session id -> the hold of the turn using it
        # holds of turns being cut short, the task running each turn, and what `claim_soon`
        # waits on: set when the hold is let go
        self._ending: set[str] = set()
        self._holder_tasks: dict[str, asyncio.Task[Any]] = {}
        self._let_go: dict[str, asyncio.Event] = {}

    def is_held(self, session_id: str) -> bool:
        """A turn (or deletion) of the session is running, from any connection or API."""
        return session_id in self._busy

    def claim(self, session_id: str) -> str:
        """Mark `session_id` busy; returns the hold that `release` takes. Raises
        `session_busy` if it is busy already."""
        if session_id in self._busy:
            raise ApiError(ErrorCode.SESSION_BUSY, f"session {session_id} is busy (answering "
                           "a message, or being deleted)")
        hold = self._busy[session_id] = "hold_" + secrets.token_urlsafe(12)
        return hold

    async def claim_soon(self, session_id: str) -> str:
        """`claim`, once a turn of the session being cut short has kept what it has and let
        go, waiting at most `free_wait_s` for it."""
        await self.wait_for_ending_turn(session_id)
        self._check_open()  # (a shutdown may have begun meanwhile)
        return self.claim(session_id)

    async def wait_for_ending_turn(self, session_id: str) -> None:
        """Wait, at most `free_wait_s`, while a turn being cut short holds the session."""
        deadline = time.monotonic() + self.free_wait_s
        while (hold := self._busy.get(session_id)) is not None and self._is_ending(hold):
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return
            let_go = self._let_go.setdefault(hold, asyncio.Event())
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(let_go.wait(), remaining)

    def _is_ending(self, hold: str) -> bool:
        """The turn holding `hold` is being cut short: marked so, or its task is being
        cancelled (at once, before the task has run to where it marks itself)."""
        task = self._holder_tasks.get(hold)
        return hold in self._ending or (task is not None and task.cancelling() > 0)

    def release(self, session_id: str, hold: str | None) -> None:
        """Clear `claim`'s mark, if `hold` still holds it (safe to call twice)."""
        if hold is not None and self._busy.get(session_id) == hold:
            del self._busy[session_id]
        if hold is not None:
            self._ending.discard(hold)
            self._holder_tasks.pop(hold, None)
            let_go = self._let_go.pop(hold, None)
            if let_go is not None:
                let_go.set()

    def mark_ending(self, hold: str | None) -> None:
        """The turn holding `hold` is being cut short: a turn or deletion that asks for its
        session waits for it to let go (`claim_soon`)."""
        if hold is not None and hold in self._busy.values():
            self._ending.add(hold)

    def held_by_this_task(self, session_id: str, hold: str | None) -> None:
        """The current task runs the turn holding `session_id` with `hold`: a turn or deletion
        that asks for the session while this task is being cancelled waits for it to let go
        (`claim_soon`)."""
        task = asyncio.current_task()
        if hold is not None and task is not None and self._busy.get(session_id) == hold:
            self._holder_tasks[hold] = task

"""The KV of deleted sessions (and live sessions' oldest chains) erased from the engine's tiers,
in the background, from the queue the session store keeps across restarts."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

from antiphon.server.chat import ChatService
from antiphon.sessions.store import SessionStore

logger = logging.getLogger(__name__)


class KvEraser:
    # A failed erasure is tried again after `kv_erasure_retry_s`, doubled after each failure
    # up to this many times it; meanwhile passes skip it and go on with the rest of the queue.
    MAX_RETRY_FACTOR = 64
    # Failures in one pass that end it: the engine, not one erasure, is failing them (down, or
    # its SSD tier's file not open), and each of the queue's would fail alike.
    MAX_FAILURES_A_PASS = 3

    def __init__(self, store: SessionStore, chat: ChatService) -> None:
        self.store = store
        self.chat = chat
        self._task: asyncio.Task[None] | None = None
        self._wanted = False  # an erasure was queued since the task read the queue
        self._retry_factor = 1  # times kv_erasure_retry_s until the next try of a failed one
        self._not_before: dict[int, float] = {}  # failed erasure id -> when to try it again
        self._paused_until = 0.0  # a pass that failed MAX_FAILURES_A_PASS: none before it
        self._retry: asyncio.TimerHandle | None = None

    def start(self) -> None:
        """Erase what the store has queued (from before a restart, if any is left), and from
        now on what it queues as sessions run (their chains past `kv_chains_kept`)."""
        loop = asyncio.get_running_loop()

        def queued() -> None:  # in the thread that wrote
            loop.call_soon_threadsafe(self.erase_queued)
        self.store.on_erasure_queued = queued
        self.erase_queued()

    def erase_queued(self) -> None:
        """Have the engine erase the KV the store has queued from its tiers, in the
        background: that of deleted sessions, and live sessions' oldest chains."""
        self._wanted = True  # a running task reads the queue again before it ends
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._erase())

    async def stop(self) -> None:
        """Stop erasing; what is left stays queued, for the next start."""
        self.store.on_erasure_queued = None
        if self._retry is not None:
            self._retry.cancel()
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def _erase(self) -> None:
        failed = False
        while self._wanted and time.monotonic() >= self._paused_until:
            self._wanted = False
            failures = 0
            pending = await asyncio.to_thread(self.store.pending_erasures)
            for gone in self._not_before.keys() - {row[0] for row in pending}:
                del self._not_before[gone]  # (no longer queued)
            for erasure_id, session_id, owner, chains in pending:
                if self._not_before.get(erasure_id, 0.0) > time.monotonic():
                    continue  # failed: its retry comes
                # A live session's old chains spare what it still runs (None: deleted).
                keep = await asyncio.to_thread(self.store.kept_chains, session_id)
                try:
                    erased = await self.chat.engine.forget(
                        session_id, chains, self.chat.cache_salt(owner), keep=keep)
                except Exception as exc:  # the engine is down, or the KV may not all be off
                    # the disk: the erasure stays queued, tried again later (or at the next
                    # start); the rest of the queue goes on
                    logger.warning("session %s: its KV could not be erased yet (kept queued): "
                                   "%s", session_id, exc)
                    failed = True
                    failures += 1
                    self._not_before[erasure_id] = time.monotonic() + self._retry_delay_s()
                    if failures >= self.MAX_FAILURES_A_PASS:
                        self._paused_until = self._not_before[erasure_id]
                        break
                    continue
                self._not_before.pop(erasure_id, None)
                logger.info("session %s %s: %d chunk-layers of its KV erased", session_id,
                            "deleted" if keep is None else "ran on past its kept chains",
                            erased or 0)
                await asyncio.to_thread(self.store.finish_erasure, erasure_id)
        if failed:
            self._retry_factor = min(2 * self._retry_factor, self.MAX_RETRY_FACTOR)
            self._retry_later()
        elif not self._not_before:
            self._retry_factor = 1

    def _retry_delay_s(self) -> float:
        return self.chat.config.kv_erasure_retry_s * self._retry_factor

    def _retry_later(self) -> None:
        """A pass at the first time a failed erasure may be tried again."""
        if self._retry is not None:
            self._retry.cancel()
        due = max(min(self._not_before.values(), default=0.0), self._paused_until)
        self._retry = asyncio.get_running_loop().call_later(
            max(0.0, due - time.monotonic()), self.erase_queued)

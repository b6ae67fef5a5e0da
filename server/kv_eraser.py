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
    # Failures in one pass, of erasures not failed before, that end it: the engine, not one
    # erasure, is failing them (down, or its SSD tier's file not open), and each of the
    # queue's would fail alike. (Failed ones tried again do not count: three that keep
    # failing at the head of the queue held back every erasure behind them.)
    MAX_FAILURES_A_PASS = 3

    def __init__(self, store: SessionStore, chat: ChatService) -> None:
        self.store = store
        self.chat = chat
        self._task: asyncio.Task[None] | None = None
        self._wanted = False  # an erasure was queued since the task read the queue
        # failed erasure id -> (when to try it again, times kv_erasure_retry_s it waited)
        self._retries: dict[int, tuple[float, int]] = {}
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
        while self._wanted and time.monotonic() >= self._paused_until:
            self._wanted = False
            failures = 0
            pending = await asyncio.to_thread(self.store.pending_erasures)
            for gone in self._retries.keys() - {row[0] for row in pending}:
                del self._retries[gone]  # (no longer queued)
            for erasure_id, session_id, owner, chains in pending:
                due, factor = self._retries.get(erasure_id, (0.0, 0))
                if due > time.monotonic():
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
                    factor = min(2 * factor, self.MAX_RETRY_FACTOR) if factor else 1
                    due = time.monotonic() + self.chat.config.kv_erasure_retry_s * factor
                    failures += erasure_id not in self._retries
                    self._retries[erasure_id] = (due, factor)
                    if failures >= self.MAX_FAILURES_A_PASS:
                        self._paused_until = due
                        break
                    continue
                self._retries.pop(erasure_id, None)
                logger.info("session %s %s: %d chunk-layers of its KV erased", session_id,
                            "deleted" if keep is None else "ran on past its kept chains",
                            erased or 0)
                await asyncio.to_thread(self.store.finish_erasure, erasure_id)
        if self._retries:  # (also those this pass skipped: the timer that woke it is gone)
            self._retry_later()

    def _retry_later(self) -> None:
        """A pass at the first time a failed erasure may be tried again."""
        if self._retry is not None:
            self._retry.cancel()
        due = max(min(due for due, _ in self._retries.values()), self._paused_until)
        self._retry = asyncio.get_running_loop().call_later(
            max(0.0, due - time.monotonic()), self.erase_queued)

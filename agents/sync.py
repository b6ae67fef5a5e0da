"""Blocking client: `Antiphon` runs an `AsyncAntiphon` on an event loop in a thread of its own.

    with Antiphon("http://127.0.0.1:8000") as client:
        sid = client.create_session().session_id
        print(client.chat(sid, "Hello!").text)

Every coroutine method of `AsyncAntiphon` is available with the same arguments, blocking.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import threading
import weakref
from typing import Any

from antiphon.agents.client import AsyncAntiphon
from antiphon.agents.errors import ConnectionLostError

CANCEL_WAIT_S = 5.0  # an interrupted call's wait for its cancel to reach the server


class Antiphon:
    _is_closing = False

    def __init__(self, base_url: str = "http://127.0.0.1:8000", api_key: str | None = None,
                 **options: Any) -> None:
        self._lock = threading.Lock()  # orders calls against `close` (`_is_closing`)
        self._waiting: set[threading.Event] = set()  # the calls' wake-ups, set at close too
        self._closed = threading.Event()
        self._loop = asyncio.new_event_loop()
        dropped = threading.Event()  # set once dropped unclosed (`_close_dropped`)
        self._thread = threading.Thread(target=_serve, args=(self._loop, dropped),
                                        name="antiphon-client", daemon=True)
        self._thread.start()
        try:
            self.aio: AsyncAntiphon = self._run(self._make(base_url, api_key, options))
        except BaseException:  # bad options: leave no thread behind
            self._stop_loop()
            raise
        # Dropped without `close`, its thread, loop and connections stayed for good.
        self._finalizer = weakref.finalize(self, _close_dropped, self._loop, self.aio, dropped)

    @staticmethod
    async def _make(base_url: str, api_key: str | None, options: dict[str, Any]
                    ) -> AsyncAntiphon:
        return AsyncAntiphon(base_url, api_key, **options)  # created on the client's loop

    def _run(self, coro: Any, *, closing: bool = False) -> Any:
        """Run `coro` on the client's loop and wait for it. Interrupted (Ctrl-C), it cancels
        the call there, and waits a moment for it to stop its turn on the server. A call
        that `close` (another thread's) stops, or that starts once it has begun, raises
        `ConnectionLostError` (it waited for ever on the loop stopped under it)."""
        if threading.current_thread() is self._thread:
            coro.close()
            raise RuntimeError("a blocking Antiphon call from a callback (on_token runs on "
                               "the client's own thread, which the call would wait for): "
                               "use the callback to record what to do, and do it after")

        async def start() -> asyncio.Task[Any]:
            return asyncio.ensure_future(coro)

        finished = threading.Event()
        with self._lock:  # (queued ahead of `close`'s stop of the loop, or refused)
            if self._loop.is_closed() or (self._is_closing and not closing):
                coro.close()
                raise ConnectionLostError("the client is closed")
            started = asyncio.run_coroutine_threadsafe(start(), self._loop)
            self._waiting.add(finished)
        try:
            task = started.result()
            try:
                self._loop.call_soon_threadsafe(task.add_done_callback,
                                                lambda _t: finished.set())
            except RuntimeError:  # the loop closed meanwhile
                finished.set()
            try:
                finished.wait()
            except BaseException:
                with contextlib.suppress(RuntimeError):
                    self._loop.call_soon_threadsafe(task.cancel)
                finished.wait(timeout=CANCEL_WAIT_S)
                raise
        finally:
            with self._lock:
                self._waiting.discard(finished)
        if not task.done() or (task.cancelled() and self._is_closing):
            raise ConnectionLostError("the client was closed during the call")
        return task.result()

    def __getattr__(self, name: str) -> Any:
        try:
            if name == "aio":  # (not made: the start failed)
                raise AttributeError(name)
            method = getattr(self.aio, name)
        except AttributeError:
            raise AttributeError(f"{type(self).__name__!r} object has no attribute "
                                 f"{name!r}", name=name, obj=self) from None
        if not asyncio.iscoroutinefunction(method):
            return method

        @functools.wraps(method)
        def blocking(*args: Any, **kwargs: Any) -> Any:
            return self._run(method(*args, **kwargs))
        return blocking

    def close(self) -> None:
        """Close the client; calls other threads are making end with `ConnectionLostError`.
        Safe to call twice, and from two threads (the second waits for the first)."""
        if threading.current_thread() is self._thread:  # (it would wait for itself)
            raise RuntimeError("Antiphon.close from a callback (on_token runs on the "
                               "client's own thread): close it after the call")
        with self._lock:
            first = not self._is_closing
            self._is_closing = True
        self._finalizer.detach()
        if not first:
            self._closed.wait(timeout=2 * CANCEL_WAIT_S + 10)
            return
        try:
            self._run(self.aio.close(), closing=True)
        finally:
            self._stop_loop()

    def _stop_loop(self) -> None:
        """Stop the loop, its calls still running (other threads') cancelled first: stopped
        under them, their threads waited for good."""
        with self._lock:
            self._is_closing = True

        async def cancel_the_rest() -> None:
            tasks = asyncio.all_tasks() - {asyncio.current_task()}
            for task in tasks:
                task.cancel()
            if tasks:
                await asyncio.wait(tasks, timeout=CANCEL_WAIT_S)

        if self._thread.is_alive():
            with contextlib.suppress(Exception):
                asyncio.run_coroutine_threadsafe(cancel_the_rest(), self._loop).result(
                    CANCEL_WAIT_S + 1)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)
        with self._lock:
            self._loop.close()
            for finished in self._waiting:  # calls whose end the stopped loop never told
                finished.set()
        self._closed.set()

    def __enter__(self) -> Antiphon:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()


def _serve(loop: asyncio.AbstractEventLoop, dropped: threading.Event) -> None:
    """The client's thread: its loop, until stopped (by `close`, which then closes it, or
    once the client was dropped unclosed: then closed here)."""
    loop.run_forever()
    if dropped.is_set():
        loop.close()


def _close_dropped(loop: asyncio.AbstractEventLoop, aio: AsyncAntiphon,
                   dropped: threading.Event) -> None:
    """Close the connections of a client dropped without `close`, then stop its thread."""
    async def close() -> None:
        with contextlib.suppress(Exception):
            await aio.close()
        dropped.set()
        loop.stop()

    with contextlib.suppress(RuntimeError):  # (its loop closed already)
        asyncio.run_coroutine_threadsafe(close(), loop)

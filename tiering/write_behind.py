"""Write-behind: a bounded FIFO of write jobs run in order by one background thread.

`submit` returns at once while fewer than `max_pending` jobs wait, and blocks otherwise: a
disk that falls behind slows its producers instead of growing memory without bound.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future

Job = Callable[[], bool]

log = logging.getLogger(__name__)


class WriteBehind:
    """One writer thread; jobs run in submission order, each resolving its future."""

    def __init__(self, name: str, max_pending: int, nice: int = 0) -> None:
        """`nice`: the writer thread's Linux nice value (0: the process's, unchanged), so
        that on a busy machine it runs on cores nothing more urgent wants."""
        if max_pending < 1:
            raise ValueError(f"max_pending must be at least 1, got {max_pending}")
        self.nice = nice
        self.max_pending = max_pending  # jobs queued and not yet started
        self._queue: queue.Queue[tuple[Job, Future[bool]] | None] = queue.Queue(max_pending)
        self._closed = False
        self._close_lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name=f"{name}-writer", daemon=True)
        self._thread.start()

    @property
    def num_pending(self) -> int:
        """Jobs submitted and not yet finished (approximate while the writer runs)."""
        return self._queue.unfinished_tasks

    def submit(self, job: Job, future: Future[bool] | None = None) -> Future[bool]:
        """Queue `job`, whose result resolves `future` (a new one if None); blocks while
        `max_pending` jobs are queued. RuntimeError once closed."""
        future = Future() if future is None else future
        # (under the lock: a job put after `close`'s end-of-jobs was never run, and a
        # `flush` behind it, an erasure's wait at shutdown, blocked for good)
        with self._close_lock:
            if self._closed:
                raise RuntimeError("write-behind queue is closed")
            self._queue.put((job, future))
        return future

    def flush(self) -> None:
        """Block until every job submitted so far has finished."""
        self._queue.join()

    def close(self) -> None:
        """Finish the queued jobs, then stop the thread (idempotent)."""
        with self._close_lock:
            if self._closed:
                return
            self._closed = True
            self._queue.put(None)
        self._thread.join()

    def _run(self) -> None:
        if self.nice:
            _lower_thread_priority(self.nice)
        while True:
            item = self._queue.get()
            try:
                if item is None:
                    return
                job, future = item
                if future.set_running_or_notify_cancel():
                    try:
                        future.set_result(job())
                    except BaseException as e:  # the job's owner decides what a failure means
                        future.set_exception(e)
            finally:
                self._queue.task_done()


def _lower_thread_priority(nice: int) -> None:
    """Give the calling thread `nice` (Linux keeps a nice value per thread); elsewhere, or
    where it is refused, the thread keeps the process's priority."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), nice)
    except (AttributeError, OSError) as e:
        log.warning("cannot lower the writer thread's priority (%s); it keeps the process's", e)

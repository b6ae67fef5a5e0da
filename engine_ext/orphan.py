"""An engine process whose server is gone shuts itself down.

vLLM's engine core does not notice its parent's death: a server killed alone (`kill -9` of
its pid, or a supervisor that signals the main process only) left the engine core and its
worker running for ever, holding their memory, the KV pool and the SSD tier's lock, so that
every later start on the same data folder failed ("in use by another SSD tier") until someone
found and killed them. The engine core now watches its parent from a thread: once the parent
is gone it asks itself to stop as a signal would (SIGTERM: vLLM shuts its engine and workers
down), and ends at once if that takes longer than `GRACE_S`.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import signal
import threading
import time
from collections.abc import Callable

# Under vLLM's logger tree, so the message shows in the EngineCore process's log.
logger = logging.getLogger("vllm.antiphon.orphan")

POLL_S = 1.0  # how often the parent is looked for
# The engine is killed if it has not ended this long after the SIGTERM (its teardown takes
# about 5 s here; the scheduler's `before_stop` makes it abort its requests, not drain them).
GRACE_S = 10.0

_watching = False


def watch_parent(poll_s: float = POLL_S, grace_s: float = GRACE_S,
                 before_stop: Callable[[], None] | None = None) -> bool:
    """In a process a server started (vLLM's engine core): stop this process once its parent
    is gone, calling `before_stop` first (in the watch's thread). Nothing in the server's own
    process (an engine run in-process), whose parent may end while it serves (a shell that
    started it in the background). Returns whether a watch started (one per process)."""
    global _watching
    parent_process = multiprocessing.parent_process()
    if _watching or parent_process is None or parent_process.pid is None:
        return False
    _watching = True
    # The pid it was started by, not os.getppid(): the scheduler is built after the model is
    # loaded, and a server killed before that has already left its engine to another parent.
    parent = parent_process.pid

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(poll_s)
        logger.error("the server (pid %d) is gone: stopping its engine (pid %d)", parent,
                     os.getpid())
        if before_stop is not None:
            before_stop()
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(grace_s)
        logger.error("the engine did not stop within %.0f s of its server's end: killing it",
                     grace_s)
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=watch, name="antiphon-parent-watch", daemon=True).start()
    return True

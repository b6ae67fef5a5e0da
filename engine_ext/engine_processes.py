"""The vLLM engine processes this process started: found, and killed where a stop cannot wait."""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import signal


def engine_process_ids() -> set[int]:
    """The pids of the vLLM engine processes this process started."""
    try:
        children = multiprocessing.active_children()
    except RuntimeError:  # the set of children changed meanwhile
        return set()
    return {p.pid for p in children if p.name.startswith("EngineCore") and p.pid is not None}


def kill_engine_processes() -> None:
    """Kill the vLLM engine processes this process started, with their workers."""
    import psutil

    # (while the set of children changes it names none: the next call sees them)
    for pid in engine_process_ids():
        with contextlib.suppress(OSError):  # stopped, it starts no worker the kill misses
            os.kill(pid, signal.SIGSTOP)
        with contextlib.suppress(psutil.Error):
            for worker in psutil.Process(pid).children(recursive=True):
                with contextlib.suppress(psutil.Error):
                    worker.kill()
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)

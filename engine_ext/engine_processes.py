"""The vLLM engine processes this process started: found, killed where a stop cannot wait, and
the folder of the socket files they talk through."""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import shutil
import signal
import tempfile
from pathlib import Path


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


RPC_DIR_PREFIX = "antiphon-vllm-rpc-"
RPC_DIR_VARIABLE = "VLLM_RPC_BASE_PATH"


START_METHOD_VARIABLE = "VLLM_WORKER_MULTIPROC_METHOD"


def use_spawned_engine() -> None:
    """Have vLLM start the engine's processes by spawning, not forking (unless the user chose):
    a forked engine process inherits every file the server holds open, the data folder's lock
    and the listening socket among them, so after a `kill -9` of the server its restart was
    refused until the orphaned engine noticed and stopped (11 s). vLLM forks by default where
    no GPU context exists yet; on CPUs it spawns already."""
    os.environ.setdefault(START_METHOD_VARIABLE, "spawn")


def use_private_rpc_dir() -> Path | None:
    """Have the vLLM engine started next put the socket files its processes talk through in
    a folder of this process's own (`VLLM_RPC_BASE_PATH`), for `remove_rpc_dir` to remove
    once it stops: vLLM leaves them in the temporary folder, seven an engine start, for good.
    The folders of processes no longer running (killed) are removed first. None where the
    user named the folder."""
    current = os.environ.get(RPC_DIR_VARIABLE)
    if current is not None and not Path(current).name.startswith(RPC_DIR_PREFIX):
        return None
    base = Path(tempfile.gettempdir())
    for old in base.glob(RPC_DIR_PREFIX + "*"):
        pid = old.name[len(RPC_DIR_PREFIX):].partition("-")[0]
        if pid.isdigit() and not _is_running(int(pid)):
            shutil.rmtree(old, ignore_errors=True)  # (another user's stays)
    folder = Path(tempfile.mkdtemp(prefix=f"{RPC_DIR_PREFIX}{os.getpid()}-", dir=base))
    os.environ[RPC_DIR_VARIABLE] = str(folder)
    return folder


def remove_rpc_dir(folder: Path | None) -> None:
    """Remove a folder `use_private_rpc_dir` made, once its engine has stopped."""
    if folder is not None:
        shutil.rmtree(folder, ignore_errors=True)


def _is_running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's
        return True
    return True

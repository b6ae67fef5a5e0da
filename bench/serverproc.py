"""Start a server (`antiphon serve`, or a baseline such as vLLM's) as a child process on a free
port and wait until it is healthy."""

from __future__ import annotations

import contextlib
import os
import random
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from types import TracebackType

import httpx

from antiphon.engine_ext.config import cpu_threading_env


@contextlib.contextmanager
def scratch_data_dir(path: Path) -> Iterator[Path]:
    """`path` empty for one server run (an earlier run's SSD tier would hold this run's KV), and
    removed after it: each run of `bench mixed` left 2-2.5 GB of KV files, and repeated runs
    filled the disk."""
    shutil.rmtree(path, ignore_errors=True)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


# Ports browsers refuse to load (Chromium's and Firefox's restricted lists) at or above the
# range `free_port` picks from: the chat page's browser tests failed on one (ERR_UNSAFE_PORT).
BROWSER_UNSAFE_PORTS = frozenset({10080})


def free_port() -> int:
    """A port free now, below the kernel's ephemeral range: the server binds it only after its
    engine has started (tens of seconds), and a port from the ephemeral range could be handed
    meanwhile to one of the engine's own sockets (a run of `bench mixed` died that way)."""
    low, _ = _ephemeral_range()
    for _ in range(100):
        port = random.randrange(10_000, max(10_001, low))
        if port in BROWSER_UNSAFE_PORTS:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket() as s:  # everything below the range taken: let the kernel choose
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _ephemeral_range() -> tuple[int, int]:
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 32768, 60999  # Linux's default


def group_alive(pgid: int) -> bool:
    """A process of process group `pgid` still runs (zombies, which init reaps, do not)."""
    import psutil

    for proc in psutil.process_iter():
        with contextlib.suppress(psutil.Error, OSError):
            if os.getpgid(proc.pid) == pgid and proc.status() != psutil.STATUS_ZOMBIE:
                return True
    return False


class ServerProcess:
    """`with ServerProcess([... "antiphon", "serve", ...]) as s:` runs it on `s.port`."""

    def __init__(self, cmd: list[str], log_path: Path | None = None,
                 start_timeout_s: float = 300.0, env: dict[str, str] | None = None,
                 health_path: str = "/healthz") -> None:
        """`health_path` answers 200 once the server serves (vLLM's own server: `/health`)."""
        self.port = free_port()
        self.cmd = [*cmd, "--port", str(self.port)]
        self.log_path = log_path or Path(f"/tmp/antiphon-serve-{self.port}.log")
        self.start_timeout_s = start_timeout_s
        # Stock vLLM servers too: the model's threads on the cores, and spinning as long, as
        # `antiphon serve` gives them.
        self.env = {**os.environ, **cpu_threading_env(), **(env or {})}
        self.health_path = health_path
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def ws_url(self) -> str:
        return f"ws://127.0.0.1:{self.port}/v1/ws"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def start(self) -> None:
        log = self.log_path.open("wb")
        self.proc = subprocess.Popen(self.cmd, stdout=log, stderr=subprocess.STDOUT, env=self.env,
                                     start_new_session=True)
        deadline = time.monotonic() + self.start_timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                self.stop()  # what it started (vLLM's engine) may run on
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n"
                                   + self.log()[-4000:])
            try:
                if httpx.get(self.url + self.health_path, timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        self.stop()
        raise TimeoutError(f"server not healthy after {self.start_timeout_s} s:\n"
                           + self.log()[-4000:])

    def stop(self, sig: int = signal.SIGTERM, timeout_s: float = 60.0) -> None:
        """Signal the server's whole process group and wait until every process of it has
        exited; SIGKILL what is left after `timeout_s`. (vLLM's worker, orphaned once the
        server exits, ran on for seconds, beside the start of the next system measured.)"""
        if self.proc is None:
            return
        deadline = time.monotonic() + timeout_s
        if self.proc.poll() is not None:  # exited (a crash, an engine's death): what is
            with contextlib.suppress(ProcessLookupError):  # left of it is told to stop too
                os.killpg(self.proc.pid, sig)
        else:
            os.killpg(self.proc.pid, sig)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        killed = False
        while group_alive(self.proc.pid):
            if time.monotonic() > deadline:
                if killed:
                    break
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.proc.pid, signal.SIGKILL)
                killed, deadline = True, time.monotonic() + 5
            time.sleep(0.05)

    def __enter__(self) -> ServerProcess:
        self.start()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()

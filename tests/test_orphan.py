"""An engine process whose server was killed alone stops (engine_ext/orphan.py)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from antiphon.engine_ext.orphan import watch_parent
from tests.procs import is_gone

# A server stand-in: starts an "engine" child as vLLM does (a multiprocessing process), prints
# its pid, and waits to be killed. The child watches its parent; with IGNORE_TERM it ignores
# SIGTERM, as an engine stuck in its drain would.
SERVER = """
import multiprocessing, signal, sys, time

def engine(ignore_term, late, marker):
    if ignore_term:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if late:  # the server is killed before the watch starts (vLLM loads the model first)
        time.sleep(1.0)
    from antiphon.engine_ext.orphan import watch_parent
    def before_stop():  # the scheduler's: abort the requests, do not drain them
        open(marker, "w").close()
    assert watch_parent(poll_s=0.05, grace_s=1.0, before_stop=before_stop)
    assert not watch_parent()  # one watch per process
    time.sleep(600)

if __name__ == "__main__":
    child = multiprocessing.get_context("spawn").Process(
        target=engine, args=(sys.argv[1] == "1", sys.argv[2] == "1", sys.argv[3]))
    child.start()
    print(child.pid, flush=True)
    time.sleep(600)
"""


@pytest.mark.parametrize(("ignores_term", "late"), [(False, False), (True, False), (False, True)],
                         ids=["stops", "killed-after-grace", "server-gone-before-the-watch"])
def test_an_engine_whose_server_was_killed_alone_stops(tmp_path: Path, ignores_term: bool,
                                                       late: bool) -> None:
    # Before: a server killed with -9 alone left vLLM's engine core running for ever, holding
    # the SSD tier's lock, and every later start on its data folder failed.
    script = tmp_path / "server.py"
    script.write_text(SERVER)
    marker = tmp_path / "before-stop"
    server = subprocess.Popen([sys.executable, str(script), str(int(ignores_term)),
                               str(int(late)), str(marker)],
                              stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        assert server.stdout is not None
        engine = int(server.stdout.readline())
        if not late:
            time.sleep(0.5)  # the engine is watching
        assert not is_gone(engine)
        server.send_signal(signal.SIGKILL)  # the server alone, not its process group
        server.wait()
        deadline = time.monotonic() + 15
        while not is_gone(engine) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert is_gone(engine)
        assert marker.exists()
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(server.pid, signal.SIGKILL)


def test_the_servers_own_process_is_not_watched() -> None:
    # An engine in the server's process: its parent (a shell that started it in the
    # background, say) may end while it serves.
    assert not watch_parent()

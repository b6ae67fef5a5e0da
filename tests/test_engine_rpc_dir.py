"""The socket files vLLM's engine processes talk through go in a folder of the server's own,
removed when the engine stops: vLLM left seven in the temporary folder at every start."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from antiphon.engine_ext.engine_processes import (
    RPC_DIR_PREFIX,
    RPC_DIR_VARIABLE,
    START_METHOD_VARIABLE,
    remove_rpc_dir,
    use_private_rpc_dir,
    use_spawned_engine,
)


@pytest.fixture
def tmp_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    monkeypatch.setenv(RPC_DIR_VARIABLE, "")  # (so that the test's own setting is undone)
    monkeypatch.delenv(RPC_DIR_VARIABLE)
    return tmp_path


def test_each_engine_start_gets_a_folder_removed_when_it_stops(tmp_dir: Path) -> None:
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True).stdout.strip()
    killed = tmp_dir / f"{RPC_DIR_PREFIX}{dead}-x1"  # a server killed before it removed it
    killed.mkdir()
    (killed / "socket").touch()
    mine = tmp_dir / f"{RPC_DIR_PREFIX}{os.getpid()}-x2"  # a running server's (this one)
    mine.mkdir()

    first = use_private_rpc_dir()
    assert first is not None and first.parent == tmp_dir
    assert first.name.startswith(f"{RPC_DIR_PREFIX}{os.getpid()}-")
    assert os.environ[RPC_DIR_VARIABLE] == str(first)  # what vLLM's processes read
    assert not killed.exists() and mine.exists()
    second = use_private_rpc_dir()  # the next engine of this process: a folder of its own
    assert second is not None and second != first
    remove_rpc_dir(first)
    assert not first.exists() and second.exists()
    remove_rpc_dir(second)
    remove_rpc_dir(None)
    assert sorted(p.name for p in tmp_dir.iterdir()) == [mine.name]


def test_a_folder_the_user_names_is_left_alone(tmp_dir: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    named = tmp_dir / "my-sockets"
    monkeypatch.setenv(RPC_DIR_VARIABLE, str(named))
    assert use_private_rpc_dir() is None
    assert os.environ[RPC_DIR_VARIABLE] == str(named)


def test_the_engine_is_spawned_not_forked_unless_the_user_chose(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Where no GPU context exists yet vLLM forks its engine process, which then held the data
    folder's lock and the listening socket: a server killed with -9 could not restart until
    the orphaned engine stopped."""
    from vllm.utils.system_utils import get_mp_context

    monkeypatch.setenv(START_METHOD_VARIABLE, "")
    monkeypatch.delenv(START_METHOD_VARIABLE)
    use_spawned_engine()
    assert get_mp_context().get_start_method() == "spawn"  # vLLM's own choice, as it starts
    monkeypatch.setenv(START_METHOD_VARIABLE, "fork")
    use_spawned_engine()
    assert get_mp_context().get_start_method() == "fork"

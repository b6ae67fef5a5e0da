"""Opt-in: the real metagpt package (its own virtual environment, `examples/metagpt/setup.sh`)
runs MetaGPT's multi-agent tutorial team through `examples/metagpt/run.py` against a live server
(scripted engine: it echoes the last user message). Set ANTIPHON_METAGPT_PYTHON to that
environment's python to run it."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest

from antiphon.engine_ext.scripted import ScriptedEngine
from tests.conftest import scripted_config
from tests.liveserver import live_server
from tests.test_agents_sdk import advisories_counted

METAGPT_PYTHON = os.environ.get("ANTIPHON_METAGPT_PYTHON")
RUN = Path(__file__).resolve().parents[1] / "examples" / "metagpt" / "run.py"

pytestmark = pytest.mark.skipif(
    not METAGPT_PYTHON, reason="set ANTIPHON_METAGPT_PYTHON to a metagpt 0.8.2 environment's "
    "python (examples/metagpt/setup.sh builds one)")


def test_metagpt_team_runs_with_call_graph_advisories(tmp_path: Path) -> None:
    engine = ScriptedEngine(token_delay_s=0.002, max_model_len=1 << 20)
    config = scripted_config(tmp_path / "server", max_content_chars=1 << 20,
                             max_frame_bytes=1 << 22, max_tokens_limit=4096)
    with live_server(config, engine) as url:
        out = subprocess.run(
            [str(METAGPT_PYTHON), str(RUN), "--team", "coders", "--url", url,
             "--workdir", str(tmp_path / "metagpt")],
            capture_output=True, text=True, timeout=600)
        assert out.returncode == 0, out.stderr[-4000:]
        calls = re.findall(r"^(Alice|Bob|Charlie) +(Simple\w+) ", out.stdout, re.MULTILINE)
        # The coder once, then the tester and the reviewer in turn until the rounds run out.
        assert calls[:3] == [("Alice", "SimpleWriteCode"), ("Bob", "SimpleWriteTest"),
                             ("Charlie", "SimpleWriteReview")]
        sessions = re.search(r"roles and sessions: (.*)", out.stdout)
        assert sessions is not None and sessions.group(1).count("s_") == 3
        assert advisories_counted(url, "rest") > 0
        # Once a role has spoken, advisories for it carry its last call to the engine.
        assert len(engine.advisories) > 0


def test_a_team_that_fails_exits_with_an_error(tmp_path: Path) -> None:
    # MetaGPT's Team.run logs an exception and returns None: run.py reported a team whose
    # every call the server refused as done, exit status 0 (found by a review).
    def refuse(turns: object) -> str:
        raise RuntimeError("the model is down")

    engine = ScriptedEngine(refuse, token_delay_s=0.002, max_model_len=1 << 20)
    with live_server(scripted_config(tmp_path / "server"), engine) as url:
        out = subprocess.run(
            [str(METAGPT_PYTHON), str(RUN), "--team", "coders", "--url", url,
             "--workdir", str(tmp_path / "metagpt")],
            capture_output=True, text=True, timeout=600)
    assert out.returncode == 1, out.stdout[-2000:]
    assert "the team stopped with an error" in out.stderr

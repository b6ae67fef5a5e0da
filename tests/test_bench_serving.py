"""`antiphon bench serve` compares like with like: the server decodes as the direct engine does."""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import pytest

from antiphon.bench.serving import run_server
from tests.conftest import Scripted


async def test_the_servers_workload_is_greedy_as_the_direct_engines(scripted: Scripted) -> None:
    """The direct engine ran greedy while the server sampled with the model's own settings
    (SmolLM2: temperature 0.2, top_p 0.9), half as fast at 16 users: the gap was the bench's."""
    result = await run_server(scripted.ws_url, concurrency=(1, 2), max_tokens=4, rounds=1,
                              ttft_repeats=1)
    assert result["c2_output_tokens"] > 0
    assert scripted.engine.params and all(p.temperature == 0 for p in scripted.engine.params)
    # each request opens with tokens of its own: a prompt sent again was a KV-tier hit in
    # Antiphon (partly filled pages are kept) and a full prefill in vLLM
    prompts = [scripted.engine.decode(p) for p in scripted.engine.request_prompts]
    openings = {p.split(": a conversation of its own")[0] for p in prompts}
    assert len(prompts) == 1 + 1 + 1 + 2 and len(openings) == len(prompts)


async def test_the_rest_workload_is_greedy_and_counts_the_served_tokens(
        scripted: Scripted) -> None:
    """Server against server (stock vLLM's, Antiphon's) goes over OpenAI's streamed chat
    completions, greedy as the other systems, each request with an opening of its own."""
    from antiphon.bench.serving import run_rest

    result = await run_rest(scripted.url, "scripted", concurrency=(1, 2), max_tokens=4,
                            rounds=1, ttft_repeats=1)
    assert result["c2_output_tokens"] > 0 and result["c1_output_tokens_per_s"] > 0
    assert scripted.engine.params and all(p.temperature == 0 for p in scripted.engine.params)
    prompts = [scripted.engine.decode(p) for p in scripted.engine.request_prompts]
    assert len({p.split(": a conversation of its own")[0] for p in prompts}) == len(prompts)


async def test_a_sustained_load_counts_the_tokens_of_its_window(
        scripted: Scripted, monkeypatch: pytest.MonkeyPatch) -> None:
    """A round of requests started together also timed their ramp-up and their tail: its
    tokens/s moved by 5-10% between two runs of one system. The sustained load keeps every
    user busy and counts what came in a window; "BE only" marks every request best-effort."""
    from antiphon.bench import serving
    from antiphon.engine_ext.types import RequestClass

    monkeypatch.setattr(serving, "SUSTAIN_WARMUP_S", 0.2)
    result = await serving.run_rest(scripted.url, "scripted", "be", concurrency=(2,),
                                    max_tokens=4, rounds=1, ttft_repeats=1, sustain_s=1.0)
    # the scripted engine echoes the message, one word a token every 10 ms: two users
    # make at most 200 tokens a second, less the gaps between a user's requests
    assert 40 < result["c2_sustained_tokens_per_s"] <= 200
    assert {p.request_class for p in scripted.engine.params} == {RequestClass.BE}


def test_tokens_within_a_window_are_spread_over_their_request() -> None:
    from antiphon.bench.serving import tokens_within

    assert tokens_within(1.0, 3.0, 10, 0.0, 10.0) == 10  # wholly inside
    assert tokens_within(1.0, 3.0, 10, 2.0, 10.0) == 5  # half of it after the window opens
    assert tokens_within(1.0, 3.0, 10, 1.5, 2.0) == 2.5
    assert tokens_within(4.0, 5.0, 10, 0.0, 3.0) == 0  # after the window
    assert tokens_within(2.0, 2.0, 1, 0.0, 3.0) == 1 and tokens_within(3.0, 3.0, 1, 0, 3) == 0


def test_a_server_stops_with_every_process_of_its_group() -> None:
    """vLLM's worker, orphaned when the server exits, ran on for seconds: `stop` returned with
    it alive, and the next system measured started beside it."""
    import subprocess
    import sys
    import time

    from antiphon.bench.serverproc import ServerProcess, group_alive

    lingering = ("import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
                 "open(__import__('sys').argv[1], 'w').close(); time.sleep(1.5)")
    ready = Path(tempfile.mkdtemp()) / "ready"
    main = ("import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', "
            f"{lingering!r}, {str(ready)!r}]); time.sleep(60)")
    server = ServerProcess([sys.executable, "-c", main])
    server.proc = subprocess.Popen(server.cmd, start_new_session=True)
    while not ready.exists():
        time.sleep(0.02)
    started = time.monotonic()
    server.stop()
    assert not group_alive(server.proc.pid)
    assert time.monotonic() - started > 1.0  # it waited for the worker-like child
    # A server that exited on its own (a crash, its engine's death) leaves its group to the
    # signal too: stop waited its whole timeout, then killed it.
    server.proc = subprocess.Popen(["bash", "-c", "sleep 300 & exit 1"], start_new_session=True)
    server.proc.wait()
    assert group_alive(server.proc.pid)
    started = time.monotonic()
    server.stop(timeout_s=8)
    assert not group_alive(server.proc.pid) and time.monotonic() - started < 4


def test_bench_serve_alternates_which_system_runs_first(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """vLLM ran first in every repeat: a host that drifts always favoured the same system."""
    import argparse
    import contextlib

    import antiphon.model
    from antiphon.bench import serving

    order: list[str] = []

    async def direct(*args: Any, **kwargs: Any) -> dict[str, float]:
        order.append("vllm")
        return {"x": 1.0}

    async def served(*args: Any, **kwargs: Any) -> dict[str, float]:
        order.append("antiphon")
        return {"x": 1.0}

    monkeypatch.setattr(serving, "run_direct", direct)
    monkeypatch.setattr(serving, "run_server", served)
    async def rest(url: str, model: str, *args: Any, **kwargs: Any) -> dict[str, float]:
        order.append(f"{url} over REST")
        return {"x": 1.0}

    monkeypatch.setattr(serving, "run_rest", rest)
    commands: list[list[str]] = []

    def server(cmd: list[str], **kwargs: Any) -> Any:
        commands.append(cmd)
        url = "stock" if "vllm.entrypoints.openai.api_server" in cmd else "antiphon"
        return contextlib.nullcontext(argparse.Namespace(ws_url="ws://x", url=url))

    monkeypatch.setattr(serving, "ServerProcess", server)
    monkeypatch.setattr(serving, "scratch_data_dir", contextlib.nullcontext)
    monkeypatch.setattr(serving, "write_json", lambda *args: None)
    monkeypatch.setattr(antiphon.model, "resolve_model", lambda model: tmp_path)
    serving.main(argparse.Namespace(model=None, quick=True, rounds=1, repeats=2, max_tokens=4,
                                    enforce_eager=True, out=str(tmp_path / "s.json"),
                                    server_arg=["--no-kv-tiering"], systems="vllm,antiphon",
                                    sustain_s=0.0))
    assert order == ["vllm", "antiphon", "antiphon", "vllm"]
    assert all(cmd[-1] == "--no-kv-tiering" for cmd in commands) and len(commands) == 2
    # server against server: stock vLLM's and Antiphon's, both over REST
    order.clear()
    serving.main(argparse.Namespace(model=None, quick=True, rounds=1, repeats=2, max_tokens=4,
                                    enforce_eager=True, out=str(tmp_path / "s.json"),
                                    server_arg=[], systems="vllm_serve,antiphon_rest",
                                    sustain_s=0.0))
    assert order == ["stock over REST", "antiphon over REST", "antiphon over REST",
                     "stock over REST"]


def test_scheduler_ab_rotates_which_variant_runs_first(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from antiphon.bench import scheduler_ab

    order: list[object] = []

    async def direct(model: Any, engine: dict[str, Any], request_class: Any,
                     **kwargs: Any) -> dict[str, float]:
        order.append(request_class)
        return {"c1_output_tokens_per_s": 1.0}

    monkeypatch.setattr(scheduler_ab, "run_direct", direct)
    monkeypatch.setattr(scheduler_ab, "resolve_model", lambda model: tmp_path)
    scheduler_ab.main(2, ["stock", "echo_rt_only"])
    assert order == [None, "rt", "rt", None]


def test_scheduler_ab_policies_run_the_class_serve_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    # On a GPU `serve` runs AntiphonAsyncScheduler and stock vLLM its AsyncScheduler: the
    # policy variants ran the synchronous class, which loses vLLM's overlap, and their
    # "at least 97% of stock" compared unlike engines (found by a review).
    from vllm.platforms import current_platform

    from antiphon.bench import scheduler_ab
    from antiphon.engine_ext.config import ASYNC_SCHEDULER_CLS

    monkeypatch.setattr(type(current_platform), "is_cpu", lambda self: False)
    assert scheduler_ab.policy_engine("bros")["scheduler_cls"] == ASYNC_SCHEDULER_CLS

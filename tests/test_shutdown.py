"""A shutdown (SIGTERM, Ctrl-C) lets the replies streaming then finish, within
`--drain-timeout-s`, refusing new turns meanwhile; real websocket and HTTP clients."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import signal
import sqlite3
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed

from antiphon.engine_ext.scripted import ScriptedEngine
from antiphon.server.app import DrainingServer, create_app
from tests.conftest import scripted_config
from tests.liveserver import running_server
from tests.wsclient import open_session, recv, recv_until, send

LONG = "one two three four five six seven eight nine ten " * 4  # 40 tokens echoed back


async def test_a_shutdown_lets_live_replies_finish_and_refuses_new_turns(
        tmp_path: Path) -> None:
    config = scripted_config(tmp_path, drain_timeout_s=30)
    with running_server(config, ScriptedEngine(token_delay_s=0.05)) as (url, server):
        ws_url = url.replace("http://", "ws://") + "/v1/ws"
        async with connect(ws_url) as ws, connect(ws_url) as late:
            sid = (await open_session(ws))["session"]["session_id"]
            late_sid = (await open_session(late))["session"]["session_id"]
            await send(ws, type="message", session_id=sid, content=LONG, request_id="live")
            await recv_until(ws, "token")
            server.should_exit = True  # what SIGTERM does
            await asyncio.sleep(0.3)
            await send(late, type="message", session_id=late_sid, content="hello?")
            refused = await recv(late)
            health = await asyncio.to_thread(httpx.get, url + "/healthz")
            advised = await asyncio.to_thread(httpx.post, url + "/v1/advisory",
                                              json={"session_id": late_sid})
            done = (await recv_until(ws, "done"))[-1]
            with contextlib.suppress(ConnectionClosed):  # then closed: 1012, service restart
                await recv(ws, timeout=30)
    assert (refused["type"], refused["code"]) == ("error", "shutting_down")
    assert health.status_code == 503  # a load balancer stops sending traffic here
    assert advised.json()["error"]["code"] == "shutting_down"  # no KV brought forward now
    assert (done["finish_reason"], done["text"]) == ("stop", "You said: " + LONG)
    db = sqlite3.connect(tmp_path / "sessions.sqlite3")
    rows = db.execute("SELECT session_id, role, finish_reason FROM messages").fetchall()
    assert rows == [(sid, "user", None), (sid, "assistant", "stop")]  # "hello?" was not taken


async def test_clients_that_close_as_the_drain_ends_fail_nothing(tmp_path: Path) -> None:
    """A client that closes once its reply is done, as the server shuts down: uvicorn's
    websocket shutdown sent a close on the connection it was closing (InvalidState), and
    `antiphon serve` exited 1 with tracebacks (`running_server` re-raises a failed server)."""
    config = scripted_config(tmp_path, drain_timeout_s=30)
    with running_server(config, ScriptedEngine(token_delay_s=0.05)) as (url, server):
        ws_url = url.replace("http://", "ws://") + "/v1/ws"
        async with connect(ws_url) as ws, connect(ws_url):  # and an idle one
            sid = (await open_session(ws))["session"]["session_id"]
            await send(ws, type="message", session_id=sid, content=LONG)
            await recv_until(ws, "token")
            server.should_exit = True
            done = (await recv_until(ws, "done"))[-1]
        # both closed at once, as the drain ends
        await asyncio.sleep(1)
    assert done["finish_reason"] == "stop"


async def test_replies_longer_than_the_drain_are_cut_short_and_kept(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    config = scripted_config(tmp_path, drain_timeout_s=0.3)
    with running_server(config, ScriptedEngine(token_delay_s=0.05)) as (url, server):
        async with connect(url.replace("http://", "ws://") + "/v1/ws") as ws:
            sid = (await open_session(ws))["session"]["session_id"]
            await send(ws, type="message", session_id=sid, content=LONG)
            frames = await recv_until(ws, "token")
            server.should_exit = True
            try:
                while True:
                    frames.append(await recv(ws, timeout=30))
            except ConnectionClosed:
                pass
    # The turn cut short got its `done` (the socket closed without one), with what streamed.
    done = frames[-1]
    assert (done["type"], done["finish_reason"]) == ("done", "cancelled"), frames[-3:]
    streamed = "".join(f["text"] for f in frames if f["type"] == "token")
    db = sqlite3.connect(tmp_path / "sessions.sqlite3")
    assert db.execute("SELECT role, finish_reason FROM messages").fetchall() == [
        ("user", None), ("assistant", "cancelled")]
    assert db.execute("SELECT content FROM messages WHERE role = 'assistant'").fetchone() == (
        streamed,) and done["text"] == streamed
    # The one reply, counted once (its turn and its stream both hold it live).
    assert "1 replies still streaming" in caplog.text, caplog.text


async def test_rest_requests_longer_than_the_drain_end_with_an_error(tmp_path: Path) -> None:
    """A REST reply still generating when the drain ends gets `shutting_down`: a stream as
    its last event (then `[DONE]`), a whole response as its status. Before, uvicorn dropped
    the connection 5 s later, and a streaming client read the cut reply as a whole one."""
    config = scripted_config(tmp_path, drain_timeout_s=0.3)
    # 160 tokens echoed back, 8 s: longer than uvicorn's 5 s wait after the drain
    body = {"model": "scripted", "messages": [{"role": "user", "content": LONG * 4}]}
    with running_server(config, ScriptedEngine(token_delay_s=0.05)) as (url, server):
        async with httpx.AsyncClient(base_url=url, timeout=30) as client:
            async with client.stream("POST", "/v1/chat/completions",
                                     json={**body, "stream": True}) as stream:
                lines = stream.aiter_lines()
                while not (await anext(lines)).startswith("data: {"):
                    pass  # until the first chunk: it is streaming
                whole = asyncio.ensure_future(client.post("/v1/chat/completions", json=body))
                await asyncio.sleep(0.2)
                server.should_exit = True  # what SIGTERM does
                events = [line async for line in lines if line.startswith("data: ")]
            response = await whole
    assert events[-1] == "data: [DONE]"
    error = json.loads(events[-2].removeprefix("data: "))["error"]
    assert error["code"] == "shutting_down" and "cut short" in error["message"]
    assert len(events) < 40  # cut at the drain's end
    assert response.status_code == 503
    assert response.json()["error"]["code"] == "shutting_down"
    assert "cut short" in response.json()["error"]["message"]  # not refused: it was running


class StartWatched(ScriptedEngine):
    """A scripted engine whose start is held (`hold`); says when it began and stopped."""

    def __init__(self) -> None:
        super().__init__()
        self.starting = threading.Event()
        self.stopped = False

    async def start(self) -> None:
        self.starting.set()
        await self.hold()
        await super().start()

    async def hold(self) -> None:
        raise NotImplementedError

    async def shutdown(self) -> None:
        self.stopped = True
        await super().shutdown()


def stop_while_starting(tmp_path: Path, engine: StartWatched) -> DrainingServer:
    """Run a server on `engine`, send it SIGTERM once the engine's start has begun, and
    return the server once it has stopped (within 5 s of the signal)."""
    config = scripted_config(tmp_path)
    server = DrainingServer(create_app(config, engine), log_level="warning",
                            **{**config.server.uvicorn_options(), "port": 0})
    failures: list[BaseException] = []

    def run() -> None:
        try:
            server.run()
        except BaseException as exc:  # re-raised below
            failures.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    assert engine.starting.wait(30)
    asked = time.monotonic()
    server.handle_exit(signal.SIGTERM, None)
    thread.join(30)
    assert not thread.is_alive() and time.monotonic() - asked < 5
    if failures:
        raise failures[0]
    return server


def test_a_shutdown_asked_for_during_the_start_stops_it_at_once(tmp_path: Path) -> None:
    """A signal while the engine starts (first-start profiling takes minutes) cancels the
    start and stops the engine, instead of waiting for it to serve first."""
    class SlowStart(StartWatched):
        async def hold(self) -> None:
            await asyncio.sleep(60)  # profiling, say

    engine = SlowStart()
    server = stop_while_starting(tmp_path, engine)
    assert engine.stopped and not engine._is_running and not server.ctx.is_ready

def fake_engine_process(pids: Any) -> None:
    """What vLLM's engine process is to `stop_starting`: a child of the server named
    EngineCore, with a worker of its own, loading."""
    import subprocess

    worker = subprocess.Popen(["sleep", "60"])
    pids.put(worker.pid)
    time.sleep(60)


def test_a_stop_during_the_model_load_kills_the_engine_processes(tmp_path: Path) -> None:
    """vLLM's engine process heeds a signal only once its model has loaded (up to minutes),
    and its start blocks the server's event loop until then: `stop_starting` kills the
    engine and its workers, those started before the call and after it, while the load
    runs."""
    import multiprocessing

    import psutil

    from antiphon.engine_ext.config import EngineConfig
    from antiphon.engine_ext.vllm_engine import VllmEngine

    spawn = multiprocessing.get_context("spawn")
    pids = spawn.Queue()

    def start_engine_process() -> multiprocessing.process.BaseProcess:
        engine_process = spawn.Process(target=fake_engine_process, args=(pids,),
                                       name="EngineCore")
        engine_process.start()
        return engine_process

    def gone(pid: int) -> bool:
        try:
            return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return True

    engine = VllmEngine(EngineConfig(), tmp_path)
    engine._loading = True  # in its start, as `_start` runs the killer beside vLLM's
    killer = threading.Thread(target=engine._kill_engine_once_stopped, daemon=True)
    killer.start()
    try:
        before = start_engine_process()
        worker = pids.get(timeout=60)
        time.sleep(0.3)
        assert before.is_alive()  # nothing is killed until a stop is asked for
        engine.stop_starting()
        after = start_engine_process()  # spawned once the stop was asked for
        for process in (before, after):
            process.join(10)
            assert process.exitcode == -9
        assert gone(worker)
    finally:
        engine._loading = False  # the load ended (failed): the killer stops
    killer.join(5)
    assert not killer.is_alive()


def test_a_shutdown_during_a_start_that_blocks_the_event_loop_stops_it(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A start that blocks the event loop (vLLM's model load) and fails once the stop has
    ended it (`stop_starting`): the server stops at once, as from a cancelled start, without
    an error."""
    class BlockingStart(StartWatched):
        stop = threading.Event()

        async def hold(self) -> None:
            if self.stop.wait(60):  # blocks the loop: the signal's cancel waits
                raise RuntimeError("Engine core initialization failed")

        def stop_starting(self) -> None:
            self.stop.set()

    engine = BlockingStart()
    server = stop_while_starting(tmp_path, engine)
    assert engine.stopped and not server.ctx.is_ready
    # not uvicorn's "Application startup failed", with the start's traceback
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], caplog.text


async def test_a_stop_asked_before_vllms_start_loads_nothing(tmp_path: Path) -> None:
    """A signal while the start still imports vLLM or loads the tokenizer (seconds, the
    event loop blocked): the start ends before vLLM's engine starts, not after its load; and
    one before the start begins starts nothing."""
    from antiphon.engine_ext.config import EngineConfig
    from antiphon.engine_ext.vllm_engine import VllmEngine
    from antiphon.server.app import _start_engine
    from antiphon.server.context import AppContext
    from tests.conftest import default_model_or_skip

    engine = VllmEngine(EngineConfig(), default_model_or_skip())
    engine.stop_starting()
    with pytest.raises(RuntimeError, match="stopped"):
        await engine.start()
    assert engine._llm is None and not multiprocessing_children()

    class NeverStarted(ScriptedEngine):
        async def start(self) -> None:
            raise AssertionError("started after the stop")

    ctx = AppContext.build(scripted_config(tmp_path), NeverStarted())
    ctx.chat.stop_requested = True  # what the signal's handler sets
    assert not await _start_engine(ctx, ctx.engine)


async def test_the_engines_shutdown_aborts_the_requests_it_still_runs(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM keys a request by the id `generate` was given plus a random suffix: the abort of
    what a shutdown left running named them as given, and stopped none (the engine ran them on
    until vLLM's process manager killed it, 15 s later, its KV connector never closed). vLLM's
    own output processor, request ids and abort; an engine core that records what reaches
    it."""
    import types

    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind
    from vllm.v1.engine import EngineCoreRequest
    from vllm.v1.engine.async_llm import AsyncLLM
    from vllm.v1.engine.input_processor import InputProcessor
    from vllm.v1.engine.output_processor import OutputProcessor

    from antiphon.engine_ext import vllm_engine
    from antiphon.engine_ext.config import EngineConfig

    outputs = OutputProcessor(None, log_stats=False)
    request = EngineCoreRequest(
        request_id="turn-1", prompt_token_ids=[1, 2, 3], mm_features=None,
        sampling_params=SamplingParams(max_tokens=4, output_kind=RequestOutputKind.DELTA),
        pooling_params=None, arrival_time=time.time(), lora_request=None, cache_salt=None,
        data_parallel_rank=None)
    InputProcessor.assign_request_id(request)
    outputs.add_request(request, None)
    assert request.request_id != "turn-1"
    reached: list[str] = []

    class Core:
        async def abort_requests_async(self, ids: list[str]) -> None:
            reached.extend(ids)

    llm = types.SimpleNamespace(output_processor=outputs, engine_core=Core(),
                                log_requests=False, shutdown=lambda timeout=None: None)
    llm.abort = lambda ids, internal=False: AsyncLLM.abort(llm, ids, internal)  # type: ignore[arg-type]
    monkeypatch.setattr(vllm_engine, "engine_process_ids", set)
    engine = vllm_engine.VllmEngine(EngineConfig(), Path("/nonexistent"))
    engine._llm = llm  # type: ignore[assignment]
    await engine.shutdown()
    assert reached == [request.request_id]


def multiprocessing_children() -> list[str]:
    import multiprocessing

    return [p.name for p in multiprocessing.active_children()]


def test_a_failure_after_the_engine_started_stops_the_engine(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """What runs after the engine's start (the shared-memory record, the batch runner) failed
    outside the lifespan's cleanup: the start failed with the engine left running. A record
    the disk cannot take no longer fails it at all."""
    import errno

    from antiphon import shmsweep
    from antiphon.bench.serverproc import free_port

    def full(path: Path) -> int:
        raise OSError(errno.ENOSPC, "No space left on device", str(path))

    monkeypatch.setattr(shmsweep, "open_private", full)
    config = scripted_config(tmp_path)
    engine = ScriptedEngine()
    app = create_app(config, engine)
    ctx = app.state.ctx

    async def broken_start() -> None:
        assert engine._is_running  # (the shared-memory record's failure did not stop it)
        raise RuntimeError("the batch runner could not start")

    monkeypatch.setattr(ctx.batches, "start", broken_start)
    server = DrainingServer(app, log_level="critical",
                            **{**config.server.uvicorn_options(), "port": free_port()})
    with pytest.raises(SystemExit):
        server.run()
    assert not engine._is_running


async def test_a_second_ctrl_c_cuts_the_drain_short_and_still_stops_cleanly(
        tmp_path: Path) -> None:
    """A second Ctrl-C during the drain neither shortened it (the server waited the whole
    --drain-timeout-s) nor let the app shut down: uvicorn skips the lifespan's end once told
    to force its exit, so the engine and stores were never stopped."""
    from antiphon.bench.serverproc import free_port

    config = scripted_config(tmp_path, drain_timeout_s=30)
    engine = ScriptedEngine(token_delay_s=0.2)
    port = free_port()
    app = create_app(config, engine)
    server = DrainingServer(app, log_level="critical",
                            **{**config.server.uvicorn_options(), "port": port})
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        await asyncio.sleep(0.05)
    async with connect(f"ws://127.0.0.1:{port}/v1/ws") as ws:
        sid = (await open_session(ws))["session"]["session_id"]
        await send(ws, type="message", session_id=sid, content="w " * 200)
        await recv_until(ws, "token")
        started = time.monotonic()
        server.handle_exit(signal.SIGINT, None)
        await asyncio.sleep(0.5)
        server.handle_exit(signal.SIGINT, None)
        done = (await recv_until(ws, "done"))[-1]
        await asyncio.to_thread(thread.join, 20)
    assert not thread.is_alive() and time.monotonic() - started < 10
    assert done["finish_reason"] == "cancelled"
    assert not engine._is_running  # the app's own shutdown ran
    with sqlite3.connect(tmp_path / "sessions.sqlite3") as db:
        roles = [r[0] for r in db.execute("SELECT role FROM messages ORDER BY seq")]
    assert roles == ["user", "assistant"]  # the reply cut short is kept

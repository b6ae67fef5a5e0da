"""`antiphon serve` with the real default model, driven as a user would: a websockets client and
the official openai client against a server process."""

from __future__ import annotations

import asyncio
import json
import signal
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from websockets.asyncio.client import connect

from antiphon.bench.serverproc import ServerProcess
from antiphon.model import DEFAULT_MODEL_NAME
from antiphon.shmsweep import RECORD_NAME, SHM_DIR
from tests.procs import descendants, is_gone
from tests.wsclient import chat, open_session, recv_until, send

pytestmark = pytest.mark.e2e

QUESTION = "What is the capital of France? Answer in one word."
FOLLOW_UP = "What is the population of that city, roughly?"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    data_dir = tmp_path_factory.mktemp("serve-data")
    # The cost model from its prior: serve would otherwise profile on a first start here.
    cmd = [sys.executable, "-m", "antiphon", "serve", "--enforce-eager", "--kv-cache-gib", "0.5",
           "--max-model-len", "4096", "--data-dir", str(data_dir), "--cost-model", "online"]
    with ServerProcess(cmd, log_path=data_dir / "serve.log") as proc:
        yield proc


async def test_websocket_chat_answers_paris_and_follows_up(server: ServerProcess) -> None:
    async with connect(server.ws_url) as ws:
        sid = (await open_session(ws))["session"]["session_id"]
        first = await chat(ws, sid, QUESTION, temperature=0.0)  # greedy: the answer is known
        assert len(first["tokens"]) > 1  # streamed, not sent in one piece
        assert "Paris" in first["done"]["text"]
        assert first["done"]["timings"]["ttft_s"] > 0
        second = await chat(ws, sid, FOLLOW_UP, temperature=0.0)
        assert "Paris" in second["done"]["text"]
        assert second["accepted"]["prompt_tokens"] > first["accepted"]["prompt_tokens"]


def test_openai_client_chat_and_stream(server: ServerProcess) -> None:
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    assert [m.id for m in client.models.list().data] == [DEFAULT_MODEL_NAME]
    messages: list[dict[str, str]] = [{"role": "user", "content": QUESTION}]
    out = client.chat.completions.create(model=DEFAULT_MODEL_NAME, messages=messages,
                                         temperature=0)  # type: ignore[arg-type]
    answer = out.choices[0].message.content or ""
    assert "Paris" in answer
    messages += [{"role": "assistant", "content": answer},
                 {"role": "user", "content": FOLLOW_UP}]
    stream = client.chat.completions.create(model=DEFAULT_MODEL_NAME, messages=messages,
                                            temperature=0, stream=True)  # type: ignore[arg-type]
    assert "Paris" in "".join(c.choices[0].delta.content or "" for c in stream if c.choices)


def test_openai_client_text_completion(server: ServerProcess) -> None:
    """`/v1/completions` continues the prompt as given (no chat template), as tools built for
    OpenAI-compatible servers (`vllm bench serve`) expect."""
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    out = client.completions.create(model=DEFAULT_MODEL_NAME, prompt="The capital of France is",
                                    max_tokens=6, temperature=0, logprobs=1)
    choice = out.choices[0]
    assert "Paris" in choice.text and out.usage is not None
    assert out.usage.prompt_tokens == 5 and out.usage.completion_tokens == 6
    assert choice.logprobs is not None and "".join(choice.logprobs.tokens or []) == choice.text
    stream = client.completions.create(model=DEFAULT_MODEL_NAME, prompt="The capital of France is",
                                       max_tokens=6, temperature=0, stream=True)
    assert "".join(c.choices[0].text for c in stream if c.choices) == choice.text
    tokens = httpx.post(server.url + "/tokenize", json={
        "model": DEFAULT_MODEL_NAME, "prompt": "The capital of France is",
        "return_token_strs": True}).json()
    assert tokens["count"] == out.usage.prompt_tokens
    assert "".join(tokens["token_strs"]).replace("\u0120", " ") == "The capital of France is"
    assert httpx.post(server.url + "/detokenize", json={"tokens": tokens["tokens"]}).json() == {
        "prompt": "The capital of France is"}


def test_engine_runs_the_antiphon_scheduler(server: ServerProcess) -> None:
    assert "AntiphonScheduler installed" in server.log()


async def test_disconnect_mid_stream_frees_the_request(server: ServerProcess) -> None:
    async with connect(server.ws_url) as ws:
        sid = (await open_session(ws))["session"]["session_id"]
        await send(ws, type="message", session_id=sid, max_tokens=2000,
                   content="Write a very long essay about the history of the sea.")
        await recv_until(ws, "token")
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        if httpx.get(server.url + "/healthz").json()["num_unfinished_requests"] == 0:
            break
        await asyncio.sleep(0.1)
    assert httpx.get(server.url + "/healthz").json()["num_unfinished_requests"] == 0
    metrics = httpx.get(server.url + "/metrics").text
    assert 'antiphon_requests_total{api="ws",outcome="cancelled",request_class="rt"}' in metrics


async def test_kill_9_loses_no_accepted_message(server: ServerProcess) -> None:
    async with connect(server.ws_url) as ws:
        sid = (await open_session(ws))["session"]["session_id"]
        await chat(ws, sid, QUESTION)
        await send(ws, type="message", session_id=sid, max_tokens=2000,
                   content="Now write a very long essay about Paris.")
        accepted = json.loads(await ws.recv())
        assert accepted["type"] == "accepted"
        record = Path(server.log_path).parent / RECORD_NAME  # the engine's /dev/shm segments
        left = [SHM_DIR / name for name in json.loads(record.read_text())["segments"]]
        server.stop(signal.SIGKILL)
    assert left and all(path.exists() for path in left)  # nothing else would remove them
    server.start()
    assert not any(path.exists() for path in left)
    async with connect(server.ws_url) as ws:
        messages = (await open_session(ws, sid))["messages"]
    assert [m["role"] for m in messages] == ["user", "assistant", "user"]
    assert messages[-1]["content"] == "Now write a very long essay about Paris."
    log = Path(server.log_path).read_text()
    assert "Application startup complete" in log


async def test_a_server_killed_alone_leaves_no_engine_behind(server: ServerProcess) -> None:
    """kill -9 of the server's pid alone (a supervisor that signals the main process only):
    vLLM's engine core and worker ran on for ever, holding the SSD tier's lock, and every
    restart on the data folder failed ("in use by another SSD tier"). Then, with a reply
    generating, the engine drained it for 10 s, for nobody, and a restart meanwhile (a
    supervisor's, 100 ms after) was refused: now it aborts it, and a restart waits."""
    assert server.proc is not None
    engine = descendants(server.proc.pid)
    assert engine  # vLLM's engine core and its worker
    async with connect(server.ws_url) as ws:
        sid = (await open_session(ws))["session"]["session_id"]
        await send(ws, type="message", session_id=sid, content="Count to a thousand.",
                   max_tokens=1000, min_tokens=1000)
        await recv_until(ws, "token")
        killed = time.monotonic()
        server.proc.send_signal(signal.SIGKILL)
        server.proc.wait()
    while not all(is_gone(pid) for pid in engine) and time.monotonic() - killed < 30:
        time.sleep(0.2)
    stopped_s = time.monotonic() - killed
    log = Path(server.log_path).read_text()
    assert "is gone: stopping its engine" in log
    assert "aborting in-flight requests" in log and "did not stop within" not in log, log
    assert stopped_s < 9, stopped_s  # noticed within 1 s; killed 10 s after, draining
    server.start()  # the data folder is free again: the restart serves


@pytest.mark.parametrize("sig", [signal.SIGINT])
async def test_ctrl_c_to_the_process_group_lets_the_streaming_reply_finish(
        server: ServerProcess, sig: int) -> None:
    """Ctrl-C in a terminal signals the server's whole process group, vLLM's engine and worker
    processes with it. They stopped at once, and the reply being drained ended with
    engine_error. Now the engine drains its requests too (vLLM's shutdown_timeout), its worker
    runs on until the engine stops it, and the reply runs to its end; the server then ends as
    SIGINT ends a process, without a traceback. (Last in this module: it stops the server.)"""
    async with connect(server.ws_url) as ws:
        sid = (await open_session(ws))["session"]["session_id"]
        await send(ws, type="message", session_id=sid, max_tokens=48,
                   content="Write a long story about a lighthouse keeper.")
        await recv_until(ws, "token")
        stopping = asyncio.create_task(asyncio.to_thread(server.stop, sig))
        tokens = 1
        while (frame := json.loads(await ws.recv()))["type"] not in ("done", "error"):
            tokens += frame["type"] == "token"
    await stopping
    assert frame["type"] == "done", frame
    assert tokens > 1 and frame["usage"]["completion_tokens"] >= tokens - 1
    # A server that inherited SIGINT ignored (started in the background by a non-interactive
    # shell, as this test run may be) drains on it all the same, and exits 0.
    inherited_ignored = signal.getsignal(signal.SIGINT) == signal.SIG_IGN
    assert server.proc is not None
    assert server.proc.returncode == (0 if inherited_ignored else -sig)
    log = server.log()
    assert "Traceback" not in log and "engine_error" not in log

"""`antiphon bench serve`: what the server costs over vLLM alone.

Runs one workload on each system in one run, side by side (`--systems`): `vllm`, vLLM's own
`AsyncLLM` in this process (stock scheduler, no server); `vllm_serve`, stock vLLM's OpenAI
server (`vllm.entrypoints.openai.api_server`) over REST; `antiphon`, a real `antiphon serve`
process over websockets (one connection and session per simulated user); `antiphon_rest`, the
same server over REST (streamed chat completions, as `vllm_serve` is driven);
`antiphon_rest_be`, the same with every request best-effort (issue 3's "BE only"). Reports
short-prompt TTFT and output tokens/s at 1 and at 16 concurrent sessions, in rounds of
requests started together and under a sustained load (closed-loop users, counted after a
ramp-up), each system started with the same engine settings. Server against server
(`vllm_serve`, `antiphon_rest`) is the comparison of two deployments; `vllm` is the engine
with no server's costs at all.

Every request opens with a system message of its own (`opening`), the same on both sides: a
prompt sent again is a cache hit in Antiphon's KV tiers, which keep partly filled pages, and a
full prefill in vLLM, which keeps whole ones (the short-prompt TTFT timed a host-RAM load
against a prefill, and came out below the engine's own).
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import itertools
import json
import logging
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from antiphon.bench.args import names_in
from antiphon.bench.report import print_table, write_json
from antiphon.bench.serverproc import ServerProcess, scratch_data_dir
from antiphon.engine_ext.config import WORKER_EXTENSION_CLS, set_cpu_threading
from antiphon.engine_ext.engine_processes import remove_rpc_dir, use_private_rpc_dir

SHORT_PROMPT = "What is the capital of France? Answer in one word."
TOPICS = ["a lighthouse keeper", "a lost robot", "the first city on Mars", "a chess prodigy",
          "an old bookshop", "a storm at sea", "a talking cat", "a mountain village",
          "a time traveller", "a forgotten song", "a desert caravan", "a clockmaker",
          "a deep-sea diver", "a haunted train", "a garden in winter", "a young inventor"]

# One request: (system message, prompt, max_tokens) -> (ttft_s, num_output_tokens, total_s)
Runner = Callable[[str, str, int], Awaitable[tuple[float, int, float]]]


def story_prompt(i: int) -> str:
    return f"Write a long, detailed story about {TOPICS[i % len(TOPICS)]}."


def opening(n: int) -> str:
    """Request `n`'s system message: its first tokens differ from every other request's."""
    return f"{hashlib.sha256(str(n).encode()).hexdigest()[:8]}: a conversation of its own."


# A sustained load's first seconds, left out of its window: the ramp-up of its first requests
SUSTAIN_WARMUP_S = 5.0


def tokens_within(first: float, end: float, tokens: int, lo: float, hi: float) -> float:
    """A request's output tokens that came in [lo, hi): spread evenly between its first
    token's time and its end's."""
    if end <= first:
        return float(tokens) if lo <= first < hi else 0.0
    return tokens * max(0.0, min(end, hi) - max(first, lo)) / (end - first)


async def sustained(fresh: Callable[[str, int], Awaitable[tuple[float, int, float]]],
                    users: int, max_tokens: int, window_s: float) -> float:
    """Output tokens/s of `users` closed-loop users, each sending its next request when its
    last one ends, counted over `window_s` seconds after `SUSTAIN_WARMUP_S`: throughput at a
    steady load, where a round of requests started together also times their ramp-up and
    their tail (a round's figure moved by 5-10% between two runs of one system)."""
    lo = time.perf_counter() + SUSTAIN_WARMUP_S
    hi = lo + window_s
    spans: list[tuple[float, float, int]] = []

    async def user(k: int) -> None:
        for i in itertools.count():
            if time.perf_counter() >= hi:
                return
            sent = time.perf_counter()
            ttft, tokens, total = await fresh(story_prompt(k + i * users), max_tokens)
            spans.append((sent + ttft, sent + total, tokens))

    await asyncio.gather(*(user(k) for k in range(users)))
    return sum(tokens_within(*span, lo, hi) for span in spans) / window_s


async def measure(run: Runner, concurrency: tuple[int, ...], max_tokens: int, rounds: int,
                  ttft_repeats: int, sustain_s: float = 0.0) -> dict[str, Any]:
    """Run the workload through `run` and summarise it: per concurrency, `rounds` rounds of
    requests started together, then (where `sustain_s` > 0) a sustained load."""
    numbers = itertools.count()

    def fresh(prompt: str, tokens: int) -> Awaitable[tuple[float, int, float]]:
        return run(opening(next(numbers)), prompt, tokens)

    await fresh(SHORT_PROMPT, 4)  # warm-up
    ttfts = [(await fresh(SHORT_PROMPT, 8))[0] for _ in range(ttft_repeats)]
    result: dict[str, Any] = {"ttft_short_p50_s": statistics.median(ttfts),
                              "ttft_short_min_s": min(ttfts)}
    for c in concurrency:
        tokens, wall, load_ttfts = 0, 0.0, []
        for r in range(rounds):
            started = time.perf_counter()
            outs = await asyncio.gather(*(fresh(story_prompt(r * c + i), max_tokens)
                                          for i in range(c)))
            wall += time.perf_counter() - started
            tokens += sum(o[1] for o in outs)
            load_ttfts += [o[0] for o in outs]
        result[f"c{c}_output_tokens_per_s"] = tokens / wall
        result[f"c{c}_output_tokens"] = tokens
        result[f"c{c}_ttft_p50_s"] = statistics.median(load_ttfts)
        if sustain_s > 0:
            result[f"c{c}_sustained_tokens_per_s"] = await sustained(fresh, c, max_tokens,
                                                                     sustain_s)
    return result


async def run_direct(model_dir: Path, engine_args: dict[str, Any],
                     request_class: str | None = None, **workload: Any) -> dict:
    """The workload through vLLM's AsyncLLM (its stock scheduler unless `engine_args` names
    another), every request of `request_class` ("rt", "be") where given."""
    from transformers import AutoTokenizer
    from vllm import SamplingParams
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.inputs import TokensPrompt
    from vllm.sampling_params import RequestOutputKind
    from vllm.v1.engine.async_llm import AsyncLLM

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    set_cpu_threading()  # as `antiphon serve` does
    # the compiled model's reuse on CPU, as `antiphon serve` has it (WORKER_EXTENSION_CLS)
    engine_args = {"worker_extension_cls": WORKER_EXTENSION_CLS, **engine_args}
    rpc_dir = use_private_rpc_dir()  # (as `antiphon serve` has it: no socket files left)
    try:
        llm = AsyncLLM.from_engine_args(AsyncEngineArgs(model=str(model_dir), **engine_args))
    except BaseException:
        remove_rpc_dir(rpc_dir)
        raise
    counter = iter(range(1 << 30))
    extra_args = {"antiphon_class": request_class} if request_class else None

    async def run(system: str, prompt: str, max_tokens: int) -> tuple[float, int, float]:
        text = tokenizer.apply_chat_template([{"role": "system", "content": system},
                                              {"role": "user", "content": prompt}],
                                             add_generation_prompt=True, tokenize=False)
        ids = tokenizer.encode(text, add_special_tokens=False)
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0,
                                output_kind=RequestOutputKind.DELTA, extra_args=extra_args)
        started, first, n = time.perf_counter(), None, 0
        async for out in llm.generate(TokensPrompt(prompt_token_ids=ids), params,
                                      f"b{next(counter)}"):
            if out.outputs[0].token_ids and first is None:
                first = time.perf_counter()
            n += len(out.outputs[0].token_ids)
        end = time.perf_counter()
        return (first or end) - started, n, end - started

    try:
        return await measure(run, **workload)
    finally:
        llm.shutdown()
        remove_rpc_dir(rpc_dir)


async def run_server(ws_url: str, **workload: Any) -> dict:
    """The workload through Antiphon's websocket API, one connection and session per user."""
    from websockets.asyncio.client import connect

    async def run(system: str, prompt: str, max_tokens: int) -> tuple[float, int, float]:
        async with connect(ws_url, max_size=None) as ws:
            await ws.send(json.dumps({"type": "session.open", "system": system}))
            sid = json.loads(await ws.recv())["session"]["session_id"]
            started, first = time.perf_counter(), None
            # greedy, as the direct engine runs (the server would sample with the model's
            # own settings: SmolLM2's temperature 0.2 and top_p 0.9, half as fast at 16 users)
            await ws.send(json.dumps({"type": "message", "session_id": sid, "content": prompt,
                                      "max_tokens": max_tokens, "temperature": 0}))
            while True:
                frame = json.loads(await ws.recv())
                if frame["type"] == "token" and first is None:
                    first = time.perf_counter()
                elif frame["type"] == "done":
                    end = time.perf_counter()
                    return (first or end) - started, frame["usage"]["completion_tokens"], \
                        end - started
                elif frame["type"] == "error":
                    raise RuntimeError(f"server error: {frame}")

    return await measure(run, **workload)


async def run_rest(base_url: str, model: str, request_class: str | None = None,
                   **workload: Any) -> dict:
    """The workload through an OpenAI-compatible server's streamed chat completions (stock
    vLLM's, or Antiphon's REST API), one request per user, greedy as the others; every
    request of `request_class` ("rt", "be": Antiphon's `vllm_xargs`) where given."""
    import httpx

    limits = httpx.Limits(max_connections=64, max_keepalive_connections=64)
    async with httpx.AsyncClient(base_url=base_url, timeout=600, limits=limits) as client:
        async def run(system: str, prompt: str, max_tokens: int) -> tuple[float, int, float]:
            body = {"model": model, "max_tokens": max_tokens, "temperature": 0,
                    "messages": [{"role": "system", "content": system},
                                 {"role": "user", "content": prompt}],
                    "stream": True, "stream_options": {"include_usage": True}}
            if request_class is not None:
                body["vllm_xargs"] = {"request_class": request_class}
            started, first, tokens = time.perf_counter(), None, 0
            async with client.stream("POST", "/v1/chat/completions", json=body) as resp:
                resp.raise_for_status()
                async for line in resp.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    chunk = json.loads(line[len("data: "):])
                    if "error" in chunk:
                        raise RuntimeError(f"server error: {chunk['error']}")
                    if first is None and any(c["delta"].get("content")
                                             for c in chunk.get("choices", ())):
                        first = time.perf_counter()
                    if chunk.get("usage"):
                        tokens = chunk["usage"]["completion_tokens"]
            end = time.perf_counter()
            return (first or end) - started, tokens, end - started

        return await measure(run, **workload)


SYSTEMS = {"vllm": "vLLM AsyncLLM directly", "vllm_serve": "stock vLLM's server over REST",
           "antiphon": "antiphon serve over websockets",
           "antiphon_rest": "antiphon serve over REST",
           "antiphon_rest_be": "antiphon serve over REST, every request best-effort"}
MODEL_NAME = "bench-model"  # the name both servers serve the model under


def main(args: argparse.Namespace) -> int:
    from antiphon.engine_ext.model_defaults import resolve_dtype
    from antiphon.model import resolve_model

    logging.getLogger("httpx").setLevel(logging.WARNING)  # a line per request otherwise
    model_dir = resolve_model(args.model)
    # Both systems in the dtype `antiphon serve` picks for this machine (bfloat16 is emulated,
    # about 5 times slower, on CPUs without bfloat16 instructions).
    dtype = resolve_dtype("auto")
    engine = {"max_model_len": 2048, "enforce_eager": args.enforce_eager, "dtype": dtype,
              "max_num_seqs": 64, "kv_cache_memory_bytes": 2 << 30, "seed": 0,
              "enable_prefix_caching": True, "max_num_batched_tokens": 2048}
    workload = {"concurrency": (1, 16), "max_tokens": args.max_tokens,
                "rounds": 1 if args.quick else args.rounds,
                "ttft_repeats": 5 if args.quick else 10, "sustain_s": args.sustain_s}
    results: dict[str, Any] = {}
    data_dir = Path(args.out).with_suffix(".data")
    cmd = [sys.executable, "-m", "antiphon", "serve", "--model", str(model_dir),
           "--served-model-name", MODEL_NAME, "--max-model-len", "2048", "--kv-cache-gib", "2",
           "--max-num-seqs", "64", "--dtype", dtype, "--data-dir", str(data_dir)]
    cmd += ["--enforce-eager"] if args.enforce_eager else ["--no-enforce-eager"]
    cmd += args.server_arg  # an ablation: `--server-arg=--no-kv-tiering`
    # stock vLLM's server on the same engine settings (and, as for `vllm`, the compiled
    # model's reuse on CPU that `antiphon serve` has: WORKER_EXTENSION_CLS)
    stock = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model",
             str(model_dir), "--served-model-name", MODEL_NAME, "--host", "127.0.0.1",
             "--max-model-len", "2048", "--max-num-seqs", "64", "--dtype", dtype, "--seed", "0",
             "--kv-cache-memory-bytes", str(2 << 30), "--enable-prefix-caching",
             "--max-num-batched-tokens", "2048", "--worker-extension-cls",
             WORKER_EXTENSION_CLS, "--disable-uvicorn-access-log"]
    stock += ["--enforce-eager"] if args.enforce_eager else []

    def run_vllm() -> dict[str, float]:
        return asyncio.run(run_direct(model_dir, engine, **workload))

    def run_vllm_serve() -> dict[str, float]:
        with ServerProcess(stock, health_path="/health") as server:
            return asyncio.run(run_rest(server.url, MODEL_NAME, **workload))

    def run_antiphon(rest: bool = False, request_class: str | None = None
                     ) -> dict[str, float]:
        with scratch_data_dir(data_dir), ServerProcess(cmd) as server:
            return asyncio.run(run_rest(server.url, MODEL_NAME, request_class, **workload)
                               if rest else run_server(server.ws_url, **workload))

    to_run: dict[str, Callable[[], dict[str, float]]] = {
        "vllm": run_vllm, "vllm_serve": run_vllm_serve, "antiphon": run_antiphon,
        "antiphon_rest": lambda: run_antiphon(rest=True),
        "antiphon_rest_be": lambda: run_antiphon(rest=True, request_class="be")}
    names = args.systems.split(",")
    for repeat in range(args.repeats):
        # the order alternates, so a host that drifts does not always favour the same one
        for name in (names if repeat % 2 == 0 else names[::-1]):
            print(f"[repeat {repeat + 1}/{args.repeats}] {SYSTEMS[name]} ...", flush=True)
            results.setdefault(name, []).append(to_run[name]())
    systems = {name: _median_of(runs) for name, runs in results.items()}
    record = {"benchmark": "serve", "config": {"model": str(model_dir), "engine": engine,
                                              "workload": workload, "repeats": args.repeats,
                                              "server_args": args.server_arg,
                                              "machine": _machine()},
              "systems": systems, "runs": results}
    write_json(args.out, record)
    print_table(systems, baseline="vllm_serve" if "vllm_serve" in systems else names[0])
    return 0


def _median_of(runs: list[dict[str, float]]) -> dict[str, float]:
    return {k: statistics.median(r[k] for r in runs) for k in runs[0]}


def _machine() -> dict[str, Any]:
    return {"cpus": os.cpu_count(), "platform": sys.platform,
            "cpu_model": subprocess.run(["sh", "-c", "grep -m1 'model name' /proc/cpuinfo"],
                                        capture_output=True, text=True).stdout.strip(),
            "date": time.strftime("%Y-%m-%d")}


def add_parser(kinds: Any) -> None:
    p = kinds.add_parser("serve", help="server overhead against vLLM's AsyncLLM directly")
    p.add_argument("--out", default="bench-serve.json", help="JSON record to write")
    p.add_argument("--model", default=None, help="model folder (default: the default model)")
    p.add_argument("--quick", action="store_true", help="one round, eager engines (minutes)")
    p.add_argument("--rounds", type=int, default=3, help="rounds per concurrency level")
    p.add_argument("--repeats", type=int, default=1, help="run both systems this many times")
    p.add_argument("--max-tokens", type=int, default=128, help="output tokens per request")
    p.add_argument("--sustain-s", type=float, default=None,
                   help="seconds of sustained load counted per concurrency, after "
                        f"{SUSTAIN_WARMUP_S:g} s of ramp-up; 0: none (default 60; --quick: 30)")
    p.add_argument("--enforce-eager", action=argparse.BooleanOptionalAction, default=None,
                   help="skip graph compilation (default: on with --quick)")
    p.add_argument("--systems", type=names_in(SYSTEMS), default="vllm,antiphon",
                   help=f"comma-separated, run in this order (of {', '.join(SYSTEMS)}; "
                        "default vllm,antiphon)")
    p.add_argument("--server-arg", action="append", default=[], metavar="ARG",
                   help="an argument for `antiphon serve` (repeat for several; an ablation, "
                        "e.g. --server-arg=--no-kv-tiering)")
    p.set_defaults(bench_func=lambda a: main(_defaults(a)))


def _defaults(args: argparse.Namespace) -> argparse.Namespace:
    if args.enforce_eager is None:
        args.enforce_eager = bool(args.quick)
    if args.sustain_s is None:
        args.sustain_s = 30.0 if args.quick else 60.0
    if args.sustain_s < 0:
        raise SystemExit("--sustain-s: at least 0 seconds")
    return args

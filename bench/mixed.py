"""`antiphon bench mixed`: RT chat turns and BE document jobs on one engine, per policy.

For each policy, in one run and on the same engine settings: start `antiphon serve --policy P`,
submit BE document chunks (LEval) as a Batch API job so BE work saturates the engine, then
replay RT arrivals from the Azure conversation trace (ShareGPT prompts, lengths scaled to this
machine) as streaming chat completions, and measure RT TTFT/TPOT against their targets and BE
tokens per second from the server's counters over one fixed window, the same for every system.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import math
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

from antiphon.bench.args import positive_int
from antiphon.bench.host_gauge import (
    host_decode_step_s,
    host_drift,
    host_step_noise,
    plain_decode_steps,
    prefill_s_per_token,
    rt_prompt_tokens_for,
    rt_rate_for,
    window_steps,
)
from antiphon.bench.report import args_config, fmt, print_table, write_json
from antiphon.bench.serverproc import ServerProcess, scratch_data_dir
from antiphon.bench.workload import (
    RtArrival,
    azure_arrivals,
    document_chunks,
    fit_tokens,
    sharegpt_conversations,
    workload_summary,
)
from antiphon.quantiles import percentile_of_sorted
from antiphon.server.config import ServerConfig

POLICIES = ("fcfs", "priority", "bros", "hygen", "echo")
# The stock baselines run on stock vLLM's memory management too: a preempted request
# recomputes, and KV lives only in the device's prefix cache (with Antiphon's, fcfs's BE work
# was checkpointed to host RAM, and its write-through cost was in the baseline's figures).
STOCK_POLICIES = ("fcfs", "priority")
MEMORY_ARGUMENTS = {"stock": ["--no-biblocks", "--no-kv-tiering"], "antiphon": [],
                    "host": ["--ssd-tier-bytes", "0"],
                    "eager": ["--background-saves", "through"],
                    "lazy": ["--background-saves", "checkpoint"]}
# Printed per run when a benchmark repeats its systems.
KEY_METRICS = ("rt_ttft_slo_attainment", "rt_tpot_slo_attainment", "rt_normalized_latency_s",
               "rt_failed", "be_tokens_per_s", "be_recomputed_tokens", "cost_model_mape", "host_decode_step_s",
               "host_step_noise")
# Metrics whose None means "beyond every served turn" (a percentile among failed turns, a
# mean over turns one of which failed), not "not measured": averaged with other runs' values
# it made failures flatter the figure.
UNBOUNDED_WHEN_NONE = frozenset({"rt_ttft_p50_s", "rt_ttft_p99_s", "rt_normalized_latency_s"})
# A spread of host gauges between runs beyond which the table is flagged as confounded.
HOST_DRIFT_WARNING = 0.05
# `--rt-rate auto`'s calibration: requests decoding together (inside `HOST_GAUGE_REQUESTS`),
# the tokens each, and how many times. Streamed, two rounds (8 s of steps) read 4-13% above
# the gauge of the fcfs run after them in three benchmarks, and their halves differed by up to
# 30%: the host drifts within seconds, and four rounds (about 16 s) average more of it.
CALIBRATION_STREAMS = 10
CALIBRATION_TOKENS = 96
CALIBRATION_ROUNDS = 4
DEFAULT_RT_PROMPT_TOKENS = 300  # the mean RT prompt, where the host does not cut it (auto)
# Each system's runs: their metrics, by system name.
Runs = dict[str, list[dict[str, Any]]]
# A run over time: its RT turns ("rt", `rt_request`'s results) and BE rate samples ("be").
Timeline = dict[str, list[dict[str, Any]]]
# Seconds between the /metrics samples of the BE token rate over time (the plot's).
BE_SAMPLE_S = 2.0
GENERATION_TOKENS = "antiphon_generation_tokens_total"
# Seconds an idle client connection is kept open, under the server's keep-alive.
CLIENT_KEEPALIVE_S = 1.0


async def rt_request(client: httpx.AsyncClient, model: str, prompt: str, arrival: RtArrival,
                     start: float) -> dict[str, Any]:
    """One streamed RT turn at its trace time; TTFT and TPOT measured at the client, TPOT
    over the tokens the server counted (a chunk may carry several). A turn that fails (an
    error status or event, a lost connection) or ends short of its `output_tokens` is
    `failed`: it misses both targets, and its latency is spread over the tokens it got. Its
    times run from its trace arrival, not from when it was sent: a bench whose event loop
    was held then (other streams parsed, a collection) sent it late, and that wait fell out
    of its TTFT (`send_lag_s` says how late it went)."""
    sent = start + arrival.at_s
    await asyncio.sleep(max(0.0, sent - time.perf_counter()))
    send_lag_s = time.perf_counter() - sent
    first = last = None
    received, chunks, finish, error = 0, 0, None, None
    body = {"model": model, "messages": [{"role": "user", "content": prompt}], "stream": True,
            "stream_options": {"include_usage": True},
            "max_tokens": arrival.output_tokens, "temperature": 0, "ignore_eos": True}
    try:
        async with client.stream("POST", "/v1/chat/completions", json=body) as resp:
            if resp.status_code != 200:
                error = f"HTTP {resp.status_code}: {(await resp.aread())[:200]!r}"
            async for line in resp.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    error = str(chunk["error"].get("message", chunk["error"]))
                for choice in chunk.get("choices") or ():
                    if choice["delta"].get("content"):
                        last = time.perf_counter()
                        first = first or last
                        chunks += 1
                    finish = choice.get("finish_reason") or finish
                if chunk.get("usage"):
                    received = chunk["usage"]["completion_tokens"]
    except httpx.HTTPError as exc:
        error = repr(exc)
    end = time.perf_counter()
    failed = error is not None or finish != "length" or received < arrival.output_tokens
    # A stream cut short sends no usage: it got at least a token a content chunk
    received = received or chunks
    return {"at_s": arrival.at_s, "ttft_s": (first or end) - sent,
            "tpot_s": ((last or end) - (first or end)) / max(1, received - 1),
            "latency_s": end - sent, "output_tokens": received, "failed": failed,
            "send_lag_s": send_lag_s, **({"error": error} if error else {})}


def document_prompts(tokenizer: Any, seed: int) -> list[str]:
    """The BE prompts: LEval chunks of 512 to 1024 tokens (as in BROS), each after its
    document's instruction."""
    return [f"{instruction}\n\n{text}"
            for instruction, text in document_chunks(512, 1024, tokenizer, seed=seed)]


def be_batch_file(path: Path, model: str, num_items: int, max_tokens: tuple[int, int],
                  documents: list[str]) -> None:
    """The BE batch job: `num_items` of the `documents` prompts (in turn), each answered with
    `max_tokens` (a range) tokens."""
    with path.open("w") as f:
        for i in range(num_items):
            body = {"model": model, "max_tokens": max_tokens[0] + (i * 37) % (
                max_tokens[1] - max_tokens[0] + 1), "temperature": 0, "ignore_eos": True,
                "messages": [{"role": "user", "content": documents[i % len(documents)]}]}
            f.write(json.dumps({"custom_id": f"doc-{i}", "method": "POST",
                                "url": "/v1/chat/completions", "body": body}) + "\n")


def counter(metrics: str, name: str, label: str = "") -> float:
    total = 0.0
    for line in metrics.splitlines():
        if line.startswith(name) and label in line:
            total += float(line.rsplit(" ", 1)[1])
    return total


async def run_policy(server: ServerProcess, args: argparse.Namespace, prompts: list[str],
                     arrivals: list[RtArrival], batch_path: Path) -> dict[str, Any]:
    # Idle connections close on the client first, whatever the server's keep-alive: with
    # both at 5 s (httpx's and uvicorn's defaults), a turn sent on a connection the server
    # was closing failed with a ReadError, and the run with it.
    limits = httpx.Limits(keepalive_expiry=CLIENT_KEEPALIVE_S)
    async with httpx.AsyncClient(base_url=server.url, timeout=600, limits=limits) as client:
        model = (await client.get("/v1/models")).json()["data"][0]["id"]
        await rt_request(client, model, "Hello!", RtArrival(0, 8, 8), time.perf_counter())
        with batch_path.open("rb") as f:
            file_id = (await client.post("/v1/files", files={"file": f},
                                         data={"purpose": "batch"})).json()["id"]
        batch = (await client.post("/v1/batches", json={
            "input_file_id": file_id, "endpoint": "/v1/chat/completions",
            "completion_window": "24h"})).json()
        await asyncio.sleep(args.be_warmup_s)
        s0 = (await client.get("/v1/engine/stats")).json()
        m0, m0_at = await metrics_snapshot(client)
        start, start_wall = time.perf_counter(), time.time()
        turns = [asyncio.create_task(rt_request(client, model, prompts[i % len(prompts)], a,
                                                start)) for i, a in enumerate(arrivals)]
        be_rates: list[dict[str, float]] = []
        sampler = asyncio.create_task(sample_be_rate(client, start, be_rates))
        # Every system is measured over the same window, whenever its RT turns finish: a
        # window ending with a system's last turn let a system that delays turns (fcfs) count
        # BE tokens from a tail where no RT turn was arriving, and one that serves turns
        # promptly count none.
        await asyncio.sleep(max(0.0, start + measurement_window_s(args, arrivals)
                                - time.perf_counter()))
        window, end_wall = time.perf_counter() - start, time.time()
        m1, m1_at = await metrics_snapshot(client)
        s1 = (await client.get("/v1/engine/stats")).json()
        sampler.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await sampler  # (a sampler that failed says so here)
        unfinished = sum(1 for turn in turns if not turn.done())
        # A job that ran out of items inside the window measured the job's size, not the
        # system's BE throughput: the figure is then flagged, not trusted. (None: the job
        # never ran, still validating or failed whole.)
        job = (await client.get(f"/v1/batches/{batch['id']}")).json()
        counts = job["request_counts"]
        be_items_left = counts["total"] - counts["completed"] - counts["failed"] \
            if job["status"] in ("in_progress", "finalizing", "completed") else None
        results = await asyncio.gather(*turns)
        await client.post(f"/v1/batches/{batch['id']}/cancel")
    steps = s1["step_s"] - s0["step_s"]
    errors = s1["cost_model_errors"] - s0["cost_model_errors"]
    return {
        **rt_summary(results, args.ttft_slo, args.tpot_slo),
        # BE tokens between the two counter snapshots, over the time between them
        "be_tokens_per_s": (counter(m1, GENERATION_TOKENS, 'request_class="be"')
                            - counter(m0, GENERATION_TOKENS, 'request_class="be"'))
        / (m1_at - m0_at),
        "be_recomputed_tokens": s1["recomputed_tokens"]["be"] - s0["recomputed_tokens"]["be"],
        "rt_recomputed_tokens": s1["recomputed_tokens"]["rt"] - s0["recomputed_tokens"]["rt"],
        "rt_preemptions": s1["num_preemptions"]["rt"] - s0["num_preemptions"]["rt"],
        "be_preemptions": s1["num_preemptions"]["be"] - s0["num_preemptions"]["be"],
        # None (not a flattering 0) where the window ran no step
        "sched_overhead_frac": (s1["schedule_s"] - s0["schedule_s"]) / steps if steps else None,
        # over every step of the window, not the engine's rolling figure at its end
        "cost_model_mape": ((s1["cost_model_error_sum"] - s0["cost_model_error_sum"]) / errors
                            if errors else None),
        # time-weighted: steps of different lengths count by their length
        "kv_utilization": (s1["kv_usage_s"] - s0["kv_usage_s"]) / steps if steps else None,
        "pages_checkpointed": _tier_delta(s0, s1, "pages_checkpointed"),
        "pages_restored": _tier_delta(s0, s1, "pages_restored"),
        # tokens preempted work lost to a full host tier (recomputed), chunks never saved
        "checkpoint_short_tokens": _tier_delta(s0, s1, "checkpoint_short_tokens"),
        "saves_refused": _tier_delta(s0, s1, "saves_refused"),
        "rt_requests": len(results),
        "rt_unfinished_at_window_end": unfinished,
        "be_items_left_at_window_end": be_items_left,
        "window_s": window,
        "window_wall": (start_wall, end_wall),
        "timeline": {"rt": results, "be": be_rates},
    }


async def sample_be_rate(client: httpx.AsyncClient, start: float,
                         samples: list[dict[str, float]], every_s: float = BE_SAMPLE_S) -> None:
    """Append the BE token rate between successive /metrics snapshots to `samples` (`at_s`,
    seconds after `start`, and `be_tokens_per_s`) until cancelled: the plot's BE curve."""
    last: tuple[float, float] | None = None
    while True:
        text, at = await metrics_snapshot(client)
        tokens = counter(text, GENERATION_TOKENS, 'request_class="be"')
        if last is not None:
            samples.append({"at_s": (last[1] + at) / 2 - start,
                            "be_tokens_per_s": (tokens - last[0]) / (at - last[1])})
        last = (tokens, at)
        await asyncio.sleep(every_s)


def rt_summary(results: list[dict[str, Any]], ttft_slo_s: float, tpot_slo_s: float
               ) -> dict[str, Any]:
    """The RT figures of a run's turns (`rt_request`'s results, at least one). A failed turn
    misses both targets, counts as an infinite TTFT in the percentiles (its time to the error
    made refusing turns look fast; a percentile among failed turns is None), and makes the
    normalised latency, a mean over every turn, None: a turn refused at once added its
    millisecond to the mean, and left out, a turn that failed after minutes made the figure
    better than serving it. Failed turns are counted in `rt_failed`."""
    served = [r for r in results if not r["failed"]]
    ttfts = sorted(math.inf if r["failed"] else r["ttft_s"] for r in results)
    return {
        "rt_ttft_slo_attainment": sum(r["ttft_s"] <= ttft_slo_s for r in served) / len(results),
        "rt_tpot_slo_attainment": sum(r["tpot_s"] <= tpot_slo_s for r in served) / len(results),
        "rt_normalized_latency_s": statistics.mean(
            r["latency_s"] / max(1, r["output_tokens"]) for r in served)
        if len(served) == len(results) else None,
        "rt_ttft_p50_s": _finite_percentile(ttfts, 0.5),
        "rt_ttft_p99_s": _finite_percentile(ttfts, 0.99),
        "rt_failed": len(results) - len(served),
        # (how late the bench sent a turn: the times count from its arrival all the same)
        "rt_send_lag_max_s": max(r.get("send_lag_s", 0.0) for r in results),
    }


def _finite_percentile(ordered: list[float], q: float) -> float | None:
    """`percentile_of_sorted`, None where it falls among (or next to) infinite values."""
    value = percentile_of_sorted(ordered, q)
    return value if math.isfinite(value) else None


async def metrics_snapshot(client: httpx.AsyncClient) -> tuple[str, float]:
    """The server's /metrics, and when it was taken (the middle of the call)."""
    asked = time.perf_counter()
    text = (await client.get("/metrics")).text
    return text, (asked + time.perf_counter()) / 2


def measurement_window_s(args: argparse.Namespace, arrivals: list[RtArrival]) -> float:
    """Seconds from the first RT arrival over which every system's BE tokens and engine
    counters are measured: the trace plus `--window-tail-s` for the last turns to finish."""
    return max((a.at_s for a in arrivals), default=0.0) + args.window_tail_s


def _tier_delta(s0: dict[str, Any], s1: dict[str, Any], name: str) -> int:
    """A KV connector counter's growth (0 when tiering is off)."""
    return int(s1["tiering"].get(name, 0) - s0["tiering"].get(name, 0))


def main(args: argparse.Namespace) -> int:
    systems = {entry: system_arguments(entry) for entry in args.policies.split(",")}
    return run_systems(args, "mixed", systems, baseline=baseline_entry(list(systems)))


def baseline_entry(entries: list[str]) -> str:
    """The `--policies` entry the ratios are to: the first fcfs one, under whatever memory
    management or step limit (`fcfs:host`, `fcfs@1`: looked up as plain `fcfs`, it was
    reported as never finished, and the table had no ratios)."""
    return next((e for e in entries if e.partition(":")[0].partition("@")[0] == "fcfs"),
                "fcfs")


def system_arguments(entry: str) -> list[str]:
    """The `serve` arguments of a `--policies` entry, `POLICY[@SECONDS][:MEMORY]`: the policy,
    its BE step limit, and its memory management, `stock` (recompute preemption, the device's
    prefix cache alone), `antiphon` (the server's defaults: bidirectional blocks, KV tiers)
    or `host` (Antiphon's with the host tier alone: no SSD write-through), `eager` or `lazy`
    (Antiphon's with BE work's KV copied to the host tier as it fills, or only when it is
    checkpointed); by default stock for the stock policies, Antiphon's for the others."""
    entry, _, memory = entry.partition(":")
    policy, _, guard = entry.partition("@")
    if memory not in ("", *MEMORY_ARGUMENTS):
        raise ValueError(f"memory management {memory!r}: one of {', '.join(MEMORY_ARGUMENTS)}")
    if not memory:
        memory = "stock" if policy in STOCK_POLICIES else "antiphon"
    return ["--policy", policy, *(["--be-step-limit-s", guard] if guard else []),
            *MEMORY_ARGUMENTS[memory]]


def trace_duration(args: argparse.Namespace) -> float:
    """The RT trace's length: `--duration`, else 40 s with `--quick` and 120 s without; set in
    `args`, so the record's config says the length run (it said 120 s after a --quick run)."""
    if args.duration is None:
        args.duration = 40.0 if args.quick else 120.0
    return float(args.duration)


def run_systems(args: argparse.Namespace, benchmark: str, systems: dict[str, list[str]],
                baseline: str) -> int:
    """Serve the RT trace and the BE batch job `args.repeats` times per system (its extra
    `serve` arguments), on the same engine settings; write the JSON record and print the
    table of means."""
    from antiphon.model import resolve_model

    model_dir = resolve_model(args.model)
    duration = trace_duration(args)
    logging.getLogger("httpx").setLevel(logging.WARNING)  # a line per chat turn otherwise
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    tokenizer.model_max_length = int(1e30)  # documents are cut to size here, not by it
    documents = document_prompts(tokenizer, args.seed)
    is_auto = args.rt_rate is None
    if is_auto:
        print("[calibration] measuring the host's decode step for --rt-rate auto ...", flush=True)
        # set in `args`, so the record's config says the rate run and the gauge it came from
        args.rt_rate_gauge_s, args.rt_prefill_s_per_token = calibrate_host(
            args, model_dir, calibration_prompts(args, tokenizer, documents))
        args.rt_rate = rt_rate_for(args.rt_rate_gauge_s)
        print(f"[calibration] {args.rt_rate_gauge_s * 1000:.1f} ms a decode step of "
              f"{CALIBRATION_STREAMS} requests: {args.rt_rate:.2f} RT turns a second",
              flush=True)
    if args.rt_prompt_tokens is None:
        args.rt_prompt_tokens = mean_rt_prompt_tokens(args, duration, is_auto)
        if is_auto:
            print(f"[calibration] {args.rt_prefill_s_per_token * 1000:.2f} ms a prefill "
                  f"token: RT prompts of {args.rt_prompt_tokens} tokens on average",
                  flush=True)
    arrivals = azure_arrivals(duration, args.rt_rate, args.rt_prompt_tokens,
                              args.rt_output_tokens, seed=args.seed)
    conversations = sharegpt_conversations(len(arrivals), seed=args.seed)
    prompts = [fit_tokens(c[0][1], a.prompt_tokens, c[-1][1], tokenizer)
               for c, a in zip(conversations, arrivals, strict=False)]
    config = {**args_config(args), **workload_summary(arrivals, duration)}  # what ran
    out = Path(args.out)
    batch_path = out.with_suffix(".batch.jsonl")
    be_batch_file(batch_path, "SmolLM2-135M-Instruct" if args.model is None else model_dir.name,
                  args.be_items, (32, 128), documents)
    timelines: dict[str, Timeline] = {}  # of each system's last run

    def run_one(name: str, repeat: int) -> dict[str, Any]:
        print(f"[{name}] run {repeat + 1}/{args.repeats}: {len(arrivals)} RT turns over "
              f"{duration:.0f} s with BE load ...", flush=True)
        result = run_system(args, model_dir, name, systems[name], prompts, arrivals, batch_path)
        timelines[name] = result.pop("timeline")
        return result

    def summaries(runs: Runs, failures: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
        return {n: summarise_runs(r, sum(f["system"] == n for f in failures))
                for n, r in runs.items() if r}

    def record(runs: Runs, failures: list[dict[str, Any]]) -> None:
        # Written after every run, so a run stopped part way keeps what it measured.
        write_json(out, {"benchmark": benchmark, "config": config,
                         "systems": summaries(runs, failures),
                         "timelines": timelines, "failures": failures})

    runs, failures = interleaved_runs(args.repeats, list(systems), run_one, record)
    results = summaries(runs, failures)
    if not results:
        print("every run failed")
        return 1
    if baseline not in results:
        print(f"no run of {baseline} finished: no ratios to it")
    print_table({p: {k: None if v is None else float(v) for k, v in s.items() if k != "runs"}
                 for p, s in results.items()},
                baseline=baseline if baseline in results else None)
    for name, summary in results.items():
        if summary.get("runs_failed"):
            print(f"warning: {summary['runs_failed']} of {name}'s runs failed (below): its "
                  "figures are the mean of those that finished, and its ratios compare "
                  "unlike samples")
    # At most this many items run at once: with no more left to start, the job's end, not
    # the system, held its BE throughput (the fastest system, the baseline's, first).
    running = args.be_concurrency or ServerConfig.max_batch_concurrency  # (its default)
    ran_out = sorted({n for n, rs in runs.items() for r in rs
                      if (left := r.get("be_items_left_at_window_end")) is not None
                      and left <= running})
    if ran_out:
        print(f"warning: the BE job ran (nearly) out of items inside the window "
              f"({', '.join(ran_out)}): its be_tokens_per_s is the job's size, not the "
              "system's throughput; raise --be-items")
    drift = host_drift(runs)
    if drift > HOST_DRIFT_WARNING:
        print(f"warning: the host's speed differed by {drift:.0%} between runs "
              "(host_decode_step_s); compare these systems over interleaved --repeats")
    if args.repeats > 1:
        print("per run:")
        for name, rs in runs.items():
            for metric in KEY_METRICS:
                print(f"  {name} {metric}: " + ", ".join(fmt(r[metric]) for r in rs))
    _plot(timelines, out.with_suffix(".png"))
    for failure in failures:
        print(f"failed: {failure['system']} run {failure['repeat']}: {failure['error']}")
    return 1 if failures else 0


def interleaved_runs(repeats: int, names: list[str],
                     run_one: Callable[[str, int], dict[str, Any]],
                     record: Callable[[Runs, list[dict[str, Any]]], None]
                     ) -> tuple[Runs, list[dict[str, Any]]]:
    """Run each system `repeats` times, interleaved so the host's drift hits each alike,
    the order rotated each repeat (a steady drift would always land on the same system):
    `run_one(name, repeat)` for its metrics, then `record(runs so far, failures)`. A run that
    raises is recorded as failed and the runs after it go on: one lost turn must not cost
    the systems still to run. Returns each system's runs and the failures."""
    runs: Runs = {name: [] for name in names}
    failures: list[dict[str, Any]] = []
    for repeat in range(repeats):
        first = repeat % len(names)
        for name in names[first:] + names[:first]:
            try:
                runs[name].append(run_one(name, repeat))
            except Exception as exc:  # any failure of the run: server, engine or client
                print(f"[{name}] run {repeat + 1} failed: {exc!r}", flush=True)
                failures.append({"system": name, "repeat": repeat + 1, "error": repr(exc)})
            record(runs, failures)
    return runs, failures


def run_system(args: argparse.Namespace, model_dir: Path, name: str, extra: list[str],
               prompts: list[str], arrivals: list[RtArrival], batch_path: Path) -> dict[str, Any]:
    """One server start of system `name` (its extra `serve` arguments) on fresh data: the SSD
    tier of an earlier run would hold this run's BE prompts."""
    out = Path(args.out)
    data_dir = out.with_suffix(f".{name}.data")
    trace = out.with_suffix(f".{name}.steps.jsonl")
    cmd = server_command(args, model_dir, data_dir, trace, extra)
    with scratch_data_dir(data_dir), \
            ServerProcess(cmd, log_path=out.with_suffix(f".{name}.log")) as server:
        result = asyncio.run(run_policy(server, args, prompts, arrivals, batch_path))
    steps = plain_decode_steps(window_steps(trace, *result.pop("window_wall")))
    result["host_decode_step_s"] = host_decode_step_s(steps)
    result["host_step_noise"] = host_step_noise(steps)
    return result


def server_command(args: argparse.Namespace, model_dir: Path, data_dir: Path, trace: Path,
                   extra: list[str]) -> list[str]:
    """`antiphon serve` on the benchmark's engine settings, with a system's `extra` arguments,
    its data in `data_dir` and its step trace in `trace` (emptied: the scheduler appends)."""
    trace.unlink(missing_ok=True)
    cmd = [sys.executable, "-m", "antiphon", "serve", "--model", str(model_dir),
           "--max-model-len", "2048", "--num-kv-pages", str(args.kv_pages), "--rt-ttft-slo-s",
           str(args.ttft_slo), "--rt-tpot-slo-s", str(args.tpot_slo), "--data-dir",
           str(data_dir), "--step-trace", str(trace)]
    cmd += [] if args.be_step_limit_s is None else ["--be-step-limit-s", str(args.be_step_limit_s)]
    cmd += [] if args.be_concurrency is None else ["--max-batch-concurrency",
                                                   str(args.be_concurrency)]
    cmd += extra  # after the common options, so a system's own guard wins
    cmd += ["--enforce-eager"] if args.quick else []
    if args.model is None:
        cmd += ["--served-model-name", "SmolLM2-135M-Instruct"]
    return cmd


def mean_rt_prompt_tokens(args: argparse.Namespace, duration: float, calibrated: bool) -> int:
    """The mean RT prompt length where `--rt-prompt-tokens` is not given: the default, cut
    to the host (`rt_prompt_tokens_for`) where the rate was `calibrated` (`args` then holds
    the calibration's gauge and prefill cost), by the trace window's longest prompt."""
    if not calibrated:
        return DEFAULT_RT_PROMPT_TOKENS
    longest = max(a.prompt_tokens for a in azure_arrivals(
        duration, args.rt_rate, DEFAULT_RT_PROMPT_TOKENS, args.rt_output_tokens,
        seed=args.seed))
    return rt_prompt_tokens_for(args.rt_rate_gauge_s, args.rt_prefill_s_per_token,
                                args.ttft_slo, longest / DEFAULT_RT_PROMPT_TOKENS,
                                DEFAULT_RT_PROMPT_TOKENS)


def calibrate_host(args: argparse.Namespace, model_dir: Path, prompts: list[str]
                   ) -> tuple[float, float]:
    """The host gauge (`host_decode_step_s`, seconds) and the seconds a prefill token adds to
    a step (`prefill_s_per_token`; 0 where unmeasured) of one server start of the baseline,
    stock fcfs, on the benchmark's engine settings, decoding `prompts` together for
    `CALIBRATION_TOKENS` tokens each, `CALIBRATION_ROUNDS` times: what `--rt-rate auto`
    scales the RT trace's rate and prompt lengths by."""
    out = Path(args.out)
    data_dir, trace = out.with_suffix(".calibration.data"), out.with_suffix(
        ".calibration.steps.jsonl")
    cmd = server_command(args, model_dir, data_dir, trace, system_arguments("fcfs"))
    with scratch_data_dir(data_dir), \
            ServerProcess(cmd, log_path=out.with_suffix(".calibration.log")) as server:
        start, end = asyncio.run(decode_together(server.url, prompts))
    steps = window_steps(trace, start, end)
    gauge = host_decode_step_s(plain_decode_steps(steps))
    if not gauge:
        raise RuntimeError(f"the calibration ran no decode step of {CALIBRATION_STREAMS} "
                           f"requests (its steps: {trace}); give --rt-rate")
    return gauge, prefill_s_per_token(steps)


async def decode_together(url: str, prompts: list[str],
                          transport: httpx.AsyncBaseTransport | None = None
                          ) -> tuple[float, float]:
    """Send every prompt at once, `CALIBRATION_ROUNDS` times, for `CALIBRATION_TOKENS` tokens
    each, to the server at `url` (through `transport` where given); the wall-clock window
    (`time.time()`) of the rounds. Not streamed: the runs' plain decode steps are mostly BE
    work, which no client streams. A failed turn fails the calibration: its steps would not
    be the gauge's."""
    async with httpx.AsyncClient(base_url=url, timeout=600, transport=transport) as client:
        model = (await client.get("/v1/models")).json()["data"][0]["id"]
        start = time.time()
        for _ in range(CALIBRATION_ROUNDS):
            errors = await asyncio.gather(*(decode_one(client, model, p) for p in prompts))
            if failed := [e for e in errors if e is not None]:
                raise RuntimeError(f"a calibration turn failed: {failed[0]}")
        return start, time.time()


async def decode_one(client: httpx.AsyncClient, model: str, prompt: str) -> str | None:
    """One chat completion of `CALIBRATION_TOKENS` tokens, not streamed: None, or what went
    wrong."""
    body = {"model": model, "messages": [{"role": "user", "content": prompt}],
            "max_tokens": CALIBRATION_TOKENS, "temperature": 0, "ignore_eos": True}
    try:
        resp = await client.post("/v1/chat/completions", json=body)
    except httpx.HTTPError as exc:
        return repr(exc)
    if resp.status_code != 200:
        return f"HTTP {resp.status_code}: {resp.text[:200]!r}"
    tokens = resp.json().get("usage", {}).get("completion_tokens", 0)
    return None if tokens >= CALIBRATION_TOKENS else f"{tokens} of {CALIBRATION_TOKENS} tokens"


def calibration_prompts(args: argparse.Namespace, tokenizer: Any,
                        documents: list[str]) -> list[str]:
    """`CALIBRATION_STREAMS` prompts, half RT chat turns of `--rt-prompt-tokens` and half the
    first BE `documents` (`document_prompts`), as the benchmark's plain decode steps mix them."""
    num_rt = CALIBRATION_STREAMS // 2
    chats = sharegpt_conversations(num_rt, seed=args.seed)
    length = args.rt_prompt_tokens or DEFAULT_RT_PROMPT_TOKENS
    return ([fit_tokens(c[0][1], length, c[-1][1], tokenizer) for c in chats]
            + documents[:CALIBRATION_STREAMS - num_rt])


def summarise_runs(runs: list[dict[str, Any]], num_failed: int = 0) -> dict[str, Any]:
    """The mean of every metric over a system's repeated runs (over those that measured
    it; None where none did), and the runs themselves; `runs_failed` where `num_failed` more
    raised (their turns are in no figure: a table without it read as every run's)."""
    mean = {}
    for key in runs[0]:
        values = [r[key] for r in runs if r.get(key) is not None]
        if key in UNBOUNDED_WHEN_NONE and any(key in r and r[key] is None for r in runs):
            values = []  # one run's percentile among failed turns: the mean is unbounded
        mean[key] = statistics.mean(values) if values else None
    summary = {**mean, "runs": runs} if len(runs) > 1 else mean
    return {**summary, "runs_failed": num_failed} if num_failed else summary


def _plot(timelines: dict[str, Timeline], path: Path) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot")
        return
    fig, (rt, be) = plt.subplots(2, 1, figsize=(9, 7), sharex=True)
    for policy, timeline in timelines.items():
        rows = timeline["rt"]
        rt.plot([r["at_s"] for r in rows], [r["ttft_s"] for r in rows], ".-", label=policy,
                alpha=0.7)
        be.plot([r["at_s"] for r in timeline["be"]],
                [r["be_tokens_per_s"] for r in timeline["be"]], "-", label=policy, alpha=0.7)
    rt.set_ylabel("RT TTFT (s)")
    rt.set_yscale("log")
    rt.legend()
    be.set_xlabel("seconds into the run (RT: arrival)")
    be.set_ylabel("BE tokens/s")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


def add_parser(kinds: Any) -> None:
    p = kinds.add_parser("mixed", help="RT chat and BE batch jobs on one engine, per policy")
    p.add_argument("--out", default="bench-mixed.json")
    p.add_argument("--policies", default=",".join(POLICIES),
                   help="comma-separated; POLICY@SECONDS runs POLICY with that BE step limit "
                        "(--be-step-limit-s, the arrival guard), e.g. bros@inf for none; "
                        "POLICY:stock, POLICY:antiphon, POLICY:host, POLICY:eager or "
                        "POLICY:lazy with that memory management (default: stock for fcfs "
                        "and priority, Antiphon's for the others)")
    add_workload_arguments(p, kv_pages=64, rt_rate=None)
    p.set_defaults(bench_func=main)


def rt_rate_arg(text: str) -> float | None:
    """`--rt-rate`: RT turns a second, or `auto` (None) for the rate that loads this host as
    the reference host was loaded (`host_gauge.rt_rate_for`)."""
    if text == "auto":
        return None
    value = float(text)
    if not 0 < value < math.inf:
        raise argparse.ArgumentTypeError(f"must be a number above 0, or auto; got {text}")
    return value


def add_workload_arguments(p: argparse.ArgumentParser, kv_pages: int,
                           rt_rate: float | None) -> None:
    """The RT trace, BE job and engine settings `run_systems` reads."""
    p.add_argument("--model", default=None)
    p.add_argument("--quick", action="store_true", help="40 s traces, eager engines")
    p.add_argument("--duration", type=float, default=None,
                   help="RT trace length (s; default 120, with --quick 40)")
    p.add_argument("--rt-rate", type=rt_rate_arg, default=rt_rate,
                   help="RT arrivals per second, or auto: scaled to this host's speed, measured "
                        "by one server start before the runs (default "
                        f"{'auto' if rt_rate is None else rt_rate})")
    p.add_argument("--rt-prompt-tokens", type=positive_int, default=None,
                   help=f"mean RT prompt length (default {DEFAULT_RT_PROMPT_TOKENS}; with "
                        "--rt-rate auto, less on a host too slow to prefill the trace's longest "
                        "prompt alone within half the TTFT target)")
    p.add_argument("--rt-output-tokens", type=int, default=48, help="mean RT output length")
    p.add_argument("--be-items", type=int, default=400, help="BE chunks in the batch job")
    p.add_argument("--be-concurrency", type=positive_int, default=None,
                   help="BE items running on the engine at once (serve "
                        "--max-batch-concurrency); default the server's")
    p.add_argument("--be-warmup-s", type=float, default=5.0)
    p.add_argument("--window-tail-s", type=float, default=20.0,
                   help="BE tokens and engine counters are measured from the first RT arrival "
                        "to this long after the last, the same window for every system")
    p.add_argument("--kv-pages", type=int, default=kv_pages,
                   help="KV pool size (128-token pages)")
    p.add_argument("--ttft-slo", type=float, default=1.0)
    p.add_argument("--tpot-slo", type=float, default=0.1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--repeats", type=positive_int, default=1,
                   help="runs of each system, interleaved; the table shows their means")
    p.add_argument("--be-step-limit-s", type=float, default=None,
                   help="every system's arrival guard (serve --be-step-limit-s); default none")

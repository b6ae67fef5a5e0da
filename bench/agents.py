"""`antiphon bench agents`: concurrent agent workflows with and without call-graph advisories.

Several copies of the example three-role workflow (`antiphon.agents.workflows`: architect,
engineer, reviewer; seven model calls, each role in its own session) run at once against one
fresh `antiphon serve` per system, on a KV pool and a host tier too small for all their
sessions, so contexts leave the device, and host memory, between a role's calls. `hints`: the
roles announce the next calls from the call graph (advisories); `no_hints`: none. Both keep KV tiers on. Reported per system: workflow time,
per-call TTFT (client side), advisory lead time, and the share of the calls' prior context
(each session's previous prompt and reply) that the server computed again.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from antiphon.bench.report import args_config, print_table, write_json
from antiphon.bench.serverproc import ServerProcess, scratch_data_dir
from antiphon.bench.sessions_metrics import COUNTERS, counter_deltas
from antiphon.quantiles import percentile

SYSTEMS = ("no_hints", "hints")
TASKS = (
    "a command-line todo list that saves to a JSON file",
    "a URL shortener with an in-memory store",
    "a unit converter for lengths and weights",
    "a tiny markdown to HTML converter",
    "a rate limiter class with a token bucket",
    "a CSV summary tool that prints column means",
    "a word frequency counter for text files",
    "a retrying HTTP fetch helper with backoff",
)


def recomputed_prompt_frac(calls: list[Any], computed_prompt_tokens: int) -> float | None:
    """Prior context of every call (its session's previous prompt and reply) against what the
    server computed beyond the calls' new tokens."""
    prior_total = new_total = 0
    last: dict[tuple[int, str], int] = {}
    for copy, c in calls:
        prior = last.get((copy, c.role), 0)
        prior_total += prior
        new_total += max(0, c.prompt_tokens - prior)
        last[(copy, c.role)] = c.prompt_tokens + c.completion_tokens
    if not prior_total:
        return None
    return min(1.0, max(0, computed_prompt_tokens - new_total) / prior_total)


async def run_system(url: str, hints: bool, copies: int, max_tokens: int,
                     stagger_s: float) -> dict[str, Any]:
    from antiphon.agents import AsyncAntiphon
    from antiphon.agents.workflows import run_workflow

    async with AsyncAntiphon(url, timeout_s=600) as client:
        before = (await client.stats()).get("tiering") or {}

        async def one(i: int) -> tuple[float, Any]:
            await asyncio.sleep(i * stagger_s)
            start = time.perf_counter()
            env = await run_workflow(client, TASKS[i % len(TASKS)], hints=hints,
                                     max_tokens=max_tokens, title_prefix=f"w{i}-")
            return time.perf_counter() - start, env

        runs = await asyncio.gather(*(one(i) for i in range(copies)))
        after = (await client.stats()).get("tiering") or {}
    calls = [(i, c) for i, (_, env) in enumerate(runs) for c in env.calls]
    leads = [c.advisory_lead_s for _, c in calls if c.advisory_lead_s is not None]
    tiering = counter_deltas(before, after) or dict.fromkeys(COUNTERS, 0)
    return {
        "workflow_s_p50": statistics.median(w for w, _ in runs),
        "call_ttft_p50_s": percentile([c.ttft_s for _, c in calls], 0.5),
        "call_ttft_p99_s": percentile([c.ttft_s for _, c in calls], 0.99),
        "advisory_lead_s_p50": percentile(leads, 0.5) if leads else 0.0,
        "recomputed_prompt_frac": recomputed_prompt_frac(calls,
                                                         tiering["computed_prompt_tokens"]),
        "calls": len(calls),
        "advisories_sent": sum(env.hooks.num_advisories for _, env in runs),
        **{k: tiering[k] for k in ("advisories_used", "advisories_late", "advisories_reclaimed",
                                   "tokens_from_host", "tokens_from_ssd", "turns_held",
                                   "turns_fetched_in_step", "ssd_fetches_cut", "fetch_retries",
                                   "saves_refused")},
    }


def main(args: argparse.Namespace) -> int:
    from antiphon.model import resolve_model

    model_dir = resolve_model(args.model)
    copies = 4 if args.quick and args.copies is None else (args.copies or 8)
    out = Path(args.out)
    results: dict[str, dict[str, Any]] = {}
    for name in args.systems.split(","):
        if name not in SYSTEMS:
            raise SystemExit(f"unknown system {name!r}; expected {', '.join(SYSTEMS)}")
        print(f"[{name}] {copies} concurrent workflows ...", flush=True)
        data_dir = out.with_suffix(f".{name}.data")
        cmd = [sys.executable, "-m", "antiphon", "serve", "--model", str(model_dir),
               "--max-model-len", "2048", "--num-kv-pages", str(args.kv_pages),
               "--kv-tiering", "--host-tier-bytes", str(args.host_tier_mib << 20),
               "--data-dir", str(data_dir)]
        cmd += ["--enforce-eager"] if args.quick else []
        with scratch_data_dir(data_dir), \
                ServerProcess(cmd, log_path=out.with_suffix(f".{name}.log")) as server:
            results[name] = asyncio.run(run_system(server.url, name == "hints", copies,
                                                   args.max_tokens, args.stagger_s))
        write_json(out, {"benchmark": "agents", "config": args_config(args) | {"copies": copies},
                         "systems": results})
    # (a figure no run measured, None, shows as n/a: shown as 0, a run with no prior context
    # read as one that recomputed none of it)
    print_table({n: {k: None if v is None else float(v) for k, v in s.items()}
                 for n, s in results.items()},
                baseline="no_hints" if "no_hints" in results else next(iter(results)))
    return 0


def add_parser(kinds: Any) -> None:
    p = kinds.add_parser("agents", help="agent workflows with and without call-graph advisories")
    p.add_argument("--out", default="bench-agents.json")
    p.add_argument("--model", default=None)
    p.add_argument("--quick", action="store_true", help="4 workflows, eager engines")
    p.add_argument("--copies", type=int, default=None, help="concurrent workflows (default 8)")
    p.add_argument("--systems", default=",".join(SYSTEMS))
    p.add_argument("--kv-pages", type=int, default=20, help="KV pool size (128-token pages)")
    p.add_argument("--host-tier-mib", type=int, default=48,
                   help="host KV tier size; small, so sessions also leave host memory for SSD")
    p.add_argument("--max-tokens", type=int, default=64, help="reply budget per call")
    p.add_argument("--stagger-s", type=float, default=1.0, help="between workflow starts")
    p.set_defaults(bench_func=main)

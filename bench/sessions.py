"""`antiphon bench sessions`: chat sessions whose KV outgrows the engine's pool, per system.

ShareGPT conversations (at least 3 user turns) are replayed as concurrent simulated users.
Between turns each user reads the reply (238 words/min), then types the next message (52
words/min); a `typing` advisory fires when typing starts. The number of users is swept from what
a small KV pool holds to about 4x more, on each system in one run:

    vllm             stock vLLM's OpenAI server, prefix caching on; the client keeps the history
    tiers            `antiphon serve --kv-tiering` over websockets, no advisories
    advisory         the same, with a typing advisory before every follow-up turn
    advisory_miss10  the same, with 10% of the advisories dropped (seeded)

Stock vLLM runs on a server of its own. The Antiphon systems differ only in their clients, so
they share one server: at each point they run one after another (the order rotated from point
to point), each under an API key of its own, which salts its KV apart from the others' (no
system finds another's conversations cached). One engine start differs from the next by a few
percent, as much as the 10%-missed advisories' cost that `advisory_miss10` measures.

Per turn: client TTFT and TPOT, prompt and cached tokens, and how much of the prior context was
recomputed (`sessions_metrics`), which is what tiering exists to avoid. While it reads the
reply before a follow-up (the reading and typing time before it: seconds to minutes, scaled by
`--time-scale`), a user sends the follow-up's message alone as a fresh one-turn chat: the TTFT
that message costs with no context to bring back, under the load of that same point (a
prober that went through the messages on its own was done, at most points, before the first
follow-up). The probe never holds the follow-up back: that goes at its think time, and each
turn records how late it went all the same (`send_lag_s`, per point its max and p99).

The JSON record is written after each server's systems are done, marked `"complete": false`
until the last (with the error that ended the run, if one did): a failed turn ends the run,
and keeps what was measured before it.

The KV pool holds `--pool-users` whole conversations at their last turn, so the lowest user
counts fit and the highest need several times the pool (vLLM's prefix cache then evicts and
recomputes; Antiphon's tiers keep the rest).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import logging
import math
import random
import shlex
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any

import httpx

from antiphon.bench.args import names_in, positive_int
from antiphon.bench.report import args_config, write_json
from antiphon.bench.serverproc import ServerProcess
from antiphon.bench.sessions_clients import ChatClient, OpenAIChat, TurnResult, WsChat
from antiphon.bench.sessions_metrics import (
    COUNTERS,
    POINT_METRICS,
    counter_deltas,
    merge_runs,
    summarise_point,
    turn_records,
)
from antiphon.bench.sessions_report import report
from antiphon.engine_ext.config import WORKER_EXTENSION_CLS

READ_WPM = 238.0  # words a minute a user reads a reply at
TYPE_WPM = 52.0  # words a minute a user types a message at
MIN_USER_TURNS = 3
# Memory both servers may take for KV; the pool itself is capped in pages (Antiphon's default;
# it also spares vLLM's CPU backend reserving most of the machine's memory).
KV_CACHE_GIB = 2
# Sizes of the run; --quick fits 10 minutes on 2 CPU cores with all four systems.
QUICK = {"users": "2,4,16", "pool_users": 5, "max_turns": 4, "max_tokens": 32,
         "max_message_tokens": 96, "time_scale": 0.08}
FULL = {"users": "4,8,16,32", "pool_users": 8, "max_turns": 4, "max_tokens": 256,
        "max_message_tokens": 256, "time_scale": 1.0}


@dataclasses.dataclass(frozen=True)
class System:
    name: str
    is_stock_vllm: bool
    advisory_miss: float | None  # fraction of typing advisories dropped; None: sends none


SYSTEMS = {s.name: s for s in (System("vllm", True, None), System("tiers", False, None),
                               System("advisory", False, 0.0),
                               System("advisory_miss10", False, 0.1))}


@dataclasses.dataclass(frozen=True)
class Sweep:
    users: tuple[int, ...]
    messages: tuple[tuple[tuple[str, ...], ...], ...]  # [point][user]: its user messages
    max_model_len: int
    kv_pages: int  # KV pool size, one page of it vLLM's null block
    pages_per_user: float  # mean KV pages of one conversation at its last turn


def think_time_s(reply: str, message: str, time_scale: float) -> tuple[float, float]:
    """(reading, typing) seconds before `message` is sent: the user reads `reply`, then types
    `message`; both times `time_scale`, which shrinks a run without changing its shape."""
    return (len(reply.split()) / READ_WPM * 60.0 * time_scale,
            len(message.split()) / TYPE_WPM * 60.0 * time_scale)


def advisory_flags(num_turns: Sequence[int], miss: float | None,
                   rng: random.Random) -> list[tuple[bool, ...]]:
    """Per user (of `num_turns` turns each) and turn, whether a typing advisory precedes it.
    Never before a first turn (there is no KV to bring back yet). Of the other turns, exactly
    `round(miss * count)` go without, drawn at random: a Bernoulli draw per turn would drop
    anywhere from none to twice the share at a sweep point of a few dozen turns."""
    if miss is None:
        return [(False,) * n for n in num_turns]
    followups = [(user, turn) for user, n in enumerate(num_turns) for turn in range(1, n)]
    dropped = set(rng.sample(followups, round(miss * len(followups))))
    return [(False, *((user, turn) not in dropped for turn in range(1, n)))
            for user, n in enumerate(num_turns)]


def kv_bytes_per_token(model_config: dict[str, Any], dtype_bytes: int = 2) -> int:
    """KV cache bytes of one token (K and V, every layer) of a Hugging Face `config.json`."""
    heads = model_config["num_attention_heads"]
    head_dim = model_config.get("head_dim") or model_config["hidden_size"] // heads
    kv_heads = model_config.get("num_key_value_heads") or heads
    return 2 * model_config["num_hidden_layers"] * kv_heads * head_dim * dtype_bytes


def pool_pages(context_tokens: Sequence[int], pool_users: int, page_tokens: int,
               max_model_len: int) -> tuple[int, float]:
    """(pages, mean pages of one conversation): the pool holds `pool_users` whole
    conversations at their last turn, and at least one request of `max_model_len`, besides the
    page vLLM keeps back (its null block)."""
    per_user = sum(math.ceil(t / page_tokens) for t in context_tokens) / len(context_tokens)
    usable = max(math.ceil(pool_users * per_user), math.ceil(max_model_len / page_tokens))
    return usable + 1, per_user


def build_sweep(args: argparse.Namespace, model_dir: Path) -> Sweep:
    """Fresh conversations per sweep point, messages cut to `max_message_tokens`, and the
    engine sized from their rendered length with every reply at `max_tokens`."""
    from transformers import AutoTokenizer

    from antiphon.bench.workload import cut_tokens, sharegpt_conversations

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    users = tuple(int(u) for u in args.users.split(","))
    convs = iter(sharegpt_conversations(sum(users), MIN_USER_TURNS, seed=args.seed))

    def context_tokens(messages: tuple[str, ...]) -> int:
        chat = [{"role": role, "content": m if role == "user" else ""}
                for m in messages for role in ("user", "assistant")]
        text = tokenizer.apply_chat_template(chat, tokenize=False)
        return len(tokenizer.encode(text, add_special_tokens=False)) + len(
            messages) * args.max_tokens

    def cut(text: str) -> str:
        return cut_tokens(text, args.max_message_tokens, tokenizer)

    messages = tuple(tuple(tuple(cut(t) for r, t in next(convs) if r == "user")[:args.max_turns]
                           for _ in range(n)) for n in users)
    sizes = [context_tokens(m) for point in messages for m in point]
    # A page of slack: replies may tokenise longer once rendered back into the history.
    max_model_len = (math.ceil(max(sizes) / args.page_tokens) + 1) * args.page_tokens
    pages, per_user = pool_pages(sizes, args.pool_users, args.page_tokens, max_model_len)
    return Sweep(users, messages, max_model_len, args.kv_pages or pages, per_user)


Probe = Callable[[int, str], Awaitable[None]]  # (turn, message) -> its fresh TTFT recorded


async def run_user(chat: ChatClient, messages: Sequence[str], advise: Sequence[bool],
                   time_scale: float, probe: Probe | None = None) -> list[TurnResult]:
    """One simulated user's conversation: type, send, read the reply, type the next, each
    turn sent at its think time and its `send_lag_s` how much later it went. Each follow-up
    is probed (`probe`) from when the reply before it is read, beside the reading, typing and
    send, never holding them back: awaited before the send, a probe that outlasted reading
    and typing (stock vLLM's, at many users) sent the follow-up late, so that system's users
    thought longer than the reading and typing rates say and offered less load (found by a
    review). A user's probes go one after another (one connection beside its own), and all
    are done when it returns."""
    results: list[TurnResult] = []
    probes: asyncio.Future[None] | None = None  # the latest probe, run after those before it
    type_s = think_time_s("", messages[0], time_scale)[1]
    due = time.perf_counter() + type_s
    try:
        async with chat:  # (opened while the first message is typed: not late for it)
            for turn, message in enumerate(messages):
                if not turn:
                    await asyncio.sleep(due - time.perf_counter())
                else:
                    read_s, type_s = think_time_s(results[-1].text, message, time_scale)
                    due = time.perf_counter() + read_s + type_s
                    if probe is not None:
                        probes = asyncio.ensure_future(
                            _probe_after(probes, probe, turn, message))
                    await asyncio.sleep(read_s)
                    await type_message(chat, type_s, advise[turn])
                send_lag_s = time.perf_counter() - due
                results.append(dataclasses.replace(await chat.turn(message),
                                                   send_lag_s=send_lag_s))
        if probes is not None:
            await probes
    finally:
        if probes is not None and not probes.done():
            probes.cancel()
    return results


async def _probe_after(previous: asyncio.Future[None] | None, probe: Probe, turn: int,
                       message: str) -> None:
    """`probe` of `turn`'s `message` once the probe before it (`previous`) is done."""
    if previous is not None:
        await previous
    await probe(turn, message)


ChatFactory = Callable[[int], ChatClient]  # max_tokens -> a new conversation
CounterReader = Callable[[], Awaitable[dict[str, Any] | None]]  # the server's tiering counters


# As the browser UI does while a typing burst goes on (`TYPING_REFRESH_MS` in
# web_ui/static/composer.js), under the engine's advisory TTL (30 s): at full scale a third of
# the messages took longer than that to type, and their one advisory had expired.
TYPING_REFRESH_S = 15.0


async def type_message(chat: ChatClient, type_s: float, advise: bool) -> None:
    """Type for `type_s` seconds, advising (`advise`) when typing starts and every
    `TYPING_REFRESH_S` after while it goes on."""
    while True:
        if advise:
            await chat.typing()
        if type_s <= TYPING_REFRESH_S or not advise:
            await asyncio.sleep(type_s)
            return
        await asyncio.sleep(TYPING_REFRESH_S)
        type_s -= TYPING_REFRESH_S


def fresh_prober(chat: ChatFactory, user: int, fresh: dict[tuple[int, int], float]) -> Probe:
    """A probe of `user`'s follow-ups: each message alone in a new chat, its TTFT into
    `fresh[user, turn]`."""
    async def probe(turn: int, message: str) -> None:
        async with chat(1) as c:
            fresh[user, turn] = (await c.turn(message)).ttft_s
    return probe


async def measure_point(chat: ChatFactory, read_counters: CounterReader, system: System,
                        users: int, messages: Sequence[Sequence[str]],
                        args: argparse.Namespace,
                        ) -> tuple[dict[str, float | None], dict[str, int] | None, list[dict]]:
    """All `users` conversations at once, each follow-up probed as a fresh prompt; (metrics,
    the server's tiering counters over the point, per-turn records)."""
    rng = random.Random(f"{args.seed}/{users}")
    before = await read_counters()
    advised = advisory_flags([len(m) for m in messages], system.advisory_miss, rng)
    fresh: dict[tuple[int, int], float] = {}
    try:
        per_user = await asyncio.gather(*(
            run_user(chat(args.max_tokens), m, flags, args.time_scale,
                     fresh_prober(chat, user, fresh))
            for user, (m, flags) in enumerate(zip(messages, advised, strict=True))))
    except Exception as exc:  # which point of the sweep failed, besides how
        raise RuntimeError(f"{system.name} at {users} users: a conversation failed: "
                           f"{exc!r}") from exc
    tiering = counter_deltas(before, await read_counters())
    records = [r for user, results in enumerate(per_user)
               for r in turn_records(users, user, results, advised[user])]
    for r in records:
        r["fresh_ttft_s"] = fresh.get((r["user"], r["turn"]))
    metrics = summarise_point(records, tiering, system.is_stock_vllm)
    print(f"[{system.name}] {users} users: " + " ".join(
        f"{k}={v:.3f}" for k, v in metrics.items() if v is not None), flush=True)
    if tiering and not system.is_stock_vllm:
        print(f"[{system.name}] {users} users: tiering " + " ".join(
            f"{k}={v}" for k, v in tiering.items()), flush=True)
    return metrics, tiering, records


def system_key(system: System) -> str:
    """The API key a system's clients use on the shared Antiphon server."""
    return f"bench-{system.name}-key"


async def measure_systems(systems: Sequence[System], server: ServerProcess, sweep: Sweep,
                          args: argparse.Namespace, rotate: int = 0) -> dict[str, Any]:
    """The whole sweep of each of `systems` on one running server (stock vLLM alone; the
    Antiphon systems each with its key): at point `p` they run one after another, in their
    order rotated by `rotate + p`. Returns each system's result by name."""
    # (idle connections dropped after 1 s, as `bench mixed` does: at httpx's 5 s, vLLM's
    # uvicorn keep-alive, a request could go out on a connection the server was closing)
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None,
                          keepalive_expiry=1.0)
    is_stock = systems[0].is_stock_vllm
    headers = {} if is_stock else {"Authorization": f"Bearer {system_key(systems[0])}"}
    async with httpx.AsyncClient(base_url=server.url, timeout=600, limits=limits,
                                 headers=headers) as http:
        model = (await http.get("/v1/models")).json()["data"][0]["id"]

        def chat_of(system: System) -> ChatFactory:
            def chat(max_tokens: int) -> ChatClient:
                if system.is_stock_vllm:
                    return OpenAIChat(http, model, max_tokens)
                return WsChat(f"{server.ws_url}?api_key={system_key(system)}", max_tokens)
            return chat

        async def read_counters() -> dict[str, Any] | None:
            if is_stock:  # no tiers: nothing ever comes from host or SSD
                return dict.fromkeys(COUNTERS, 0)
            stats = (await http.get("/v1/engine/stats")).json()
            tiering = stats.get("tiering")
            if tiering is not None:  # how often running RT turns lost their pages to others
                preemptions = stats.get("num_preemptions") or {}
                tiering["rt_preemptions"] = preemptions.get("rt", 0)
                tiering["rt_recomputed_tokens"] = (stats.get("recomputed_tokens") or {}).get(
                    "rt", 0)
            return tiering

        async with chat_of(systems[0])(4) as warm_up:  # first-request costs stay out
            await warm_up.turn("Hello!")
        results: dict[str, dict[str, Any]] = {
            s.name: {"users": list(sweep.users), "tiering": [], "turns": [],
                     **{k: [] for k in POINT_METRICS}} for s in systems}
        for point, (users, messages) in enumerate(zip(sweep.users, sweep.messages,
                                                      strict=True)):
            shift = (rotate + point) % len(systems)
            for system in (*systems[shift:], *systems[:shift]):
                metrics, tiering, records = await measure_point(
                    chat_of(system), read_counters, system, users, messages, args)
                result = results[system.name]
                for k in POINT_METRICS:
                    result[k].append(metrics[k])
                result["tiering"].append(tiering)
                result["turns"] += records
        # Every tiering counter at the end, per tier too (puts refused, misses, evictions):
        # what a prefetch that failed leaves behind (all systems on the server together).
        final = None if is_stock else await read_counters()
        for result in results.values():
            result["tiering_final"] = final
    return results


def server_command(system: System, model_dir: Path, sweep: Sweep, args: argparse.Namespace,
                   tmp: Path, num_sharing: int = 1) -> list[str]:
    """The same engine shape and dtype (`args.dtype`) for every system; the Antiphon ones with
    their tiers in `tmp`, an API key for each Antiphon system, and tiers `num_sharing` times
    `args`' sizes: as much room as each of the systems sharing the server had alone, where
    the KV the others leave behind competes for it as its own stale KV did."""
    from antiphon.model import DEFAULT_MODEL_NAME

    name = DEFAULT_MODEL_NAME if args.model is None else model_dir.name
    engine = ["--model", str(model_dir), "--served-model-name", name, "--max-model-len",
              str(sweep.max_model_len), "--max-num-seqs", "64", "--max-num-batched-tokens",
              str(max(2048, sweep.max_model_len)), "--dtype", args.dtype, "--seed", "0"]
    engine += ["--enforce-eager"] if args.enforce_eager else []
    if system.is_stock_vllm:
        # the compiled model's reuse on CPU, as `antiphon serve` has it (WORKER_EXTENSION_CLS)
        return [sys.executable, "-m", "vllm.entrypoints.openai.api_server", *engine,
                "--worker-extension-cls", WORKER_EXTENSION_CLS,
                "--host", "127.0.0.1", "--enable-prefix-caching", "--enable-prompt-tokens-details",
                "--num-gpu-blocks-override", str(sweep.kv_pages), "--kv-cache-memory-bytes",
                str(KV_CACHE_GIB << 30), "--disable-uvicorn-access-log"]
    keys = [arg for s in SYSTEMS.values() if not s.is_stock_vllm
            for arg in ("--api-keys", system_key(s))]
    # each user's websocket, and its probe's beside it while that runs (past the per-key
    # defaults of 64 at 64 users, where a user's turn was refused and the point failed)
    most = 2 * max(sweep.users) + 8
    limits = ["--max-connections-per-key", str(most), "--max-inflight-per-key", str(most),
              "--max-connections", str(max(512, most))]
    return [sys.executable, "-m", "antiphon", "serve", *engine, *keys, *limits, "--num-kv-pages",
            str(sweep.kv_pages), "--kv-cache-gib", str(KV_CACHE_GIB), "--data-dir",
            str(tmp / "data"), "--kv-tiering", "--ssd-dir", str(tmp / "ssd"), "--host-tier-bytes",
            str(num_sharing * args.host_tier_bytes), "--ssd-tier-bytes",
            str(num_sharing * args.ssd_tier_bytes),
            *(["--policy", args.policy] if args.policy else []), *shlex.split(args.serve_extra)]


def alternated(groups: list[list[Any]], repeat: int) -> list[list[Any]]:
    """The non-empty `groups` in the order repeat `repeat` runs them: reversed every other
    repeat, so a host that drifts favours none (stock vLLM ran first in every repeat)."""
    present = [group for group in groups if group]
    return present if repeat % 2 == 0 else present[::-1]


def main(args: argparse.Namespace) -> int:
    import torch

    from antiphon.engine_ext.model_defaults import resolve_dtype
    from antiphon.model import resolve_model

    logging.getLogger("httpx").setLevel(logging.WARNING)  # a line per chat turn otherwise
    model_dir = resolve_model(args.model)
    sweep = build_sweep(args, model_dir)
    args.dtype = resolve_dtype("auto")  # what `antiphon serve` runs: float32 where bf16 is emulated
    pool_bytes = sweep.kv_pages * args.page_tokens * kv_bytes_per_token(
        json.loads((model_dir / "config.json").read_text()), getattr(torch, args.dtype).itemsize)
    args.host_tier_bytes = args.host_tier_bytes or 2 * pool_bytes
    args.ssd_tier_bytes = args.ssd_tier_bytes or 16 * pool_bytes
    config = {**args_config(args),
              "model": str(model_dir), "read_wpm": READ_WPM, "type_wpm": TYPE_WPM,
              "max_model_len": sweep.max_model_len, "kv_pages": sweep.kv_pages,
              "kv_pool_bytes": pool_bytes, "pages_per_user": round(sweep.pages_per_user, 2),
              "pool_fill": [round(u * sweep.pages_per_user / (sweep.kv_pages - 1), 2)
                            for u in sweep.users]}
    # The Antiphon systems share one server, whose tiers are that many times the sizes above
    # (`server_command`): what each system found room in, with the others' KV beside its own.
    names = args.systems.split(",")
    sharing = sum(not SYSTEMS[n].is_stock_vllm for n in names)
    if sharing:
        config |= {"antiphon_systems_sharing_server": sharing,
                   "server_host_tier_bytes": sharing * args.host_tier_bytes,
                   "server_ssd_tier_bytes": sharing * args.ssd_tier_bytes}
    print("config: " + json.dumps(config), flush=True)
    out = Path(args.out)
    runs = measure_all([SYSTEMS[n] for n in names], model_dir, sweep, args, config, out)
    report(sessions_record(config, runs, complete=True), out)
    return 0


def measure_all(systems: Sequence[System], model_dir: Path, sweep: Sweep,
                args: argparse.Namespace, config: dict[str, Any], out: Path,
                ) -> dict[str, list[dict[str, Any]]]:
    """Every repeat of each server's systems (stock vLLM's, the Antiphon ones'; in
    `alternated` order); each system's runs by name. After each server, what was measured so
    far is written to `out`, incomplete (`sessions_record`): one failed turn ended the run
    and took every finished system's results with it (found by a review). On a failure it
    is written with the error, which goes on up (the command fails)."""
    runs: dict[str, list[dict[str, Any]]] = {s.name: [] for s in systems}
    groups = [[s for s in systems if s.is_stock_vllm], [s for s in systems if not s.is_stock_vllm]]
    try:
        for repeat in range(args.repeats):
            for group in alternated(groups, repeat):
                label = "vllm" if group[0].is_stock_vllm else "antiphon"
                if args.repeats > 1:
                    print(f"[{label}] run {repeat + 1}/{args.repeats}", flush=True)
                with tempfile.TemporaryDirectory(prefix=f"antiphon-bench-{label}-") as tmp:
                    cmd = server_command(group[0], model_dir, sweep, args, Path(tmp),
                                         len(group))
                    with ServerProcess(cmd, log_path=out.with_suffix(f".{label}.log"),
                                       health_path="/health" if label == "vllm" else "/healthz",
                                       ) as server:
                        measured = asyncio.run(measure_systems(group, server, sweep, args,
                                                               repeat))
                for name, result in measured.items():
                    runs[name].append(result)
                write_json(out, sessions_record(config, runs, complete=False))
    except BaseException as exc:  # a SIGTERM (`timeout`) or Ctrl-C too: the record says so
        error = f"{type(exc).__name__}: {exc}"
        write_json(out, sessions_record(config, runs, complete=False, error=error))
        print(f"bench sessions stopped ({error}); what was measured before is in {out}",
              file=sys.stderr, flush=True)
        raise
    return runs


def sessions_record(config: dict[str, Any], runs: dict[str, list[dict[str, Any]]],
                    complete: bool, error: str | None = None) -> dict[str, Any]:
    """The JSON record of the systems with a run (`runs`, by name; each merged over its
    repeats); `complete` false while a run is still to come or where one failed (`error`)."""
    return {"benchmark": "sessions", "complete": complete,
            **({"error": error} if error is not None else {}), "config": config,
            "systems": {name: merge_runs(r) for name, r in runs.items() if r}}


def add_parser(kinds: Any) -> None:
    p = kinds.add_parser("sessions", help="multi-turn sessions beyond the KV pool, per system")
    p.add_argument("--out", default="bench-sessions.json", help="JSON record (and .png) to write")
    p.add_argument("--model", default=None, help="model folder (default: the default model)")
    p.add_argument("--quick", action="store_true",
                   help="a run that fits 10 minutes on 2 CPU cores, eager engines")
    p.add_argument("--systems", default=",".join(SYSTEMS), type=names_in(SYSTEMS),
                   help="comma-separated systems to run (default: all)")
    p.add_argument("--users", help="comma-separated concurrent users per sweep point"
                   + _sizes("users"))
    p.add_argument("--max-turns", type=int,
                   help="user turns per conversation at most" + _sizes("max_turns"))
    p.add_argument("--max-tokens", type=int,
                   help="output tokens per turn at most" + _sizes("max_tokens"))
    p.add_argument("--max-message-tokens", type=int,
                   help="user messages cut to this length" + _sizes("max_message_tokens"))
    p.add_argument("--time-scale", type=float,
                   help="factor on reading and typing times" + _sizes("time_scale"))
    p.add_argument("--pool-users", type=int,
                   help="the KV pool holds this many whole conversations" + _sizes("pool_users"))
    p.add_argument("--kv-pages", type=int, default=None,
                   help="KV pool size in pages (default: from --pool-users)")
    p.add_argument("--page-tokens", type=int, default=128,
                   help="tokens per KV page, for sizing (vLLM's block size: 128 on CPU)")
    p.add_argument("--host-tier-bytes", type=int, default=None,
                   help="Antiphon's host tier (default: twice the KV pool)")
    p.add_argument("--ssd-tier-bytes", type=int, default=None,
                   help="Antiphon's SSD tier (default: 16 times the KV pool)")
    p.add_argument("--enforce-eager", action=argparse.BooleanOptionalAction, default=None,
                   help="skip graph compilation (default: on with --quick)")
    p.add_argument("--policy", default=None,
                   help="Antiphon's scheduling policy (default: serve's default)")
    p.add_argument("--serve-extra", default="",
                   help="more `antiphon serve` options for the Antiphon systems, e.g. "
                        "'--step-trace steps.jsonl'")
    p.add_argument("--repeats", type=positive_int, default=1,
                   help="sweeps per system, the systems alternated; each point's metrics are "
                        "the median over them (one engine start differs from the next by a few "
                        "percent)")
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(bench_func=lambda a: main(_defaults(a)))


def _sizes(key: str) -> str:
    return f" (default {FULL[key]}; --quick: {QUICK[key]})"


def _defaults(args: argparse.Namespace) -> argparse.Namespace:
    for key, value in (QUICK if args.quick else FULL).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.enforce_eager is None:
        args.enforce_eager = bool(args.quick)
    return args

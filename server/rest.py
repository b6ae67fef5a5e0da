"""REST endpoints besides the OpenAI ones: sessions, advisories, health and metrics."""

from __future__ import annotations

import logging
import math
from typing import Annotated, Any

from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field

from antiphon.server.completions import require_served_model
from antiphon.server.context import AppContext
from antiphon.server.errors import ApiError, ErrorCode
from antiphon.server.http import authorize, read_model
from antiphon.server.protocol import ID_PATTERN, AdvisoryPriority, StrictBool, StrictFloat

logger = logging.getLogger(__name__)

router = APIRouter()


class NewSession(BaseModel):
    model_config = ConfigDict(extra="forbid")
    title: Annotated[str, Field(max_length=200)] | None = None
    system: str | None = None  # the system message the model sees first


class SessionUpdate(BaseModel):
    model_config = ConfigDict(extra="forbid")
    title: Annotated[str, Field(min_length=1, max_length=200)]


class Advisory(BaseModel):
    """Symphony's advisory request: a turn of `session_id` is coming."""

    model_config = ConfigDict(extra="forbid")
    session_id: Annotated[str, Field(pattern=ID_PATTERN)]
    model_id: str | None = None
    # numbers and flags of their JSON types, as everywhere in the API ("3" is not 3)
    expected_arrival: Annotated[StrictFloat, Field(ge=0)] | None = None  # seconds from now
    # Its turn comes after those of the ordered advisories the key sent before it.
    ordered: StrictBool = False
    priority: AdvisoryPriority = None


def _ctx(request: Request) -> AppContext:
    return request.app.state.ctx


@router.get("/v1/sessions")
async def list_sessions(request: Request, before: str | None = None) -> dict[str, Any]:
    """The most recent sessions; `?before=` a listing's `next_before` gives the next page."""
    ctx, owner = _ctx(request), authorize(request)
    sessions, next_before = await ctx.turns.list_recent(owner, before)
    return {"sessions": [s.to_json(listed=True) for s in sessions], "has_more": next_before is not None,
            "next_before": next_before}


@router.post("/v1/sessions", status_code=201)
async def create_session(request: Request) -> dict[str, Any]:
    ctx, owner = _ctx(request), authorize(request)
    body = await read_model(request, NewSession, may_be_empty=True)  # `curl -X POST` works
    session, _ = await ctx.turns.open(owner, None, body.title, body.system)
    return session.to_json()


@router.get("/v1/sessions/{session_id}")
async def get_session(session_id: str, request: Request) -> dict[str, Any]:
    ctx, owner = _ctx(request), authorize(request)
    session, messages = await ctx.turns.open(owner, session_id)
    return {"session": session.to_json(), "messages": [m.to_json() for m in messages],
            "replying": ctx.turns.is_replying(session_id)}


@router.patch("/v1/sessions/{session_id}")
async def update_session(session_id: str, request: Request) -> dict[str, Any]:
    ctx, owner = _ctx(request), authorize(request)
    body = await read_model(request, SessionUpdate)
    return (await ctx.turns.rename(owner, session_id, body.title)).to_json()


@router.delete("/v1/sessions/{session_id}", status_code=204)
async def delete_session(session_id: str, request: Request) -> Response:
    ctx, owner = _ctx(request), authorize(request)
    await ctx.turns.delete(owner, session_id)
    return Response(status_code=204)


@router.post("/v1/advisory", status_code=202)
async def advisory(request: Request) -> dict[str, Any]:
    ctx, owner = _ctx(request), authorize(request)
    ctx.chat.check_open()
    body = await read_model(request, Advisory)
    if body.model_id is not None:
        require_served_model(ctx.chat, body.model_id)
    lead = ctx.config.server.max_advisory_lead_s
    if body.expected_arrival is not None and body.expected_arrival > lead:
        raise ApiError(ErrorCode.BAD_MESSAGE, f"expected_arrival is {body.expected_arrival} s "
                       f"away; the limit is {lead} s")
    # Each one a key records at once is an engine call answered between steps (the
    # websocket's typing advisories count against --max-inflight-per-connection)
    slot = ctx.advisories_per_key.take(owner)
    try:
        advised = await ctx.turns.record_advisory(owner, body.session_id, "rest",
                                                  body.expected_arrival,
                                                  priority=body.priority or 0,
                                                  ordered=body.ordered)
    finally:
        slot.release()
    return {"accepted": True, "session_id": body.session_id,
            "context_tokens_held": advised.context_tokens_held, "repeat": advised.repeat}


@router.get("/healthz")
async def healthz(request: Request) -> Response:
    ctx = _ctx(request)
    health = await ctx.engine.health()
    ok = ctx.is_ready and health.is_healthy
    return JSONResponse({"status": "ok" if ok else "unavailable", "model": health.model,
                         "num_unfinished_requests": health.num_unfinished_requests,
                         "detail": health.detail}, status_code=200 if ok else 503)


@router.get("/v1/engine/stats")
async def engine_stats(request: Request) -> dict[str, Any]:
    """The scheduler's counters: steps, scheduling time, preemptions and recomputed tokens per
    request class, cost-model error, policy and batch size."""
    authorize(request)
    engine = _ctx(request).engine
    return {**await engine.scheduler_stats(), "tiering": await engine.tiering_stats()}


@router.get("/v1/dashboard")
async def dashboard(request: Request, since: float | None = None) -> dict[str, Any]:
    """The live dashboard's time series: points sampled after `since` (unix seconds), or all
    kept. See `server/dashboard.py` for the fields."""
    authorize(request)
    if since is not None and not math.isfinite(since):
        raise ApiError(ErrorCode.BAD_MESSAGE, "since must be a finite number of seconds")
    return _ctx(request).dashboard.snapshot(since)


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    """Prometheus text. With API keys it needs one (its counters describe every key's load),
    unless `--public-metrics`."""
    ctx = _ctx(request)
    if not ctx.config.server.public_metrics:
        authorize(request)
    try:
        engine = (scheduler_metrics_text(await ctx.engine.scheduler_stats())
                  + tiering_metrics_text(await ctx.engine.tiering_stats()))
    except Exception as exc:  # vLLM's engine refuses them while it drains on a signal
        logger.warning("the engine's metrics are left out: %s", exc)
        engine = b""
    return Response(ctx.metrics.render() + engine, media_type="text/plain; version=0.0.4")


def scheduler_metrics_text(stats: dict[str, Any]) -> bytes:
    """Prometheus text for the scheduler's counters (they live in the EngineCore process)."""
    if not stats:
        return b""
    lines = [
        "# HELP antiphon_scheduler_steps_total Engine steps scheduled",
        "# TYPE antiphon_scheduler_steps_total counter",
        f"antiphon_scheduler_steps_total {stats['num_steps']}",
        "# HELP antiphon_scheduler_seconds_total Time spent in the scheduler",
        "# TYPE antiphon_scheduler_seconds_total counter",
        f"antiphon_scheduler_seconds_total {stats['schedule_s']}",
        "# HELP antiphon_step_seconds_total Time spent executing scheduled steps",
        "# TYPE antiphon_step_seconds_total counter",
        f"antiphon_step_seconds_total {stats.get('step_s', 0.0)}",
        "# HELP antiphon_preemptions_total Requests preempted, by class",
        "# TYPE antiphon_preemptions_total counter",
        *(f'antiphon_preemptions_total{{request_class="{c}"}} {n}'
          for c, n in stats["num_preemptions"].items()),
        "# HELP antiphon_recomputed_tokens_total Tokens computed again after a preemption",
        "# TYPE antiphon_recomputed_tokens_total counter",
        *(f'antiphon_recomputed_tokens_total{{request_class="{c}"}} {n}'
          for c, n in stats["recomputed_tokens"].items()),
    ]
    if stats.get("queues"):
        lines += ["# HELP antiphon_engine_requests Requests in the engine's scheduler now, "
                  "waiting or running, by class",
                  "# TYPE antiphon_engine_requests gauge"]
        lines += [f'antiphon_engine_requests{{state="{state}",request_class="{c}"}} {n}'
                  for state, counts in stats["queues"].items() for c, n in counts.items()]
    lines += [
        "# HELP antiphon_kv_utilization_sum KV pool use (fraction of pages) summed over steps",
        "# TYPE antiphon_kv_utilization_sum counter",
        f"antiphon_kv_utilization_sum {stats.get('kv_usage_sum', 0.0)}",
        "# HELP antiphon_integrity_problems_total Bidirectional-block invariants found broken",
        "# TYPE antiphon_integrity_problems_total counter",
        f"antiphon_integrity_problems_total {stats.get('integrity_problems', 0)}",
    ]
    lines += biblocks_metrics_lines(stats.get("biblocks"))
    if stats.get("cost_model_mape") is not None:
        lines += ["# HELP antiphon_cost_model_mape Cost model mean absolute percentage error",
                  "# TYPE antiphon_cost_model_mape gauge",
                  f"antiphon_cost_model_mape {stats['cost_model_mape']}"]
    return ("\n".join(lines) + "\n").encode()


def biblocks_metrics_lines(blocks: dict[str, Any] | None) -> list[str]:
    """Bidirectional shared blocks: page occupancy by class, blocks in use and shared, and the
    placement counters (none when the engine runs without them)."""
    if not blocks:
        return []
    lines = ["# HELP antiphon_biblocks_pages KV pages held in shared blocks, by request class",
             "# TYPE antiphon_biblocks_pages gauge",
             f'antiphon_biblocks_pages{{request_class="rt"}} {blocks["pages_rt"]}',
             f'antiphon_biblocks_pages{{request_class="be"}} {blocks["pages_be"]}',
             "# HELP antiphon_biblocks_blocks Shared blocks: in use, shared by RT and BE, total",
             "# TYPE antiphon_biblocks_blocks gauge"]
    lines += [f'antiphon_biblocks_blocks{{kind="{kind}"}} {blocks[f"blocks_{kind}"]}'
              for kind in ("used", "shared", "total")]
    lines += ["# HELP antiphon_biblocks_placements_total Pages placed, by how",
              "# TYPE antiphon_biblocks_placements_total counter"]
    lines += [f'antiphon_biblocks_placements_total{{kind="{kind}"}} {blocks[kind]}'
              for kind in ("new_blocks", "overflows", "strays")]
    return [
        *lines,
        "# HELP antiphon_biblocks_collisions_total RT pages taken from a preempted BE tail",
        "# TYPE antiphon_biblocks_collisions_total counter",
        f"antiphon_biblocks_collisions_total {blocks['collisions']}",
    ]


# Counters of the KV connector: (name in its stats, metric name, help).
_TIERING_COUNTERS = (
    ("prompt_tokens", "antiphon_kv_prompt_tokens_total", "Prompt tokens of admitted turns"),
    ("computed_prompt_tokens", "antiphon_kv_computed_prompt_tokens_total",
     "Prompt tokens the model computed (not found in any KV tier)"),
    ("advisories_received", "antiphon_kv_advisories_received_total",
     "Advisories that reached the engine"),
    ("advisories_renewed", "antiphon_kv_advisories_renewed_total",
     "Advisories for a session whose live advisory held the same KV: that one kept longer"),
    ("advisories_used", "antiphon_kv_advisories_used_total",
     "Advisories whose session's turn arrived before they expired"),
    ("advisories_late", "antiphon_kv_advisories_late_total",
     "Advisories whose turn arrived before the prefetch finished"),
    ("prefetches_failed", "antiphon_kv_prefetches_failed_total",
     "Used advisories whose prefetch ended without some of its KV (gone from the SSD tier, "
     "or no host room)"),
    ("advisories_expired", "antiphon_kv_advisories_expired_total",
     "Advisories that expired unused"),
    ("advisories_dropped", "antiphon_kv_advisories_dropped_total",
     "Advisories let go unused before their expiry: replaced by a newer one of their "
     "session, or their session deleted"),
    ("advisories_reclaimed", "antiphon_kv_advisories_reclaimed_total",
     "Advisories whose prefetched KV was given up for a running turn's host room, or an "
     "advisory expected sooner"),
    ("chunk_layers_forgotten", "antiphon_kv_chunk_layers_forgotten_total",
     "Chunk-layers of KV erased from the tiers because their session was deleted"),
    ("tail_layers_retired", "antiphon_kv_tail_layers_retired_total",
     "Copies of partial-chunk KV layers erased from a tier because a later save holds their "
     "tokens (a turn's tail, covered by its follow-up's chunk or tail)"),
    ("turns_held", "antiphon_kv_turns_held_total",
     "Turns held to a later step for their SSD fetch"),
    ("turns_fetched_in_step", "antiphon_kv_turns_fetched_in_step_total",
     "Turns whose SSD fetch came up within the step that admitted them"),
    ("fetch_retries", "antiphon_kv_fetch_retries_total",
     "Turns' fetches from SSD sent again because other fetches took their host room"),
    ("saves_refused", "antiphon_kv_saves_refused_total",
     "Chunks of KV not saved because every host slot was pinned (to be recomputed)"),
    ("ssd_fetches_cut", "antiphon_kv_ssd_fetches_cut_total",
     "Fetches from SSD (for a turn or an advisory) that outgrew the host tier's room: the "
     "leading chunks come up, the rest stays below (a turn recomputes it)"),
    ("checkpoints", "antiphon_kv_checkpoints_total",
     "Preempted requests whose KV was checkpointed to the tiers instead of dropped"),
    ("pages_checkpointed", "antiphon_kv_pages_checkpointed_total",
     "KV pages copied to the host tier at a preemption (not yet written through)"),
    ("pages_handed_over", "antiphon_kv_pages_handed_over_total",
     "KV pages of preempted requests that a tier already held (given up at no cost)"),
    ("checkpoint_short_tokens", "antiphon_kv_checkpoint_short_tokens_total",
     "Tokens of preempted requests recomputed: the full host tier could not take them, "
     "a full tier evicted them, or their restore loaded less"),
    ("restores", "antiphon_kv_restores_total", "Checkpointed requests admitted again"),
    ("pages_restored", "antiphon_kv_pages_restored_total",
     "KV pages checkpointed requests loaded back from the tiers"),
    ("copy_steps_failed", "antiphon_kv_copy_steps_failed_total",
     "Engine steps whose KV page copies failed in the worker (their saves were dropped)"),
    ("prefetches_timed", "antiphon_kv_prefetches_timed_total",
     "Used advisories whose prefetch finished before their turn came (the two sums below "
     "are over these)"),
    ("prefetch_load_s_sum", "antiphon_kv_prefetch_load_seconds_total",
     "Advisory to prefetched KV in host memory, summed over timed prefetches"),
    ("prefetch_lead_s_sum", "antiphon_kv_prefetch_lead_seconds_total",
     "Prefetch done to the turn's arrival, summed over timed prefetches"),
)


def tiering_metrics_text(stats: dict[str, Any]) -> bytes:
    """Prometheus text for the KV connector's counters (they live in the EngineCore process)."""
    if not stats:
        return b""
    lines = ["# HELP antiphon_kv_tokens_total Prompt tokens served, by where their KV came from",
             "# TYPE antiphon_kv_tokens_total counter",
             *(f'antiphon_kv_tokens_total{{tier="{tier}"}} {stats[f"tokens_from_{tier}"]}'
               for tier in ("device", "host", "ssd"))]
    for key, name, help_text in _TIERING_COUNTERS:
        lines += [f"# HELP {name} {help_text}", f"# TYPE {name} counter", f"{name} {stats[key]}"]
    lines += ["# HELP antiphon_kv_tier_bytes KV tier occupancy and capacity",
              "# TYPE antiphon_kv_tier_bytes gauge"]
    for tier, t in stats["tiers"].items():
        lines += [f'antiphon_kv_tier_bytes{{tier="{tier}",kind="used"}} {t["used_bytes"]}',
                  f'antiphon_kv_tier_bytes{{tier="{tier}",kind="capacity"}} {t["capacity_bytes"]}']
    lines += ["# HELP antiphon_kv_tier_reads_total Chunk-layer reads of each tier, by outcome: "
              "the host tier's by turns' loads (a hit: found there when the turn was admitted; a "
              "miss: fetched from below first), the SSD tier's by fetches into the host tier",
              "# TYPE antiphon_kv_tier_reads_total counter"]
    for tier, t in stats["tiers"].items():
        lines += [f'antiphon_kv_tier_reads_total{{tier="{tier}",outcome="hit"}} {t["hits"]}',
                  f'antiphon_kv_tier_reads_total{{tier="{tier}",outcome="miss"}} {t["misses"]}']
    return ("\n".join(lines) + "\n").encode()

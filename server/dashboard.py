"""The live dashboard's data: a time series the server samples itself and serves as JSON.

Every `dashboard_interval_s` the sampler reads the server's counters, the requests that finished
since the last sample, and the engine's scheduler and KV tier counters, and keeps one point of
rates, windowed latency quantiles and occupancies. `GET /v1/dashboard?since=T` answers the points
after T, so a page draws the recent history at once and then follows with small polls.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from typing import Any

from antiphon.engine_ext.engine import Engine
from antiphon.quantiles import percentile
from antiphon.server.metrics import FinishedRequest, ServerMetrics

logger = logging.getLogger(__name__)

# The KV connector's counters, followed as per-window deltas.
_TIER_COUNTERS = ("prompt_tokens", "computed_prompt_tokens", "tokens_from_device",
                  "tokens_from_host", "tokens_from_ssd", "advisories_received",
                  "advisories_used", "advisories_expired", "prefetches_timed",
                  "prefetch_lead_s_sum", "prefetch_load_s_sum")


class Dashboard:
    def __init__(self, metrics: ServerMetrics, engine: Engine, targets_s: tuple[float, float],
                 interval_s: float, history: int) -> None:
        """`targets_s`: the deployment's (TTFT, TPOT) targets of RT requests, drawn as lines."""
        self.metrics = metrics
        self.engine = engine
        self.targets_s = targets_s
        self.interval_s = interval_s
        self.points: deque[dict[str, Any]] = deque(maxlen=history)
        self._last: dict[str, float] | None = None
        self._last_at = time.monotonic()
        self.stopped = False  # the server is shutting down: no more samples

    async def run(self) -> None:
        """Sample until `stopped` (the app cancels this task at the end of a shutdown; during
        its drain, vLLM's engine refuses the calls a sample makes, once a signal reached it)."""
        while not self.stopped:
            try:
                await self.sample()
            except Exception:  # a failed sample leaves a gap in the charts, nothing worse
                logger.exception("dashboard sample failed")
            await asyncio.sleep(self.interval_s)

    def snapshot(self, since: float | None = None) -> dict[str, Any]:
        points = [p for p in self.points if since is None or p["t"] > since]
        return {"interval_s": self.interval_s, "model": self.engine.model_name,
                "targets": {"ttft_s": self.targets_s[0], "tpot_s": self.targets_s[1]},
                "points": points}

    async def sample(self) -> dict[str, Any]:
        """Take one point now and keep it."""
        sched = await self.engine.scheduler_stats()
        tiers = await self.engine.tiering_stats()
        now = time.monotonic()
        dt = max(1e-6, now - self._last_at)
        counters = self._counters(tiers)
        last = self._last if self._last is not None else counters
        delta = {k: v - last.get(k, 0.0) for k, v in counters.items()}
        self._last, self._last_at = counters, now
        point = {"t": time.time(), **_latencies(self.metrics.take_finished(), dt),
                 **self._server_point(delta, dt), **_engine_point(sched, tiers, delta, counters)}
        self.points.append(point)
        return point

    def _counters(self, tiers: dict[str, Any]) -> dict[str, float]:
        m = self.metrics
        counters = {f"{c}_tokens": m.value("antiphon_generation_tokens_total", request_class=c)
                    for c in ("rt", "be")}
        counters["advisories_sent"] = m.total("antiphon_advisories_total")
        counters.update({k: float(tiers[k]) for k in _TIER_COUNTERS if k in tiers})
        return counters

    def _server_point(self, delta: dict[str, float], dt: float) -> dict[str, Any]:
        """Token rates of the window, and requests in flight and queued now."""
        m = self.metrics
        return {"rt_tokens_per_s": delta["rt_tokens"] / dt,
                "be_tokens_per_s": delta["be_tokens"] / dt,
                "rt_inflight": m.value("antiphon_inflight_requests", request_class="rt"),
                "be_inflight": m.value("antiphon_inflight_requests", request_class="be"),
                "be_queued": m.value("antiphon_batch_queue_items")}


def _latencies(finished: list[FinishedRequest], dt: float) -> dict[str, Any]:
    """Request rates and latency quantiles of the requests that finished in the window."""
    rt = [r for r in finished if r.request_class == "rt"]
    be = [r for r in finished if r.request_class == "be"]
    rt_ttft = [r.ttft_s for r in rt if r.ttft_s is not None]
    rt_tpot = [r.tpot_s for r in rt if r.tpot_s is not None]
    judged = [r.met_slo for r in rt if r.met_slo is not None]
    return {"rt_finished": len(rt), "be_finished": len(be),
            "rt_per_s": len(rt) / dt, "be_per_s": len(be) / dt,
            "rt_ttft_p50_s": percentile(rt_ttft, 0.5), "rt_ttft_p95_s": percentile(rt_ttft, 0.95),
            "rt_tpot_p50_s": percentile(rt_tpot, 0.5), "rt_tpot_p95_s": percentile(rt_tpot, 0.95),
            "be_ttft_p50_s": percentile([r.ttft_s for r in be if r.ttft_s is not None], 0.5),
            "rt_slo_attainment": sum(judged) / len(judged) if judged else None}


def _ratio(num: float, den: float) -> float | None:
    return num / den if den > 0 else None


def _engine_point(sched: dict[str, Any], tiers: dict[str, Any], delta: dict[str, float],
                  totals: dict[str, float]) -> dict[str, Any]:
    """The engine's side of a point: queues, KV occupancy per tier, where the window's prompt
    tokens came from, tier hit rates, prefetch timing, advisories."""
    point: dict[str, Any] = {
        "policy": sched.get("policy"), "engine_waiting": sched.get("num_waiting"),
        "engine_running": sched.get("num_running"), "kv_device_used": sched.get("kv_usage"),
        "advisories_sent_total": totals["advisories_sent"]}
    if not tiers:
        return point
    for name, tier in tiers["tiers"].items():
        point[f"kv_{name}_used"] = _ratio(tier["used_bytes"], tier["capacity_bytes"])
    # Hit rate of a tier: of the prompt tokens looked up in it (those the faster tiers did not
    # hold), the share it held. Lookups go device, host, SSD, in that order.
    asked_host = delta["prompt_tokens"] - delta["tokens_from_device"]
    asked_ssd = asked_host - delta["tokens_from_host"]
    point["kv_host_hit_rate"] = _ratio(delta["tokens_from_host"], asked_host)
    point["kv_ssd_hit_rate"] = _ratio(delta["tokens_from_ssd"], asked_ssd)
    # Averages over the prefetches that finished before their turn: a late or reclaimed one,
    # or one with nothing to bring, adds no time to the sums.
    timed = delta["prefetches_timed"]
    point.update({
        "prompt_tokens_from": {"device": delta["tokens_from_device"],
                               "host": delta["tokens_from_host"],
                               "ssd": delta["tokens_from_ssd"],
                               "computed": delta["computed_prompt_tokens"]},
        "prefetch_lead_s": _ratio(delta["prefetch_lead_s_sum"], timed),
        "prefetch_load_s": _ratio(delta["prefetch_load_s_sum"], timed),
        "advisories_received_total": totals["advisories_received"],
        "advisories_used_total": totals["advisories_used"],
        "advisories_expired_total": totals["advisories_expired"]})
    return point

"""The dashboard's points from the engine's counters: windowed deltas, tier hit rates, prefetch
times, occupancy."""

from __future__ import annotations

from typing import Any

from antiphon.engine_ext.scripted import ScriptedEngine
from antiphon.server.dashboard import Dashboard
from antiphon.server.metrics import FinishedRequest, ServerMetrics


class CountingEngine(ScriptedEngine):
    """Reports whatever counters the test sets."""

    def __init__(self) -> None:
        super().__init__()
        self.tiers: dict[str, Any] = {}
        self.sched: dict[str, Any] = {}

    async def tiering_stats(self) -> dict[str, Any]:
        return self.tiers

    async def scheduler_stats(self) -> dict[str, Any]:
        return self.sched


def tier_stats(prompt: int, device: int, host: int, ssd: int, used: int, timed: int,
               lead_s: float, load_s: float) -> dict[str, Any]:
    return {"prompt_tokens": prompt, "tokens_from_device": device, "tokens_from_host": host,
            "tokens_from_ssd": ssd, "computed_prompt_tokens": prompt - device - host - ssd,
            "advisories_received": used + 1, "advisories_used": used, "advisories_expired": 0,
            "prefetches_timed": timed, "prefetch_lead_s_sum": lead_s,
            "prefetch_load_s_sum": load_s,
            "tiers": {"host": {"used_bytes": 25, "capacity_bytes": 100},
                      "ssd": {"used_bytes": 1, "capacity_bytes": 1000}}}


async def test_points_are_window_deltas_of_the_engine_counters() -> None:
    engine, metrics = CountingEngine(), ServerMetrics()
    dash = Dashboard(metrics, engine, (1.0, 0.1), interval_s=1.0, history=10)
    engine.sched = {"policy": "bros", "kv_usage": 0.5, "num_waiting": 2, "num_running": 3}
    engine.tiers = tier_stats(100, 50, 10, 0, used=1, timed=1, lead_s=2.0, load_s=0.5)
    await dash.sample()
    # Of the window's 4 used advisories, 2 had a prefetch that finished before their turn (the
    # others were late, or had nothing to bring): the times average over those 2.
    engine.tiers = tier_stats(300, 50, 110, 40, used=5, timed=3, lead_s=5.0, load_s=0.9)
    metrics.finished.extend([FinishedRequest("rt", 0.2, 0.05, True),
                             FinishedRequest("rt", 0.4, 0.2, False),
                             FinishedRequest("be", 1.0, 0.1, None)])
    point = await dash.sample()
    # 200 new prompt tokens: none on the device, 100 of 200 looked up on the host found there,
    # 40 of the other 100 on SSD.
    assert point["prompt_tokens_from"] == {"device": 0, "host": 100, "ssd": 40, "computed": 60}
    assert point["kv_host_hit_rate"] == 0.5 and point["kv_ssd_hit_rate"] == 0.4
    assert point["prefetch_lead_s"] == 1.5 and abs(point["prefetch_load_s"] - 0.2) < 1e-9
    assert point["kv_host_used"] == 0.25 and point["kv_device_used"] == 0.5
    assert (point["rt_finished"], point["be_finished"]) == (2, 1)
    assert point["rt_slo_attainment"] == 0.5
    assert abs(point["rt_ttft_p50_s"] - 0.3) < 1e-9
    assert point["policy"] == "bros" and point["engine_waiting"] == 2
    assert len(dash.snapshot()["points"]) == 2
    assert dash.snapshot(since=point["t"])["points"] == []
    engine.tiers = tier_stats(300, 50, 110, 40, used=6, timed=3, lead_s=5.0, load_s=0.9)
    late_only = await dash.sample()  # one late advisory used: no prefetch time to show
    assert late_only["prefetch_lead_s"] is None and late_only["prefetch_load_s"] is None


async def test_an_engine_without_tiers_still_gives_points() -> None:
    dash = Dashboard(ServerMetrics(), ScriptedEngine(), (1.0, 0.1), interval_s=1.0, history=2)
    for _ in range(3):
        point = await dash.sample()
    assert "kv_host_used" not in point and point["rt_slo_attainment"] is None
    assert len(dash.snapshot()["points"]) == 2  # history bound


def test_rt_attainment_counts_turns_the_engine_failed_or_users_gave_up_on() -> None:
    """Counted over completed requests only, the attainment rose as an overloaded server
    failed turns or its users gave up waiting (found by a review). A turn the engine failed
    missed; one cancelled past its TTFT target missed it; one cancelled in time is not the
    server's miss and is not judged."""
    import time

    from antiphon.engine_ext.types import GenerationParams, RequestClass
    from antiphon.server.chat import ChatService, Generation
    from antiphon.server.config import ServerConfig
    from antiphon.server.dashboard import _latencies

    metrics = ServerMetrics()
    chat = ChatService(engine=None, metrics=metrics, config=ServerConfig())  # type: ignore[arg-type]

    def record(waited_s: float, tokens: int, outcome: str, engine_failed: bool = False
               ) -> None:
        gen = Generation("r", [1, 2, 3], GenerationParams(max_tokens=8,
                                                          request_class=RequestClass.RT))
        gen.arrival = time.perf_counter() - waited_s - 0.01 * tokens
        if tokens:
            gen.first_token_at = gen.arrival + waited_s
            gen.last_token_at = gen.first_token_at + 0.01 * (tokens - 1)
            gen.num_output_tokens = tokens
        gen.finish_reason = "cancelled" if outcome == "cancelled" else None
        chat._record(gen, "openai", outcome, engine_failed)

    record(0.2, 8, "ok")  # on time
    record(0.1, 0, "cancelled")  # stopped in time: not judged
    assert _latencies(metrics.take_finished(), 1.0)["rt_slo_attainment"] == 1.0
    record(0.2, 8, "ok")
    record(9.0, 0, "cancelled")  # gave up past the TTFT target
    record(9.0, 0, "error", engine_failed=True)
    assert _latencies(metrics.take_finished(), 1.0)["rt_slo_attainment"] == 1 / 3
    missed = metrics.value("antiphon_rt_slo_requests_total", target="ttft", met="false")
    assert missed == 2

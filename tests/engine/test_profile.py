"""`antiphon profile`'s machinery against the real engine: a tiny grid, fitted and stored."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from antiphon.engine_ext.costfit import fit_path, load_fit, save_fit
from antiphon.engine_ext.costforms import FORMS
from antiphon.engine_ext.profiler import TINY, grid_points, profile
from antiphon.engine_ext.vllm_engine import VllmEngine

pytestmark = pytest.mark.engine


async def test_a_tiny_profile_fits_stores_and_installs_a_cost_model(
        engine: VllmEngine, tmp_path: Path) -> None:
    fit, steps = await profile(engine, TINY)

    assert {s.group for s in steps} == set(range(len(grid_points(TINY, engine.limits()))))
    assert all(s.latency_s > 0 for s in steps)
    shapes = [s.shape for s in steps]
    assert any(s.num_prefill_requests and not s.num_decode_requests for s in shapes)
    assert any(s.num_decode_requests >= 4 and not s.num_prefill_requests for s in shapes)
    assert any(s.num_prefill_requests and s.num_decode_requests for s in shapes)
    assert max(s.max_decode_context for s in shapes) > 300  # reached through the prefix cache
    assert {s.form for s in fit.scores} == set(FORMS)
    assert math.isfinite(fit.heldout_mape) and fit.heldout_mape == fit.scores[0].heldout_mape

    model, machine = engine.cost_model_key()
    assert machine["enforce_eager"] is True and machine["num_cpus"] >= 1
    path = fit_path(tmp_path, model, machine)
    save_fit(fit, path)
    assert load_fit(path, model, machine) == fit

    stats = await engine.scheduler_stats()
    assert stats["policy"] == "bros"  # FCFS only while profiling
    await engine.use_cost_model(fit.form, fit.coefficients, fit.heldout_mape)
    try:
        stats = await engine.scheduler_stats()
        assert stats["cost_model_form"] == fit.form
        assert stats["cost_model_profiled_mape"] == fit.heldout_mape
    finally:  # the other tests run on the prior
        await engine.use_cost_model("bros", FORMS["bros"].prior)

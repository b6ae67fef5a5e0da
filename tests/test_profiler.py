"""The profile grid, and where the engine's cost model starts (`EngineConfig.cost_model`), with
a stand-in engine and profile: no model."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

import pytest

from antiphon import env
from antiphon.engine_ext import profiler
from antiphon.engine_ext.config import EngineConfig
from antiphon.engine_ext.costfit import (
    CostFit,
    CostFitError,
    Machine,
    choose_fit,
    fit_path,
    read_fit,
    save_fit,
)
from antiphon.engine_ext.engine import EngineRequestFailedError
from antiphon.engine_ext.profiler import QUICK, EngineLimits, grid_points, prepare_cost_model
from antiphon.engine_ext.types import Delta
from tests.test_costmodel import MACHINE, MODEL, synthetic_steps


class StandInEngine:
    """What `prepare_cost_model` uses of a VllmEngine."""

    def __init__(self, mode: str) -> None:
        self.config = EngineConfig(cost_model=mode)
        self.installed: list[tuple[str, tuple[float, ...], float | None]] = []
        self.forgotten: list[list[list[int]]] = []  # `forget_profiling` calls
        self.engine_limits = EngineLimits(max_num_seqs=64, max_num_tokens=2048,
                                          max_model_len=2048, kv_tokens=100_000, page_tokens=16)

    def cost_model_key(self) -> tuple[str, Machine]:
        return MODEL, MACHINE

    def limits(self) -> EngineLimits:
        return self.engine_limits

    async def use_cost_model(self, form: str, coefficients: Sequence[float],
                             profiled_mape: float | None = None) -> None:
        self.installed.append((form, tuple(coefficients), profiled_mape))

    async def forget_profiling(self, chains: Sequence[Sequence[int]]) -> None:
        self.forgotten.append([list(c) for c in chains])


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("ANTIPHON_CACHE_DIR", str(tmp_path))
    return tmp_path


@pytest.fixture
def profiled(monkeypatch: pytest.MonkeyPatch) -> list[CostFit]:
    """Fits the stand-in profile made (it makes a HyGen one)."""
    made: list[CostFit] = []

    async def fake_profile(engine: Any, spec: Any, progress: Any = None,
                           ran: list[list[int]] | None = None) -> tuple[CostFit, list]:
        fit = choose_fit(synthetic_steps("hygen"), MODEL, MACHINE)
        made.append(fit)
        if ran is not None:
            ran.append([1, 2, 3])  # the tokens of a request it ran
        return fit, []

    monkeypatch.setattr(profiler, "profile", fake_profile)
    return made


def stored(form: str = "bros") -> CostFit:
    fit = choose_fit(synthetic_steps(form), MODEL, MACHINE)
    save_fit(fit, fit_path(env.cache_dir(), MODEL, MACHINE))
    return fit


@pytest.mark.parametrize("mode", ["stored", "auto"])
async def test_a_stored_fit_is_installed(cache: Path, profiled: list[CostFit], mode: str) -> None:
    fit = stored()
    engine = StandInEngine(mode)
    assert await prepare_cost_model(engine) == fit  # type: ignore[arg-type]
    assert engine.installed == [(fit.form, fit.coefficients, fit.heldout_mape)]
    assert profiled == [] and engine.forgotten == []


async def test_online_ignores_the_stored_fit(cache: Path, profiled: list[CostFit]) -> None:
    stored()
    engine = StandInEngine("online")
    assert await prepare_cost_model(engine) is None  # type: ignore[arg-type]
    assert engine.installed == [] and profiled == []


async def test_stored_without_a_fit_keeps_the_prior(cache: Path,
                                                    profiled: list[CostFit]) -> None:
    engine = StandInEngine("stored")
    assert await prepare_cost_model(engine) is None  # type: ignore[arg-type]
    assert engine.installed == [] and profiled == []


async def test_a_fit_the_cache_cannot_keep_is_still_installed(
        cache: Path, profiled: list[CostFit], monkeypatch: pytest.MonkeyPatch) -> None:
    """A read-only or full cache folder: the fit profiled at start failed to save, and the
    start failed with it, after minutes of profiling, again at every restart."""
    from antiphon.engine_ext import costfit

    def full(self: Path, data: str, *args: Any, **kwargs: Any) -> int:
        Path.write_bytes(self, data[:10].encode())  # (part of it lands)
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(costfit.Path, "write_text", full)
    engine = StandInEngine("auto")
    fit = await prepare_cost_model(engine)  # type: ignore[arg-type]
    assert fit is not None and engine.installed == [
        ("hygen", fit.coefficients, fit.heldout_mape)]
    assert [p.name for p in cache.rglob("*") if p.is_file()] == []  # no part file left


@pytest.mark.parametrize("existing", [None, "{corrupt", "other machine"])
async def test_auto_profiles_stores_and_installs_when_no_usable_fit_is_stored(
        cache: Path, profiled: list[CostFit], existing: str | None) -> None:
    path = fit_path(cache, MODEL, MACHINE)
    if existing == "other machine":
        other = choose_fit(synthetic_steps("echo"), MODEL, {**MACHINE, "cpu": "other"})
        save_fit(other, path)
    elif existing is not None:
        path.parent.mkdir(parents=True)
        path.write_text(existing)
    engine = StandInEngine("auto")
    fit = await prepare_cost_model(engine)  # type: ignore[arg-type]
    assert profiled == [fit] and fit is not None and fit.form == "hygen"
    assert engine.installed == [("hygen", fit.coefficients, fit.heldout_mape)]
    assert engine.forgotten == [[[1, 2, 3]]]  # what profiling ran is cleared before serving
    assert read_fit(path) == fit
    # The next start finds it.
    again = StandInEngine("auto")
    assert await prepare_cost_model(again) == fit  # type: ignore[arg-type]
    assert len(profiled) == 1


async def test_a_fit_profiled_within_smaller_engine_limits_is_profiled_again(
        cache: Path, profiled: list[CostFit]) -> None:
    """`antiphon profile --max-model-len 1024` stored a fit of a grid cut to 1,024 tokens
    under the same key, and a serve at 2,048 planned with its extrapolation."""
    engine = StandInEngine("auto")
    small = dataclasses.replace(stored(), limits={
        **profiler.fit_limits(engine.engine_limits), "max_model_len": 1024})
    save_fit(small, fit_path(env.cache_dir(), MODEL, MACHINE))
    fit = await prepare_cost_model(engine)  # type: ignore[arg-type]
    assert profiled == [fit] and fit is not None and fit.form == "hygen"
    # one of larger limits, or of limits not recorded (an older file), serves
    for limits in ({**profiler.fit_limits(engine.engine_limits), "max_num_seqs": 256}, None):
        save_fit(dataclasses.replace(small, limits=limits),
                 fit_path(env.cache_dir(), MODEL, MACHINE))
        assert await prepare_cost_model(StandInEngine("stored")) is not None  # type: ignore
    # a larger batch or KV pool than the grid reaches needs no new profile
    save_fit(dataclasses.replace(small, limits=profiler.fit_limits(engine.engine_limits)),
             fit_path(env.cache_dir(), MODEL, MACHINE))
    bigger = StandInEngine("stored")
    bigger.engine_limits = dataclasses.replace(engine.engine_limits, max_num_seqs=128,
                                               kv_tokens=1_000_000)
    assert await prepare_cost_model(bigger) is not None  # type: ignore[arg-type]
    # a larger step budget chunks the same prompts into larger steps than any profiled
    bigger.engine_limits = dataclasses.replace(bigger.engine_limits, max_num_tokens=8192)
    assert profiler.largest_step(bigger.engine_limits) > profiler.largest_step(
        engine.engine_limits)
    assert await prepare_cost_model(bigger) is None  # type: ignore[arg-type]


def test_a_fit_file_with_numbers_out_of_range_is_corrupt(cache: Path) -> None:
    path = fit_path(cache, MODEL, MACHINE)
    save_fit(stored(), path)
    path.write_text(path.read_text().replace('"num_steps": ', '"num_steps": 1e999, "x": '))
    with pytest.raises(CostFitError, match="corrupt"):
        read_fit(path)


async def test_a_fit_from_too_few_steps_is_neither_used_nor_stored(
        cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = fit_path(cache, MODEL, MACHINE)
    save_fit(choose_fit(synthetic_steps("bros", num_steps=20), MODEL, MACHINE), path)
    engine = StandInEngine("stored")
    assert await prepare_cost_model(engine) is None  # type: ignore[arg-type]
    assert engine.installed == []

    path.unlink()
    small = choose_fit(synthetic_steps("hygen", num_steps=20), MODEL, MACHINE)

    async def small_profile(engine: Any, spec: Any, progress: Any = None,
                            ran: Any = None) -> tuple[CostFit, list]:
        return small, []

    monkeypatch.setattr(profiler, "profile", small_profile)
    engine = StandInEngine("auto")
    assert await prepare_cost_model(engine) == small  # type: ignore[arg-type]
    assert engine.installed == [("hygen", small.coefficients, small.heldout_mape)]
    assert not path.exists()  # this engine's measurements, for this run only


async def test_a_failed_profile_leaves_the_prior(cache: Path, monkeypatch: pytest.MonkeyPatch,
                                                caplog: pytest.LogCaptureFixture) -> None:
    async def failing_profile(engine: Any, spec: Any, progress: Any = None,
                              ran: list[list[int]] | None = None) -> None:
        assert ran is not None
        ran.append([4, 5])  # it ran a request before it failed
        raise RuntimeError("engine died")

    monkeypatch.setattr(profiler, "profile", failing_profile)
    engine = StandInEngine("auto")
    assert await prepare_cost_model(engine) is None  # type: ignore[arg-type]
    assert engine.installed == [] and "Profiling failed" in caplog.text
    assert not fit_path(cache, MODEL, MACHINE).exists()
    assert engine.forgotten == [[[4, 5]]]  # cleared all the same


class FailingPromptEngine:
    """Generates a token each 50 ms; the first prompt of a mixed grid point fails."""

    def __init__(self) -> None:
        self.running: set[str] = set()

    async def scheduler_stats(self) -> dict[str, Any]:
        return {"policy": "bros"}

    async def set_policy(self, name: str) -> None:
        pass

    async def recorded_steps(self, record: bool) -> list[list[float]]:
        return []

    async def generate(self, request_id: str, token_ids: list[int],
                       params: Any) -> AsyncIterator[Delta]:
        if "-r0p" in request_id:  # (a KV load error, say)
            await asyncio.sleep(0.01)
            raise EngineRequestFailedError("vLLM ended the request with an error")
        self.running.add(request_id)
        try:
            for i in range(params.max_tokens):
                await asyncio.sleep(0.05)
                yield Delta(text="x", num_new_tokens=1, token_ids=(7,),
                            finished=i == params.max_tokens - 1)
        finally:
            self.running.discard(request_id)


async def test_a_failed_grid_point_leaves_no_request_running() -> None:
    # Its decoders generated on after the failure, while the server cleared what profiling
    # had left, and served (found by a review).
    engine = FailingPromptEngine()
    point = profiler.GridPoint(num_decodes=4, decode_context=64, num_prefills=1,
                               prefill_tokens=64, rounds=2)
    ran: list[list[int]] = []
    with pytest.raises(EngineRequestFailedError):
        await profiler.profile_steps(engine, [point], [], QUICK, ran=ran)  # type: ignore[arg-type]
    assert engine.running == set()
    assert sum(len(chain) > 64 for chain in ran) == 5  # the primer's and the decoders' tokens


def test_serve_profiles_on_first_start_and_code_does_not() -> None:
    from antiphon.cli import build_parser
    from antiphon.configfields import dataclass_from_args

    assert EngineConfig().cost_model == "stored"
    args = build_parser().parse_args(["serve"])
    assert dataclass_from_args(EngineConfig, args).cost_model == "auto"
    args = build_parser().parse_args(["serve", "--cost-model", "online"])
    assert dataclass_from_args(EngineConfig, args).cost_model == "online"
    with pytest.raises(ValueError, match="auto, stored, online"):
        EngineConfig(cost_model="profiled")


def test_the_grid_respects_the_engine_limits() -> None:
    roomy = EngineLimits(max_num_seqs=64, max_num_tokens=2048, max_model_len=8192,
                         kv_tokens=80_000, page_tokens=128)
    points = grid_points(QUICK, roomy)
    assert any(p.num_decodes and not p.num_prefills for p in points)
    assert any(p.num_prefills and not p.num_decodes for p in points)
    assert any(p.num_prefills and p.num_decodes for p in points)
    small = EngineLimits(max_num_seqs=8, max_num_tokens=2048, max_model_len=2048,
                         kv_tokens=20 * 128, page_tokens=128)
    few = grid_points(QUICK, small)
    assert few and len(few) < len(points)
    assert all(p.num_decodes + p.num_prefills <= 8 for p in few)
    assert all(p.decode_context + p.num_prefills * p.prefill_tokens < 2048 for p in few)

"""`antiphon profile`: measure step latency over a grid of batch compositions on this machine
and model, fit the BROS, HyGen and Echo forms, keep the best by held-out error, and store the
fit where `serve` finds it (one file per model and machine under the cache folder)."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from antiphon import env
from antiphon.configfields import add_dataclass_args, dataclass_from_args
from antiphon.engine_ext.config import EngineConfig
from antiphon.engine_ext.costfit import (
    MIN_STORED_FIT_STEPS,
    CostFit,
    ProfiledStep,
    fit_path,
    is_storable,
    save_fit,
)
from antiphon.engine_ext.costforms import cost_form


def coefficients_text(form: str, coefficients: Sequence[float]) -> str:
    """`term=value` for each of the form's terms."""
    return " ".join(f"{t}={c:.3g}" for t, c in zip(cost_form(form).terms, coefficients,
                                                   strict=True))


def format_table(fit: CostFit) -> str:
    """One line per form: train and held-out MAPE, coefficients (on the training split)."""
    lines = [f"{'form':<7} {'train MAPE':>10} {'held-out MAPE':>13}  coefficients"]
    for score in fit.scores:
        lines.append(f"{score.form:<7} {score.train_mape:>10.1%} {score.heldout_mape:>13.1%}"
                     f"  {coefficients_text(score.form, score.coefficients)}")
    return "\n".join(lines)


def _report(fit: CostFit, steps: list[ProfiledStep], wall_s: float) -> dict[str, Any]:
    return {"fit": fit.to_json(), "wall_s": wall_s,
            "steps": [[*s.shape.to_list(), s.latency_s, s.group] for s in steps],
            "step_fields": [f.name for f in dataclasses.fields(steps[0].shape)] + [
                "latency_s", "group"] if steps else []}


async def _profile(config: EngineConfig, quick: bool
                   ) -> tuple[CostFit, list[ProfiledStep], Path | OSError | None]:
    """Profile an engine of `config`: the fit, its steps, and where it is stored (the error
    that kept it from being stored; None: too few steps to store)."""
    from antiphon.engine_ext.profiler import FULL, QUICK, profile
    from antiphon.engine_ext.vllm_engine import VllmEngine
    from antiphon.model import resolve_model

    engine = VllmEngine(config, resolve_model(config.model))
    await engine.start()
    try:
        def progress(done: int, total: int) -> None:
            print(f"\rprofiling: grid point {done}/{total}", end="", file=sys.stderr,
                  flush=True)

        fit, steps = await profile(engine, QUICK if quick else FULL, progress)
        print(file=sys.stderr)
        path = fit_path(env.cache_dir(), *engine.cost_model_key())
        if not is_storable(fit):
            return fit, steps, None
        try:
            save_fit(fit, path)
        except OSError as exc:  # (a read-only or full cache: the fit is still reported)
            print(f"antiphon profile: cannot store the fit in {path}: {exc}", file=sys.stderr)
            return fit, steps, exc
        return fit, steps, path
    finally:
        await engine.shutdown()


def run(args: argparse.Namespace) -> int:
    from antiphon.model import ModelPrepareError

    if args.out:  # known before minutes of profiling, not after
        problem = _unwritable(Path(args.out))
        if problem:
            print(f"antiphon profile: cannot write --out {args.out}: {problem}",
                  file=sys.stderr)
            return 2
    started = time.monotonic()
    try:
        eager = args.enforce_eager if args.enforce_eager is not None else (args.quick or None)
        # The profile's own engine neither loads nor makes a fit at start.
        config = dataclass_from_args(EngineConfig, args, fallbacks={"model": env.model()},
                                     enforce_eager=eager, cost_model="online")
        fit, steps, path = asyncio.run(_profile(config, args.quick))
    except (ValueError, ModelPrepareError) as exc:
        print(f"antiphon profile: {exc}", file=sys.stderr)
        return 1
    wall_s = time.monotonic() - started
    print(format_table(fit))
    print(f"\nchosen: {fit.form}, held-out MAPE {fit.heldout_mape:.1%} over {fit.num_steps} "
          f"steps; refitted on all of them: {coefficients_text(fit.form, fit.coefficients)}")
    written = True
    if args.out:
        try:
            Path(args.out).write_text(json.dumps(_report(fit, steps, wall_s), indent=1) + "\n")
            print(f"steps and fit written to {args.out}")
        except OSError as exc:  # (the fit is stored all the same: said below)
            print(f"antiphon profile: cannot write --out {args.out}: {exc}", file=sys.stderr)
            written = False
    if isinstance(path, OSError):
        return 1
    if path is None:
        print(f"antiphon profile: not stored: {fit.num_steps} steps, fewer than "
              f"{MIN_STORED_FIT_STEPS} ({wall_s:.0f} s); the engine's limits (KV pool, "
              f"max sequences, model length) left too few grid points: profile with the "
              f"defaults", file=sys.stderr)
        return 1
    print(f"stored in {path} ({wall_s:.0f} s)")
    # (eagerness is part of the fit's key: a default serve compiles, and never finds it)
    print("`antiphon serve` starts from it when it runs " + (
        "with --enforce-eager" if config.enforce_eager else "without --enforce-eager")
        + ", on this model and machine")
    return 0 if written else 1


def _unwritable(out: Path) -> str | None:
    """Why `out` cannot take the report (None: it can), found without changing anything: a
    file there is opened to append; where there is none (or a link to none), its folder is
    asked for write access (a file made for the check, then removed, took a dangling link
    with it and left its target)."""
    if out.is_dir():
        return "it is a folder"
    if not out.exists():
        folder = out.resolve().parent
        if not folder.is_dir():
            return f"no folder {folder}"
        return None if os.access(folder, os.W_OK) else f"{folder} is not writable"
    try:
        with open(out, "a"):
            pass
    except OSError as exc:
        return exc.strerror or str(exc)
    return None


PROFILE_IGNORES = frozenset({"cost_model", "policy", "rt_ttft_slo_s", "rt_tpot_slo_s",
                             "slo_headroom", "be_step_limit_s", "served_model_name"})


def add_profile_parser(commands: Any) -> None:
    profile = commands.add_parser(
        "profile", help="fit the step cost model on this machine and model, for serve")
    profile.add_argument("--quick", action="store_true",
                         help="a small grid (a few minutes on 2 CPU cores); implies "
                              "--enforce-eager unless --no-enforce-eager is given, and a fit "
                              "made eager serves only `serve --enforce-eager`")
    profile.add_argument("--out", help="also write the measured steps and the fit to this "
                                       "JSON file")
    # (not the options profiling ignores: it runs FCFS, with no targets, no API, and makes
    # the fit `--cost-model` would choose)
    add_dataclass_args(profile, EngineConfig, exclude=PROFILE_IGNORES)
    profile.set_defaults(func=run)

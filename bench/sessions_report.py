"""Output of `antiphon bench sessions`: the JSON record, two side-by-side tables and a plot."""

from __future__ import annotations

import math
import random
import statistics
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from antiphon.bench.report import print_table, write_json
from antiphon.bench.sessions_metrics import POINT_METRICS
from antiphon.quantiles import percentile

# Prior-context edges (tokens) of the follow-up / fresh TTFT table.
CONTEXT_EDGES = (0, 256, 512, 1024, 2048)
BOOTSTRAP_DRAWS = 2000  # resamples behind the pooled miss cost's 95% interval


def report(record: dict[str, Any], out: Path) -> None:
    """Write `out` (JSON) and `out` with .png, and print the tables."""
    systems = record["systems"]
    miss_cost = None
    if "advisory" in systems and "advisory_miss10" in systems:
        miss_cost = miss_cost_rows(systems["advisory_miss10"], systems["advisory"])
        record = {**record, "advisory_miss10_cost": {  # (kept in the JSON too)
            k: None if math.isnan(v) else v for k, v in miss_cost.items()}}
    write_json(out, record)
    baseline = "vllm" if "vllm" in systems else next(iter(systems))
    print_table({name: point_rows(s) for name, s in systems.items()}, baseline)
    print("\nfollow-up TTFT / fresh TTFT of the same message, median, by prior context tokens:")
    print_table({name: ttft_ratio_rows(s["turns"]) for name, s in systems.items()}, baseline)
    print(f"\nusers sustained at {baseline}'s median TPOT at each of its points (every point up "
          f"to there within {TPOT_TOLERANCE:.0%} of it), over {baseline}'s own (capped by the "
          f"sweep):")
    print_table({name: capacity_rows(s, systems[baseline]) for name, s in systems.items()},
                baseline)
    if miss_cost is not None:
        print("\nwhat the dropped advisories cost, per point: follow-up TTFT p50 of "
              "advisory_miss10 over advisory's, and within advisory_miss10, the turns without "
              "an advisory over those with one (each turn's TTFT over its message's fresh "
              "TTFT, p50); all points pooled, that ratio's mean over advisory's, and over "
              "that of advisory_miss10's own advised turns (one engine start: no start-to-start "
              "drift), each with its 95% bootstrap interval (the headline: a median hides the "
              "missed tenth):")
        print_table({"advisory_miss10": miss_cost}, "advisory_miss10")
    plot(systems, out.with_suffix(".png"))


def miss_cost_rows(missing: dict[str, Any], advised: dict[str, Any]) -> dict[str, float]:
    """Per user count: `missing`'s follow-up TTFT p50 over `advised`'s, how many follow-ups
    went without an advisory, and what that cost them against the advised ones in the same
    run (`summarise_point`'s missed_over_advised_p50)."""
    rows = {}
    for i, users in enumerate(missing["users"]):
        mine, theirs = missing["followup_ttft_p50_s"][i], advised["followup_ttft_p50_s"][i]
        # (none at a point where none was dropped, a few follow-ups rounding a tenth to 0:
        # two runs of one system there, their difference noise, not a cost)
        dropped = missing["missed_advisories"][i] != 0
        rows[f"u{users}_over_advisory"] = _num(mine / theirs if mine and theirs and dropped
                                               else None)
        rows[f"u{users}_missed_advisories"] = _num(missing["missed_advisories"][i])
        rows[f"u{users}_missed_over_advised"] = _num(missing["missed_over_advised_p50"][i])
    cost, low, high = pooled_ratio(fresh_ratios(missing["turns"]), fresh_ratios(advised["turns"]))
    rows["all_over_advisory"], rows["all_over_advisory_lo95"], rows["all_over_advisory_hi95"] = (
        _num(cost), _num(low), _num(high))
    cost, low, high = within_run_ratio(missing["turns"])
    rows["all_over_advised"], rows["all_over_advised_lo95"], rows["all_over_advised_hi95"] = (
        _num(cost), _num(low), _num(high))
    return rows


def within_run_ratio(turns: list[dict[str, Any]], seed: int = 0
                     ) -> tuple[float | None, float | None, float | None]:
    """What the dropped advisories cost within one system's run: the mean over all its
    probed follow-ups of TTFT over fresh TTFT (`fresh_ratios`), over that mean of the ones
    that had their advisory, pooled over every point, with its 95% bootstrap interval (the
    follow-ups resampled with replacement, seeded). The advised turns ran beside the missed
    ones on the same engine start, so the few percent one start differs from the next, which
    `all_over_advisory` carries, is not in it; nor is what a missed turn's load on the
    critical path costs the turns sharing its steps (it slows both sides alike). None where
    no turn, or every turn, went without its advisory."""
    probed = [(t["ttft_s"] / t["fresh_ttft_s"], bool(t.get("advised"))) for t in turns
              if t.get("fresh_ttft_s")]

    def ratio(sample: Sequence[tuple[float, bool]]) -> float | None:
        advised = [r for r, had in sample if had]
        if not advised or len(advised) == len(sample):
            return None
        return statistics.fmean(r for r, _ in sample) / statistics.fmean(advised)

    cost = ratio(probed)
    if cost is None:
        return None, None, None
    return (cost, *_interval95(lambda rng: ratio(rng.choices(probed, k=len(probed))), seed))


def fresh_ratios(turns: list[dict[str, Any]]) -> list[float]:
    """Each follow-up's TTFT over its message's fresh TTFT (where the prober measured it)."""
    return [t["ttft_s"] / t["fresh_ttft_s"] for t in turns if t.get("fresh_ttft_s")]


def pooled_ratio(mine: Sequence[float], theirs: Sequence[float], seed: int = 0
                 ) -> tuple[float | None, float | None, float | None]:
    """mean(`mine`) / mean(`theirs`), pooled over every point, and its 95% bootstrap
    interval (each side resampled with replacement, seeded). A mean, not a median: the cost
    of a tenth of the turns going without their advisory is in that tenth, which a median
    hardly sees (missed turns 100 times slower moved it by 4%, inside the 6% target; found by
    a review). A point has a dozen follow-ups; the interval says which differences the run
    can tell apart."""
    if not mine or not theirs:
        return None, None, None
    return (statistics.fmean(mine) / statistics.fmean(theirs), *_interval95(
        lambda rng: statistics.fmean(rng.choices(mine, k=len(mine)))
        / statistics.fmean(rng.choices(theirs, k=len(theirs))), seed))


def _interval95(draw: Callable[[random.Random], float | None], seed: int) -> tuple[float, float]:
    """The 95% interval of `BOOTSTRAP_DRAWS` resampled estimates (`draw`, from a generator
    seeded with `seed`; a draw of None, a resample the estimate does not cover, is left out)."""
    rng = random.Random(seed)
    draws = sorted(d for d in (draw(rng) for _ in range(BOOTSTRAP_DRAWS)) if d is not None)
    return draws[int(0.025 * len(draws))], draws[int(0.975 * len(draws)) - 1]


def point_rows(system: dict[str, Any]) -> dict[str, float]:
    """One row per metric and user count; NaN where a system reports nothing (no tiers, or
    a record from before the metric was kept)."""
    none = [None] * len(system["users"])
    return {f"u{users}_{k}": _num(system.get(k, none)[i])
            for i, users in enumerate(system["users"]) for k in POINT_METRICS}


# Two medians of TPOT this close count as equal: a point's median moves by a few percent
# between two runs of one system, and on a flat curve (TPOT hardly growing with users) a
# reading a hair lower decided the users "served" at the baseline's TPOT (4 or 8 times).
TPOT_TOLERANCE = 0.05


def users_at_tpot(system: dict[str, Any], tpot_s: float) -> float | None:
    """The most users `system` sustains at a median TPOT of at most `tpot_s` (within
    `TPOT_TOLERANCE`): every sweep point up to there within it, interpolated linearly to
    where TPOT crosses it on the way to the next point; the sweep's last point where every
    point is within it (the sweep caps the figure); None where its first point is not."""
    limit = tpot_s * (1 + TPOT_TOLERANCE)
    points = list(zip(system["users"], system["tpot_p50_s"], strict=True))
    sustained = None
    for k, (users, tpot) in enumerate(points):
        if tpot is None:
            return sustained
        if tpot > limit:
            if sustained is None:
                return None
            low_users, low_tpot = points[k - 1]
            return low_users + (users - low_users) * (limit - low_tpot) / (tpot - low_tpot)
        sustained = float(users)
    return sustained


def capacity_rows(system: dict[str, Any], baseline: dict[str, Any]) -> dict[str, float]:
    """Per baseline sweep point: the users `system` sustains at the baseline's median TPOT
    there, over the users the baseline itself sustains at it (`users_at_tpot`; 1.0 for the
    baseline, 4.0: four times as many). NaN where either sustains none: also where the
    baseline had a point at fewer users more than `TPOT_TOLERANCE` slower (a noisy curve
    there says nothing about users at equal TPOT)."""
    rows = {}
    for users, tpot in zip(baseline["users"], baseline["tpot_p50_s"], strict=True):
        mine = None if tpot is None else users_at_tpot(system, tpot)
        theirs = None if tpot is None else users_at_tpot(baseline, tpot)
        rows[f"at_u{users}_tpot_ratio"] = _num(None if mine is None or not theirs
                                               else mine / theirs)
    return rows


def ttft_ratio_rows(turns: list[dict[str, Any]]) -> dict[str, float]:
    """Median follow-up TTFT over fresh TTFT of the same message, per prior-context bucket."""
    rows = {}
    for lo, hi in zip(CONTEXT_EDGES, (*CONTEXT_EDGES[1:], math.inf), strict=True):
        ratios = [t["ttft_s"] / t["fresh_ttft_s"] for t in turns
                  if t["fresh_ttft_s"] and lo <= t["prior_context_tokens"] < hi]
        rows[f"ctx_{lo}_{hi}"] = _num(percentile(ratios, 0.5))
    return rows


def _num(value: float | None) -> float:
    return math.nan if value is None else float(value)


def plot(systems: dict[str, dict[str, Any]], path: Path) -> None:
    """Follow-up TTFT against prior context (each turn; the fresh p50 dashed) and against
    users (p50 solid, p99 dotted)."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot")
        return
    fig, (by_context, by_users) = plt.subplots(1, 2, figsize=(12, 4.5))
    for i, (name, s) in enumerate(systems.items()):
        color = f"C{i}"
        followups = [t for t in s["turns"] if t["turn"] > 0]
        by_context.scatter([t["prior_context_tokens"] for t in followups],
                           [t["ttft_s"] for t in followups], s=8, alpha=0.5, color=color,
                           label=name)
        fresh = percentile([t["fresh_ttft_s"] for t in followups if t["fresh_ttft_s"]], 0.5)
        if fresh is not None:
            by_context.axhline(fresh, color=color, linestyle="--", linewidth=1)
        by_users.plot(s["users"], [_num(v) for v in s["followup_ttft_p50_s"]], "o-",
                      color=color, label=f"{name} p50")
        by_users.plot(s["users"], [_num(v) for v in s["followup_ttft_p99_s"]], "o:",
                      color=color, label=f"{name} p99")
    by_context.set_xlabel("prior context (tokens)")
    by_context.set_ylabel("follow-up TTFT (s); dashed: fresh prompt p50")
    by_users.set_xticks(sorted({u for s in systems.values() for u in s["users"]}))
    by_users.set_xlabel("concurrent users")
    by_users.set_ylabel("follow-up TTFT (s)")
    for ax in (by_context, by_users):
        ax.set_yscale("log")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")

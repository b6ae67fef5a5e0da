"""The host's speed, read from a server's step trace (`serve --step-trace`): how fast a run's
host went (the gauge), how much its steps jitter, what a prefill token costs it, and the RT
arrival rate and prompt lengths that load this host as the reference host was loaded (`bench
mixed --rt-rate auto`).

These 2-vCPU hosts drift by up to half within an hour, so every run of `bench mixed` and `bench
blocks` carries its own gauge, and a table whose runs' gauges differ says so.
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Mapping
from pathlib import Path
from typing import Any

# Decode-only steps of this many requests (inclusive) gauge the host's speed per run.
HOST_GAUGE_REQUESTS = (8, 12)
# Steps of one batch size on either side whose median a step's noise is measured from.
NOISE_NEIGHBOURS = 5
# The load `--rt-rate auto` sets: RT turns a second times the host gauge (seconds), or RT
# turns arriving per decode step. At the default lengths, `bench mixed --quick` met issue 3's
# TTFT and BE targets together at 0.055 on two hosts (docs/benchmarks.md: stop 70, 2 turns a
# second at 27.8 ms; stop 72, 1.7 at 32.5 ms), with fcfs at 9-24% TTFT attainment; at 0.064
# (2 a second at 32 ms) HyGen's fell to 89%.
RT_TURNS_PER_GAUGE_STEP = 0.055
# The longest RT prompt of the trace, prefilled alone, may take at most this share of the TTFT
# target; the rest is for waiting behind the step in flight and the turns ahead of it. The
# reference hosts met it at the default lengths: the longest prompt of a 300-token mean (1,033
# tokens) took 28 ms + 1,033 x 0.445 ms = 0.49 s on stop 70's. On stop 75's (0.92 ms a token) it
# took about 1 s alone against the 1 s target, and no policy could make it (docs/benchmarks.md).
LONGEST_PROMPT_TTFT_SHARE = 0.5


def rt_rate_for(gauge_s: float) -> float:
    """RT turns a second that load a host whose gauge (`host_decode_step_s`) reads `gauge_s`
    as `RT_TURNS_PER_GAUGE_STEP` says: a host twice as slow gets half the turns."""
    if not gauge_s > 0:
        raise ValueError(f"no host gauge to scale the RT rate by (read {gauge_s} s)")
    return RT_TURNS_PER_GAUGE_STEP / gauge_s


def rt_prompt_tokens_for(gauge_s: float, prefill_s_per_token: float, ttft_slo_s: float,
                         longest_per_mean: float, default: int) -> int:
    """The mean RT prompt length (tokens) for `--rt-rate auto`: `default`, or less where the
    trace's longest prompt (`longest_per_mean` times the mean) would take this host more than
    `LONGEST_PROMPT_TTFT_SHARE` of the TTFT target alone: a step of the gauge's (`gauge_s`)
    plus `prefill_s_per_token` a token. Prompt lengths scale with the host as the rate does:
    where a prompt cannot make its target even alone, its misses measure the host, not the
    scheduler. At least 16 tokens."""
    if not prefill_s_per_token > 0 or not longest_per_mean > 0:
        return default
    longest = (LONGEST_PROMPT_TTFT_SHARE * ttft_slo_s - gauge_s) / prefill_s_per_token
    return max(16, min(default, int(longest / longest_per_mean)))


def prefill_s_per_token(steps: list[dict[str, Any]]) -> float:
    """Seconds a prefill token adds to a step, from `steps` (`window_steps`): the
    least-squares fit of each step's latency to a constant, its prefill tokens and its
    decoding requests. 0 when they hold no prefill step, or too few steps to fit three
    terms."""
    import numpy as np

    timed = [step for step in steps if step.get("lat_s")]
    rows = [[1.0, step["rt"][1] + step["be"][1], step["rt"][2] + step["be"][2]]
            for step in timed]
    if len(rows) < 4 or not any(row[1] for row in rows):
        return 0.0
    latencies = [step["lat_s"] for step in timed]
    fit = np.linalg.lstsq(np.array(rows), np.array(latencies), rcond=None)[0]
    return max(0.0, float(fit[1]))


def host_drift(runs: Mapping[str, list[dict[str, Any]]]) -> float:
    """How much slower the slowest run's host gauge was than the fastest's (0.1: 10%)."""
    gauges = [r["host_decode_step_s"] for rs in runs.values() for r in rs
              if r.get("host_decode_step_s")]
    return max(gauges) / min(gauges) - 1 if gauges else 0.0


def host_decode_step_s(steps: list[tuple[int, float]]) -> float:
    """How fast the host ran a system: the median latency of its plain decode `steps`
    (`plain_decode_steps`) of `HOST_GAUGE_REQUESTS` requests; 0 when there were none. Every
    policy runs such steps, and they cost about the same under any of them, so a system whose
    figure differs from the others' ran on a faster or slower host (these CPUs drift by up to
    half within an hour), and a comparison with it is confounded."""
    low, high = HOST_GAUGE_REQUESTS
    latencies = [lat for n, lat in steps if low <= n <= high]
    return statistics.median(latencies) if latencies else 0.0


def host_step_noise(steps: list[tuple[int, float]]) -> float:
    """How much the host's step latency jitters, as the cost-model error is measured
    (mean |predicted - measured| / measured): how far the plain decode `steps`
    (`plain_decode_steps`) lie from the median of their `NOISE_NEIGHBOURS` nearest steps of
    the same batch size on either side, which had the same shape and nearly the same time.
    A model that predicts from a step's shape cannot do much better on those steps (on this
    2-core host the model's error on them came within 0.8 points of this figure). 0 when no
    step had enough such neighbours."""
    by_size: dict[int, list[float]] = {}
    for n, lat in steps:
        by_size.setdefault(n, []).append(lat)
    deviations = []
    k = NOISE_NEIGHBOURS
    for latencies in by_size.values():
        for i, lat in enumerate(latencies):
            near = latencies[max(0, i - k):i] + latencies[i + 1:i + 1 + k]
            if len(near) >= k:
                deviations.append(abs(lat - statistics.median(near)) / lat)
    return statistics.mean(deviations) if deviations else 0.0


def window_steps(trace: Path, start: float, end: float) -> list[dict[str, Any]]:
    """The steps of `trace` (`serve --step-trace`, a JSON object a line) from `start` to
    `end` (`time.time()`)."""
    with trace.open() as lines:
        return [step for step in map(json.loads, lines) if start <= step["t"] <= end]


def plain_decode_steps(steps: list[dict[str, Any]]) -> list[tuple[int, float]]:
    """(requests, latency in seconds) of each of `steps` (`window_steps`) that only decoded:
    no prefill, no KV copies."""
    return [(step["rt"][2] + step["be"][2], step["lat_s"]) for step in steps
            if not step["rt"][0] and not step["be"][0] and not step["copies"]
            and step.get("lat_s")]

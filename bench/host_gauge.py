"""The host's speed, read from a server's step trace (`serve --step-trace`): how fast a run's
host went (the gauge), how much its steps jitter, and the RT arrival rate that loads this host
as the reference host was loaded (`bench mixed --rt-rate auto`).

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


def rt_rate_for(gauge_s: float) -> float:
    """RT turns a second that load a host whose gauge (`host_decode_step_s`) reads `gauge_s`
    as `RT_TURNS_PER_GAUGE_STEP` says: a host twice as slow gets half the turns."""
    if not gauge_s > 0:
        raise ValueError(f"no host gauge to scale the RT rate by (read {gauge_s} s)")
    return RT_TURNS_PER_GAUGE_STEP / gauge_s


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


def plain_decode_steps(trace: Path, start: float, end: float) -> list[tuple[int, float]]:
    """(requests, latency in seconds) of each step in `trace` from `start` to `end`
    (`time.time()`) that only decoded: no prefill, no KV copies."""
    steps = []
    with trace.open() as lines:
        for line in lines:
            step = json.loads(line)
            if (start <= step["t"] <= end and not step["rt"][0] and not step["be"][0]
                    and not step["copies"] and step.get("lat_s")):
                steps.append((step["rt"][2] + step["be"][2], step["lat_s"]))
    return steps

"""The repeated-run summary and the measurement window of `bench mixed` and `bench blocks`."""

from __future__ import annotations

import argparse

import pytest

from antiphon.bench.mixed import measurement_window_s, positive_int, summarise_runs
from antiphon.bench.workload import RtArrival


def test_one_run_is_its_own_summary() -> None:
    assert summarise_runs([{"be_tokens_per_s": 8.0}]) == {"be_tokens_per_s": 8.0}


def test_repeated_runs_are_averaged_and_kept() -> None:
    runs = [{"be_tokens_per_s": 8.0, "rt_ttft_slo_attainment": 0.75},
            {"be_tokens_per_s": 10.0, "rt_ttft_slo_attainment": 1.0}]
    summary = summarise_runs(runs)
    assert summary["be_tokens_per_s"] == 9.0
    assert summary["rt_ttft_slo_attainment"] == 0.875
    assert summary["runs"] == runs


def test_repeats_must_be_positive() -> None:
    assert positive_int("3") == 3
    with pytest.raises(argparse.ArgumentTypeError, match="at least 1"):
        positive_int("0")


def test_every_system_is_measured_over_the_trace_and_a_fixed_tail() -> None:
    args = argparse.Namespace(window_tail_s=20.0)
    arrivals = [RtArrival(0.5, 100, 48), RtArrival(39.0, 100, 48), RtArrival(12.0, 100, 48)]
    assert measurement_window_s(args, arrivals) == 59.0
    assert measurement_window_s(args, []) == 20.0

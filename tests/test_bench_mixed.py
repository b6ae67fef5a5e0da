"""The repeated-run summary, the measurement window and the host gauge of `bench mixed` and
`bench blocks`."""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from pathlib import Path

import pytest

from antiphon.bench.host_gauge import (
    host_decode_step_s,
    host_drift,
    host_step_noise,
    plain_decode_steps,
    prefill_s_per_token,
    rt_prompt_tokens_for,
    rt_rate_for,
    window_steps,
)
from antiphon.bench.mixed import (
    interleaved_runs,
    measurement_window_s,
    positive_int,
    rt_request,
    rt_summary,
    summarise_runs,
)
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


def test_a_metric_no_run_measured_is_none_not_zero() -> None:
    runs = [{"cost_model_mape": None, "be_tokens_per_s": 8.0},
            {"cost_model_mape": 0.04, "be_tokens_per_s": 10.0}]
    assert summarise_runs(runs)["cost_model_mape"] == 0.04  # of the run that measured it
    assert summarise_runs(runs[:1])["cost_model_mape"] is None


def test_the_table_shows_no_ratio_without_its_baseline(capsys: pytest.CaptureFixture[str]
                                                       ) -> None:
    from antiphon.bench.report import print_table

    print_table({"echo": {"be_tokens_per_s": 8.0, "cost_model_mape": None}}, baseline=None)
    out = capsys.readouterr().out
    assert "n/a" in out and "/" not in out.splitlines()[0]
    print_table({"fcfs": {"be_tokens_per_s": 10.0, "cost_model_mape": 0.05},
                 "echo": {"be_tokens_per_s": 8.0, "cost_model_mape": None}}, baseline="fcfs")
    rows = capsys.readouterr().out.splitlines()
    assert rows[2].split()[-1] == "0.800" and rows[3].split()[-1] == "-"


def _sse(*events: object) -> bytes:
    return b"".join(b"data: " + json.dumps(e).encode() + b"\n\n" for e in events) + (
        b"data: [DONE]\n\n")


def _delta(text: str, finish: str | None = None) -> dict[str, object]:
    return {"choices": [{"index": 0, "delta": {"content": text}, "finish_reason": finish}]}


@pytest.mark.parametrize(("events", "failed", "tokens"), [
    # whole: three chunks carry four tokens (a chunk may carry several)
    ([_delta("a"), _delta("b c"), _delta("d", "length"),
      {"choices": [], "usage": {"completion_tokens": 4}}], False, 4),
    # an error event after the first token: it must not pass as a quick turn, and its
    # latency is spread over the token it got (no usage came: counted by content chunks)
    ([_delta("a"), {"error": {"message": "the engine failed"}}], True, 1),
    # finished early (cancelled, or a stop): fewer tokens than the trace asked for
    ([_delta("a", "abort"), {"choices": [], "usage": {"completion_tokens": 1}}], True, 1),
])
async def test_a_turn_that_fails_or_ends_short_misses_its_targets(
        events: list[object], failed: bool, tokens: int) -> None:
    import httpx

    def reply(request: httpx.Request) -> httpx.Response:
        sent = json.loads(request.content)
        assert sent["stream_options"] == {"include_usage": True}
        return httpx.Response(200, content=_sse(*events))

    async with httpx.AsyncClient(transport=httpx.MockTransport(reply),
                                 base_url="http://bench") as client:
        result = await rt_request(client, "m", "hi", RtArrival(0.0, 10, 4), 0.0)
    assert result["failed"] is failed and result["output_tokens"] == tokens
    if not failed:
        assert result["tpot_s"] >= 0 and "error" not in result


async def test_a_refused_or_lost_turn_is_failed_not_raised() -> None:
    import httpx

    def refuse(request: httpx.Request) -> httpx.Response:
        return httpx.Response(503, json={"error": {"message": "busy"}})

    def drop(request: httpx.Request) -> httpx.Response:
        raise httpx.ReadError("connection lost", request=request)

    for handler in (refuse, drop):
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler),
                                     base_url="http://bench") as client:
            result = await rt_request(client, "m", "hi", RtArrival(0.0, 10, 4), 0.0)
        assert result["failed"] and result["error"]


def test_repeats_must_be_positive() -> None:
    assert positive_int("3") == 3
    with pytest.raises(argparse.ArgumentTypeError, match="at least 1"):
        positive_int("0")


def test_every_system_is_measured_over_the_trace_and_a_fixed_tail() -> None:
    args = argparse.Namespace(window_tail_s=20.0)
    arrivals = [RtArrival(0.5, 100, 48), RtArrival(39.0, 100, 48), RtArrival(12.0, 100, 48)]
    assert measurement_window_s(args, arrivals) == 59.0
    assert measurement_window_s(args, []) == 20.0


def _step(t: float, lat_s: float, rt: list[int], be: list[int], copies: int = 0) -> str:
    return json.dumps({"t": t, "lat_s": lat_s, "rt": rt, "be": be, "copies": copies}) + "\n"


def test_the_host_gauge_reads_plain_decode_steps_of_the_window(tmp_path: Path) -> None:
    trace = tmp_path / "steps.jsonl"
    trace.write_text("".join([
        _step(5.0, 0.030, [0, 0, 6], [0, 0, 4]),  # before the window
        _step(10.0, 0.040, [0, 0, 6], [0, 0, 4]),
        _step(11.0, 0.050, [0, 0, 2], [0, 0, 6]),
        _step(12.0, 0.060, [0, 0, 9], [0, 0, 3]),
        _step(13.0, 0.200, [1, 300, 6], [0, 0, 4]),  # an RT prefill
        _step(14.0, 0.300, [0, 0, 6], [1, 500, 4]),  # a BE prefill
        _step(15.0, 0.090, [0, 0, 6], [0, 0, 4], copies=60),  # KV copies
        _step(16.0, 0.030, [0, 0, 3], [0, 0, 4]),  # 7 requests: too few
        _step(17.0, 0.020, [0, 0, 9], [0, 0, 4]),  # 13: too many
        _step(30.0, 0.500, [0, 0, 6], [0, 0, 4]),  # after the window
    ]))
    assert host_decode_step_s(plain_decode_steps(window_steps(trace, 10.0, 20.0))) == pytest.approx(0.050)
    assert host_decode_step_s(plain_decode_steps(window_steps(trace, 40.0, 50.0))) == 0.0


def test_host_drift_compares_the_slowest_run_with_the_fastest() -> None:
    runs = {"fcfs": [{"host_decode_step_s": 0.044}, {"host_decode_step_s": 0.040}],
            "echo": [{"host_decode_step_s": 0.050}],
            "stock": [{"host_decode_step_s": 0.0}]}  # no plain decode steps: no gauge
    assert host_drift(runs) == pytest.approx(0.25)
    assert host_drift({"echo": [{"be_tokens_per_s": 8.0}]}) == 0.0


def test_host_noise_compares_each_plain_decode_step_with_its_neighbours_of_its_size(
        tmp_path: Path) -> None:
    latencies = [0.040] * 5 + [0.050] + [0.040] * 5  # 10 requests each: one step off by 0.01
    trace = tmp_path / "steps.jsonl"
    trace.write_text("".join(
        [_step(10.0 + i, lat, [0, 0, 6], [0, 0, 4]) for i, lat in enumerate(latencies)]
        + [_step(30.0 + i, lat, [0, 0, 2], [0, 0, 2]) for i, lat in enumerate([0.02, 0.09])]
        + [_step(40.0, 0.300, [1, 300, 6], [0, 0, 4]),  # an RT prefill
           _step(41.0, 0.090, [0, 0, 6], [0, 0, 4], copies=60),  # KV copies
           _step(60.0, 0.500, [0, 0, 6], [0, 0, 4])]))  # after the window
    # Only the odd step deviates from the median of its neighbours, by 0.01 / 0.05; the
    # steps of 4 requests have too few neighbours to count.
    assert host_step_noise(plain_decode_steps(window_steps(trace, 0.0, 50.0))) == pytest.approx(
        0.2 / len(latencies))
    assert host_step_noise(plain_decode_steps(window_steps(trace, 30.0, 50.0))) == 0.0


def test_a_failed_run_is_recorded_and_the_runs_after_it_go_on() -> None:
    order: list[tuple[str, int]] = []
    recorded: list[tuple[dict[str, int], int]] = []

    def run_one(name: str, repeat: int) -> dict[str, float]:
        order.append((name, repeat))
        if (name, repeat) == ("echo", 0):
            raise ConnectionError("server closed the connection")
        return {"be_tokens_per_s": 10.0 * (repeat + 1)}

    def record(runs: dict[str, list[dict[str, float]]], failures: list[dict[str, object]]
               ) -> None:
        recorded.append(({n: len(r) for n, r in runs.items()}, len(failures)))

    runs, failures = interleaved_runs(2, ["fcfs", "echo"], run_one, record)
    # interleaved, the order rotated each repeat
    assert order == [("fcfs", 0), ("echo", 0), ("echo", 1), ("fcfs", 1)]
    assert runs == {"fcfs": [{"be_tokens_per_s": 10.0}, {"be_tokens_per_s": 20.0}],
                    "echo": [{"be_tokens_per_s": 20.0}]}
    assert failures == [{"system": "echo", "repeat": 1,
                         "error": "ConnectionError('server closed the connection')"}]
    assert recorded == [({"fcfs": 1, "echo": 0}, 0), ({"fcfs": 1, "echo": 0}, 1),
                        ({"fcfs": 1, "echo": 1}, 1), ({"fcfs": 2, "echo": 1}, 1)]


def test_a_system_with_a_failed_run_says_so() -> None:
    # A run that raised was left out of its system's mean without a word in the table
    # (found by a review): half of echo's runs crashed, and it read as one clean run.
    summary = summarise_runs([{"rt_ttft_slo_attainment": 0.99}], num_failed=1)
    assert summary == {"rt_ttft_slo_attainment": 0.99, "runs_failed": 1}
    assert "runs_failed" not in summarise_runs([{"rt_ttft_slo_attainment": 0.99}])


async def test_a_turns_times_count_from_its_trace_arrival() -> None:
    # The TTFT ran from when the bench got round to sending the turn: an event loop held
    # across its arrival (another stream parsed, a collection) took the wait out of it.
    import httpx

    from antiphon.bench.mixed import rt_request
    from antiphon.bench.workload import RtArrival

    def reply(request: httpx.Request) -> httpx.Response:
        events = [{"choices": [{"index": 0, "delta": {"content": "x"},
                                "finish_reason": "length"}]},
                  {"choices": [], "usage": {"completion_tokens": 1}}]
        return httpx.Response(200, content=b"".join(
            b"data: " + json.dumps(e).encode() + b"\n\n" for e in events))

    async with httpx.AsyncClient(transport=httpx.MockTransport(reply),
                                 base_url="http://bench") as client:
        start = time.perf_counter()
        asyncio.get_running_loop().call_later(0.02, time.sleep, 0.3)  # held past the arrival
        turn = await rt_request(client, "m", "hi", RtArrival(0.05, 10, 1), start)
    assert turn["ttft_s"] >= 0.25 and turn["send_lag_s"] >= 0.25


def test_the_record_says_the_trace_length_run() -> None:
    """A --quick run's record said "duration": 120 over a 40 s trace, and --quick silently
    beat a --duration given."""
    from antiphon.bench.mixed import add_workload_arguments, trace_duration

    parser = argparse.ArgumentParser()
    add_workload_arguments(parser, kv_pages=64, rt_rate=None)
    for given, expected in ((["--quick"], 40.0), ([], 120.0),
                            (["--quick", "--duration", "15"], 15.0)):
        args = parser.parse_args(given)
        assert trace_duration(args) == expected == args.duration


def turn(ttft_s: float, failed: bool = False, tokens: int = 10) -> dict[str, object]:
    return {"ttft_s": ttft_s, "tpot_s": 0.02, "latency_s": ttft_s + 0.02 * tokens,
            "output_tokens": tokens, "failed": failed}


def test_failed_turns_do_not_flatter_the_rt_figures() -> None:
    """Half the turns refused at once showed as 41% lower normalised latency, and two slow
    turns whose streams died left the p99, which read as a served turn's."""
    served = rt_summary([turn(0.3)] * 20, 1.0, 0.1)
    refused = rt_summary([turn(0.3), turn(0.001, failed=True)] * 10, 1.0, 0.1)
    assert served["rt_normalized_latency_s"] == pytest.approx(0.05)
    assert refused["rt_normalized_latency_s"] is None  # not a mean over the served half
    assert (refused["rt_failed"], refused["rt_ttft_slo_attainment"]) == (10, 0.5)
    assert refused["rt_ttft_p99_s"] is None and refused["rt_ttft_p50_s"] is None
    cut = rt_summary([turn(0.3)] * 18 + [turn(3.0, failed=True, tokens=5)] * 2, 1.0, 0.1)
    assert cut["rt_ttft_p50_s"] == pytest.approx(0.3) and cut["rt_ttft_p99_s"] is None
    assert rt_summary([turn(0.3)] * 18 + [turn(3.0)] * 2, 1.0, 0.1)["rt_ttft_p99_s"] > 2.9


def test_a_turn_failing_after_minutes_does_not_make_the_normalised_latency_better() -> None:
    """Averaged over the turns served, a turn that ran for 600 s and then failed left the
    figure at a tenth of what serving it gave."""
    fast = [turn(0.3)] * 9
    slow = {"ttft_s": 599.0, "tpot_s": 0.02, "latency_s": 600.0, "output_tokens": 3}
    assert rt_summary([*fast, {**slow, "failed": False}], 1.0, 0.1)[
        "rt_normalized_latency_s"] > 6.0
    failing = rt_summary([*fast, {**slow, "failed": True}], 1.0, 0.1)
    assert failing["rt_normalized_latency_s"] is None
    assert summarise_runs([rt_summary(fast, 1.0, 0.1), failing])[
        "rt_normalized_latency_s"] is None  # unbounded, not the clean run's


def test_a_percentile_on_a_served_turn_is_not_lost_to_a_failed_neighbour() -> None:
    assert rt_summary([turn(0.1), turn(0.2), turn(0.0, failed=True)], 1.0, 0.1)[
        "rt_ttft_p50_s"] == pytest.approx(0.2)
    many = [turn(0.01 * (i + 1)) for i in range(100)] + [turn(0.0, failed=True)]
    assert rt_summary(many, 1.0, 0.1)["rt_ttft_p99_s"] == pytest.approx(1.0)


def test_a_run_whose_p99_is_among_failed_turns_leaves_the_mean_unbounded() -> None:
    """Averaged over the runs that had a value, one clean run and one with 3% of its turns
    failed gave the clean run's p99."""
    clean = rt_summary([turn(0.5)] * 100, 1.0, 0.1)
    failing = rt_summary([turn(0.5)] * 97 + [turn(0.0, failed=True)] * 3, 1.0, 0.1)
    summary = summarise_runs([clean, failing])
    assert summary["rt_ttft_p99_s"] is None and summary["rt_ttft_p50_s"] == pytest.approx(0.5)


def test_the_p99_interpolates_as_the_sessions_benchmark_does() -> None:
    turns = [turn(0.05 * (i + 1)) for i in range(100)]  # 0.05 .. 5.00 s
    assert rt_summary(turns, 1.0, 0.1)["rt_ttft_p99_s"] == pytest.approx(4.9505)  # not the max


def test_the_stock_baselines_run_on_stock_memory_management(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """`serve` turns bidirectional blocks and KV tiering on by default: the fcfs baseline
    checkpointed its preempted BE work to host RAM and paid the write-through."""
    from antiphon.bench import mixed

    ran: dict[str, list[str]] = {}
    monkeypatch.setattr(mixed, "run_systems", lambda args, bench, systems, baseline: (
        ran.update(systems), 0)[1])
    mixed.main(argparse.Namespace(policies="fcfs,priority,echo,bros@inf,echo:stock,"
                                           "fcfs:antiphon,bros@0.5:stock"))
    for name in ("fcfs", "priority"):
        assert "--no-biblocks" in ran[name] and "--no-kv-tiering" in ran[name], ran
    assert ran["echo"] == ["--policy", "echo"]
    assert ran["fcfs:antiphon"] == ["--policy", "fcfs"]
    assert ran["bros@inf"] == ["--policy", "bros", "--be-step-limit-s", "inf"]
    assert ran["echo:stock"] == ["--policy", "echo", "--no-biblocks", "--no-kv-tiering"]
    assert ran["bros@0.5:stock"] == ["--policy", "bros", "--be-step-limit-s", "0.5",
                                     "--no-biblocks", "--no-kv-tiering"]
    assert mixed.system_arguments("echo:host") == ["--policy", "echo", "--ssd-tier-bytes", "0"]
    with pytest.raises(ValueError, match="stock, antiphon, host"):
        mixed.main(argparse.Namespace(policies="echo:tiered"))


async def test_the_be_rate_is_sampled_over_the_run() -> None:
    """The plot showed RT TTFT alone; issue 3 asks for BE throughput over time beside it."""
    import asyncio
    import time

    import httpx

    from antiphon.bench.mixed import sample_be_rate

    calls = 0

    def metrics(request: httpx.Request) -> httpx.Response:
        nonlocal calls
        calls += 1
        return httpx.Response(200, text=(
            f'antiphon_generation_tokens_total{{request_class="be"}} {100.0 * calls}\n'
            f'antiphon_generation_tokens_total{{request_class="rt"}} {7.0 * calls}\n'))

    samples: list[dict[str, float]] = []
    async with httpx.AsyncClient(transport=httpx.MockTransport(metrics),
                                 base_url="http://x") as client:
        task = asyncio.create_task(sample_be_rate(client, time.perf_counter(), samples, 0.05))
        await asyncio.sleep(0.3)
        task.cancel()
    assert len(samples) >= 3
    assert all(0 < s["be_tokens_per_s"] <= 100 / 0.05 for s in samples)  # 100 a sample
    assert [s["at_s"] for s in samples] == sorted(s["at_s"] for s in samples)


def test_the_ratios_are_to_the_fcfs_entry_whatever_its_memory_or_step_limit() -> None:
    # Looked up as plain "fcfs", a run of `fcfs:host,bros` was reported as never finished and
    # its table had no ratios (found by a review).
    from antiphon.bench import mixed

    assert mixed.baseline_entry(["fcfs:host", "bros"]) == "fcfs:host"
    assert mixed.baseline_entry(["bros", "fcfs@1"]) == "fcfs@1"
    assert mixed.baseline_entry(["bros", "echo"]) == "fcfs"


def test_the_auto_rt_rate_keeps_rt_turns_per_decode_step() -> None:
    """`--rt-rate` was set by hand, and a load where the targets held on one day's host missed
    them on a host 13% slower: auto scales the turns by the host's decode step."""
    from antiphon.bench import host_gauge

    reference = host_gauge.RT_TURNS_PER_GAUGE_STEP
    assert rt_rate_for(0.030) == pytest.approx(reference / 0.030)
    assert rt_rate_for(0.060) == pytest.approx(rt_rate_for(0.030) / 2)  # twice as slow
    for unmeasured in (0.0, float("nan")):
        with pytest.raises(ValueError, match="no host gauge"):
            rt_rate_for(unmeasured)


def test_the_prefill_cost_is_fitted_beside_a_steps_constant_and_its_decodes(
        tmp_path: Path) -> None:
    trace = tmp_path / "steps.jsonl"
    # 30 ms a step, 1 ms a prefill token, 2 ms a decoding request
    lines = [_step(10.0 + i, 0.030 + 0.001 * p + 0.002 * d, [1 if p else 0, p, d], [0, 0, 0])
             for i, (p, d) in enumerate([(0, 10), (0, 4), (300, 2), (1000, 8), (64, 5)])]
    trace.write_text("".join(lines) + _step(99.0, 9.0, [1, 100, 0], [0, 0, 0]))  # outside
    assert prefill_s_per_token(window_steps(trace, 0.0, 50.0)) == pytest.approx(0.001)
    decodes_only = tmp_path / "decodes.jsonl"
    decodes_only.write_text("".join(_step(10.0 + i, 0.03, [0, 0, 8], [0, 0, 0])
                                    for i in range(6)))
    assert prefill_s_per_token(window_steps(decodes_only, 0.0, 50.0)) == 0.0  # nothing to fit it on


def test_auto_cuts_rt_prompts_on_a_host_too_slow_to_prefill_the_longest_in_time() -> None:
    """On a host prefilling 0.92 ms a token, the trace's longest prompt at a 300-token mean
    (1,033 tokens) took about 1 s alone: its 1 s TTFT target could not be met by any policy,
    and the turn counted as the scheduler's miss."""
    longest_per_mean = 1033 / 300
    # the reference host (stop 70: 27.8 ms a decode step, 0.445 ms a prefill token) keeps them
    assert rt_prompt_tokens_for(0.0278, 0.000445, 1.0, longest_per_mean, 300) == 300
    slow = rt_prompt_tokens_for(0.045, 0.00092, 1.0, longest_per_mean, 300)
    assert 100 < slow < 200
    assert 0.045 + slow * longest_per_mean * 0.00092 <= 0.5  # half the target, alone
    assert rt_prompt_tokens_for(0.045, 0.00092, 2.0, longest_per_mean, 300) > slow  # looser
    assert rt_prompt_tokens_for(0.045, 0.0, 1.0, longest_per_mean, 300) == 300  # unmeasured
    assert rt_prompt_tokens_for(0.6, 0.01, 1.0, longest_per_mean, 300) == 16  # at least


def test_rt_prompts_keep_their_given_or_default_length_unless_the_rate_was_calibrated(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from antiphon.bench import mixed

    # a trace of 48 turns a second apart, one of them four times as long as the others
    rows = [f"2023-11-16 18:00:{i:02d}.000000,{400 if i == 7 else 100},20" for i in range(48)]
    (tmp_path / "AzureLLMInferenceTrace_conv.csv").write_text(
        "TIMESTAMP,ContextTokens,GeneratedTokens\n" + "\n".join(rows) + "\n")
    monkeypatch.setenv("ANTIPHON_BENCH_DATA", str(tmp_path))

    parser = argparse.ArgumentParser()
    mixed.add_workload_arguments(parser, kv_pages=64, rt_rate=None)
    args = parser.parse_args(["--quick"])
    assert args.rt_prompt_tokens is None  # resolved by the run
    assert parser.parse_args(["--rt-prompt-tokens", "120"]).rt_prompt_tokens == 120
    with pytest.raises(SystemExit):
        parser.parse_args(["--rt-prompt-tokens", "0"])
    args.rt_rate = 1.2
    assert mixed.mean_rt_prompt_tokens(args, 40.0, calibrated=False) == 300
    args.rt_rate_gauge_s, args.rt_prefill_s_per_token = 0.045, 0.00092
    longest = round(400 * 300 / (47 * 100 + 400) * 48)  # at a 300-token mean
    assert mixed.mean_rt_prompt_tokens(args, 40.0, calibrated=True) == rt_prompt_tokens_for(
        0.045, 0.00092, 1.0, longest / 300, 300) < 300


def test_rt_rate_is_a_positive_number_or_auto_and_auto_is_mixeds_default() -> None:
    from antiphon.bench.blocks import add_parser as add_blocks
    from antiphon.bench.mixed import add_parser as add_mixed

    parser = argparse.ArgumentParser()
    kinds = parser.add_subparsers()
    add_mixed(kinds)
    add_blocks(kinds)
    assert parser.parse_args(["mixed"]).rt_rate is None  # auto
    assert parser.parse_args(["mixed", "--rt-rate", "auto"]).rt_rate is None
    assert parser.parse_args(["mixed", "--rt-rate", "1.5"]).rt_rate == 1.5
    assert parser.parse_args(["blocks"]).rt_rate == 1.0  # (its runs are sized by hand)
    for bad in ("0", "-1", "fast", "inf", "nan"):
        with pytest.raises(SystemExit):
            parser.parse_args(["mixed", "--rt-rate", bad])


async def test_the_calibration_decodes_every_prompt_together_and_fails_on_a_failed_turn(
        ) -> None:
    import httpx

    from antiphon.bench import mixed

    sent: list[str] = []
    short = False

    def serve(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/models":
            return httpx.Response(200, json={"data": [{"id": "m"}]})
        body = json.loads(request.content)
        sent.append(body["messages"][0]["content"])
        assert body["max_tokens"] == mixed.CALIBRATION_TOKENS and body["ignore_eos"]
        assert not body.get("stream")  # as the runs' BE work, which is most of their steps
        tokens = body["max_tokens"] - (1 if short else 0)
        return httpx.Response(200, json={"choices": [{"finish_reason": "length"}],
                                         "usage": {"completion_tokens": tokens}})

    prompts = [f"prompt {i}" for i in range(mixed.CALIBRATION_STREAMS)]
    before = time.time()
    start, end = await mixed.decode_together("http://bench", prompts, httpx.MockTransport(serve))
    assert before <= start <= end <= time.time()
    assert sorted(sent) == sorted(prompts * mixed.CALIBRATION_ROUNDS)
    short = True  # a turn cut short decoded fewer steps than the gauge reads
    cut = f"{mixed.CALIBRATION_TOKENS - 1} of {mixed.CALIBRATION_TOKENS} tokens"
    with pytest.raises(RuntimeError, match=f"calibration turn failed: {cut}"):
        await mixed.decode_together("http://bench", prompts, httpx.MockTransport(serve))

    def refuse(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/models":
            return httpx.Response(200, json={"data": [{"id": "m"}]})
        return httpx.Response(503, json={"error": {"message": "busy"}})

    with pytest.raises(RuntimeError, match="HTTP 503"):
        await mixed.decode_together("http://bench", prompts, httpx.MockTransport(refuse))


def test_a_calibration_without_gauge_steps_says_to_give_the_rate(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from antiphon.bench import mixed

    class Server:
        url = "http://bench"

        def __init__(self, cmd: list[str], log_path: Path) -> None:
            assert cmd[cmd.index("--policy") + 1] == "fcfs" and "--no-kv-tiering" in cmd
            self.trace = Path(cmd[cmd.index("--step-trace") + 1])

        def __enter__(self) -> Server:
            return self

        def __exit__(self, *exc: object) -> None:
            return None

    steps: list[str] = []

    async def decode(url: str, prompts: list[str]) -> tuple[float, float]:
        Path(args.out).with_suffix(".calibration.steps.jsonl").write_text("".join(steps))
        return 0.0, 100.0

    monkeypatch.setattr(mixed, "ServerProcess", Server)
    monkeypatch.setattr(mixed, "decode_together", decode)
    parser = argparse.ArgumentParser()
    mixed.add_workload_arguments(parser, kv_pages=64, rt_rate=None)
    args = parser.parse_args(["--quick"])
    args.out = str(tmp_path / "m.json")
    steps = [_step(10.0 + i, 0.030 + i / 1000, [0, 0, 10], [0, 0, 0]) for i in range(3)]
    assert mixed.calibrate_host(args, tmp_path, ["p"]) == (pytest.approx(0.031), 0.0)
    # with prefill steps, what a prefill token costs too
    steps += [_step(20.0 + i, 0.030 + 0.001 * n, [1, n, 9], [0, 0, 0])
              for i, n in enumerate((100, 500, 2000))]
    assert mixed.calibrate_host(args, tmp_path, ["p"]) == (pytest.approx(0.031),
                                                            pytest.approx(0.001, rel=0.05))
    steps = [_step(10.0, 0.5, [1, 300, 0], [0, 0, 0])]  # a prefill: no gauge step
    with pytest.raises(RuntimeError, match="give --rt-rate"):
        mixed.calibrate_host(args, tmp_path, ["p"])

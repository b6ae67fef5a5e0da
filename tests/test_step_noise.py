from antiphon.bench.step_noise import spread


def test_spread_reports_percentiles_in_ms_and_the_deviation_as_a_share_of_the_median() -> None:
    result = spread([0.010, 0.010, 0.010, 0.020, 0.010])
    assert result["p50_ms"] == 10.0 and result["p10_ms"] == 10.0 and result["p90_ms"] == 20.0
    assert result["mean_abs_dev"] == 0.2  # one step 10 ms off a 10 ms median, over 5 steps

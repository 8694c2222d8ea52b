"""The micro-batch trend bench groups vTrain runs that differ only in the micro-batch and compares
each run's time relative to the group's smallest micro-batch; the cases are worked out by hand."""

from __future__ import annotations

import pytest

from paratrain.plan.validate import MeasuredRun
from tests.scripts import load_script

bench = load_script("bench/bench_microbatch_trend.py", "bench_microbatch_trend")


def _run(mb: int, time_s: float, tp: int = 8, line: int = 2) -> MeasuredRun:
    return MeasuredRun(gpus=64, global_batch=512, microbatch=mb, hidden=3072, heads=32, layers=30, seq=2048,
                       tp=tp, dp=64 // tp, pp=1, time_s=time_s, line=line)


def test_runs_differing_only_in_micro_batch_form_one_group_sorted_by_it() -> None:
    runs = [_run(8, 5.0), _run(2, 8.0), _run(4, 6.0), _run(4, 9.0, tp=4)]  # the tp-4 run is alone: no group
    groups = bench.trend_groups(runs, [5.5, 8.0, 6.6, 9.9])
    assert list(groups.values()) == [[(2, 8.0, 8.0), (4, 6.0, 6.6), (8, 5.0, 5.5)]]


def test_a_micro_batch_measured_twice_keeps_its_first_run() -> None:
    groups = bench.trend_groups([_run(2, 8.0), _run(2, 7.0, line=3), _run(4, 6.0)], [8.0, 7.0, 6.0])
    assert list(groups.values()) == [[(2, 8.0, 8.0), (4, 6.0, 6.0)]]


def test_ratio_error_compares_predicted_with_measured_trend() -> None:
    # measured 8 -> 6 s (ratio 0.75), predicted 8 -> 6.6 s (0.825): the model's trend is 10 % too flat
    [(mb, measured, predicted, err)] = bench.ratio_errors([(2, 8.0, 8.0), (4, 6.0, 6.6)])
    assert (mb, measured, predicted) == (4, 0.75, pytest.approx(0.825))
    assert err == pytest.approx(10.0)
    # an absolute error common to every run cancels: each prediction 20 % slow, trend exact
    assert bench.ratio_errors([(2, 8.0, 9.6), (4, 6.0, 7.2)])[0][3] == pytest.approx(0.0, abs=1e-12)

"""The MegaScale bench splits an iteration time into a cost per micro-batch and a fixed cost per
step by least squares; the cases are worked out by hand."""

from __future__ import annotations

import pytest

from tests.scripts import load_script

bench = load_script("bench/bench_megascale.py", "bench_megascale")


def test_points_on_a_line_give_its_slope_and_intercept() -> None:
    # 0.2 s per micro-batch and 1.5 s per step: 192 -> 39.9, 96 -> 20.7, 48 -> 11.1
    slope, fixed = bench.fixed_and_per_microbatch([192, 96, 48], [39.9, 20.7, 11.1])
    assert slope == pytest.approx(0.2, rel=1e-12)
    assert fixed == pytest.approx(1.5, rel=1e-12)


def test_scattered_points_give_the_least_squares_line() -> None:
    # m = 0, 1, 2 with times 0, 2, 1: mean m 1, mean t 1, Sxx = 2, Sxy = (-1)(-1) + 0 + (1)(0) = 1,
    # so slope 1/2 and intercept 1 - 1/2 = 1/2
    assert bench.fixed_and_per_microbatch([0, 1, 2], [0.0, 2.0, 1.0]) == pytest.approx((0.5, 0.5), rel=1e-12)


def test_one_micro_batch_count_cannot_be_split() -> None:
    with pytest.raises(ValueError, match="two distinct"):
        bench.fixed_and_per_microbatch([48, 48], [10.0, 11.0])

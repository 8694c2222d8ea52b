"""The layouts bench compares rankings strictly and up to ties within the measured noise.

``bench/bench_layouts.py`` orders two layouts only when every measured step of one was faster than
every step of the other; these cases are worked out by hand.
"""

from __future__ import annotations

from tests.scripts import load_script

bench = load_script("bench/bench_layouts.py", "bench_layouts")


def test_overlapping_step_ranges_are_not_ordered() -> None:
    # a: 1.0-1.2 and b: 1.1-1.3 overlap; c: 2.0-2.1 is slower than every step of both
    times = [[1.0, 1.2], [1.1, 1.3], [2.0, 2.1]]
    assert sorted(bench.ordered_pairs(times)) == [(0, 2), (1, 2)]


def test_touching_ranges_count_as_a_tie() -> None:
    # the slowest step of one equals the fastest of the other: the measurement does not order them
    assert bench.ordered_pairs([[1.0, 1.5], [1.5, 2.0]]) == []


def test_a_swap_inside_the_noise_agrees_up_to_ties_but_not_strictly() -> None:
    times = [[1.0, 1.2], [1.1, 1.3], [2.0, 2.1]]
    predicted = [1.25, 1.15, 2.2]  # a and b swapped: both measured medians 1.1 / 1.2 are within each other's range
    assert bench.ranking_up_to_ties(predicted, times) == (2, 2)
    assert bench._ranks(predicted) != bench._ranks([1.1, 1.2, 2.05])


def test_a_swap_the_measurement_resolves_is_counted_against_the_prediction() -> None:
    times = [[1.0, 1.2], [1.1, 1.3], [2.0, 2.1]]
    predicted = [2.3, 1.15, 2.2]  # a predicted slower than c, which every measured step contradicts
    assert bench.ranking_up_to_ties(predicted, times) == (1, 2)


def test_steps_are_spread_over_rounds_with_the_remainder_first() -> None:
    # every layout trains its --steps in turn in each round; the sum is always --steps
    assert bench.round_steps(4, 2) == [2, 2]
    assert bench.round_steps(5, 2) == [3, 2]
    assert bench.round_steps(7, 3) == [3, 2, 2]
    assert bench.round_steps(4, 1) == [4]
    assert bench.round_steps(2, 4) == [1, 1]  # rounds left without a step are dropped
    for steps in range(1, 12):
        for rounds in range(1, 6):
            assert sum(bench.round_steps(steps, rounds)) == steps

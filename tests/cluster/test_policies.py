"""Gavel's policies on instances small enough to solve by hand (each case derives its answer in the
comment), plus the property the paper's comparison rests on: the heterogeneity-aware max-min
objective is never worse under the aware policy than under the agnostic one."""

from __future__ import annotations

import numpy as np
import pytest

from paratrain.cluster.policies import POLICY_NAMES, AllocationProblem, equal_share, get_policy
from paratrain.errors import ConfigError

TOL = 1e-6


def problem(thr, caps, sf=None, w=None, **kw) -> AllocationProblem:
    thr = np.asarray(thr, float)
    n, k = thr.shape
    return AllocationProblem(job_ids=tuple(range(n)), worker_types=tuple(f"t{j}" for j in range(k)), throughputs=thr,
                             scale_factors=np.ones(n) if sf is None else np.asarray(sf), capacities=np.asarray(caps),
                             priority_weights=w, **kw)


def check_feasible(p: AllocationProblem, x: np.ndarray) -> None:
    assert (x >= -TOL).all() and (x <= 1 + TOL).all()
    assert (x.sum(axis=1) <= 1 + TOL).all()
    assert ((p.scale_factors[:, None] * x).sum(axis=0) <= p.capacities + TOL).all()


def test_las_weights_split_one_gpu_in_proportion():
    # max min(xA/1, xB/2) s.t. xA + xB ≤ 1  →  xA = 1/3, xB = 2/3.
    p = problem([[1.0], [1.0]], [1], w=[1.0, 2.0])
    x = get_policy("max_min_fairness").solve(p).x
    np.testing.assert_allclose(x[:, 0], [1 / 3, 2 / 3], atol=TOL)


def test_las_gives_a_multi_gpu_job_less_time():
    # 4 GPUs; A uses 1, B uses 4: maximize min(sA, 4·sB) with sA + 4·sB ≤ 4, s ≤ 1. sA is capped at
    # 1 (the min is 1); the second LP then gives B what is left: sB = 3/4.
    p = problem([[1.0], [1.0]], [4], sf=[1, 4])
    x = get_policy("max_min_fairness").solve(p).x
    np.testing.assert_allclose(x[:, 0], [1.0, 0.75], atol=TOL)


def test_perf_max_min_two_jobs_two_types_by_hand():
    # One GPU of each type. T_A = (4, 1), T_B = (3, 1). Equal share: 1/2 of each type, so
    # iso_A = 2.5, iso_B = 2. Using every GPU, x_A = (a, 1-a), x_B = (1-a, a):
    # ρ_A = (1 + 3a)/2.5, ρ_B = (3 - 2a)/2, equal at a = 1/2 where both are 1.
    p = problem([[4.0, 1.0], [3.0, 1.0]], [1, 1])
    alloc = get_policy("max_min_fairness_perf").solve(p)
    check_feasible(p, alloc.x)
    np.testing.assert_allclose(alloc.x, [[0.5, 0.5], [0.5, 0.5]], atol=1e-5)
    assert alloc.solve_time_s > 0


def test_perf_puts_each_job_on_its_faster_type():
    # T_A = (4, 1), T_B = (2, 2): B is indifferent, so ρ_B = 1 whatever happens; the second LP then
    # maximizes ρ_A: A on type 0, B on type 1.
    p = problem([[4.0, 1.0], [2.0, 2.0]], [1, 1])
    x = get_policy("max_min_fairness_perf").solve(p).x
    np.testing.assert_allclose(x, [[1, 0], [0, 1]], atol=1e-6)


def test_equal_share_is_water_filled():
    # 2 GPUs, weights 1, 1, 2 and one 2-GPU job... c solves Σ min(sf, c·w) = 2 over sf = (1, 1, 1):
    # min(1, c) + min(1, c) + min(1, 2c) = 2 → c = 1/2, shares (1/2, 1/2, 1).
    p = problem([[1.0, 1.0]] * 3, [1, 1], w=[1.0, 1.0, 2.0])
    x = equal_share(p)
    np.testing.assert_allclose(x.sum(axis=1), [0.5, 0.5, 1.0], atol=1e-9)
    np.testing.assert_allclose(x[:, 0], x[:, 1])  # spread in proportion to type sizes (1:1)


def test_water_filling_gives_the_leftover_to_the_unconstrained_job():
    # A and B run only on type 0, C only on type 1 (1 GPU each). Equal share gives everyone
    # iso = 1/3; A and B split type 0 (ρ = 1.5 each); C, alone on type 1, gets all of it (ρ = 3).
    p = problem([[1.0, 0.0], [1.0, 0.0], [0.0, 1.0]], [1, 1])
    x = get_policy("max_min_fairness_water_filling_perf").solve(p).x
    np.testing.assert_allclose(x, [[0.5, 0], [0.5, 0], [0, 1]], atol=1e-6)


def test_hierarchical_weights_split_an_entity_among_its_jobs():
    # Entities X (A, B) and Y (C), weight 1 each, one GPU: A and B share X's half.
    p = problem([[1.0]] * 3, [1], entities=("X", "X", "Y"), entity_weights={"X": 1.0, "Y": 1.0})
    x = get_policy("max_min_fairness_water_filling").solve(p).x
    np.testing.assert_allclose(x[:, 0], [0.25, 0.25, 0.5], atol=1e-6)


def test_min_total_duration_by_hand():
    # One GPU, T = 1, remaining 100 and 300 steps: the makespan is 400 s with shares 1/4 and 3/4.
    p = problem([[1.0], [1.0]], [1], steps_remaining=np.array([100.0, 300.0]))
    x = get_policy("min_total_duration_perf").solve(p).x
    np.testing.assert_allclose(x[:, 0], [0.25, 0.75], atol=1e-6)
    # Two types: A = (2, 1) with 200 steps, B = (1, 1) with 100. A alone on type 0 and B on type 1
    # both end at 100 s; below 100 s A would need 2a + b > 2 with a + b ≤ 1.
    p = problem([[2.0, 1.0], [1.0, 1.0]], [1, 1], steps_remaining=np.array([200.0, 100.0]))
    x = get_policy("min_total_duration_perf").solve(p).x
    thr = (p.throughputs * x).sum(axis=1)
    assert max(p.steps_remaining / thr) == pytest.approx(100.0, rel=1e-6)


def test_finish_time_fairness_by_hand():
    # T_A = (2, 1), T_B = (1, 2), t = 0: iso = 1.5 each; each job's best is 2 steps/s on its own
    # type, so ρ ≥ 0.75, reached by A on type 0 and B on type 1.
    p = problem([[2.0, 1.0], [1.0, 2.0]], [1, 1], steps_remaining=np.array([100.0, 100.0]),
                times_since_start_s=np.zeros(2))
    x = get_policy("finish_time_fairness_perf").solve(p).x
    np.testing.assert_allclose(x, [[1, 0], [0, 1]], atol=1e-3)
    # Agnostic (T = 1): one GPU each… the equal share itself is optimal: ρ = 1 for both.
    x = get_policy("finish_time_fairness").solve(p).x
    np.testing.assert_allclose(x.sum(axis=1), [1.0, 1.0], atol=1e-3)


def test_max_sum_throughput_and_slos():
    # One GPU, 3 vs 5 steps/s: all to the faster job.
    p = problem([[3.0], [5.0]], [1])
    np.testing.assert_allclose(get_policy("max_sum_throughput_perf").solve(p).x[:, 0], [0, 1], atol=1e-9)
    # Cost policy with an SLO: job 0 needs 150 steps in 100 s (1.5 steps/s → x0 = 1/2).
    kw = dict(prices_per_hour=np.array([1.0]), steps_remaining=np.array([150.0, 100.0]),
              slo_deadlines_s=np.array([100.0, np.nan]))
    a = get_policy("max_sum_throughput_normalized_by_cost_perf_SLOs").solve(problem([[3.0], [5.0]], [1], **kw))
    np.testing.assert_allclose(a.x[:, 0], [0.5, 0.5], atol=1e-9)
    assert a.note == ""
    # 400 steps in 100 s needs 4 steps/s > 3: infeasible, solved without the SLO, and said so.
    kw["steps_remaining"] = np.array([400.0, 100.0])
    a = get_policy("max_sum_throughput_normalized_by_cost_perf_SLOs").solve(problem([[3.0], [5.0]], [1], **kw))
    np.testing.assert_allclose(a.x[:, 0], [0, 1], atol=1e-9)
    assert "without them" in a.note


def test_cost_policy_prefers_throughput_per_dollar():
    # Type 0: 1 step/s at $1/h; type 1: 2 steps/s at $4/h → type 0 gives more steps per dollar.
    p = problem([[1.0, 2.0]], [1, 1], prices_per_hour=np.array([1.0, 4.0]))
    np.testing.assert_allclose(get_policy("max_sum_throughput_normalized_by_cost_perf").solve(p).x, [[1, 0]])
    with pytest.raises(ConfigError, match="prices"):
        get_policy("max_sum_throughput_normalized_by_cost_perf").solve(problem([[1.0, 2.0]], [1, 1]))


def test_fifo_in_arrival_order():
    p = problem([[1.0]] * 3, [2])
    np.testing.assert_allclose(get_policy("fifo").solve(p).x[:, 0], [1, 1, 0])
    p = problem([[1.0, 2.0], [3.0, 1.0]], [1, 1])
    np.testing.assert_allclose(get_policy("fifo_perf").solve(p).x, [[0, 1], [1, 0]])


@pytest.mark.parametrize("seed", range(5))
def test_heterogeneity_aware_max_min_is_at_least_agnostic(seed):
    rng = np.random.default_rng(seed)
    n, k = 12, 3
    thr = rng.uniform(0.2, 5.0, size=(n, k))
    p = problem(thr, [3, 3, 3], sf=rng.choice([1, 2], size=n))
    aware = get_policy("max_min_fairness_perf")
    coef = aware.coefficients(p)

    def objective(x):
        return float((coef * x).sum(axis=1).min())

    xa = aware.solve(p).x
    xg = get_policy("max_min_fairness").solve(p).x
    check_feasible(p, xa)
    check_feasible(p, xg)
    assert objective(xa) >= objective(xg) - 1e-7


def test_every_policy_returns_a_feasible_allocation():
    rng = np.random.default_rng(7)
    thr = rng.uniform(0.1, 3.0, size=(8, 3))
    kw = dict(steps_remaining=rng.uniform(100, 1000, 8), times_since_start_s=rng.uniform(0, 500, 8),
              prices_per_hour=np.array([3.0, 1.5, 0.9]), slo_deadlines_s=np.full(8, np.nan))
    p = problem(thr, [2, 2, 2], sf=rng.choice([1, 2], size=8), **kw)
    for name in POLICY_NAMES:
        check_feasible(p, get_policy(name).solve(p).x)


def test_unknown_policy_names_the_choices():
    with pytest.raises(ConfigError, match="max_min_fairness_perf"):
        get_policy("max_min")

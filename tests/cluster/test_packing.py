"""Space sharing (Gavel's ``_packed`` policies): a pair solved by hand, the LP's invariants on Gavel's
measured pairs, and the round mechanism and simulator running co-located jobs."""

from __future__ import annotations

import json

import numpy as np
import pytest

from paratrain.cluster.packing import PackedAllocation, combinations
from paratrain.cluster.policies import AllocationProblem, equal_share, get_policy
from paratrain.cluster.simulator import simulate_cluster
from paratrain.cluster.throughputs import ThroughputTable, read_throughputs
from paratrain.cluster.trace import Job, read_trace
from paratrain.spec.hetero import parse_accelerators


def two_jobs_one_gpu(pair: tuple[float, float]) -> AllocationProblem:
    """Jobs 0 and 1, 1 step/s each alone on the one GPU of type g; ``pair`` when co-located."""
    return AllocationProblem(job_ids=(0, 1), worker_types=("g",), throughputs=np.ones((2, 1)),
                             scale_factors=np.ones(2), capacities=np.ones(1),
                             colocated={(0, 1): np.array([pair])})


def test_max_min_packed_solved_by_hand():
    # Alone the jobs split the GPU: 0.5 steps/s each. Co-located they make 0.9 and 0.5 steps/s.
    # With p the pair's share and y1 job 1's share alone (job 0 alone gets none): rates 0.9p and
    # y1 + 0.5p under p + y1 ≤ 1; the minimum is largest when 0.9p = 1 − 0.5p: p = 5/7, y1 = 2/7,
    # both jobs at 9/14 steps/s.
    alloc = get_policy("max_min_fairness_packed").solve(two_jobs_one_gpu((0.9, 0.5)))
    assert isinstance(alloc, PackedAllocation)
    y = dict(zip(alloc.combos, alloc.y[:, 0], strict=True))
    assert y[(0,)] == pytest.approx(0.0, abs=1e-6)
    assert y[(1,)] == pytest.approx(2 / 7, abs=1e-6)
    assert y[(0, 1)] == pytest.approx(5 / 7, abs=1e-6)
    np.testing.assert_allclose(alloc.effective_throughputs(np.ones((2, 1))), [9 / 14, 9 / 14], atol=1e-6)
    assert alloc.pairs() == [{"jobs": [0, 1], "worker_type": "g", "fraction": pytest.approx(5 / 7)}]
    # Isolation (no co-located rates) is the equal split; a pair slower than taking turns is unused.
    alone = get_policy("max_min_fairness_packed").solve(two_jobs_one_gpu((0.4, 0.4)))
    np.testing.assert_allclose(alone.effective_throughputs(np.ones((2, 1))), [0.5, 0.5], atol=1e-6)
    assert alone.pairs() == []


def test_finish_time_packed_solved_by_hand():
    # 100 steps left each, just started: under the equal share (0.5 steps/s) both end at 200 s, so
    # ρ_m = (100/rate_m)/200 and min max ρ is max-min rate again: 9/14 steps/s each, ρ = 7/9.
    problem = two_jobs_one_gpu((0.9, 0.5))
    problem.steps_remaining, problem.times_since_start_s = np.array([100.0, 100.0]), np.zeros(2)
    alloc = get_policy("finish_time_fairness_packed").solve(problem)
    np.testing.assert_allclose(alloc.effective_throughputs(None), [9 / 14, 9 / 14], rtol=1e-3)


def test_max_sum_packed_solved_by_hand():
    # Σ rates: alone at most 1 (one GPU); as a pair 0.9 + 0.5 = 1.4 → the pair all the time.
    alloc = get_policy("max_sum_throughput_packed").solve(two_jobs_one_gpu((0.9, 0.5)))
    np.testing.assert_allclose(alloc.effective_throughputs(np.ones((2, 1))), [0.9, 0.5], atol=1e-6)


@pytest.fixture(scope="module")
def table():
    return read_throughputs("gavel:simulation_throughputs.json")


def gavel_problem(table: ThroughputTable, n: int, colocated: bool) -> AllocationProblem:
    jobs = read_trace("gavel:max_min_fairness.trace")[:n]
    types = ("v100", "p100", "k80")
    pairs = {(a, b): np.array([table.pair(jobs[a].key, jobs[b].key, t) for t in types])
             for a in range(n) for b in range(a + 1, n)} if colocated else None
    return AllocationProblem(job_ids=tuple(range(n)), worker_types=types,
                             throughputs=np.array([[table.get(j.key, t) for t in types] for j in jobs]),
                             scale_factors=np.array([j.scale_factor for j in jobs]),
                             capacities=np.array([4, 4, 4]), colocated=pairs)


def test_packed_invariants_on_gavel_pairs(table):
    problem = gavel_problem(table, 24, colocated=True)
    combos, rates = combinations(problem)
    sf = problem.scale_factors
    # Only jobs with equal GPU counts are paired (Gavel packs only equal scale factors).
    assert all(sf[a] == sf[b] for c in combos if len(c) == 2 for a, b in [c])
    assert sum(len(c) == 2 for c in combos) > 0
    for name in ("max_min_fairness_packed", "max_sum_throughput_packed", "finish_time_fairness_packed"):
        alloc = get_policy(name).solve(problem)
        y = alloc.y
        assert y.min() >= 0 and y.max() <= 1 + 1e-9
        for m in range(24):  # a job's shares over its combinations and the types sum to ≤ 1
            assert sum(y[c].sum() for c, combo in enumerate(combos) if m in combo) <= 1 + 1e-7
        gpus = np.array([sf[c[0]] for c in combos]) @ y  # a pair uses its GPUs once
        assert np.all(gpus <= problem.capacities + 1e-7)
        assert np.all(y[(rates == 0).all(axis=2)] <= 1e-9)  # nothing where the combination cannot run
        # Packing only adds options: never worse than the same LP with every job alone.
        alone = get_policy(name).solve(gavel_problem(table, 24, colocated=False))
        eff, eff_alone = alloc.effective_throughputs(None), alone.effective_throughputs(None)
        if name == "max_sum_throughput_packed":
            assert eff.sum() >= eff_alone.sum() * (1 - 1e-7)
        elif name == "finish_time_fairness_packed":  # no time elapsed: ρ = rate under equal share / rate
            iso = (problem.throughputs * equal_share(problem)).sum(axis=1)
            assert (iso / eff).max() <= (iso / eff_alone).max() * (1 + 1e-3)  # bisected to 1e-4
        else:
            norm = sf / problem.throughputs.sum(axis=1)
            assert (eff * norm).min() >= (eff_alone * norm).min() * (1 - 1e-7)
        assert len(alloc.pairs()) > 0


def pair_table(pair: tuple[float, float]) -> ThroughputTable:
    a, b = ("a", 1), ("b", 1)
    return ThroughputTable({a: {"g": 1.0}, b: {"g": 1.0}}, {(a, b): {"g": pair}, (b, a): {"g": pair[::-1]}})


def test_simulated_pair_by_hand():
    # Two 720-step jobs, 1 step/s alone; co-located 0.9 steps/s each, so max-min packs them all the
    # time: 324 steps each per 360-s round, 324 + 324 + 72 → both end at 360 + 360 + 80 = 800 s
    # (taking turns alone: 1,080 and 1,440 s). The one GPU is busy throughout, counted once.
    res = simulate_cluster([Job("a", 720), Job("b", 720)], pair_table((0.9, 0.9)), parse_accelerators("g=1"),
                           get_policy("max_min_fairness_packed"), record_occupancy=True)
    assert res.jct_s == {0: pytest.approx(800.0), 1: pytest.approx(800.0)}
    assert res.makespan_s == pytest.approx(800.0) and res.rounds == 3
    assert res.utilization == pytest.approx(1.0)
    assert res.colocated_gpu_s == pytest.approx(800.0)
    assert all(busy["g"] == 1 for _, _, busy in res.occupancy)


def test_packed_trace_end_to_end(table):
    # 24 jobs of Gavel's trace (1–4 GPUs) on 4 GPUs of each type: every job completes.
    jobs = read_trace("gavel:max_min_fairness.trace")[:24]
    cluster = parse_accelerators("v100=4,p100=4,k80=4")
    res = simulate_cluster(jobs, table, cluster, get_policy("max_min_fairness_packed"), record_occupancy=True)
    assert sorted(res.jct_s) == list(range(24))
    assert all(v > 0 for v in res.jct_s.values())
    assert all(busy[t] <= cluster.counts[t] for _, _, busy in res.occupancy for t in busy)
    assert 0 < res.utilization <= 1
    busy = sum(res.busy_s_by_type.values())
    assert 0 < res.colocated_gpu_s < busy  # some GPU time was shared, not all


def test_cli_solve_lists_pairs(run_cli):
    code, out, err = run_cli("cluster", "solve", "--jobs", "gavel:max_min_fairness.trace", "--accelerators",
                             "v100=12,p100=12,k80=12", "--policy", "max_min_fairness_packed", "--json")
    assert code == 0, err
    doc = json.loads(out)
    assert doc["policy"] == "max_min_fairness_packed" and doc["pairs"]
    assert all(p["fraction"] > 0 and p["jobs"][0] < p["jobs"][1] for p in doc["pairs"])


def test_ray_driver_refuses_packing(tmp_path):
    from paratrain.cluster.ray_driver import drive
    from paratrain.errors import ConfigError

    with pytest.raises(ConfigError, match="co-locates"):
        drive([], parse_accelerators("g=1"), get_policy("max_min_fairness_packed"), round_s=1.0,
              workdir=tmp_path, execute=lambda *a: [])

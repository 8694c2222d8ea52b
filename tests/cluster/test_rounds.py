"""The round-based mechanism: placement invariants on Gavel's trace, priorities that make time
shares follow the allocation, kept leases, and the throughput moving average."""

from __future__ import annotations

import pytest

from paratrain.cluster.policies import get_policy
from paratrain.cluster.rounds import EMA_ALPHA, RoundMechanism
from paratrain.cluster.throughputs import read_throughputs
from paratrain.cluster.trace import Job, read_trace
from paratrain.spec.hetero import parse_accelerators


@pytest.fixture(scope="module")
def table():
    return read_throughputs("gavel:simulation_throughputs.json")


@pytest.mark.parametrize("policy", ["max_min_fairness", "max_min_fairness_perf", "fifo", "min_total_duration_perf"])
def test_placements_respect_the_cluster(table, policy):
    cluster = parse_accelerators("v100=4,p100=4,k80=4")
    mech = RoundMechanism(cluster, get_policy(policy))
    jobs = read_trace("gavel:max_min_fairness.trace")[:30]
    for i, job in enumerate(jobs):
        mech.add_job(i, job, {t: table.get(job.key, t) for t in cluster.types})
    for r in range(20):
        placed = mech.schedule(now_s=360.0 * r)
        used = [w for ws in placed.values() for w in ws]
        assert len(used) == len(set(used))  # no accelerator twice
        for j, ws in placed.items():
            types = {mech.worker_type[w] for w in ws}
            assert len(types) == 1  # one type per job
            assert len(ws) == jobs[j].scale_factor
            assert mech.jobs[j].throughputs[types.pop()] > 0
        for j, ws in placed.items():  # everybody ran the whole round
            mech.record(j, mech.worker_type[ws[0]], 1, 360.0)


def test_time_shares_follow_the_allocation():
    # One GPU, weights 1 and 3 (LAS): allocation 1/4 and 3/4. Over 40 rounds the priorities
    # (allocation / share received) make the shares of rounds converge to it.
    cluster = parse_accelerators("g=1")
    mech = RoundMechanism(cluster, get_policy("max_min_fairness"))
    mech.add_job(0, Job("a", 10**9, priority_weight=1.0), {"g": 1.0})
    mech.add_job(1, Job("b", 10**9, priority_weight=3.0), {"g": 1.0})
    ran = {0: 0, 1: 0}
    for r in range(40):
        placed = mech.schedule(now_s=360.0 * r)
        (j,) = placed
        ran[j] += 1
        mech.record(j, "g", 360, 360.0)
    assert mech.allocation[0]["g"] == pytest.approx(0.25)
    assert ran == {0: 10, 1: 30}


def test_unchanged_placements_keep_their_lease():
    # Two GPUs, two jobs: each job keeps its accelerator round after round.
    cluster = parse_accelerators("g=2")
    mech = RoundMechanism(cluster, get_policy("max_min_fairness_perf"))
    for j in range(2):
        mech.add_job(j, Job("a", 10**9), {"g": 1.0})
    first = mech.schedule(0.0)
    for r in range(1, 6):
        for j in first:
            mech.record(j, "g", 360, 360.0)
        assert mech.schedule(360.0 * r) == first
    assert mech.lease_extensions == 10 and mech.lease_opportunities == 10


def test_measured_throughput_moves_by_ema():
    cluster = parse_accelerators("g=1")
    mech = RoundMechanism(cluster, get_policy("max_min_fairness_perf"))
    mech.add_job(0, Job("a", 100), {"g": 2.0})
    mech.observe(0, "g", steps=40, seconds=10.0)  # measured 4 steps/s
    assert mech.jobs[0].throughputs["g"] == pytest.approx(EMA_ALPHA * 4.0 + (1 - EMA_ALPHA) * 2.0)


def test_allocation_is_recomputed_only_at_resets():
    # Gavel recomputes the allocation when something changed and 1,920 s passed since the last
    # reset (a reset at t = 0 still counts as "never reset"): the job arriving at 400 s gets no
    # allocation, and no accelerator, until 360 + 1,920 s.
    cluster = parse_accelerators("g=3")
    mech = RoundMechanism(cluster, get_policy("max_min_fairness_perf"))
    mech.add_job(0, Job("a", 10**9), {"g": 1.0})
    assert 0 in mech.schedule(0.0)
    mech.add_job(1, Job("b", 10**9), {"g": 1.0})
    assert 1 in mech.schedule(360.0)
    mech.add_job(2, Job("c", 10**9), {"g": 1.0})
    assert 2 not in mech.schedule(400.0)
    assert 2 not in mech.schedule(2000.0)
    assert 2 in mech.schedule(360.0 + 1920.0)

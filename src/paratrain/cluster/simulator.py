"""Round-by-round cluster simulation, with the semantics of Gavel's ``Scheduler.simulate``.

Each round: every job placed for the round runs ``min(⌊throughput·round_s⌋, remaining)`` steps and
ends after steps/throughput seconds; the round ends when its last job ends (so a round is shorter
than ``round_s`` when every placed job finishes early). Then completed micro-tasks are credited, jobs
that arrived by that time join, and the mechanism places the next round. A job's completion time
is the end of its last micro-task minus its arrival; the makespan is the end of the last round; a
GPU's utilization is its busy time over the makespan. Under a ``_packed`` policy both jobs of a
pair run on the same accelerators at their co-located rates (``cluster/packing.py``); the GPUs are
busy until the later one ends.

Differences from Gavel, and why:
* A round's start is the time it was placed. Gavel takes the previous round's end, which differs
  only after the cluster sat idle waiting for an arrival (there it credits jobs with the idle gap).
* A job too slow to make one step in a round still makes one (Gavel would schedule zero steps and
  loop on the same timestamp).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from paratrain.cluster.market import PriceBook
from paratrain.cluster.policies import Policy
from paratrain.cluster.rounds import RoundMechanism
from paratrain.cluster.throughputs import ThroughputTable
from paratrain.cluster.trace import Job
from paratrain.errors import ConfigError
from paratrain.spec.hetero import HeteroClusterSpec

__all__ = ["SimulationResult", "check_jobs_runnable", "simulate_cluster", "MAX_ROUNDS"]

# A bound on rounds so a typo (a job of 10^12 steps) cannot run for hours: 10^6 rounds of 360 s
# is 11 simulated years.
MAX_ROUNDS = 1_000_000


@dataclass
class SimulationResult:
    policy: str
    accelerators: dict[str, int]
    round_s: float
    jct_s: dict[int, float]
    makespan_s: float
    utilization: float
    rounds: int
    lease_extensions: int
    lease_opportunities: int
    solve_times_s: list[float]
    busy_s_by_type: dict[str, float]
    occupancy: list[tuple[float, float, dict[str, int]]] = field(default_factory=list)  # (start, end, GPUs busy)
    total_cost: float | None = None
    notes: list[str] = field(default_factory=list)
    colocated_gpu_s: float | None = None  # packed policies: GPU-seconds two jobs shared

    @property
    def avg_jct_s(self) -> float:
        return sum(self.jct_s.values()) / len(self.jct_s)

    def to_dict(self) -> dict[str, object]:
        d: dict[str, object] = {
            "policy": self.policy,
            "accelerators": self.accelerators,
            "round_s": self.round_s,
            "jobs": len(self.jct_s),
            "avg_jct_s": self.avg_jct_s,
            "makespan_s": self.makespan_s,
            "utilization": self.utilization,
            "rounds": self.rounds,
            "lease_extensions": self.lease_extensions,
            "lease_opportunities": self.lease_opportunities,
            "solves": len(self.solve_times_s),
            "solve_time_total_s": sum(self.solve_times_s),
            "solve_time_max_s": max(self.solve_times_s, default=0.0),
            "busy_s_by_type": self.busy_s_by_type,
            "jct_s_by_job": {str(k): v for k, v in sorted(self.jct_s.items())},
        }
        if self.total_cost is not None:
            d["total_cost"] = self.total_cost
        if self.notes:
            d["notes"] = self.notes
        if self.colocated_gpu_s is not None:
            d["colocated_gpu_s"] = self.colocated_gpu_s
        return d


def check_jobs_runnable(jobs: tuple[Job, ...] | list[Job], table: ThroughputTable, cluster: HeteroClusterSpec,
                        field_name: str = "--jobs") -> None:
    """Every job's type must be in the table, and some accelerator type must run it with its GPUs."""
    for i, job in enumerate(jobs, 1):
        if not table.has(job.key):
            known = sorted({k[0] for k in table.isolated})
            raise ConfigError(field_name, f"job {i}: unknown job type {job.job_type!r} at {job.scale_factor} GPU(s)",
                              f"use a type of the throughput file ({len(known)} known, e.g. {known[0]!r})")
        usable = [t for t in cluster.types if table.get(job.key, t) > 0 and cluster.counts[t] >= job.scale_factor]
        if not usable:
            raise ConfigError("--accelerators", f"no accelerator type can run job {i} ({job.job_type}, "
                              f"{job.scale_factor} GPU(s)): types {', '.join(cluster.types)}",
                              "add a type the job has a throughput on, with enough accelerators")


def _check_rounds_needed(jobs: tuple[Job, ...] | list[Job], table: ThroughputTable, cluster: HeteroClusterSpec,
                         round_s: float, max_rounds: int, *, pairs: bool) -> None:
    """A ConfigError now, not after ``max_rounds`` rounds (a minute of work), when the trace needs
    more: a job makes at most ``max(1, ⌊rate·round_s⌋)`` steps a round at its fastest rate, so it
    needs that many rounds alone, and all jobs together need their GPU-rounds over the GPUs (twice
    the GPUs under a packed policy, which puts two jobs on one). A short ``--round-s`` is what
    makes these large (``1e-9``: one step a round)."""
    counts = cluster.counts
    fastest: dict[tuple[str, int], float] = {}
    for job in jobs:
        fastest[job.key] = max((table.get(job.key, t) for t in cluster.types), default=0.0)
    if pairs:  # a co-located rate may (in a measured table) exceed the isolated one
        for (a, b), by_type in table.colocated.items():
            for t, (ra, rb) in by_type.items():
                if t in counts:
                    if a in fastest:
                        fastest[a] = max(fastest[a], ra)
                    if b in fastest:
                        fastest[b] = max(fastest[b], rb)
    alone = 0  # the most rounds one job needs
    gpu_rounds = 0
    for job in jobs:
        per_round = max(1, int(fastest[job.key] * round_s)) if fastest[job.key] > 0 else 1
        need = -(-job.total_steps // per_round)
        alone = max(alone, need)
        gpu_rounds += need * job.scale_factor
    slots = sum(counts.values()) * (2 if pairs else 1)
    need = max(alone, -(-gpu_rounds // slots))
    if need > max_rounds:
        raise ConfigError("--round-s", f"the trace needs at least {need:,} rounds of {round_s:g} s, more than the "
                          f"limit of {max_rounds:,}", "use longer rounds (Gavel: --round-s 360)")


def simulate_cluster(
    jobs: tuple[Job, ...] | list[Job],
    table: ThroughputTable,
    cluster: HeteroClusterSpec,
    policy: Policy,
    *,
    round_s: float = 360.0,
    seed: int = 0,
    prices: PriceBook | None = None,
    record_occupancy: bool = False,
    max_rounds: int = MAX_ROUNDS,
) -> SimulationResult:
    """Simulate ``jobs`` (sorted by arrival) on ``cluster`` under ``policy``."""
    if not (math.isfinite(round_s) and round_s > 0):
        raise ConfigError("--round-s", f"must be a positive number of seconds, got {round_s}", "pass e.g. 360")
    check_jobs_runnable(jobs, table, cluster)
    _check_rounds_needed(jobs, table, cluster, round_s, max_rounds, pairs=policy.is_packed)
    if policy.is_packed:
        from paratrain.cluster.packing import PackedRoundMechanism

        def pair_rates(a: int, b: int) -> dict[str, tuple[float, float]]:
            return {t: table.pair(jobs[a].key, jobs[b].key, t) for t in cluster.types}

        mech: RoundMechanism = PackedRoundMechanism(cluster, policy, round_s=round_s, seed=seed,
                                                    pair_rates=pair_rates)
    else:
        mech = RoundMechanism(cluster, policy, round_s=round_s, seed=seed)
    queued = sorted(enumerate(jobs), key=lambda p: p[1].arrival_time_s)
    remaining = len(jobs)
    now = queued[0][1].arrival_time_s
    running: list[tuple[float, int, str, tuple[int, ...], int]] = []  # finish, job, type, workers, steps
    round_start = now
    busy_by_worker = {w: 0.0 for w in mech.worker_type}
    jct: dict[int, float] = {}
    costs: dict[int, float] = {}
    occupancy: list[tuple[float, float, dict[str, int]]] = []
    rounds = 0
    colocated_gpu_s = 0.0
    while remaining > 0:
        if running:
            now = max(r[0] for r in running)
        elif queued:
            now = max(now, queued[0][1].arrival_time_s)
        else:
            mech.last_reset_s = 0.0  # nothing runs and nothing will arrive: Gavel forces a reset
        if prices is not None:
            mech.set_prices(prices.latest(now, cluster.types))
        if record_occupancy and running:
            busy: dict[str, int] = {t: 0 for t in cluster.types}
            for t, ws in {(t, ws) for _, _, t, ws, _ in running}:  # a pair's GPUs count once
                busy[t] += len(ws)
            occupancy.append((round_start, now, busy))
        ends: dict[tuple[int, ...], float] = {}  # a pair's accelerators are busy until its later job ends
        for finish, _, _, ws, _ in running:
            if ws in ends:  # the second job of a pair: its GPUs were shared until the earlier end
                colocated_gpu_s += len(ws) * (min(ends[ws], finish) - round_start)
            ends[ws] = max(ends.get(ws, 0.0), finish)
        for ws, finish in ends.items():
            for w in ws:
                busy_by_worker[w] += finish - round_start
        for finish, j, t, _, steps in running:
            exec_s = finish - round_start
            if mech.record(j, t, steps, exec_s):
                jct[j] = finish - jobs[j].arrival_time_s
                costs[j] = mech.jobs[j].cost
                mech.remove_job(j)
                remaining -= 1
        running = []
        while queued and queued[0][1].arrival_time_s <= now:
            j, job = queued.pop(0)
            mech.add_job(j, job, {t: table.get(job.key, t) for t in cluster.types})
        if remaining == 0:
            break
        rounds += 1
        if rounds > max_rounds:
            raise ConfigError("--jobs", f"the simulation passed {max_rounds} rounds", "check the jobs' step counts")
        round_start = now
        for j, ws in mech.schedule(now).items():
            t = mech.worker_type[ws[0]]
            active = mech.jobs[j]
            thr = mech.rate(j, t) if policy.is_packed else active.throughputs[t]  # type: ignore[attr-defined]
            steps = min(max(int(thr * round_s), 1), active.steps_remaining)
            running.append((now + steps / thr, j, t, ws, steps))
    makespan = now
    util = (sum(busy_by_worker.values()) / (len(busy_by_worker) * makespan)) if makespan > 0 else 0.0
    busy_by_type = {t: sum(busy_by_worker[w] for w in mech.workers[t]) for t in cluster.types}
    return SimulationResult(
        policy=policy.name,
        accelerators=cluster.counts,
        round_s=round_s,
        jct_s=jct,
        makespan_s=makespan,
        utilization=util,
        rounds=rounds,
        lease_extensions=mech.lease_extensions,
        lease_opportunities=mech.lease_opportunities,
        solve_times_s=[a.solve_time_s for a in mech.solves],
        busy_s_by_type=busy_by_type,
        colocated_gpu_s=colocated_gpu_s if policy.is_packed else None,
        occupancy=occupancy,
        total_cost=sum(costs.values()) if prices is not None else None,
        notes=mech.notes,
    )

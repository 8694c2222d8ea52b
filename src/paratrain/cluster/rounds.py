"""Gavel's round-based mechanism (``scheduler/scheduler.py``): turn an allocation X into which job
runs on which accelerators for the next round.

* Priority of (job m, type j) = X[m, j] / fraction[m, j], where fraction is the time job m ran on
  type j over the time type j ran any job, both since the last reset. A job with allocation but no
  recorded time gets X·1e9; a job with X = 0, no allocation yet, or zero throughput gets 0. Every
  job enters with half a round of time on every type (so a newcomer's fraction is not 0 once the
  type has run).
* The allocation is recomputed only at a *reset*: when something changed (a job arrived or left,
  a price moved) and at least ``reset_interval_s`` (1,920 s) passed since the previous reset, or
  no reset happened yet. A reset also moves the time run so far into per-type deficits
  (time the allocation promised minus time received), the second sort key.
* Each round, per type (types fastest first for ``_perf`` policies, shuffled for the agnostic
  ones), jobs are sorted by (priority, deficit, allocation), descending; walking the queues in
  type order, a job is placed on a type if its GPU count fits what is left there, once per round.
  A job that arrived after the last allocation is counted in that pass but not placed (as in Gavel;
  its accelerators idle until the next reset gives it an allocation).
* Placement keeps a job on the same accelerators as last round when it stays on that type and they
  are still free (a kept lease, counted in ``lease_extensions``); other jobs take the lowest free
  ids, largest jobs first.
* Measured throughputs update the policy's inputs with an exponential moving average
  (α = 0.5, :meth:`RoundMechanism.observe`); the simulator, like Gavel's, uses the table as is.
"""

from __future__ import annotations

import math
import random
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np

from paratrain.cluster.policies import Allocation, AllocationProblem, Policy
from paratrain.cluster.trace import Job
from paratrain.spec.hetero import HeteroClusterSpec

__all__ = ["RoundMechanism", "ActiveJob", "type_order", "EMA_ALPHA", "RESET_INTERVAL_S"]

EMA_ALPHA = 0.5  # Gavel scheduler.py EMA_ALPHA
RESET_INTERVAL_S = 1920.0  # Gavel's minimum_time_between_allocation_resets
_NEW_JOB_PRIORITY = 1e9  # Gavel: "don't use inf so 2*new_priority > new_priority"

# Gavel walks the types as ["v100", "p100", "k80"]; types it does not know come after, fastest
# presets first.
_PREFERRED = ("h100", "a100-80gb", "a100", "a100-40gb", "v100", "p100", "k80")


def type_order(types: tuple[str, ...] | list[str]) -> list[str]:
    known = [t for t in _PREFERRED if t in types]
    return known + [t for t in types if t not in known]


@dataclass
class ActiveJob:
    job_id: int
    job: Job
    throughputs: dict[str, float]  # steps/s on each type (measured or predicted)
    steps_done: int = 0
    cost: float = 0.0

    @property
    def steps_remaining(self) -> int:
        return self.job.total_steps - self.steps_done


class RoundMechanism:
    """Scheduler state across rounds. Call :meth:`add_job` / :meth:`remove_job` as jobs come and
    go, :meth:`schedule` at each round start, and :meth:`record` when a job's micro-task ends."""

    def __init__(self, cluster: HeteroClusterSpec, policy: Policy, *, round_s: float = 360.0,
                 reset_interval_s: float = RESET_INTERVAL_S, seed: int = 0) -> None:
        self.cluster = cluster
        self.policy = policy
        self.round_s = round_s
        self.reset_interval_s = reset_interval_s
        self.types = type_order(list(cluster.types))
        self._shuffler = random.Random(seed + 5)  # Gavel seeds its type shuffler with seed + 5
        # Worker ids by type name order (Gavel registers sorted(cluster_spec)), one GPU per server.
        self.workers: dict[str, list[int]] = {}
        self.worker_type: dict[int, str] = {}
        wid = 0
        for t in sorted(cluster.types):
            self.workers[t] = list(range(wid, wid + cluster.counts[t]))
            for w in self.workers[t]:
                self.worker_type[w] = t
            wid += cluster.counts[t]
        self.jobs: dict[int, ActiveJob] = {}
        self.allocation: dict[int, dict[str, float]] = {}
        self.job_time: dict[int, dict[str, float]] = {}
        self.worker_time: dict[str, float] = {t: 0.0 for t in self.types}
        self.deficits: dict[str, dict[int, float]] = {t: {} for t in self.types}
        self.priorities: dict[str, dict[int, float]] = {t: {} for t in self.types}
        self.last_reset_s = 0.0
        self.need_update = False
        self.assignments: OrderedDict[int, tuple[int, ...]] = OrderedDict()
        self.lease_extensions = 0
        self.lease_opportunities = 0
        self.solves: list[Allocation] = []
        self.prices: dict[str, float] | None = None
        self.notes: list[str] = []

    # -- jobs ------------------------------------------------------------------------------------
    def add_job(self, job_id: int, job: Job, throughputs: dict[str, float]) -> None:
        self.jobs[job_id] = ActiveJob(job_id, job, {t: float(throughputs.get(t, 0.0)) for t in self.types})
        self.job_time[job_id] = {t: self.round_s / 2 for t in self.types}
        for t in self.types:
            self.priorities[t][job_id] = 0.0
            self.deficits[t][job_id] = 0.0
        self.need_update = True

    def remove_job(self, job_id: int) -> None:
        del self.jobs[job_id]
        del self.job_time[job_id]
        for t in self.types:
            self.priorities[t].pop(job_id, None)
            self.deficits[t].pop(job_id, None)
        self.need_update = True

    def set_prices(self, prices: dict[str, float]) -> None:
        """Latest price per type ($/h per accelerator); a change triggers a re-solve."""
        if prices != self.prices:
            self.prices = dict(prices)
            self.need_update = True

    def record(self, job_id: int, worker_type: str, steps: int, exec_time_s: float) -> bool:
        """A micro-task ended: credit steps and time; returns True when the job has finished."""
        job = self.jobs[job_id]
        job.steps_done += steps
        if self.prices is not None:
            job.cost += self.prices[worker_type] * exec_time_s / 3600.0 * job.job.scale_factor
        self.job_time[job_id][worker_type] += exec_time_s
        self.worker_time[worker_type] += exec_time_s
        return job.steps_remaining <= 0

    def observe(self, job_id: int, worker_type: str, steps: int, seconds: float) -> None:
        """Fold a measured throughput into the estimate: new = α·measured + (1 − α)·old."""
        measured = steps / seconds if seconds > 0 else 0.0
        old = self.jobs[job_id].throughputs[worker_type]
        self.jobs[job_id].throughputs[worker_type] = EMA_ALPHA * measured + (1 - EMA_ALPHA) * old

    # -- allocation --------------------------------------------------------------------------------
    def problem(self, now_s: float) -> AllocationProblem:
        ids = tuple(self.jobs)
        jobs = [self.jobs[j] for j in ids]
        deadlines = None
        if any(a.job.slo is not None for a in jobs):
            dl = []
            for a in jobs:
                best = max(a.throughputs.values())
                if a.job.slo is None or best <= 0:
                    dl.append(math.nan)
                else:
                    dl.append(a.job.arrival_time_s + a.job.slo * a.job.total_steps / best - now_s)
            deadlines = np.array(dl)
        return AllocationProblem(
            job_ids=ids,
            worker_types=tuple(self.types),
            throughputs=np.array([[a.throughputs[t] for t in self.types] for a in jobs]).reshape(
                len(ids), len(self.types)),
            scale_factors=np.array([a.job.scale_factor for a in jobs]),
            capacities=np.array([self.cluster.counts[t] for t in self.types]),
            priority_weights=np.array([a.job.priority_weight for a in jobs]),
            steps_remaining=np.array([max(a.steps_remaining, 0) for a in jobs], dtype=float),
            times_since_start_s=np.array([now_s - a.job.arrival_time_s for a in jobs]),
            prices_per_hour=None if self.prices is None else np.array([self.prices[t] for t in self.types]),
            slo_deadlines_s=deadlines,
            entities=tuple(a.job.entity for a in jobs) if any(a.job.entity for a in jobs) else None,
        )

    def _reset(self, now_s: float) -> None:
        elapsed = now_s - self.last_reset_s
        half = self.round_s / 2
        for t in self.types:
            self.worker_time[t] = 0.0
            for j in self.job_time:
                received = self.job_time[j][t] - half
                should = self.allocation[j][t] * elapsed if j in self.allocation else 0.0
                self.deficits[t][j] = self.deficits[t].get(j, 0.0) + should - received
                self.job_time[j][t] = half
                self.worker_time[t] += half
        self.last_reset_s = now_s

    def _update_priorities(self, now_s: float) -> None:
        due = (now_s - self.last_reset_s >= self.reset_interval_s) or self.last_reset_s == 0
        if self.need_update and due:
            self._reset(now_s)
            alloc = self.policy.solve(self.problem(now_s))
            self.solves.append(alloc)
            if alloc.note and alloc.note not in self.notes:
                self.notes.append(alloc.note)
            self.allocation = alloc.as_dict()
            self.need_update = False
        for t in self.types:
            wt = self.worker_time[t]
            for j in self.priorities[t]:
                a = self.allocation.get(j)
                if a is None:
                    self.priorities[t][j] = 0.0
                    continue
                share = a[t]
                if share == 0.0 or self.jobs[j].throughputs[t] == 0:
                    prio = 0.0
                elif wt > 0 and self.job_time[j][t] > 0:
                    prio = share / (self.job_time[j][t] / wt)
                else:
                    prio = share * _NEW_JOB_PRIORITY
                self.priorities[t][j] = prio

    # -- one round -------------------------------------------------------------------------------
    def schedule(self, now_s: float) -> OrderedDict[int, tuple[int, ...]]:
        """Decide the next round: job id → accelerator ids (all of one type)."""
        self._update_priorities(now_s)
        types = list(self.types)
        if not self.policy.is_perf:
            self._shuffler.shuffle(types)
        left = dict(self.cluster.counts)
        queue: list[tuple[int, str]] = []
        for t in types:
            entries = [(j, t, self.priorities[t][j], self.deficits[t][j], self.allocation.get(j, {}).get(t, 0.0))
                       for j in self.priorities[t]]
            entries.sort(key=lambda e: (e[2], e[3], e[4]), reverse=True)
            queue += [(e[0], e[1]) for e in entries]
        chosen: dict[str, list[tuple[int, int]]] = {t: [] for t in types}
        placed: set[int] = set()
        for j, t in queue:
            if left[t] == 0 or j in placed:
                continue
            if self.jobs[j].throughputs[t] <= 0:
                continue
            if self.policy.is_fifo and self.priorities[t][j] <= 0:
                continue
            sf = self.jobs[j].job.scale_factor
            if sf > left[t]:
                continue
            left[t] -= sf
            placed.add(j)
            chosen[t].append((j, sf))
        new: OrderedDict[int, tuple[int, ...]] = OrderedDict()
        prev_type = {j: self.worker_type[w[0]] for j, w in self.assignments.items()}
        for t in types:
            taken: set[int] = set()
            free = list(self.workers[t])
            for size in sorted({sf for _, sf in chosen[t]}, reverse=True):
                for j, sf in chosen[t]:  # keep last round's accelerators where possible
                    if sf == size and prev_type.get(j) == t and not (set(self.assignments[j]) & taken):
                        new[j] = self.assignments[j]
                        taken |= set(self.assignments[j])
                for j, sf in chosen[t]:
                    if sf != size or j in new or j not in self.allocation:
                        continue
                    ids = []
                    while len(ids) < sf:
                        w = free.pop(0)
                        if w not in taken:
                            ids.append(w)
                            taken.add(w)
                    new[j] = tuple(ids)
        self.lease_opportunities += sum(1 for j in self.assignments if j in self.jobs)
        self.lease_extensions += sum(1 for j, w in new.items() if self.assignments.get(j) == w)
        self.assignments = new
        return new

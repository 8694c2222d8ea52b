"""Space sharing: Gavel's ``_packed`` policies and the round mechanism that places job pairs.

The allocation is over job *combinations* — each job alone and each pair of jobs co-located on
the same accelerators — × accelerator types: Y[c, j] is the fraction of time combination c runs on
type j. Job m's effective throughput sums over the combinations that contain it::

    throughput_m(Y) = Σ_{c ∋ m} Σ_j T_m[c, j]·Y[c, j]

with T_m[c, j] job m's steps/s in c on type j (its isolated rate when c = {m}, its co-located rate
from Gavel's throughput file when c is a pair). Constraints (Gavel ``policies/policy.py``,
``PolicyWithPacking``): 0 ≤ Y ≤ 1; Σ_{c ∋ m} Σ_j Y[c, j] ≤ 1 for every job (it runs in one
combination at a time); Σ_c sf_c·Y[c, j] ≤ N_j for every type (a pair uses its jobs' sf GPUs once).
As in Gavel, only jobs with equal scale factors are paired, and a pair is only allowed on types
where both jobs' co-located rates were measured.

``max_min_fairness_packed`` maximizes min_m w_m⁻¹·sf_m·throughput_m(Y) / Σ_j T[m, j], normalized
as Gavel's ``MaxMinFairnessPolicyWithPacking`` does (by the sum of the job's isolated rates over the
types, where ``max_min_fairness_perf`` uses its rate under the equal share: the two agree up to a
constant for 1-GPU jobs on equally sized types), then (second LP, as for the unpacked policies) the
sum of those normalized rates at that minimum: Gavel stops at the solver's first optimum.
``max_sum_throughput_packed`` maximizes Σ_m throughput_m(Y) (Gavel's
``max_sum_throughput_normalized_by_cost_packed_SLOs`` without prices or SLOs).

The mechanism (:class:`PackedRoundMechanism`) is Gavel's with combinations in place of jobs:
priorities, deficits and time received are kept per (combination, type); walking the queues, a
combination is placed when none of its jobs is placed yet and its GPUs fit, and both jobs of a
pair share the same accelerators; a pair's time received is the longer of its two jobs'
micro-tasks, as in Gavel.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np
from scipy import sparse

from paratrain.cluster.policies import (
    Allocation,
    AllocationProblem,
    Policy,
    _linprog,
    equal_share,
)
from paratrain.cluster.rounds import _NEW_JOB_PRIORITY, RoundMechanism
from paratrain.errors import ConfigError

__all__ = ["Combination", "PackedAllocation", "PackedPolicy", "PackedRoundMechanism", "combinations"]

Combination = tuple[int, ...]  # job ids, sorted: (m,) alone, (a, b) co-located


@dataclass
class PackedAllocation(Allocation):
    """An allocation over combinations: ``combos[c]`` and ``y[c, j]``; ``x`` (per job, summed over
    its combinations) keeps the :class:`Allocation` view."""

    combos: tuple[Combination, ...] = ()
    y: np.ndarray | None = None
    rates: np.ndarray | None = None  # C × k × n, from :func:`combinations`

    def effective_throughputs(self, throughputs: np.ndarray) -> np.ndarray:
        """Σ over each job's combinations and types of its rate there × Y (``throughputs`` unused:
        the co-located rates come with the allocation)."""
        assert self.y is not None and self.rates is not None
        return np.einsum("ctm,ct->m", self.rates, self.y) if len(self.combos) else np.zeros(len(self.job_ids))

    def pairs(self, tol: float = 1e-6) -> list[dict[str, object]]:
        """The co-located combinations with time: ``{"jobs": [a, b], "worker_type", "fraction"}``."""
        assert self.y is not None
        return [{"jobs": list(c), "worker_type": w, "fraction": float(self.y[i, t])}
                for i, c in enumerate(self.combos) if len(c) == 2
                for t, w in enumerate(self.worker_types) if self.y[i, t] > tol]

    def combo_dict(self) -> dict[Combination, dict[str, float]]:
        assert self.y is not None
        return {c: {w: float(self.y[i, t]) for t, w in enumerate(self.worker_types)} for i, c in enumerate(self.combos)}


def combinations(problem: AllocationProblem) -> tuple[list[Combination], np.ndarray]:
    """Every job alone, then every pair with equal scale factors and a co-located rate on some
    type. Returns the combinations and R (C × k × n): job m's steps/s in combination c on type j."""
    n, k = problem.shape
    row = {j: i for i, j in enumerate(problem.job_ids)}
    combos: list[Combination] = [(j,) for j in problem.job_ids]
    rates = [np.zeros((k, n)) for _ in combos]
    for i in range(n):
        rates[i][:, i] = problem.throughputs[i]
    for (a, b), pair in sorted((problem.colocated or {}).items()):
        if a not in row or b not in row or a == b:
            continue
        ia, ib = row[a], row[b]
        if problem.scale_factors[ia] != problem.scale_factors[ib]:
            continue
        pair = np.asarray(pair, dtype=float).reshape(k, 2)
        both = (pair[:, 0] > 0) & (pair[:, 1] > 0)
        if not both.any():
            continue
        r = np.zeros((k, n))
        r[both, ia] = pair[both, 0]
        r[both, ib] = pair[both, 1]
        combos.append(tuple(sorted((a, b))))
        rates.append(r)
    return combos, np.stack(rates) if rates else np.zeros((0, k, n))


def _constraints(problem: AllocationProblem, combos: list[Combination], extra: int
                 ) -> tuple[sparse.csr_matrix, np.ndarray]:
    n, k = problem.shape
    row = {j: i for i, j in enumerate(problem.job_ids)}
    nc = len(combos)
    r_job, c_job, r_type, c_type, v_type = [], [], [], [], []
    for c, combo in enumerate(combos):
        sf = problem.scale_factors[row[combo[0]]]
        for t in range(k):
            var = c * k + t
            for j in combo:
                r_job.append(row[j])
                c_job.append(var)
            r_type.append(t)
            c_type.append(var)
            v_type.append(sf)
    nv = nc * k + extra
    per_job = sparse.csr_matrix((np.ones(len(r_job)), (r_job, c_job)), shape=(n, nv))
    per_type = sparse.csr_matrix((v_type, (r_type, c_type)), shape=(k, nv))
    return sparse.vstack([per_job, per_type]).tocsr(), np.concatenate([np.ones(n), problem.capacities])


class PackedPolicy(Policy):
    """``max_min_fairness_packed`` (``objective="max_min"``), ``max_sum_throughput_packed``
    (``"sum"``) and ``finish_time_fairness_packed`` (``"finish_time"``)."""

    is_packed = True
    is_perf = True

    def __init__(self, objective: str) -> None:
        self.objective = objective
        self.name = {"max_min": "max_min_fairness_packed", "sum": "max_sum_throughput_packed",
                     "finish_time": "finish_time_fairness_packed"}[objective]

    def solve(self, problem: AllocationProblem) -> PackedAllocation:
        t0 = time.perf_counter()
        n, k = problem.shape
        combos, rates = combinations(problem)
        y = np.zeros((len(combos), k)) if n == 0 else np.clip(self._solve_y(problem, combos, rates), 0.0, 1.0)
        x = np.zeros((n, k))
        row = {j: i for i, j in enumerate(problem.job_ids)}
        for c, combo in enumerate(combos):
            for j in combo:
                x[row[j]] += y[c]
        return PackedAllocation(problem.job_ids, problem.worker_types, x, time.perf_counter() - t0, "",
                                tuple(combos), y, rates)

    def _solve_y(self, problem: AllocationProblem, combos: list[Combination], rates: np.ndarray) -> np.ndarray:
        n, k = problem.shape
        nc = len(combos)
        if self.objective == "finish_time":
            return self._finish_time(problem, combos, rates)
        if self.objective == "max_min":
            w = problem.weights()
            total = problem.throughputs.sum(axis=1)  # Gavel's packed normalization (see above)
            scale = problem.scale_factors / (w * np.where(total > 0, total, 1.0))
        else:
            scale = np.ones(n)
        # coef[m, c·k + t]: job m's normalized rate per unit of Y[c, t].
        coef = sparse.csr_matrix((rates * scale[None, None, :]).transpose(2, 0, 1).reshape(n, nc * k))
        runnable = (rates > 0).any(axis=2)  # some job of c runs on t (pairs: both, see combinations)
        bounds = np.zeros((nc * k + 1, 2))
        bounds[: nc * k, 1] = runnable.reshape(-1).astype(float)
        bounds[-1] = (0.0, np.inf)
        a_base, b_base = _constraints(problem, combos, 1)
        coef1 = sparse.hstack([coef, sparse.csr_matrix((n, 1))]).tocsr()
        if self.objective == "sum":
            c = np.concatenate([-np.asarray(coef.sum(axis=0)).ravel(), [0.0]])
            y, _ = _linprog(c, a_base, b_base, bounds)
            assert y is not None  # Y = 0 is feasible
            return y[: nc * k].reshape(nc, k)
        t_col = sparse.csr_matrix((np.ones(n), (np.arange(n), np.full(n, nc * k))), shape=(n, nc * k + 1))
        a_ub = sparse.vstack([a_base, t_col - coef1]).tocsr()
        b_ub = np.concatenate([b_base, np.zeros(n)])
        c = np.zeros(nc * k + 1)
        c[-1] = -1.0
        y, res = _linprog(c, a_ub, b_ub, bounds)
        if y is None:
            raise ConfigError("policy", f"the packed max-min LP failed: {getattr(res, 'message', '')}",
                              "check the cluster and the jobs' throughputs")
        bounds[-1] = (float(y[-1]) * (1 - 1e-7), np.inf)
        c2 = np.concatenate([-np.asarray(coef.sum(axis=0)).ravel(), [0.0]])
        y2, _ = _linprog(c2, a_ub, b_ub, bounds)
        return (y2 if y2 is not None else y)[: nc * k].reshape(nc, k)


    def _finish_time(self, problem: AllocationProblem, combos: list[Combination], rates: np.ndarray) -> np.ndarray:
        """min max_m ρ_m, ρ_m = (t_m + r_m/throughput_m(Y)) / (t_m + r_m/throughput_m(X_equal)), bisected
        on ρ as the unpacked policy does: ρ ≤ ρ* iff throughput_m(Y) ≥ r_m / (ρ*·D_m − t_m), an LP
        feasibility check over the combinations."""
        n, k = problem.shape
        nc = len(combos)
        iso = (problem.throughputs * equal_share(problem)).sum(axis=1)
        iso = np.where(iso > 0, iso, 1.0)
        r = np.asarray(problem.steps_remaining if problem.steps_remaining is not None else np.ones(n), float)
        t = np.asarray(problem.times_since_start_s if problem.times_since_start_s is not None else np.zeros(n), float)
        d = t + r / iso
        coef = sparse.csr_matrix(rates.transpose(2, 0, 1).reshape(n, nc * k))
        a_base, b_base = _constraints(problem, combos, 0)
        a_ub = sparse.vstack([a_base, -coef]).tocsr()
        bounds = np.zeros((nc * k, 2))
        bounds[:, 1] = (rates > 0).any(axis=2).reshape(-1).astype(float)

        def solve_at(rho: float, objective: np.ndarray) -> np.ndarray | None:
            slack = rho * d - t
            if np.any(slack[r > 0] <= 0):
                return None
            need = np.where(r > 0, r / np.where(slack > 0, slack, 1.0), 0.0)
            y, _ = _linprog(objective, a_ub, np.concatenate([b_base, -need]), bounds)
            return y

        lo, hi = float((t / d).max()), 1.0  # ρ = 1 is reachable: the equal share, every job alone
        zero = np.zeros(nc * k)
        while hi - lo > 1e-4 * hi:
            mid = (lo + hi) / 2
            lo, hi = (lo, mid) if solve_at(mid, zero) is not None else (mid, hi)
        # At ρ = hi, maximize the total normalized throughput (Pareto-efficient point).
        y = solve_at(hi, -np.asarray((coef.multiply(1 / iso[:, None])).sum(axis=0)).ravel())
        if y is None:  # ρ = 1 can only fail numerically: fall back to the equal share, alone
            y = np.zeros(nc * k)
            y[: n * k] = equal_share(problem).reshape(-1)
        return y.reshape(nc, k)


class PackedRoundMechanism(RoundMechanism):
    """Gavel's round mechanism over combinations. ``pair_rates(a, b)`` gives job ids a and b's
    co-located steps/s per type ({type: (rate_a, rate_b)}); :meth:`schedule` maps each placed
    combination's jobs to the same accelerator ids, and :attr:`combo_of` says who shares."""

    def __init__(self, *args, pair_rates, **kwargs) -> None:  # type: ignore[no-untyped-def]
        super().__init__(*args, **kwargs)
        self.pair_rates = pair_rates
        self._pairs: dict[tuple[int, int], dict[str, tuple[float, float]]] = {}
        self.combo_alloc: dict[Combination, dict[str, float]] = {}
        self.combo_time: dict[Combination, dict[str, float]] = {}
        self.combo_deficit: dict[Combination, dict[str, float]] = {}
        self.combo_of: dict[int, Combination] = {}
        self.combo_assignments: OrderedDict[Combination, tuple[int, ...]] = OrderedDict()
        self._credited: dict[Combination, float] = {}  # time credited to each combination this round

    def add_job(self, job_id, job, throughputs) -> None:  # type: ignore[no-untyped-def]
        for other in self.jobs:
            if self.jobs[other].job.scale_factor == job.scale_factor:
                a, b = sorted((other, job_id))
                self._pairs[(a, b)] = self.pair_rates(a, b)
        super().add_job(job_id, job, throughputs)

    def remove_job(self, job_id: int) -> None:
        super().remove_job(job_id)
        self._pairs = {p: v for p, v in self._pairs.items() if job_id not in p}
        for d in (self.combo_alloc, self.combo_time, self.combo_deficit, self.combo_assignments):
            for c in [c for c in d if job_id in c]:
                del d[c]

    def problem(self, now_s: float) -> AllocationProblem:
        p = super().problem(now_s)
        p.colocated = {ab: np.array([v.get(t, (0.0, 0.0)) for t in self.types]) for ab, v in self._pairs.items()}
        return p

    def record(self, job_id: int, worker_type: str, steps: int, exec_time_s: float) -> bool:
        # As Gavel: a combination is credited with the longer of its jobs' micro-tasks, once.
        combo = self.combo_of.get(job_id, (job_id,))
        before = self._credited.get(combo, 0.0)
        add = max(exec_time_s - before, 0.0)
        self._credited[combo] = before + add
        self.combo_time.setdefault(combo, {t: self.round_s / 2 for t in self.types})[worker_type] += add
        done = super().record(job_id, worker_type, steps, exec_time_s)
        self.worker_time[worker_type] += add - exec_time_s  # a pair's GPUs count once
        return done

    def _reset(self, now_s: float) -> None:
        elapsed = now_s - self.last_reset_s
        half = self.round_s / 2
        super()._reset(now_s)
        for c, times in self.combo_time.items():
            d = self.combo_deficit.setdefault(c, {t: 0.0 for t in self.types})
            for t in self.types:
                should = self.combo_alloc.get(c, {}).get(t, 0.0) * elapsed
                d[t] += should - (times[t] - half)
                times[t] = half

    def schedule(self, now_s: float) -> OrderedDict[int, tuple[int, ...]]:  # type: ignore[override]
        self._credited = {}
        due = (now_s - self.last_reset_s >= self.reset_interval_s) or self.last_reset_s == 0
        if self.need_update and due:
            self._reset(now_s)
            alloc = self.policy.solve(self.problem(now_s))
            self.solves.append(alloc)
            assert isinstance(alloc, PackedAllocation)
            self.allocation = alloc.as_dict()
            self.combo_alloc = alloc.combo_dict()
            for c in self.combo_alloc:
                self.combo_time.setdefault(c, {t: self.round_s / 2 for t in self.types})
            self.need_update = False
        queue: list[tuple[Combination, str]] = []
        for t in self.types:
            wt = self.worker_time[t]
            entries = []
            for c, a in self.combo_alloc.items():
                share = a[t]
                if share <= 0.0:
                    continue
                ct = self.combo_time[c][t]
                prio = share / (ct / wt) if wt > 0 and ct > 0 else share * _NEW_JOB_PRIORITY
                entries.append((c, prio, self.combo_deficit.get(c, {}).get(t, 0.0), share))
            entries.sort(key=lambda e: (e[1], e[2], e[3]), reverse=True)
            queue += [(e[0], t) for e in entries]
        left = dict(self.cluster.counts)
        placed: set[int] = set()
        chosen: dict[str, list[Combination]] = {t: [] for t in self.types}
        for c, t in queue:
            if any(j in placed for j in c) or not all(self._rate(j, c, t) > 0 for j in c):
                continue
            sf = self.jobs[c[0]].job.scale_factor
            if sf > left[t]:
                continue
            left[t] -= sf
            placed.update(c)
            chosen[t].append(c)
        new: OrderedDict[Combination, tuple[int, ...]] = OrderedDict()
        prev_type = {c: self.worker_type[w[0]] for c, w in self.combo_assignments.items()}
        for t in self.types:
            taken: set[int] = set()
            sizes = {c: self.jobs[c[0]].job.scale_factor for c in chosen[t]}
            for c in sorted(chosen[t], key=lambda c: -sizes[c]):  # keep last round's accelerators
                if prev_type.get(c) == t and not (set(self.combo_assignments[c]) & taken):
                    new[c] = self.combo_assignments[c]
                    taken |= set(new[c])
            free = [w for w in self.workers[t] if w not in taken]
            for c in sorted(chosen[t], key=lambda c: -sizes[c]):
                if c not in new:
                    new[c], free = tuple(free[: sizes[c]]), free[sizes[c]:]
        self.lease_opportunities += sum(1 for c in self.combo_assignments if all(j in self.jobs for j in c))
        self.lease_extensions += sum(1 for c, w in new.items() if self.combo_assignments.get(c) == w)
        self.combo_assignments = new
        self.combo_of = {j: c for c in new for j in c}
        self.assignments = OrderedDict((j, w) for c, w in new.items() for j in c)
        return self.assignments

    def _rate(self, job_id: int, combo: Combination, worker_type: str) -> float:
        """Steps/s of ``job_id`` on ``worker_type`` when run as ``combo``."""
        if len(combo) == 1:
            return self.jobs[job_id].throughputs[worker_type]
        a, b = combo
        pair = self._pairs.get((a, b), {}).get(worker_type, (0.0, 0.0))
        return pair[0] if job_id == a else pair[1]

    def rate(self, job_id: int, worker_type: str) -> float:
        """Steps/s of ``job_id`` this round (co-located rate when it shares)."""
        return self._rate(job_id, self.combo_of.get(job_id, (job_id,)), worker_type)

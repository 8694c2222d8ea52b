"""Gavel's scheduling policies as optimization problems over the allocation X.

X[m, j] is the fraction of wall time job m should spend on accelerator type j. Every policy shares
Gavel's base constraints (``policies/policy.py``)::

    0 ≤ X ≤ 1,   Σ_j X[m, j] ≤ 1 (a job runs on one type at a time),
    Σ_m sf_m · X[m, j] ≤ N_j (type j has N_j accelerators; job m uses sf_m of them),

and measures a job's effective throughput as Σ_j T[m, j]·X[m, j] (steps/s). The LPs are solved
with SciPy's HiGHS (``scipy.optimize.linprog``); Gavel uses cvxpy with ECOS.

Where this differs from Gavel, and why:

* Max-min LPs have many optima (only the minimum is fixed). ECOS returns an interior point of that
  optimal face, so Gavel's allocation depends on the solver. Here a second LP keeps the optimal
  minimum and maximizes the sum of the same normalized throughputs: a Pareto-efficient point of the
  same face. The agnostic policies cannot tell types apart, so ``max_min_fairness`` (LAS) and its
  water filling are the water-filled equal share in closed form, and agnostic finish-time fairness
  spreads each job's share over the types in proportion to their size.
* ``_perf`` policies normalize by each job's throughput under an equal share. Gavel takes that share
  from its agnostic LP's solution (again one arbitrary optimum); here it is the water-filled equal
  share (each job's time share ∝ its weight, capped at 1, spread over types in proportion to their
  size), which is one of those optima and does not depend on the solver.
* ``min_total_duration_perf`` solves max z s.t. throughput_m ≥ remaining_m·z exactly (one LP, z =
  1/makespan) instead of Gavel's bisection over the makespan with a 5 % stopping gap.
* ``finish_time_fairness`` bisects on ρ with LP feasibility checks (ρ ≤ ρ_m iff throughput_m(X) ≥
  remaining_m / (ρ·D_m − t_m)), to a relative gap of 1e-4; Gavel hands the inverse to ECOS.
* ``min_total_duration`` (agnostic) sees each job's mean throughput over the types it can run on;
  Gavel's policy of that name is throughput-aware, so ours adds the agnostic baseline the
  comparison needs and ``min_total_duration_perf`` is Gavel's.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
from scipy import sparse
from scipy.optimize import linprog

from paratrain.errors import ConfigError

__all__ = [
    "Allocation",
    "AllocationProblem",
    "Policy",
    "POLICY_NAMES",
    "equal_share",
    "get_policy",
]


@dataclass
class AllocationProblem:
    """What a policy sees: the active jobs (rows) and accelerator types (columns).

    ``throughputs``: steps/s of each job alone on each type (n × k; 0 = cannot run);
    ``scale_factors``: GPUs per job; ``priority_weights``: larger = more share;
    ``capacities``: accelerators per type; ``steps_remaining`` and ``times_since_start_s`` for
    finish-time fairness and makespan; ``prices_per_hour`` per type for the cost policy;
    ``slo_deadlines_s``: seconds left before each job's deadline (NaN = none);
    ``entities``/``entity_weights`` for hierarchical water filling.
    """

    job_ids: tuple[int, ...]
    worker_types: tuple[str, ...]
    throughputs: np.ndarray
    scale_factors: np.ndarray
    capacities: np.ndarray
    priority_weights: np.ndarray | None = None
    steps_remaining: np.ndarray | None = None
    times_since_start_s: np.ndarray | None = None
    prices_per_hour: np.ndarray | None = None
    slo_deadlines_s: np.ndarray | None = None
    entities: tuple[str | None, ...] | None = None
    entity_weights: dict[str, float] = field(default_factory=dict)
    # Space sharing: (job id a, job id b) → k × 2 steps/s of a and b co-located on each type.
    colocated: dict[tuple[int, int], np.ndarray] | None = None

    def __post_init__(self) -> None:
        n, k = len(self.job_ids), len(self.worker_types)
        self.throughputs = np.asarray(self.throughputs, dtype=float).reshape(n, k)
        self.scale_factors = np.asarray(self.scale_factors, dtype=float).reshape(n)
        self.capacities = np.asarray(self.capacities, dtype=float).reshape(k)
        if self.priority_weights is None:
            self.priority_weights = np.ones(n)
        self.priority_weights = np.asarray(self.priority_weights, dtype=float).reshape(n)

    @property
    def shape(self) -> tuple[int, int]:
        return self.throughputs.shape  # type: ignore[return-value]

    def weights(self) -> np.ndarray:
        """Job weights, after splitting each entity's weight among its jobs in proportion to
        their own weights (Gavel's hierarchical "fairness" re-weighting)."""
        w = np.asarray(self.priority_weights, dtype=float)
        if not self.entities:
            return w
        out = w.copy()
        for ent in {e for e in self.entities if e is not None}:
            idx = [i for i, e in enumerate(self.entities) if e == ent]
            total = w[idx].sum()
            out[idx] = self.entity_weights.get(ent, 1.0) * w[idx] / total
        return out


@dataclass
class Allocation:
    """A policy's answer: ``x`` (n × k time fractions), the LP solve time and a note (e.g. that the
    SLO constraints were infeasible and were dropped)."""

    job_ids: tuple[int, ...]
    worker_types: tuple[str, ...]
    x: np.ndarray
    solve_time_s: float = 0.0
    note: str = ""

    def as_dict(self) -> dict[int, dict[str, float]]:
        return {j: {w: float(self.x[i, c]) for c, w in enumerate(self.worker_types)}
                for i, j in enumerate(self.job_ids)}

    def effective_throughputs(self, throughputs: np.ndarray) -> np.ndarray:
        return (throughputs * self.x).sum(axis=1)


class Policy:
    """Base class: ``solve`` maps an :class:`AllocationProblem` to an :class:`Allocation`."""

    name = "policy"
    is_perf = True  # heterogeneity-aware: the mechanism keeps the type order fixed (fastest first)
    is_fifo = False
    is_packed = False  # space sharing: allocates job combinations (see cluster/packing.py)

    def solve(self, problem: AllocationProblem) -> Allocation:
        t0 = time.perf_counter()
        n, k = problem.shape
        if n == 0:
            x = np.zeros((0, k))
            note = ""
        else:
            x, note = self._solve(problem)
        x = np.clip(x, 0.0, 1.0)
        return Allocation(problem.job_ids, problem.worker_types, x, time.perf_counter() - t0, note)

    def _solve(self, problem: AllocationProblem) -> tuple[np.ndarray, str]:
        raise NotImplementedError


# ---------------------------------------------------------------------------------------------
# LP helpers. Variables: x flattened row-major (n·k), then ``extra`` scalars.


def _base(problem: AllocationProblem, extra: int) -> tuple[sparse.csr_matrix, np.ndarray]:
    n, k = problem.shape
    rows = np.repeat(np.arange(n), k)
    cols = np.arange(n * k)
    per_job = sparse.csr_matrix((np.ones(n * k), (rows, cols)), shape=(n, n * k + extra))
    per_type = sparse.csr_matrix((np.repeat(problem.scale_factors, k), (np.tile(np.arange(k), n), cols)),
                                 shape=(k, n * k + extra))
    return sparse.vstack([per_job, per_type]).tocsr(), np.concatenate([np.ones(n), problem.capacities])


def _rate_rows(coef: np.ndarray, extra_cols: dict[int, np.ndarray] | None, nvars: int) -> sparse.csr_matrix:
    """Rows m: Σ_j coef[m, j]·x[m, j] (+ extra column terms)."""
    n, k = coef.shape
    rows = [np.repeat(np.arange(n), k)]
    cols = [np.arange(n * k)]
    vals = [coef.reshape(-1)]
    for col, v in (extra_cols or {}).items():
        rows.append(np.arange(n))
        cols.append(np.full(n, col))
        vals.append(np.broadcast_to(v, (n,)).astype(float))
    return sparse.csr_matrix((np.concatenate(vals), (np.concatenate(rows), np.concatenate(cols))), shape=(n, nvars))


def _linprog(c: np.ndarray, a_ub: sparse.csr_matrix, b_ub: np.ndarray, bounds: list[tuple[float, float | None]]
             | np.ndarray) -> tuple[np.ndarray | None, object]:
    # HiGHS's interior-point method (with crossover to a vertex): on the 2,048-job max-min LP about
    # twice as fast as its dual simplex (bench/bench_cluster.py).
    res = linprog(c, A_ub=a_ub, b_ub=b_ub, bounds=bounds, method="highs-ipm")
    return (res.x if res.status == 0 else None), res


def _bounds(problem: AllocationProblem, extra: list[tuple[float, float | None]], zero_mask: np.ndarray | None = None
            ) -> np.ndarray:
    n, k = problem.shape
    b = np.zeros((n * k + len(extra), 2))
    b[: n * k, 1] = 1.0
    if zero_mask is not None:
        b[: n * k][zero_mask.reshape(-1), 1] = 0.0
    for i, (lo, hi) in enumerate(extra):
        b[n * k + i] = (lo, np.inf if hi is None else hi)
    return b


def _max_min(problem: AllocationProblem, coef: np.ndarray, zero_mask: np.ndarray | None = None,
             fixed: dict[int, float] | None = None) -> tuple[np.ndarray, float, np.ndarray]:
    """Maximize min_m Σ_j coef[m, j]·x[m, j] over the jobs not in ``fixed``; jobs in ``fixed`` keep
    at least their fixed rate. Then (second LP) maximize Σ of the rates at that minimum.

    Returns x, the optimal minimum and the dual prices of the min constraints (bottleneck jobs
    have positive ones).
    """
    n, k = problem.shape
    fixed = fixed or {}
    free = np.array([i for i in range(n) if i not in fixed], dtype=int)
    nv = n * k + 1
    a_base, b_base = _base(problem, 1)
    rates = _rate_rows(coef, None, nv)
    t_col = sparse.csr_matrix((np.ones(len(free)), (np.arange(len(free)), np.full(len(free), n * k))),
                              shape=(len(free), nv))
    a_min = t_col - rates[free]
    blocks, rhs = [a_base, a_min], [b_base, np.zeros(len(free))]
    if fixed:
        idx = np.array(sorted(fixed), dtype=int)
        blocks.append(-rates[idx])
        rhs.append(-np.array([fixed[i] for i in idx]) * (1 - 1e-9))
    a_ub, b_ub = sparse.vstack(blocks).tocsr(), np.concatenate(rhs)
    c = np.zeros(nv)
    c[-1] = -1.0
    bounds = _bounds(problem, [(0.0, None)], zero_mask)
    x, res = _linprog(c, a_ub, b_ub, bounds)
    if x is None:
        raise ConfigError("policy", f"the max-min LP failed: {getattr(res, 'message', '')}",
                          "check the cluster and the jobs' throughputs")
    t_opt = float(x[-1])
    duals = -np.asarray(res.ineqlin.marginals)[len(b_base): len(b_base) + len(free)]  # type: ignore[attr-defined]
    # Second LP: keep the minimum, maximize the sum of rates (Pareto-efficient, solver-independent).
    bounds2 = bounds.copy()
    bounds2[-1] = (t_opt * (1 - 1e-7), np.inf)
    c2 = np.concatenate([-coef.reshape(-1), [0.0]])
    x2, _ = _linprog(c2, a_ub, b_ub, bounds2)
    if x2 is not None:
        x = x2
    dual_full = np.zeros(n)
    dual_full[free] = duals
    return x[: n * k].reshape(n, k), t_opt, dual_full


def equal_share(problem: AllocationProblem, weights: np.ndarray | None = None) -> np.ndarray:
    """Water-filled equal share: job m's time share s_m = min(1, c·w_m/sf_m) with c chosen so the
    shares fill the cluster (or every job runs all the time), spread over types in proportion to
    their size: X_iso[m, j] = s_m·N_j/N. A max-min fair solution of the agnostic problem."""
    n, k = problem.shape
    w = problem.weights() if weights is None else weights
    sf = problem.scale_factors
    cap_total = float(problem.capacities.sum())
    if n == 0:
        return np.zeros((0, k))
    share = np.ones(n)
    if float(sf.sum()) > cap_total:
        lo, hi = 0.0, float((sf / w).max())
        for _ in range(200):  # bisection on c; GPU use Σ sf·min(1, c·w/sf) is monotone in c
            c = (lo + hi) / 2
            use = float(np.minimum(sf, c * w).sum())
            lo, hi = (c, hi) if use < cap_total else (lo, c)
        share = np.minimum(1.0, lo * w / sf)
    return share[:, None] * (problem.capacities / cap_total)[None, :]


# ---------------------------------------------------------------------------------------------
# Policies


class MaxMinFairness(Policy):
    """``max_min_fairness`` (LAS: every type counts the same) and ``max_min_fairness_perf``:
    maximize min_m w_m⁻¹·sf_m·throughput_m(X) / throughput_m(X_equal) (Gavel §4.1)."""

    def __init__(self, perf: bool) -> None:
        self.is_perf = perf
        self.name = "max_min_fairness_perf" if perf else "max_min_fairness"

    def coefficients(self, problem: AllocationProblem) -> np.ndarray:
        w = problem.weights()
        sf = problem.scale_factors
        if not self.is_perf:
            return np.repeat((sf / w)[:, None], problem.shape[1], axis=1)
        iso = (problem.throughputs * equal_share(problem)).sum(axis=1)
        return problem.throughputs * (sf / (w * iso))[:, None]

    def _solve(self, problem: AllocationProblem) -> tuple[np.ndarray, str]:
        if not self.is_perf:
            # With every type alike the types pool into one resource, whose max-min fair split is
            # the water-filled equal share: unique, where the per-type LP's optima are not.
            return equal_share(problem), ""
        x, _, _ = _max_min(problem, self.coefficients(problem))
        return x, ""


def _spread(x: np.ndarray, problem: AllocationProblem) -> np.ndarray:
    """Each job's total share spread over the types in proportion to their size: for agnostic
    policies, which cannot tell types apart, the one split that does not depend on the solver."""
    caps = problem.capacities
    return x.sum(axis=1)[:, None] * (caps / caps.sum())[None, :]


class WaterFilling(MaxMinFairness):
    """``max_min_fairness_water_filling[_perf]``: max-min fairness repeated: solve, freeze the
    bottleneck jobs (positive dual price on their min constraint) at their rate, and maximize the
    minimum of the rest, until every job is frozen. With ``entities`` on the problem the weights
    are hierarchical (each entity's weight split among its jobs)."""

    def __init__(self, perf: bool) -> None:
        super().__init__(perf)
        self.name = "max_min_fairness_water_filling" + ("_perf" if perf else "")

    def _solve(self, problem: AllocationProblem) -> tuple[np.ndarray, str]:
        if not self.is_perf:
            return equal_share(problem), ""  # pooled types: water filling is the equal share
        coef = self.coefficients(problem)
        n = problem.shape[0]
        fixed: dict[int, float] = {}
        x = np.zeros(problem.shape)
        for _ in range(n):
            x, t_opt, duals = _max_min(problem, coef, fixed=fixed)
            free = [i for i in range(n) if i not in fixed]
            bottleneck = [i for i in free if duals[i] > 1e-9]
            if not bottleneck:  # degenerate duals: freeze the jobs at the minimum
                rates = (coef * x).sum(axis=1)
                bottleneck = [i for i in free if rates[i] <= t_opt * (1 + 1e-6)]
            for i in bottleneck or free:
                fixed[i] = t_opt
            if len(fixed) == n:
                break
        return x, ""


class FinishTimeFairness(Policy):
    """``finish_time_fairness[_perf]`` (Themis): minimize max_m ρ_m with
    ρ_m = (t_m + r_m/throughput_m(X)) / (t_m + r_m/throughput_m(X_equal)); ρ ≤ 1 is always
    reachable (X_equal itself), so ρ is bisected in (max_m t_m/D_m, 1]."""

    def __init__(self, perf: bool) -> None:
        self.is_perf = perf
        self.name = "finish_time_fairness_perf" if perf else "finish_time_fairness"

    def _solve(self, problem: AllocationProblem) -> tuple[np.ndarray, str]:
        n, k = problem.shape
        thr = problem.throughputs if self.is_perf else np.ones((n, k))
        x_iso = equal_share(problem)
        iso = (thr * x_iso).sum(axis=1)
        r = np.asarray(problem.steps_remaining if problem.steps_remaining is not None else np.ones(n), float)
        t = np.asarray(problem.times_since_start_s if problem.times_since_start_s is not None else np.zeros(n), float)
        d = t + r / iso
        a_base, b_base = _base(problem, 0)
        rates = _rate_rows(thr, None, n * k)
        bounds = _bounds(problem, [])

        def feasible(rho: float) -> np.ndarray | None:
            slack = rho * d - t
            if np.any(slack <= 0):
                return None
            a_ub = sparse.vstack([a_base, -rates]).tocsr()
            b_ub = np.concatenate([b_base, -r / slack])
            x, _ = _linprog(np.zeros(n * k), a_ub, b_ub, bounds)
            return x

        lo, hi = float((t / d).max()), 1.0
        best = x_iso.reshape(-1)
        while hi - lo > 1e-4 * hi:
            mid = (lo + hi) / 2
            x = feasible(mid)
            if x is None:
                lo = mid
            else:
                hi, best = mid, x
        # At ρ = hi, maximize the total normalized throughput (Pareto-efficient point).
        slack = hi * d - t
        a_ub = sparse.vstack([a_base, -rates]).tocsr()
        b_ub = np.concatenate([b_base, -r / slack])
        x2, _ = _linprog(-(thr / iso[:, None]).reshape(-1), a_ub, b_ub, bounds)
        x = (x2 if x2 is not None else best).reshape(n, k)
        return (x if self.is_perf else _spread(x, problem)), ""


class MinTotalDuration(Policy):
    """``min_total_duration[_perf]`` (makespan): the smallest T such that every job can finish its
    remaining steps within T: maximize z = 1/T s.t. throughput_m(X) ≥ r_m·z."""

    def __init__(self, perf: bool) -> None:
        self.is_perf = perf
        self.name = "min_total_duration_perf" if perf else "min_total_duration"

    def _solve(self, problem: AllocationProblem) -> tuple[np.ndarray, str]:
        n, k = problem.shape
        thr = problem.throughputs
        zero = thr <= 0
        if not self.is_perf:  # agnostic: every type looks like the job's mean over runnable types
            mean = np.where(zero, 0, thr).sum(axis=1) / np.maximum((~zero).sum(axis=1), 1)
            thr = np.where(zero, 0.0, mean[:, None])
        r = np.asarray(problem.steps_remaining if problem.steps_remaining is not None else np.ones(n), float)
        nv = n * k + 1
        a_base, b_base = _base(problem, 1)
        # r_m z − Σ_j T x ≤ 0; z scaled by max r to keep the LP well conditioned.
        scale = float(r.max())
        rows = _rate_rows(-thr, {n * k: r / scale}, nv)
        a_ub, b_ub = sparse.vstack([a_base, rows]).tocsr(), np.concatenate([b_base, np.zeros(n)])
        c = np.zeros(nv)
        c[-1] = -1.0
        bounds = _bounds(problem, [(0.0, None)], zero)
        x, res = _linprog(c, a_ub, b_ub, bounds)
        if x is None:
            raise ConfigError("policy", f"the makespan LP failed: {getattr(res, 'message', '')}", "check the inputs")
        bounds[-1] = (x[-1] * (1 - 1e-7), np.inf)
        c2 = np.concatenate([-(thr / r[:, None]).reshape(-1) * scale, [0.0]])
        x2, _ = _linprog(c2, a_ub, b_ub, bounds)
        return (x2 if x2 is not None else x)[: n * k].reshape(n, k), ""


class MaxSumThroughput(Policy):
    """``max_sum_throughput_perf``: maximize Σ_m throughput_m(X). With ``by_cost``
    (``max_sum_throughput_normalized_by_cost_perf``, the cost policy): maximize Σ_m Σ_j
    T[m, j]·X[m, j] / price_j; with ``slos`` (``…_SLOs``) also throughput_m ≥ r_m / deadline_m,
    falling back to no SLOs (and saying so in the note) when those cannot all be met."""

    def __init__(self, by_cost: bool = False, slos: bool = False) -> None:
        self.by_cost = by_cost
        self.slos = slos
        kind = "normalized_by_cost_perf" if by_cost else "perf"
        self.name = "max_sum_throughput_" + kind + ("_SLOs" if slos else "")

    def _solve(self, problem: AllocationProblem) -> tuple[np.ndarray, str]:
        n, k = problem.shape
        thr = problem.throughputs
        obj = thr.copy()
        if self.by_cost:
            if problem.prices_per_hour is None:
                raise ConfigError("--prices", f"policy {self.name} needs prices per accelerator type",
                                  "pass --prices FILE (or --synthetic-prices)")
            obj = thr / np.asarray(problem.prices_per_hour, float)[None, :]
        a_base, b_base = _base(problem, 0)
        bounds = _bounds(problem, [])
        note = ""
        if self.slos and problem.slo_deadlines_s is not None and problem.steps_remaining is not None:
            dl = np.asarray(problem.slo_deadlines_s, float)
            has = ~np.isnan(dl)
            if has.any():
                need = np.asarray(problem.steps_remaining, float)[has] / np.maximum(dl[has], 1e-9)
                rows = _rate_rows(-thr, None, n * k)[np.flatnonzero(has)]
                a_ub = sparse.vstack([a_base, rows]).tocsr()
                x, _ = _linprog(-obj.reshape(-1), a_ub, np.concatenate([b_base, -need]), bounds)
                if x is not None:
                    return x.reshape(n, k), ""
                note = "SLOs cannot all be met: solved without them"
        x, _ = _linprog(-obj.reshape(-1), a_base, b_base, bounds)
        assert x is not None  # X = 0 is always feasible
        return x.reshape(n, k), note


class Fifo(Policy):
    """``fifo`` / ``fifo_perf`` (Gavel ``policies/fifo.py``): jobs in arrival order each get a whole
    type (X = 1 on it) while accelerators remain. ``fifo`` keeps a job's type once given and picks a
    type at random among those with room; ``fifo_perf`` re-plans every time and picks the fastest
    type with room."""

    is_fifo = True

    def __init__(self, perf: bool, seed: int = 0) -> None:
        self.is_perf = perf
        self.name = "fifo_perf" if perf else "fifo"
        self._rng = random.Random(seed)
        self._assigned: dict[int, str] = {}

    def _solve(self, problem: AllocationProblem) -> tuple[np.ndarray, str]:
        n, k = problem.shape
        types = list(problem.worker_types)
        free = {w: float(problem.capacities[c]) for c, w in enumerate(types)}
        sf = {j: float(problem.scale_factors[i]) for i, j in enumerate(problem.job_ids)}
        active = set(problem.job_ids)
        if self.is_perf:
            self._assigned = {}
        self._assigned = {j: w for j, w in self._assigned.items() if j in active}
        for j, w in self._assigned.items():
            free[w] -= sf[j]
        row = {j: i for i, j in enumerate(problem.job_ids)}
        for j in sorted(active - set(self._assigned)):
            # Gavel's fifo draws among every type with room, even one the job cannot run on (it
            # would then never run); here only types with a throughput count.
            fits = [w for w in sorted(types) if free[w] >= sf[j] and problem.throughputs[row[j], types.index(w)] > 0]
            if not fits:
                break  # strict FIFO: nobody jumps the queue
            if self.is_perf:
                w = max(fits, key=lambda w: problem.throughputs[row[j], types.index(w)])
            else:
                w = fits[self._rng.randrange(len(fits))]
            self._assigned[j] = w
            free[w] -= sf[j]
        x = np.zeros((n, k))
        for j, w in self._assigned.items():
            x[row[j], types.index(w)] = 1.0
        return x, ""


def _packed(objective: str) -> Policy:
    from paratrain.cluster.packing import PackedPolicy  # packing builds on this module

    return PackedPolicy(objective)


_FACTORIES: dict[str, Callable[[], Policy]] = {
    "max_min_fairness": lambda: MaxMinFairness(False),
    "max_min_fairness_perf": lambda: MaxMinFairness(True),
    "max_min_fairness_water_filling": lambda: WaterFilling(False),
    "max_min_fairness_water_filling_perf": lambda: WaterFilling(True),
    "finish_time_fairness": lambda: FinishTimeFairness(False),
    "finish_time_fairness_perf": lambda: FinishTimeFairness(True),
    "min_total_duration": lambda: MinTotalDuration(False),
    "min_total_duration_perf": lambda: MinTotalDuration(True),
    "max_sum_throughput_perf": lambda: MaxSumThroughput(),
    "max_sum_throughput_normalized_by_cost_perf": lambda: MaxSumThroughput(by_cost=True),
    "max_sum_throughput_normalized_by_cost_perf_SLOs": lambda: MaxSumThroughput(by_cost=True, slos=True),
    "max_min_fairness_packed": lambda: _packed("max_min"),
    "max_sum_throughput_packed": lambda: _packed("sum"),
    "finish_time_fairness_packed": lambda: _packed("finish_time"),
    "fifo": lambda: Fifo(False),
    "fifo_perf": lambda: Fifo(True),
}

POLICY_NAMES = tuple(_FACTORIES)


def get_policy(name: str, field_name: str = "--policy") -> Policy:
    """A fresh policy object by Gavel's name (policies such as ``fifo`` keep state between solves)."""
    try:
        return _FACTORIES[name]()
    except KeyError:
        raise ConfigError(field_name, f"unknown policy {name!r}", f"use one of: {', '.join(POLICY_NAMES)}") from None

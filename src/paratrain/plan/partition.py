"""Layer partitioning across pipeline stages: balance time per stage, respect memory per stage.

Two solvers of the same problem (contiguous split of an ordered layer list into ``n`` non-empty
stages minimizing the slowest stage, each stage within its memory budget):

- :func:`partition_dp` — the dynamic program of PipeDream (Narayanan et al., SOSP 2019, sec. 3.1):
  ``A[j][s]`` = best bottleneck time for the first ``j`` layers on ``s`` stages, built from
  ``A[i][s-1]`` and the cost of layers ``i..j-1`` as stage ``s``. O(L²·n); the reference.
- :func:`partition_fast` — bisection on the bottleneck time with a greedy fill. For monotone
  costs (a stage's time and memory never shrink when a layer is added) the greedy fill that makes
  each stage as long as the bound allows is optimal: by induction its stage ends are never before
  those of any feasible split, so whatever suffix remains is a suffix of a feasible split's suffix.
  O(L·log L) per probe; the planner uses it, tests check it against the DP.

Memory budgets may differ per stage: under 1F1B the first stage holds ``p`` micro-batches of
activations, the last one (Narayanan et al., SC 2021, sec. 2.2). Layers are heterogeneous: the
embedding and the LM head make the end stages heavier, and any list of per-layer costs works.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["LayerCost", "Partition", "partition_dp", "partition_fast", "stage_costs"]


@dataclass(frozen=True)
class LayerCost:
    """One partitionable unit (a transformer block, possibly with the embedding or head attached).

    ``time_s`` is forward + backward of one micro-batch; ``static_bytes`` weights, gradients and
    optimizer state; ``activation_bytes`` held per in-flight micro-batch.
    """

    time_s: float
    static_bytes: float = 0.0
    activation_bytes: float = 0.0


@dataclass(frozen=True)
class Partition:
    """Layers per stage, the slowest stage's time and each stage's time and memory."""

    layers: tuple[int, ...]
    bottleneck_s: float
    stage_time_s: tuple[float, ...]
    stage_memory_bytes: tuple[float, ...]


def _prefix(values: Sequence[float]) -> list[float]:
    out = [0.0]
    for v in values:
        out.append(out[-1] + v)
    return out


class _Sums:
    """Prefix sums so that any contiguous range costs O(1)."""

    def __init__(self, layers: Sequence[LayerCost]) -> None:
        self.t = _prefix([x.time_s for x in layers])
        self.w = _prefix([x.static_bytes for x in layers])
        self.a = _prefix([x.activation_bytes for x in layers])

    def time(self, i: int, j: int) -> float:
        return self.t[j] - self.t[i]

    def memory(self, i: int, j: int, inflight: float) -> float:
        return (self.w[j] - self.w[i]) + inflight * (self.a[j] - self.a[i])


def _budgets(n: int, memory_budget_bytes: float | Sequence[float] | None) -> list[float]:
    if memory_budget_bytes is None:
        return [math.inf] * n
    if isinstance(memory_budget_bytes, (int, float)):
        return [float(memory_budget_bytes)] * n
    b = [float(x) for x in memory_budget_bytes]
    if len(b) != n:
        raise ValueError(f"{len(b)} memory budgets for {n} stages")
    return b


def _inflight(n: int, inflight: float | Sequence[float]) -> list[float]:
    if isinstance(inflight, (int, float)):
        return [float(inflight)] * n
    f = [float(x) for x in inflight]
    if len(f) != n:
        raise ValueError(f"{len(f)} in-flight counts for {n} stages")
    return f


def _result(sums: _Sums, bounds: list[int], inflight: list[float]) -> Partition:
    times = tuple(sums.time(bounds[s], bounds[s + 1]) for s in range(len(bounds) - 1))
    mem = tuple(sums.memory(bounds[s], bounds[s + 1], inflight[s]) for s in range(len(bounds) - 1))
    return Partition(
        layers=tuple(bounds[s + 1] - bounds[s] for s in range(len(bounds) - 1)),
        bottleneck_s=max(times),
        stage_time_s=times,
        stage_memory_bytes=mem,
    )


def stage_costs(
    layers: Sequence[LayerCost], split: Sequence[int], inflight: float | Sequence[float] = 1.0
) -> Partition:
    """Time and memory of each stage for a given split (layers per stage)."""
    if sum(split) != len(layers) or any(k <= 0 for k in split):
        raise ValueError(f"split {list(split)} does not cover {len(layers)} layers with non-empty stages")
    bounds = [0]
    for k in split:
        bounds.append(bounds[-1] + k)
    return _result(_Sums(layers), bounds, _inflight(len(split), inflight))


def partition_dp(
    layers: Sequence[LayerCost],
    stages: int,
    *,
    memory_budget_bytes: float | Sequence[float] | None = None,
    inflight: float | Sequence[float] = 1.0,
) -> Partition | None:
    """PipeDream's dynamic program; ``None`` if no split fits the memory budgets.

    ``inflight[s]`` is the number of micro-batches whose activations stage ``s`` holds at peak.
    Ties on the bottleneck are broken toward the smaller total of the stage times squared,
    which spreads slack evenly instead of leaving it all to one end.
    """
    n_layers = len(layers)
    if not 1 <= stages <= n_layers:
        return None
    sums = _Sums(layers)
    budget = _budgets(stages, memory_budget_bytes)
    held = _inflight(stages, inflight)
    inf = (math.inf, math.inf)
    # best[s][j]: (bottleneck, sum of squares) for layers [0, j) on stages 0..s-1.
    best = [[inf] * (n_layers + 1) for _ in range(stages + 1)]
    cut = [[-1] * (n_layers + 1) for _ in range(stages + 1)]
    best[0][0] = (0.0, 0.0)
    for s in range(1, stages + 1):
        # Stage s-1 ends at j; it needs at least one layer and leaves one per later stage.
        for j in range(s, n_layers - (stages - s) + 1):
            for i in range(s - 1, j):
                prev = best[s - 1][i]
                if prev[0] == math.inf:
                    continue
                if sums.memory(i, j, held[s - 1]) > budget[s - 1]:
                    continue
                t = sums.time(i, j)
                cand = (max(prev[0], t), prev[1] + t * t)
                if cand < best[s][j]:
                    best[s][j] = cand
                    cut[s][j] = i
    if best[stages][n_layers][0] == math.inf:
        return None
    bounds = [n_layers]
    for s in range(stages, 0, -1):
        bounds.append(cut[s][bounds[-1]])
    bounds.reverse()
    return _result(sums, bounds, held)


def _greedy(
    sums: _Sums, n_layers: int, stages: int, bound_s: float, budget: list[float], held: list[float]
) -> list[int] | None:
    """Stage ends of a split whose every stage takes at most ``bound_s`` and fits its budget, or
    ``None`` when there is none.

    Exact, not greedy: a stage's memory depends on its index (stage s holds ``held[s]``
    micro-batches), so the longest first stages can push a layer with large activations into a
    stage that holds too many of them while a shorter first stage would have fitted (hypothesis
    found one: six unit layers, five stages, the third layer's activations 2.5 with budget 8).
    For a start ``i`` the ends a stage may take are ``i + 1 .. last(i)`` (time and memory only
    grow with the end), so the positions reachable after each stage are a union of ranges, swept
    in O(n) per stage with a difference array; the split is read back through the stages."""
    inf = math.inf
    reach = [False] * (n_layers + 1)
    reach[0] = True
    lasts: list[list[int]] = []  # per stage: last allowed end for each start (-1: not a start)
    reached: list[list[bool]] = [reach]
    for s in range(stages):
        # memory(i, j) = c[j] - c[i] with c = w + held[s] * a, non-decreasing in j
        c = [sums.w[j] + held[s] * sums.a[j] for j in range(n_layers + 1)]
        last = [-1] * (n_layers + 1)
        diff = [0] * (n_layers + 2)
        for i in range(n_layers):
            if not reach[i]:
                continue
            j_time = bisect.bisect_right(sums.t, sums.t[i] + bound_s * (1 + 1e-12), lo=i + 1) - 1
            j_mem = n_layers if budget[s] == inf else bisect.bisect_right(c, c[i] + budget[s], lo=i + 1) - 1
            j = min(j_time, j_mem, n_layers - (stages - 1 - s))  # one layer left for each later stage
            while j > i and sums.memory(i, j, held[s]) > budget[s]:  # c's rounding may differ by an ulp
                j -= 1
            if j <= i:
                continue
            last[i] = j
            diff[i + 1] += 1
            diff[j + 1] -= 1
        nxt, run = [False] * (n_layers + 1), 0
        for j in range(n_layers + 1):
            run += diff[j]
            nxt[j] = run > 0
        lasts.append(last)
        reached.append(nxt)
        reach = nxt
    if not reach[n_layers]:
        return None
    bounds = [n_layers]
    for s in range(stages - 1, -1, -1):
        j, last, before = bounds[-1], lasts[s], reached[s]
        # the latest reachable start that may end at j: shorter later stages, longer early ones
        i = next(i for i in range(j - 1, -1, -1) if before[i] and last[i] >= j)
        bounds.append(i)
    bounds.reverse()
    return bounds


def partition_fast(
    layers: Sequence[LayerCost],
    stages: int,
    *,
    memory_budget_bytes: float | Sequence[float] | None = None,
    inflight: float | Sequence[float] = 1.0,
) -> Partition | None:
    """Same optimum bottleneck as :func:`partition_dp`, by bisection over candidate bottlenecks.

    The optimal bottleneck is the time of some contiguous range; the search probes range times
    in increasing order (binary search over the sorted distinct range times for short lists,
    over a numeric interval then snapping to a range time for long ones).
    """
    n_layers = len(layers)
    if not 1 <= stages <= n_layers:
        return None
    sums = _Sums(layers)
    budget = _budgets(stages, memory_budget_bytes)
    held = _inflight(stages, inflight)
    if _greedy(sums, n_layers, stages, math.inf, budget, held) is None:
        return None  # memory alone rules out every split
    if n_layers <= 160:
        cands = sorted({sums.time(i, j) for i in range(n_layers) for j in range(i + 1, n_layers + 1)})
        lo, hi = 0, len(cands) - 1
        while lo < hi:
            mid = (lo + hi) // 2
            if _greedy(sums, n_layers, stages, cands[mid], budget, held) is not None:
                hi = mid
            else:
                lo = mid + 1
        bounds = _greedy(sums, n_layers, stages, cands[lo], budget, held)
    else:
        lo_t, hi_t = 0.0, sums.t[-1]
        for _ in range(60):
            mid_t = 0.5 * (lo_t + hi_t)
            if _greedy(sums, n_layers, stages, mid_t, budget, held) is not None:
                hi_t = mid_t
            else:
                lo_t = mid_t
        bounds = _greedy(sums, n_layers, stages, hi_t, budget, held)
    assert bounds is not None  # the largest probe is always feasible once memory allows a split
    return _result(sums, bounds, held)

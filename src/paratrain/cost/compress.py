"""Cost of a compressed gradient reduction: volume, alpha–beta time and selection compute, per
compressor of ``paratrain.runtime.compress`` (pure functions).

Per rank, for a gradient of ``n`` elements on ``P`` ranks, ``k = ceil(n * density)`` kept entries
(a sparse entry is a value and an index: 2 elements), ``R`` the elements PowerSGD all-reduces:

============  ==================================  =====================================
method        elements sent per rank              latency (alpha) terms
============  ==================================  =====================================
none (dense)  2n(P-1)/P (ring all-reduce)         2(P-1)
oktopk        6k(P-1)/P (bound; paper Eq. 1-3)    2P + 2 log2 P
topka         2k(P-1) (all-gather of k entries)   log2 P (recursive doubling)
gaussiank     2k(P-1) (as TopkA, k estimated)     log2 P
gtopk         2k log2 P (k entries per round)     log2 P
powersgd      2R(P-1)/P (two ring all-reduces)    4(P-1)
============  ==================================  =====================================

Time = alpha * terms + bytes / bandwidth (Hockney). Selection compute is memory-bound: a number of
streaming passes over the n gradient values at the device's sustained bandwidth
(:data:`SELECTION_PASSES`, counted from the code's memory traffic, not timed).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from paratrain.errors import ConfigError

__all__ = ["COMPRESSED", "SELECTION_PASSES", "TOPK_PASSES", "CompressionCost", "selection_passes",
           "entries_kept", "volume_elements", "latency_terms", "compression_cost", "powersgd_elements",
           "compressed_reduce_s"]

COMPRESSED = ("oktopk", "topka", "gtopk", "gaussiank", "powersgd")

# An exact top-k of n values: a radix select over 32-bit keys, 4 digit passes each reading the keys
# and a histogram, plus the gather: ~8 streaming passes (estimate; what torch.topk over all n costs,
# the fallback when a sampled bound lets too few entries through).
TOPK_PASSES = 8.0
OKTOPK_THRESHOLD_PERIOD = 32  # exact thresholds every 32 calls (runtime.compress.oktopk)

# Streaming passes over the n-entry gradient per call, counted from the code
# (tests/cost/test_compress_passes.py). Every sparse method starts with one compiled loop
# (runtime.compress.kernels.accumulate_select) that adds the gradient into the residual, clears
# the gradient (it receives the result), selects and sums the squares and the values: read g and
# r, write r and g = 4. The exact top-k (TopkA, gTop-k, Ok-Topk every 32 calls) runs over the ~2k
# entries above a sampled bound that the same loop collects: O(k), not a pass. Ok-Topk sums its
# region as sorted merges of the received pieces (O(k), no dense buffer of n/P); Gaussiank's fit
# comes from the loop's sums, then one read selects (1).
SELECTION_PASSES = {
    "none": 0.0,
    "oktopk": 4.0,
    "topka": 4.0,
    "gtopk": 4.0,
    "gaussiank": 4 + 1,
    "powersgd": 2 + 2 + 1 + 2,  # error feedback (2), M·Q and Mᵀ·P read M (2), P·Qᵀ writes M (1), error (2)
}


def selection_passes(method: str, p: int) -> float:
    """Streaming passes over the gradient of one call of ``method`` on ``p`` ranks
    (:data:`SELECTION_PASSES`; none of them depends on ``p`` since Ok-Topk's region is summed sparsely)."""
    return SELECTION_PASSES[method]


def entries_kept(n: int, density: float) -> int:
    """``k``: the entries a sparse compressor keeps of ``n`` (at least one), as the runtime."""
    return max(1, min(n, math.ceil(n * density)))


def _check(method: str, p: int) -> None:
    if method not in ("none", *COMPRESSED):
        raise ConfigError("compression", f"unknown compressor {method!r}", f"use none or one of {COMPRESSED}")
    if p < 1:
        raise ConfigError("ranks", f"must be at least 1, got {p}", "give the data-parallel group size")


def volume_elements(method: str, n: int, density: float, p: int, *, powersgd_elements: int | None = None) -> float:
    """Elements sent per rank in one reduction (module table; values and indices counted)."""
    _check(method, p)
    if p == 1:
        return 0.0
    k = entries_kept(n, density)
    frac = (p - 1) / p
    if method == "none":
        return 2 * n * frac
    if method == "oktopk":
        return 6 * k * frac
    if method in ("topka", "gaussiank"):
        return 2 * k * (p - 1)
    if method == "gtopk":
        return 2 * k * math.ceil(math.log2(p))
    r = powersgd_elements if powersgd_elements is not None else n
    return 2 * r * frac


def latency_terms(method: str, p: int) -> float:
    """Number of alpha (per-message latency) terms on the critical path (module table)."""
    _check(method, p)
    if p == 1:
        return 0.0
    log_p = math.ceil(math.log2(p))
    return {"none": 2 * (p - 1), "oktopk": 2 * p + 2 * log_p, "topka": log_p, "gaussiank": log_p,
            "gtopk": log_p, "powersgd": 4 * (p - 1)}[method]


@dataclass(frozen=True)
class CompressionCost:
    """One reduction of one rank's gradient with ``method`` (times in seconds, per rank)."""

    method: str
    elements_sent: float
    bytes_sent: float
    latency_terms: float
    comm_time_s: float
    select_time_s: float

    @property
    def time_s(self) -> float:
        """Selection and communication one after the other (selection needs the whole gradient)."""
        return self.comm_time_s + self.select_time_s


def compression_cost(method: str, n: int, density: float, p: int, *, alpha_s: float, bandwidth_Bps: float,
                     memory_bandwidth_Bps: float, value_bytes: int = 4, index_bytes: int = 4,
                     powersgd_elements: int | None = None) -> CompressionCost:
    """Volume, alpha–beta time and selection time of one reduction (module docstring)."""
    elements = volume_elements(method, n, density, p, powersgd_elements=powersgd_elements)
    sparse = method in ("oktopk", "topka", "gtopk", "gaussiank")
    nbytes = elements / 2 * (value_bytes + index_bytes) if sparse else elements * value_bytes
    terms = latency_terms(method, p)
    comm = terms * alpha_s + nbytes / bandwidth_Bps if p > 1 else 0.0
    select = selection_passes(method, p) * n * value_bytes / memory_bandwidth_Bps if p > 1 else 0.0
    return CompressionCost(method, elements, nbytes, terms, comm, select)


def powersgd_elements(shapes: Sequence[tuple[int, ...]], rank: int = 4, min_compression_rate: float = 2) -> int:
    """What torch's PowerSGD hook all-reduces for parameters of ``shapes``: r(rows+cols) for a matrix
    worth compressing (``(rows+cols)·r·min_compression_rate < rows·cols``), the tensor otherwise."""
    total = 0
    for s in shapes:
        rows = s[0] if s else 1
        cols = math.prod(s) // max(rows, 1)
        r = min(rows, cols, rank)
        if len(s) > 1 and (rows + cols) * r * min_compression_rate < rows * cols:
            total += r * (rows + cols)
        else:
            total += rows * cols
    return total


def compressed_reduce_s(method: str, density: float, grad_bytes: float, value_bytes: int, ranks: tuple[int, ...],
                        cluster: object, *, matrix: tuple[int, int] | None = None) -> float:
    """Time of one compressed reduction of ``grad_bytes`` of gradients over ``ranks`` of ``cluster``
    (the simulator's and the planner's data-parallel reduction with ``ParallelConfig.compression``).

    Sparse methods talk to distant partners (alpha and bandwidth of the group's "global" links);
    PowerSGD is two dense all-reduces (the cluster's best all-reduce). ``matrix``: the typical
    gradient matrix (rows, cols) PowerSGD compresses; the whole gradient counts as matrices of it.
    """
    from paratrain.cost.collectives import collective_time, group_layout
    from paratrain.spec.cluster import ClusterSpec

    assert isinstance(cluster, ClusterSpec)
    p = len(ranks)
    if p == 1:
        return 0.0
    n = int(grad_bytes // value_bytes)
    device = cluster.device
    mem_bw = device.memory_bandwidth_Bps * device.memory_efficiency
    if method == "powersgd":
        rows, cols = matrix if matrix is not None else (int(math.isqrt(n)) or 1, int(math.isqrt(n)) or 1)
        per_matrix = powersgd_elements([(rows, cols)])
        r = round(n / (rows * cols) * per_matrix)
        select = SELECTION_PASSES["powersgd"] * n * value_bytes / mem_bw
        return 2 * collective_time("all_reduce", r / 2 * value_bytes, ranks, cluster).time_s + select
    alpha, bw = group_layout(ranks, cluster).flat("global")
    return compression_cost(method, n, density, p, alpha_s=alpha, bandwidth_Bps=bw, memory_bandwidth_Bps=mem_bw,
                            value_bytes=value_bytes).time_s

"""Magnitude thresholds: exact local top-k, exact top-k over a group without gathering values,
the Gaussian estimate, and the selection rule shared by every sparse compressor.

Selections run over a rank's whole gradient (25M entries in the benchmark), so they avoid
n-sized temporaries (a fresh 100 MB tensor costs more than the pass that fills it: page faults) and
passes: on the CPU the passes over n entries are compiled loops (:mod:`.kernels`, one read of
each input); elsewhere :meth:`Scratch.above` finds the entries above a threshold from per-block
maxima in reused buffers. The exact k-th largest comes from a top-k over the few entries above a
sampled bound instead of over all n (torch.topk of 25M at 1 %: 540 ms on one thread).
"""

from __future__ import annotations

import math
from typing import Any

import torch

from .base import Comm

__all__ = ["Scratch", "accumulate_above", "add_at", "put_at", "clear_sent", "count_at_least", "keep_at_least",
           "merge_add",
           "exact_threshold", "top_k",
           "sampled_threshold", "strided_sample", "sample_bound", "group_threshold", "gaussian_threshold",
           "gaussian_threshold_of", "k_of"]


def _kernels(t: torch.Tensor) -> Any:
    """The compiled loops (:mod:`.kernels`) when they take ``t``, else ``None`` (torch ops). The
    module, and numba with it, is imported on first use: a process that never selects (dense
    training) does not load it."""
    if t.device.type != "cpu":
        return None
    from . import kernels

    return kernels if kernels.supported(t) else None


def k_of(n: int, density: float) -> int:
    """Entries to keep of ``n`` at ``density`` (at least one)."""
    return max(1, min(n, math.ceil(n * density)))


class Scratch:
    """Buffers reused by every selection of one compressor (module docstring)."""

    BLOCK = 8  # entries per block of :meth:`above`'s first pass (torch ops, off the CPU)

    def __init__(self) -> None:
        self._hi: torch.Tensor | None = None
        self._lo: torch.Tensor | None = None
        self._indices: Any = None
        self.total = 0.0  # sum of the new residual, from the last :func:`accumulate_above`
        self.values: torch.Tensor | None = None  # its values at the indices it returned

    @property
    def indices(self) -> Any:
        """The compiled loops' reused index buffer (:class:`.kernels.IndexBuffer`)."""
        if self._indices is None:
            from .kernels import IndexBuffer

            self._indices = IndexBuffer()
        return self._indices

    def _blocks(self, x: torch.Tensor, columns: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self._hi is None or self._hi.numel() < columns or self._hi.dtype != x.dtype or self._hi.device != x.device:
            self._hi = torch.empty(columns, dtype=x.dtype, device=x.device)
            self._lo = torch.empty(columns, dtype=x.dtype, device=x.device)
        assert self._lo is not None
        return self._hi[:columns], self._lo[:columns]

    def above(self, x: torch.Tensor, threshold: float, limit: int | None = None) -> torch.Tensor | None:
        """Sorted indices (int64) of the entries with ``|x| >= threshold`` (``x != 0`` when the
        threshold is 0: exact zeros are never sent); ``None`` when more than ``limit`` blocks
        hold one (so more than ``limit`` entries pass).

        Two passes, no n-sized temporary: ``x`` (1-D) viewed as 8 rows of n/8 makes n/8 blocks of
        8 entries (``j, j + n/8, ...``); one max and one min down the rows give each block's largest
        magnitude, and only the blocks that reach the threshold are gathered and compared (at 1 %
        density ~8 % of them). About 2x faster than ``abs``, compare and ``nonzero`` over all n.
        On the CPU: one read of ``x`` in a compiled loop (:func:`.kernels.select_above`)."""
        if (kern := _kernels(x)) is not None:
            return kern.select_above(x, threshold, self.indices, None if limit is None else limit * self.BLOCK)
        n = x.numel()
        cols = n // self.BLOCK
        main = x[: cols * self.BLOCK].view(self.BLOCK, cols)
        hi, lo = self._blocks(x, cols)
        torch.amax(main, 0, out=hi)
        torch.amin(main, 0, out=lo)
        torch.maximum(hi, lo.neg_(), out=hi)  # each block's largest magnitude
        hit_cols = (hi >= threshold if threshold > 0 else hi > 0).nonzero().squeeze(1)
        if limit is not None and hit_cols.numel() > limit:
            return None
        part = main.index_select(1, hit_cols).abs_()
        rows, at = (part >= threshold if threshold > 0 else part > 0).nonzero().unbind(1)
        idx = rows * cols + hit_cols[at]  # row-major order is index order: rows, then columns
        tail = x[cols * self.BLOCK:]
        if tail.numel():
            t = tail.abs()
            hit = (t >= threshold if threshold > 0 else t > 0).nonzero().squeeze(1)
            idx = torch.cat([idx, hit + cols * self.BLOCK])
        return idx


FUSED_BLOCK = 2**18  # entries per block of :func:`accumulate_above`: 1 MiB of fp32, one core's L2


def accumulate_above(residual: torch.Tensor, grad: torch.Tensor, threshold: float | None, scratch: Scratch, *,
                     limit: int | None = None, expect: int = 0) -> tuple[torch.Tensor | None, float]:
    """``residual += grad`` and ``grad`` zeroed, block by block, with the selection of
    :meth:`Scratch.above` on each block while it is in cache: one streaming pass where add, block
    maxima, zeroing and the norm took one pass each.

    Returns the sorted indices (int64) of the entries of the new residual with ``|r| >= threshold``
    (``r != 0`` for a threshold of 0; ``None`` when ``threshold`` is ``None``, or when more than
    ``limit`` entries pass: the pass then only adds), and the squared L2 norm of the new residual;
    its sum goes to ``scratch.total`` and its values at the returned indices to
    ``scratch.values`` (no gather afterwards: indexing 25M entries at 500k sorted places with
    ``acc[idx]`` took 25 ms). ``expect``: about how many entries will pass (sizes the
    index buffer on first use).

    On the CPU the whole of it is one compiled loop (:func:`.kernels.accumulate_select`): read
    ``residual`` and ``grad``, write both, no block temporaries; the blocked torch version below
    is for other devices.
    """
    if (kern := _kernels(residual)) is not None:
        idx, scratch.values, sumsq, scratch.total = kern.accumulate_select(residual, grad, threshold, scratch.indices,
                                                                           limit=limit, expect=expect)
        return idx, sumsq
    n = residual.numel()
    found: list[torch.Tensor] = []
    count = 0
    sumsq = total = 0.0
    select = threshold is not None
    for a in range(0, n, FUSED_BLOCK):
        rb, gb = residual[a: a + FUSED_BLOCK], grad[a: a + FUSED_BLOCK]
        rb.add_(gb)
        gb.zero_()
        sumsq += float(torch.dot(rb, rb))
        total += float(rb.sum())
        if select:
            assert threshold is not None
            idx = scratch.above(rb, threshold)
            assert idx is not None
            count += idx.numel()
            if limit is not None and count > limit:
                select = False
                found = []
            elif idx.numel():
                found.append(idx.add_(a))
    scratch.total = total
    scratch.values = None
    if threshold is None or (limit is not None and count > limit):
        return None, sumsq
    idx = torch.cat(found) if found else torch.empty(0, dtype=torch.int64, device=residual.device)
    scratch.values = residual.index_select(0, idx)
    return idx, sumsq


def strided_sample(parts: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """The strided sample :func:`sampled_threshold` reads, of the sum of ``parts`` (the residual
    and the gradient before they are added: the same values the sum would hold there)."""
    n = parts[0].numel()
    stride = max(1, n // SAMPLE)
    out = parts[0][::stride].clone()
    for p in parts[1:]:
        out += p[::stride]
    return out


def sample_bound(sample: torch.Tensor, n: int, k: int) -> float:
    """:func:`sampled_threshold` of a tensor of ``n`` entries from its :func:`strided_sample`."""
    return exact_threshold(sample, max(1, round(k * sample.numel() / n)))


def _candidates(x: torch.Tensor, k: int, scratch: Scratch | None) -> torch.Tensor | None:
    """Indices of the entries whose magnitude reaches a sampled estimate of the 2k-th largest,
    when at least k do (then the k largest are all among them); ``None`` otherwise (an unlucky
    sample, a small tensor, no scratch)."""
    n = x.numel()
    if scratch is None or n <= 4 * SAMPLE:
        return None
    bound = sampled_threshold(x, min(n, 2 * k))
    # at most half the blocks: past that, gathering them costs about what a top-k over all n does
    cand = scratch.above(x, bound, limit=n // (2 * Scratch.BLOCK)) if bound > 0 else None
    return cand if cand is not None and cand.numel() >= k else None


def exact_threshold(x: torch.Tensor, k: int, scratch: Scratch | None = None) -> float:
    """The k-th largest magnitude of ``x`` (0 when ``k`` covers every entry: keep all). With
    ``scratch``, a top-k over the candidates of :func:`_candidates` when there are enough: the
    same value, without a top-k over all n (torch.topk of 25M at 1 %: 540 ms)."""
    if k >= x.numel():
        return 0.0
    cand = _candidates(x, k, scratch)
    pool = x.abs() if cand is None else x[cand].abs()
    return float(torch.topk(pool, k, sorted=False).values.min())


def top_k(x: torch.Tensor, k: int, scratch: Scratch | None = None) -> tuple[torch.Tensor, float]:
    """Sorted indices (int64) of the k largest magnitudes of ``x`` and the k-th largest (0: all
    kept); exactly k (torch.topk breaks ties at the k-th value)."""
    n = x.numel()
    if k >= n:
        return torch.arange(n, device=x.device), 0.0
    cand = _candidates(x, k, scratch)
    if cand is None:
        top = torch.topk(x.abs(), k, sorted=False)
        return top.indices.sort().values, float(top.values.min())
    top = torch.topk(x[cand].abs(), k, sorted=False)
    return cand[top.indices].sort().values, float(top.values.min())


SAMPLE = 2**16  # magnitudes a sampled threshold looks at: ~k/n * 65,536 of them lie above it


def sampled_threshold(x: torch.Tensor, k: int) -> float:
    """An estimate of the k-th largest magnitude of ``x`` from every s-th entry (s = n / 65,536):
    the same quantile of the sample. O(n / s) instead of a top-k over all n."""
    n = x.numel()
    stride = max(1, n // SAMPLE)
    sample = x[::stride]
    ks = max(1, round(k * sample.numel() / n))
    return exact_threshold(sample, ks)


def _bits(magnitude: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Non-negative floats as integers of the same order (IEEE 754: the bit pattern of a
    non-negative float grows with its value), and the pattern's width."""
    if magnitude.dtype == torch.float64:
        return magnitude.view(torch.int64), 64
    if magnitude.dtype == torch.float32:
        return magnitude.view(torch.int32).to(torch.int64), 32
    return magnitude.float().view(torch.int32).to(torch.int64), 32


def group_threshold(x: torch.Tensor, k: int, comm: Comm, scratch: Scratch | None = None, *,
                    bits: int | None = None, per_rank: bool = False) -> Any:
    """The exact k-th largest of the magnitudes of the values all ranks hold together (disjoint
    pieces).

    Radix selection on the bit patterns, 8 bits a round: each round all-reduces a 256-bin
    histogram of the next byte among the entries matching the prefix found so far (4 rounds for
    fp32, 8 for fp64); the first round's histogram also gives the total. Control traffic of 256
    counts a round instead of gathering every nonzero (what the public Ok-Topk code does every 32
    calls), so the exact recompute keeps the volume bound. Returns 0 when the group holds at most
    ``k`` nonzeros (keep all of them).

    ``bits``: stop after the leading ``bits`` bits (a multiple of 8) and return the lower edge of
    the bucket holding the k-th largest: at least k entries pass it, and for ``bits=16`` (sign, 8
    exponent and 7 mantissa bits of fp32) those above the k-th lie within 1/128 of it in magnitude.

    ``per_rank``: all-gather the histograms instead (the same rounds) and return
    ``(threshold, counts)``, ``counts[i]`` the entries of rank ``i`` whose magnitude reaches it.
    """
    nonzero = x[(scratch or Scratch()).above(x, 0.0)].abs()
    keys, width = _bits(nonzero)
    last = width - (bits if bits is not None else width)
    prefix = 0
    remaining = k  # rank, among entries matching the prefix, of the one we look for
    candidates = keys
    above_by_rank = None  # per rank: entries already known to lie above the prefix
    for shift in range(width - 8, last - 1, -8):
        digit = (candidates >> shift) & 0xFF
        hist = torch.bincount(digit, minlength=256).to(torch.int64)
        if per_rank:
            ranks = torch.stack(comm.all_gather(hist))
            hist = ranks.sum(0)
        else:
            comm.all_reduce(hist)
        # largest digit first: walk down until the count above reaches ``remaining``
        above = torch.flip(torch.cumsum(torch.flip(hist, [0]), 0), [0])  # above[d] = count of digits >= d
        if shift == width - 8 and int(above[0]) <= k:
            return (0.0, ranks.sum(1).tolist()) if per_rank else 0.0
        d = int((above >= remaining).nonzero().max())
        remaining -= int(above[d + 1]) if d < 255 else 0
        prefix |= d << shift
        candidates = candidates[digit == d]
        if per_rank:
            here = ranks[:, d + 1:].sum(1)
            above_by_rank = here if above_by_rank is None else above_by_rank + here
            last_digit = ranks[:, d]
    as_int = torch.tensor([prefix], dtype=torch.int64)
    thr = float(as_int.view(torch.float64)) if width == 64 else float(as_int.to(torch.int32).view(torch.float32))
    if not per_rank:
        return thr
    assert above_by_rank is not None
    return thr, (above_by_rank + last_digit).tolist()


def gaussian_threshold_of(n: int, total: float, sumsq: float, density: float) -> float:
    """:func:`gaussian_threshold` of ``n`` values from their sum and sum of squares (the adding
    pass gives both): mean, and the unbiased variance ``(sumsq - n mean^2) / (n - 1)``."""
    mean = total / n
    var = max(0.0, sumsq - n * mean * mean) / (n - 1) if n > 1 else 0.0
    return _gaussian_magnitude(mean, var ** 0.5, density)


def gaussian_threshold(values: torch.Tensor, density: float) -> float:
    """Gaussiank's estimate: the magnitude a Gaussian fit of ``values`` exceeds with probability
    ``density`` (two-sided: |mean| + std * Phi^-1(1 - density/2))."""
    return _gaussian_magnitude(float(values.mean()), float(values.std()) if values.numel() > 1 else 0.0, density)


def _gaussian_magnitude(mean: float, std: float, density: float) -> float:
    z = float(torch.special.ndtri(torch.tensor(1.0 - density / 2, dtype=torch.float64)))
    return abs(mean) + std * z


def add_at(dst: torch.Tensor, idx: torch.Tensor, vals: torch.Tensor, offset: int = 0) -> None:
    """``dst[idx - offset] += vals``: received sparse pieces summed into a dense buffer (a
    compiled loop on the CPU: no int64 copy of ``idx`` and no shifted temporary)."""
    if (kern := _kernels(dst)) is not None:
        kern.scatter_add(dst, idx, vals, offset)
    else:
        dst.index_add_(0, idx.long() - offset if offset else idx.long(), vals)


def put_at(dst: torch.Tensor, idx: torch.Tensor, vals: torch.Tensor) -> None:
    """``dst[idx] = vals``."""
    if (kern := _kernels(dst)) is not None:
        kern.scatter_copy(dst, idx, vals)
    else:
        dst.index_copy_(0, idx.long(), vals)


def clear_sent(acc: torch.Tensor, result: torch.Tensor, idx: torch.Tensor) -> tuple[torch.Tensor, float]:
    """Zero the residual ``acc`` where this rank selected an entry (``idx``) that the group kept
    (``result`` nonzero there: a kept entry passed a positive threshold, or was nonzero); returns
    those entries and the sum of squares ``acc`` held at them."""
    if (kern := _kernels(acc)) is not None:
        return kern.clear_sent(acc, result, idx)
    sent = idx[result[idx] != 0]
    zeroed = acc[sent].double()
    acc.index_fill_(0, sent, 0)
    return sent, float(zeroed.dot(zeroed))


def count_at_least(vals: torch.Tensor, threshold: float) -> int:
    """How many of the candidates' values ``vals`` have ``|v| >= threshold`` (> 0)."""
    if (kern := _kernels(vals)) is not None:
        return kern.count_at_least(vals, threshold)
    return int((vals.abs() >= threshold).sum())


def keep_at_least(idx: torch.Tensor, vals: torch.Tensor, threshold: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The candidates (indices ``idx`` int64, values ``vals``) with ``|v| >= threshold`` (> 0), in
    order: on the CPU one compiled pass compacting them in place (``idx`` and ``vals`` are
    overwritten), where a mask and two masked gathers took three passes and two allocations."""
    if (kern := _kernels(vals)) is not None:
        return kern.keep_at_least(idx, vals, threshold)
    keep = vals.abs() >= threshold
    return idx[keep], vals[keep]


def merge_add(ia: torch.Tensor, va: torch.Tensor, ib: torch.Tensor,
              vb: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Two sparse vectors (sorted unique int64 indices and their values) summed: the sorted union
    of the indices, the values added where both hold one (``va + vb``, in that order). A merge of
    the two lists, O(len a + len b): no dense buffer of the index range."""
    if (kern := _kernels(va)) is not None:
        return kern.merge_add(ia.long(), va, ib.long(), vb)
    both = torch.cat([ia.long(), ib.long()])
    uniq, inverse = torch.unique(both, sorted=True, return_inverse=True)
    summed = torch.zeros(uniq.numel(), dtype=va.dtype, device=va.device)
    return uniq, summed.index_add_(0, inverse, torch.cat([va, vb]))

"""The sparse baselines Ok-Topk is measured against (Li & Hoefler, PPoPP'22, §5), in the same
interface: TopkA, gTop-k and Gaussiank. Each keeps a residual (error feedback) and leaves in the
flat gradient the group's sum of what it kept."""

from __future__ import annotations

import torch
import torch.distributed as dist

from .base import Comm, ReductionStats, index_dtype
from .select import (
    Scratch,
    accumulate_above,
    add_at,
    gaussian_threshold_of,
    k_of,
    put_at,
    sample_bound,
    strided_sample,
    top_k,
)

__all__ = ["TopkA", "GTopk", "Gaussiank"]


class _Sparse:
    name = "sparse"

    def __init__(self, group: dist.ProcessGroup | None, density: float) -> None:
        self.comm = Comm(group)
        self.density = density
        self.residual: torch.Tensor | None = None
        self.scratch = Scratch()
        self._sumsq = 0.0  # squared norm of g + residual, from the pass that adds them

    def residual_norm(self) -> float:
        return 0.0 if self.residual is None else float(self.residual.norm())

    def _acc(self, flat: torch.Tensor) -> torch.Tensor:
        """g + residual, in the residual's memory; ``flat`` zeroed (it receives the result)."""
        if self.residual is None:
            self.residual = torch.zeros_like(flat)
        _, self._sumsq = accumulate_above(self.residual, flat, None, self.scratch)
        return self.residual

    def _acc_top_k(self, flat: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, float]:
        """:meth:`_acc` and the exact top-k of the sum (sorted indices, exactly k, their values and
        the k-th largest magnitude): the adding pass also collects the entries above a sampled
        estimate of the 2k-th largest with their values, and the top-k runs over those (as
        Ok-Topk's exact steps)."""
        if self.residual is None:
            self.residual = torch.zeros_like(flat)
        acc, n = self.residual, flat.numel()
        if k >= n:
            _, self._sumsq = accumulate_above(acc, flat, None, self.scratch)
            return acc, torch.arange(n, device=acc.device), acc.clone(), 0.0
        bound = sample_bound(strided_sample((acc, flat)), n, min(n, 2 * k))
        cand, self._sumsq = accumulate_above(acc, flat, bound, self.scratch, expect=5 * k // 2)
        cvals = self.scratch.values
        if cand is None or cvals is None or cand.numel() < k:
            idx, thr = top_k(acc, k, self.scratch)
            return acc, idx, acc.index_select(0, idx), thr
        top = torch.topk(cvals.abs(), k, sorted=False)
        pick = top.indices.sort().values  # candidates are sorted: so are the picked ones
        return acc, cand[pick], cvals[pick], float(top.values.min())

    def _gather_sum(self, flat: torch.Tensor, idx: torch.Tensor, vals: torch.Tensor) -> None:
        """``flat`` (zeroed) += every rank's (idx, vals); counts may differ (padded all-gather)."""
        counts = [int(c) for c in self.comm.all_gather(self.comm.ints([idx.numel()]))]
        width = max(counts)
        pi = torch.zeros(width, dtype=index_dtype(flat.numel()), device=flat.device)
        pv = torch.zeros(width, dtype=flat.dtype, device=flat.device)
        pi[: idx.numel()] = idx
        pv[: idx.numel()] = vals
        all_i, all_v = self.comm.all_gather(pi, "indices"), self.comm.all_gather(pv, "values")
        for c, gi, gv in zip(counts, all_i, all_v, strict=True):
            add_at(flat, gi[:c], gv[:c])

    def _finish(self, stats: ReductionStats, acc: torch.Tensor, sent: torch.Tensor, thr: float) -> ReductionStats:
        zeroed = acc.index_select(0, sent).double()
        acc.index_fill_(0, sent, 0)
        self.residual = acc
        stats.density = sent.numel() / acc.numel()
        stats.threshold = thr
        # the adding pass's sum of squares less the entries sent (no pass of its own)
        stats.residual_norm = max(0.0, self._sumsq - float(zeroed.dot(zeroed))) ** 0.5
        return stats


class TopkA(_Sparse):
    """Exact local top-k, all-gather of every rank's k (index, value) pairs, sum. Volume
    2k(P-1) per rank: it grows with P."""

    name = "topka"

    def reduce(self, flat: torch.Tensor) -> ReductionStats:
        stats = self.comm.begin(flat.numel(), flat.device)
        k = k_of(flat.numel(), self.density)
        acc, idx, vals, thr = self._acc_top_k(flat, k)
        self._gather_sum(flat, idx, vals)
        return self._finish(stats, acc, idx, thr)


class Gaussiank(_Sparse):
    """Threshold from a Gaussian fit of ``g + residual`` at density d, moved by x/÷1.02 (at most 20
    times) until the selected count lies in [3k/4, 5k/4]; then TopkA's all-gather."""

    name = "gaussiank"

    def reduce(self, flat: torch.Tensor) -> ReductionStats:
        stats = self.comm.begin(flat.numel(), flat.device)
        acc = self._acc(flat)
        n = flat.numel()
        k = k_of(n, self.density)
        # the fit's mean and variance from the adding pass's sum and sum of squares (no pass of its own)
        thr = gaussian_threshold_of(n, self.scratch.total, self._sumsq, self.density) if k < n else 0.0
        # one pass at the lowest threshold the search can reach (20 divisions by 1.02, and a
        # margin for rounding); every step then counts within those entries
        pool = self.scratch.above(acc, thr / 1.02**21, limit=n // (2 * Scratch.BLOCK)) if thr > 0 else None
        if pool is None:
            pool = torch.arange(n, device=acc.device)
        mags = acc.index_select(0, pool).abs()
        for _ in range(20):
            count = int(torch.count_nonzero(mags >= thr)) if thr > 0 else int(torch.count_nonzero(mags))
            if thr <= 0 or 3 * k / 4 <= count <= 5 * k / 4:
                break
            thr = thr / 1.02 if count < 3 * k / 4 else thr * 1.02
        idx = pool[mags >= thr] if thr > 0 else pool[mags > 0]
        self._gather_sum(flat, idx, acc.index_select(0, idx))
        return self._finish(stats, acc, idx, thr)


class GTopk(_Sparse):
    """gTop-k (Shi et al., ICDCS 2019): exact local top-k, then log2(P) rounds of recursive
    doubling in which partners exchange their k (index, value) pairs, sum the overlaps and keep the
    top k; after the last round every rank holds the same global k. Needs P a power of two."""

    name = "gtopk"

    def reduce(self, flat: torch.Tensor) -> ReductionStats:
        stats = self.comm.begin(flat.numel(), flat.device)
        n = flat.numel()
        k = k_of(n, self.density)
        acc, local, vals, thr = self._acc_top_k(flat, k)
        idx = local
        p, r = self.comm.size, self.comm.rank
        itype = index_dtype(n)
        step = 1
        while step < p:
            peer = r ^ step
            counts = self.comm.ints([idx.numel()])
            their = self.comm.ints([0])
            self.comm.exchange({peer: [(counts, "control")]}, {peer: [their]})
            bi = torch.empty(int(their), dtype=itype, device=flat.device)
            bv = torch.empty(int(their), dtype=flat.dtype, device=flat.device)
            self.comm.exchange({peer: [(idx.to(itype), "indices"), (vals, "values")]}, {peer: [bi, bv]})
            # the lower rank's entries first on both partners: the same sums in the same order
            pairs = [(idx, vals), (bi.long(), bv)] if r < peer else [(bi.long(), bv), (idx, vals)]
            both_i = torch.cat([pairs[0][0], pairs[1][0]])
            both_v = torch.cat([pairs[0][1], pairs[1][1]])
            uniq, inverse = torch.unique(both_i, sorted=True, return_inverse=True)
            summed = torch.zeros(uniq.numel(), dtype=flat.dtype, device=flat.device).index_add_(0, inverse, both_v)
            if uniq.numel() > k:
                top = torch.topk(summed.abs(), k, sorted=False).indices.sort().values
                uniq, summed = uniq[top], summed[top]
            idx, vals = uniq, summed
            step *= 2
        put_at(flat, idx, vals)  # flat was zeroed by _acc_top_k
        # residual: local entries that did not survive the tree stay (both index lists sorted: a
        # binary search instead of an n-entry mask)
        pos = torch.searchsorted(idx, local).clamp_(max=max(idx.numel() - 1, 0))
        return self._finish(stats, acc, local[idx[pos] == local] if idx.numel() else local[:0], thr)

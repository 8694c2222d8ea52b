"""The selections every sparse compressor is built on, against plain torch on the same tensors:
entries above a threshold, the exact k-th largest magnitude and the top k, on sizes below and
above the one where the exact threshold switches to a top-k over sampled candidates."""

from __future__ import annotations

import pytest
import torch

from paratrain.runtime.compress.select import SAMPLE, Scratch, exact_threshold, sampled_threshold, top_k


def _gradient(n: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    g = torch.randn(n, generator=gen) * torch.exp(torch.randn(n, generator=gen))  # heavy tails
    g[::7] = 0.0  # exact zeros are never selected
    return g


@pytest.mark.parametrize("n", [3, 1000, 4 * SAMPLE + 13])
def test_selections_match_plain_torch(n: int) -> None:
    g, scratch = _gradient(n, n), Scratch()
    mag = g.abs()
    for k in sorted({1, 2, n // 100 + 1, max(1, n // 10)}):
        kth = float(torch.topk(mag, k).values.min())
        assert exact_threshold(g, k, scratch) == kth
        idx, thr = top_k(g, k, scratch)
        assert thr == kth and idx.numel() == k
        assert torch.equal(idx, idx.sort().values)
        assert torch.equal(mag[idx].sort().values, torch.topk(mag, k).values.sort().values)
        assert torch.equal(scratch.above(g, kth), (mag >= kth).nonzero().squeeze(1))
    assert torch.equal(scratch.above(g, 0.0), g.nonzero().squeeze(1))
    assert exact_threshold(g, n, scratch) == 0.0  # k covers everything: keep all


def test_above_reuses_its_buffers_across_sizes_and_reports_overflow() -> None:
    scratch = Scratch()
    big, small = _gradient(10_001, 1), _gradient(37, 2)
    for g in (big, small, big):  # a longer earlier use must not leak into a shorter one
        assert torch.equal(scratch.above(g, 1.0), (g.abs() >= 1.0).nonzero().squeeze(1))
    assert scratch.above(big, 0.0, limit=10) is None  # more than 10 blocks hold a nonzero


def test_sampled_threshold_is_close_to_the_exact_one() -> None:
    g = _gradient(2_000_000, 3)
    k = 20_000
    kept = int((g.abs() >= sampled_threshold(g, k)).sum())
    assert 0.8 * k <= kept <= 1.2 * k  # ~650 sampled entries above it: a few % off

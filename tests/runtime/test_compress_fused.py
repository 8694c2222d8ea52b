"""The one-pass selection every sparse compressor now starts with (add the gradient into the
residual, zero the gradient, select, sum of squares) and the shortened group threshold, against
plain torch on the same tensors."""

from __future__ import annotations

import pytest
import torch

from paratrain.runtime.compress import select
from paratrain.runtime.compress.select import (
    Scratch,
    accumulate_above,
    group_threshold,
    sample_bound,
    sampled_threshold,
    strided_sample,
)


def _heavy(n: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    g = torch.randn(n, generator=gen) * torch.exp(torch.randn(n, generator=gen))
    g[::5] = 0.0
    return g


class _OneRank:
    """The group of one rank: an all-reduce returns its input."""

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        return t


@pytest.mark.parametrize("n", [1, 7, 1000, 3 * select.FUSED_BLOCK + 13])
def test_accumulate_above_is_add_then_select(n: int) -> None:
    residual, grad = _heavy(n, 1), _heavy(n, 2)
    want = residual + grad
    thr = float(want.abs().median()) or 0.5  # positive: 0 means "every nonzero" (below)
    idx, sumsq = accumulate_above(residual, grad, thr, Scratch())
    assert torch.equal(residual, want) and not grad.any()  # added, and the gradient cleared
    assert torch.equal(idx, (want.abs() >= thr).nonzero().squeeze(1))
    assert sumsq == pytest.approx(float(want.double().pow(2).sum()), rel=1e-5)


def test_accumulate_above_threshold_zero_none_and_limit() -> None:
    n = 2 * select.FUSED_BLOCK + 5
    base, g = _heavy(n, 3), _heavy(n, 4)
    r = base.clone()
    idx, _ = accumulate_above(r, g.clone(), 0.0, Scratch())
    assert torch.equal(idx, r.nonzero().squeeze(1))  # exact zeros are never selected
    r = base.clone()
    assert accumulate_above(r, g.clone(), None, Scratch())[0] is None
    assert torch.equal(r, base + g)  # adds all the same
    r = base.clone()
    assert accumulate_above(r, g.clone(), 0.0, Scratch(), limit=n // 10)[0] is None  # too many pass
    assert torch.equal(r, base + g)


def test_sample_bound_is_the_sampled_threshold_of_the_sum() -> None:
    r, g = _heavy(1_000_003, 5), _heavy(1_000_003, 6)
    k = 10_000
    assert sample_bound(strided_sample((r, g)), r.numel(), k) == sampled_threshold(r + g, k)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_group_threshold_exact_and_first_two_rounds(dtype: torch.dtype) -> None:
    x = _heavy(50_000, 8).to(dtype)
    mags = x.abs()
    for k in (1, 37, 2_000):
        kth = float(mags.topk(k).values.min())
        assert group_threshold(x, k, _OneRank()) == kth  # type: ignore[arg-type]
        approx = group_threshold(x, k, _OneRank(), bits=16)  # type: ignore[arg-type]
        passing = int((mags >= approx).sum())
        # the lower edge of kth's 16-bit bucket: at least k pass, the rest within the bucket's width
        assert approx <= kth and passing >= k
        width = 2.0 ** -7 if dtype == torch.float32 else 2.0 ** -4
        assert kth - approx <= width * kth
    assert group_threshold(x, x.count_nonzero().item(), _OneRank()) == 0.0  # type: ignore[arg-type]

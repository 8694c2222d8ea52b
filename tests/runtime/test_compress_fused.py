"""The one-pass selection every sparse compressor now starts with (add the gradient into the
residual, zero the gradient, select, sums) and the shortened group threshold, against plain torch
on the same tensors; on the CPU it is a compiled loop (runtime.compress.kernels), elsewhere
blocked torch ops, and both are checked here (the ``path`` fixture)."""

from __future__ import annotations

import pytest
import torch

from paratrain.runtime.compress import kernels, select
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


@pytest.fixture(params=["compiled", "torch"])
def path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """The compiled loops (the CPU's path), or the torch ops other devices take."""
    if request.param == "torch":
        monkeypatch.setattr(kernels, "supported", lambda t: False)
    return str(request.param)


class _OneRank:
    """The group of one rank: an all-reduce returns its input."""

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        return t


@pytest.mark.parametrize("n", [1, 7, 1000, 3 * select.FUSED_BLOCK + 13])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_accumulate_above_is_add_then_select(n: int, dtype: torch.dtype, path: str) -> None:
    residual, grad = _heavy(n, 1).to(dtype), _heavy(n, 2).to(dtype)
    want = residual + grad
    thr = float(want.abs().median()) or 0.5  # positive: 0 means "every nonzero" (below)
    scratch = Scratch()
    idx, sumsq = accumulate_above(residual, grad, thr, scratch)
    assert torch.equal(residual, want) and not grad.any()  # added, and the gradient cleared
    assert torch.equal(idx, (want.abs() >= thr).nonzero().squeeze(1))
    assert scratch.values is not None and torch.equal(scratch.values, want[idx])  # collected in the pass
    # fp32 sums round at 2^-24 per add (the total of 786k entries cancels down to ~3.7e3 and is off by
    # ~1e-3 there); float64 tensors are summed in float64: rounding only
    rel, abs_ = (1e-5, 1e-3) if dtype == torch.float32 else (1e-12, 1e-9)
    assert sumsq == pytest.approx(float(want.double().pow(2).sum()), rel=rel)
    assert scratch.total == pytest.approx(float(want.double().sum()), rel=rel, abs=abs_)


def test_a_threshold_between_two_floats_compares_as_torch_does(path: str) -> None:
    """A Python float threshold is rounded to the tensor's dtype before the compare (torch's rule):
    fp32 entries equal to the rounded threshold are selected, as ``x.abs() >= thr`` does."""
    x = torch.tensor([0.1, -0.1, 0.099, 0.2], dtype=torch.float32)
    thr = float(x[0]) * (1 + 2**-30)  # above 0.1f as a double, rounds to 0.1f in fp32
    want = (x.abs() >= thr).nonzero().squeeze(1)
    assert want.tolist() == [0, 1, 3]
    assert torch.equal(Scratch().above(x, thr), want)
    idx, _ = accumulate_above(x.clone(), torch.zeros(4), thr, Scratch())
    assert torch.equal(idx, want)


def test_accumulate_above_threshold_zero_none_and_limit(path: str) -> None:
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
def test_group_threshold_exact_and_first_two_rounds(dtype: torch.dtype, path: str) -> None:
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


class _Gather(_OneRank):
    def all_gather(self, t: torch.Tensor) -> list[torch.Tensor]:
        return [t]


def test_group_threshold_counts_per_rank_what_passes_it() -> None:
    """``per_rank``: the histograms gathered, every rank's count of entries reaching the result
    (here one rank: all of them) with the same threshold."""
    x = _heavy(50_000, 9)
    mags = x.abs()
    for k, bits in ((37, None), (2_000, 16), (10**6, None)):
        thr, counts = group_threshold(x, k, _Gather(), bits=bits, per_rank=True)  # type: ignore[arg-type]
        assert thr == group_threshold(x, k, _OneRank(), bits=bits)  # type: ignore[arg-type]
        assert counts == [int((mags >= thr).sum()) if thr > 0 else int(x.count_nonzero())]


def test_gaussian_fit_from_the_passes_sums_is_the_fit_of_the_values() -> None:
    x = _heavy(100_001, 10).double()
    want = select.gaussian_threshold(x, 0.01)
    got = select.gaussian_threshold_of(x.numel(), float(x.sum()), float(x.pow(2).sum()), 0.01)
    assert got == pytest.approx(want, rel=1e-9)


@pytest.mark.parametrize("itype", [torch.int32, torch.int64])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_scatters_and_residual_clearing_match_torch(itype: torch.dtype, dtype: torch.dtype, path: str) -> None:
    gen = torch.Generator().manual_seed(11)
    n = 1000
    idx = torch.randint(0, n, (300,), generator=gen).to(itype)  # repeats: added in order
    vals = torch.randn(300, generator=gen).to(dtype)
    dst = torch.randn(n, generator=gen).to(dtype)
    want = dst.clone().index_add_(0, idx.long(), vals)
    select.add_at(dst, idx, vals)
    torch.testing.assert_close(dst, want, rtol=0, atol=1e-12 if dtype == torch.float64 else 1e-5)
    shifted = dst.clone()
    select.add_at(shifted[100:], idx[idx >= 100], vals[idx >= 100], 100)  # region offset
    torch.testing.assert_close(shifted, dst.clone().index_add_(0, idx[idx >= 100].long(), vals[idx >= 100]),
                               rtol=0, atol=1e-5)
    uniq = torch.unique(idx)
    out = torch.zeros(n, dtype=dtype)
    select.put_at(out, uniq, vals[: uniq.numel()])
    assert torch.equal(out, torch.zeros(n, dtype=dtype).index_copy_(0, uniq.long(), vals[: uniq.numel()]))
    # residual: cleared where this rank selected and the result is nonzero
    acc = torch.randn(n, generator=gen).to(dtype)
    result = torch.zeros(n, dtype=dtype)
    result[uniq[::2].long()] = 1.0
    sel = uniq.long()
    kept = sel[result[sel] != 0]
    want_zeroed = float(acc[kept].double().pow(2).sum())
    want_acc = acc.clone()
    want_acc[kept] = 0
    sent, zeroed = select.clear_sent(acc, result, sel)
    assert torch.equal(acc, want_acc) and torch.equal(sent, kept)
    assert zeroed == pytest.approx(want_zeroed, rel=1e-12)


@pytest.mark.parametrize("itype", [torch.int32, torch.int64])
@pytest.mark.parametrize("vtype", [torch.float32, torch.float64])
def test_packed_messages_round_trip(itype: torch.dtype, vtype: torch.dtype) -> None:
    """Segments of (indices, values) in one byte buffer, an empty one and a count in front
    included; the values stay aligned after an odd number of int32 indices."""
    from paratrain.runtime.compress.base import pack, packed_bytes, unpack

    segs = [(torch.tensor([3, 1, 4]), torch.tensor([0.5, -1.5, 2.0], dtype=vtype)),
            (torch.tensor([], dtype=torch.int64), torch.tensor([], dtype=vtype)),
            (torch.tensor([9]), torch.tensor([7.25], dtype=vtype))]
    for head in (None, 4):
        p = pack(segs, itype, head=head)
        assert p.entries == 4 and p.buf.dtype == torch.uint8
        assert p.buf.numel() == packed_bytes([3, 0, 1], itype, vtype, head=head is not None)
        longer = torch.cat([p.buf, torch.zeros(40, dtype=torch.uint8)])  # a receive buffer may be longer
        if head is not None:
            assert int(longer[:8].view(torch.int64)) == 4
        got = unpack(longer, [3, 0, 1], itype, vtype, head=head is not None)
        for (gi, gv), (wi, wv) in zip(got, segs, strict=True):
            assert gi.dtype == itype and torch.equal(gi.long(), wi) and torch.equal(gv, wv)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_filtering_candidates_matches_a_mask(dtype: torch.dtype, path: str) -> None:
    """Ok-Topk's threshold steps count and keep within the candidates of the pass."""
    vals = _heavy(10_001, 12).to(dtype)
    idx = torch.arange(0, 3 * vals.numel(), 3)
    for thr in (0.3, 1.0, float(vals.abs().max()), 1e9):
        mask = vals.abs() >= thr
        assert select.count_at_least(vals, thr) == int(mask.sum())
        got_i, got_v = select.keep_at_least(idx.clone(), vals.clone(), thr)
        assert torch.equal(got_i, idx[mask]) and torch.equal(got_v, vals[mask])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_merge_add_is_the_sum_of_two_sparse_vectors(dtype: torch.dtype, path: str) -> None:
    """Ok-Topk's split-and-reduce sums the pieces it receives as sorted merges."""
    ia, va = torch.tensor([1, 4, 7, 9]), torch.tensor([1.0, 2.0, -3.0, 0.5], dtype=dtype)
    ib, vb = torch.tensor([0, 4, 9, 12], dtype=torch.int32), torch.tensor([5.0, 1.0, -0.5, 2.0], dtype=dtype)
    got_i, got_v = select.merge_add(ia, va, ib, vb)
    assert got_i.tolist() == [0, 1, 4, 7, 9, 12]
    assert got_v.tolist() == [5.0, 1.0, 3.0, -3.0, 0.0, 2.0]  # a cancelled entry stays (never selected)
    empty_i, empty_v = select.merge_add(ia[:0], va[:0], ib, vb)
    assert empty_i.tolist() == ib.tolist() and torch.equal(empty_v, vb)

"""ZeRO-1's layout (runtime/zero.py) without processes: three simulated data-parallel ranks pack
their gradients, the reduce-scatter and all-gather are summed and stacked by hand, and each rank
must end with the sum of the gradients of exactly its slices, and then with every rank's update."""

from __future__ import annotations

import torch
from torch import nn

from paratrain.runtime.zero import ShardedParams

WORLD = 3
SHAPES = [(2, 5), (3,), (7,), (1,)]  # 10, 3, 7 and 1 elements: slices of 4, 1, 3 and 1 (padded)


def _ranks() -> list[ShardedParams]:
    torch.manual_seed(0)
    base = [torch.randn(s, dtype=torch.float64) for s in SHAPES]
    out = []
    for r in range(WORLD):
        params = [nn.Parameter(b.clone()) for b in base]
        for p in params:
            p.grad = torch.randn_like(p) + r
        out.append(ShardedParams(params, WORLD, r))
    return out


def test_every_element_is_owned_by_exactly_one_rank() -> None:
    ranks = _ranks()
    sizes = [sum(s.numel() for s in r.shards) for r in ranks]
    total = sum(torch.Size(s).numel() for s in SHAPES)
    assert sum(sizes) == total == 21
    assert max(sizes) <= sum(-(-torch.Size(s).numel() // WORLD) for s in SHAPES)  # ~1/WORLD of the state each
    assert [s.numel() for s in ranks[2].shards] == [2, 1, 1, 0]  # the last rank's slices end at each tensor's end


def test_reduce_scatter_layout_gives_each_rank_the_sum_of_its_slices() -> None:
    ranks = _ranks()
    want = [sum(r.params[i].grad.reshape(-1) for r in ranks) for i in range(len(SHAPES))]
    buffers = [r.pack_grads().view(WORLD, -1) for r in ranks]
    assert all(p.grad is None for r in ranks for p in r.params)  # packing drops the full gradients
    for k, r in enumerate(ranks):
        r.set_shard_grads(sum(b[k] for b in buffers))  # what rank k receives from the reduce-scatter
        for i, (shard, c) in enumerate(zip(r.shards, r.slices, strict=True)):
            lo = min(k * c, want[i].numel())
            torch.testing.assert_close(shard.grad, want[i][lo: lo + shard.numel()], rtol=0, atol=0)


def test_slices_are_views_and_the_gather_returns_every_update() -> None:
    ranks = _ranks()
    before = [p.detach().clone() for p in ranks[0].params]
    for k, r in enumerate(ranks):
        with torch.no_grad():
            for shard in r.shards:
                shard.add_(10.0 ** k)  # an optimizer step on this rank's slices, in place
    rows = torch.stack([r.local_segment() for r in ranks])  # the all-gather
    for r in ranks:
        r.unpack_params(rows)
    for i, p in enumerate(ranks[0].params):
        c, n = ranks[0].slices[i], p.numel()
        owner = torch.arange(n) // c  # the rank that stepped each element
        torch.testing.assert_close(p.detach().reshape(-1), before[i].reshape(-1) + 10.0 ** owner.double(),
                                   rtol=0, atol=0)
        for r in ranks[1:]:
            assert torch.equal(r.params[i], p)

"""Worker for tests/runtime/test_compress.py: one launch of 4 gloo processes runs every case.

``python tests/runtime/compress_harness.py OUT_DIR`` spawns the 4 ranks; rank r writes
``OUT_DIR/rank{r}.pt``: a dict of case name -> what the test checks.
"""

from __future__ import annotations

import os
import sys
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from paratrain.runtime.compress import GTopk, OkTopk, PowerSGD, make_compressor

WORLD = 4

# The hand-computed example (tests/runtime/test_compress.py): n = 8, density 1/4 -> k = 2, each rank
# with exactly two nonzeros, so its local top-2 is its support.
HAND = [
    {0: 4.0, 5: 1.0},
    {0: 3.0, 2: 2.5},
    {2: 5.0, 7: 0.25},
    {5: -1.5, 6: 6.0},
]


def _vector(entries: dict[int, float], n: int = 8) -> torch.Tensor:
    v = torch.zeros(n, dtype=torch.float64)
    for i, x in entries.items():
        v[i] = x
    return v


def _residual(c: Any, n: int) -> torch.Tensor:
    """A compressor's residual (zeros before its first call)."""
    r = c.state.error_dict.get(0) if isinstance(c, PowerSGD) else c.residual
    return torch.zeros(n, dtype=torch.float64) if r is None else r.clone()


def _hand(rank: int) -> dict[str, Any]:
    c = OkTopk(None, 0.25, threshold_period=1)
    g = _vector(HAND[rank])
    s1 = c.reduce(g)
    out = {"step1": g.clone(), "residual1": c.residual.clone(), "sent1": s1.elements_sent}
    g = torch.zeros(8, dtype=torch.float64)  # step 2: nothing new, the residuals alone
    c.reduce(g)
    out.update(step2=g.clone(), residual2=c.residual.clone(), bounds=list(c.bounds or []))
    return out


class SplitMessages(OkTopk):
    """Split-and-reduce messages of one entry: every longer piece sends its rest in a second message."""

    def _capacity(self, k: int) -> int:
        return 1


class CountedMessages(OkTopk):
    """Counts all-gathered before the split-and-reduce messages, as on NCCL (exact receive sizes)."""

    def _sized_receives(self) -> bool:
        return False


def _conservation(name: str, group: dist.ProcessGroup | None, *, n: int = 1000, density: float = 0.05,
                  calls: int = 4, seed: int = 0, cls: type | None = None) -> dict[str, Any]:
    """Each call: the group's sum of ``g + residual`` equals the result plus the group's sum of the new
    residuals (error feedback loses nothing); every rank holds the same result. ``cls``: an Ok-Topk
    variant instead of ``name``."""
    me = dist.get_rank(group)
    shapes = [torch.Size([20, 40]), torch.Size([n - 800])]
    c = cls(group, density) if cls is not None else make_compressor(name, group, density, shapes)
    errors, spread, nonzeros, sent = [], [], [], []
    gen = torch.Generator().manual_seed(seed + me)
    for _ in range(calls):
        g = torch.randn(n, dtype=torch.float64, generator=gen) * torch.rand(n, dtype=torch.float64, generator=gen)
        acc = g + _residual(c, n)
        stats = c.reduce(g)
        total_acc = acc.clone()
        dist.all_reduce(total_acc, group=group)
        total_res = _residual(c, n)
        dist.all_reduce(total_res, group=group)
        errors.append(float((total_acc - g - total_res).abs().max()))
        gathered = [torch.empty_like(g) for _ in range(dist.get_world_size(group))]
        dist.all_gather(gathered, g, group=group)
        spread.append(float(max((x - g).abs().max() for x in gathered)))
        nonzeros.append(int((g != 0).sum()))
        sent.append(stats.elements_sent)
    return {"errors": errors, "spread": spread, "nonzeros": nonzeros, "sent": sent, "result": g.clone()}


def _keep_all(rank: int) -> dict[str, Any]:
    """Density 1: Ok-Topk's full path (regions, split and reduce, balance, all-gather) must equal the
    dense sum and leave no residual."""
    gen = torch.Generator().manual_seed(10 + rank)
    g = torch.randn(501, dtype=torch.float64, generator=gen)
    g[::7] = 0  # exact zeros are skipped by the selection and must still come out right
    dense = g.clone()
    dist.all_reduce(dense)
    c = OkTopk(None, 1.0)
    c.reduce(g)
    return {"error": float((g - dense).abs().max()), "residual": float(c.residual.abs().max())}


def _gtopk(rank: int) -> dict[str, Any]:
    """gTop-k keeps at most k entries, the same on every rank."""
    gen = torch.Generator().manual_seed(20 + rank)
    g = torch.randn(400, dtype=torch.float64, generator=gen)
    c = GTopk(None, 0.05)
    c.reduce(g)
    return {"nonzeros": int((g != 0).sum()), "result": g.clone()}


def _worker(rank: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1")
    dist.init_process_group("gloo", init_method=f"file://{out}/rendezvous", rank=rank, world_size=WORLD)
    torch.set_num_threads(1)
    sub = dist.new_group([1, 2, 3])  # three ranks: the ring all-gather, group ranks != global ranks
    res: dict[str, Any] = {"hand": _hand(rank), "keep_all": _keep_all(rank), "gtopk": _gtopk(rank)}
    for name in ("oktopk", "topka", "gaussiank", "powersgd"):
        res[f"conservation-{name}"] = _conservation(name, None)
    res["conservation-oktopk-split"] = _conservation("oktopk", None, cls=SplitMessages)
    res["conservation-oktopk-counted"] = _conservation("oktopk", None, cls=CountedMessages)
    if rank > 0:
        res["conservation-oktopk-3ranks"] = _conservation("oktopk", sub)
    # threshold reuse: 40 calls cross the exact recompute at call 32
    res["conservation-oktopk-reuse"] = _conservation("oktopk", None, calls=40, density=0.02, n=4000)
    torch.save(res, f"{out}/rank{rank}.pt")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    mp.spawn(_worker, args=(sys.argv[1],), nprocs=WORLD, join=True)

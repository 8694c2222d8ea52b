"""Tensor-parallel measurements of ``paratrain calibrate``: what a collective adds to a step when
tensor parallelism issues it in lockstep with compute, and the host time DTensor adds per
parallelized module (the inputs of ``cost.tensor_parallel``)."""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Callable
from typing import Any

__all__ = ["TP_GEMM", "measure_tp_collectives", "measure_tp_dispatch", "tp_group_sizes", "trimmed_mean"]

# Tensor-parallel collectives: each follows a GEMM of about a few ms on one loaded thread, the
# compute between two of a small model's collectives at tp 2-4 (a 512-token micro-batch, hidden
# 256). Sizes around such models' activations (T x h fp32: 512 x 256 x 4 = 512 KiB) and the
# loss's per-token values; the cost model fits a line through them (cost.tensor_parallel).
TP_GEMM = (512, 256, 256)
_TP_BYTES = (4 * 2**10, 256 * 2**10, 2 * 2**20)
_TP_REPEATS = 12
_DISPATCH_REPEATS = 24


def tp_group_sizes(world: int) -> list[int]:
    """Tensor-parallel group sizes a run of ``world`` processes can use: divisors of it from 2."""
    return [g for g in range(2, world + 1) if world % g == 0]


def measure_tp_collectives(
    rank: int, world: int, *, progress: Callable[[int, int, str], None] | None = None, done: int = 0,
    total: int | None = None,
) -> list[tuple[str, int, int, float]]:
    """Collectives as tensor parallelism issues them: for every group size ``g`` (divisors of
    ``world`` from 2), the world split into groups of ``g`` consecutive ranks (tp is the mesh's
    innermost axis), every group at once, each collective right after a GEMM of a few ms
    (``TP_GEMM``) and waited for, through the functional collectives DTensor calls. Its time is
    the iteration of GEMM + collective minus the iteration of the GEMM alone, the two interleaved
    so that both see the same load (:func:`trimmed_mean` of the differences): what a collective
    adds to a step in lockstep with compute, the waiting for the slowest peer and the wake-up of a
    blocked process included. Rows ``(kind, g, bytes, seconds)``: the mean over the ranks of each
    rank's figure (in lockstep a collective adds the same time on every rank, so the mean of
    ``world`` estimates halves the noise of one at 4 ranks; rank 0's alone varied by half between
    calibrations); every rank must call it."""
    import torch
    import torch.distributed as dist

    c10d = torch.ops._c10d_functional
    tell = progress or (lambda done, total, what: None)
    of = total if total is not None else len(tp_group_sizes(world))
    m, k, n = TP_GEMM
    a, b = torch.randn(m, k), torch.randn(k, n)
    rows: list[tuple[str, int, int, float]] = []

    def added(op: Callable[[], Any]) -> float:
        torch.matmul(a, b)
        op()  # warm-up: a group's first call sets up its connections
        dist.barrier()
        added = []
        for _ in range(_TP_REPEATS):
            t0 = time.perf_counter()
            torch.matmul(a, b)
            t1 = time.perf_counter()
            torch.matmul(a, b)
            op()
            t2 = time.perf_counter()
            added.append((t2 - t1) - (t1 - t0))
        return max(0.0, trimmed_mean(added))

    for i, g in enumerate(tp_group_sizes(world)):
        tell(done + i, of, f"tensor-parallel collectives over {g} processes")
        group, _ = dist.new_subgroups(group_size=g)
        name = group.group_name
        for nbytes in _TP_BYTES:
            x, shard = torch.randn(nbytes // 4), torch.randn(nbytes // 4 // g)
            ops: dict[str, Callable[[], Any]] = {
                "all_reduce": lambda x=x, pg=name: c10d.wait_tensor(c10d.all_reduce(x, "sum", pg)),
                "all_gather": lambda s=shard, g=g, pg=name: c10d.wait_tensor(c10d.all_gather_into_tensor(s, g, pg)),
                "reduce_scatter": lambda x=x, g=g, pg=name: c10d.wait_tensor(
                    c10d.reduce_scatter_tensor(x, "sum", g, pg)),
            }
            for kind, op in ops.items():
                rows.append((kind, g, nbytes, added(op)))
    mean = torch.tensor([r[3] for r in rows], dtype=torch.float64)
    dist.all_reduce(mean)
    return [(kind, g, nbytes, float(t) / world) for (kind, g, nbytes, _), t in zip(rows, mean, strict=True)]


def measure_tp_dispatch() -> tuple[float, float]:
    """Host time DTensor adds per tensor-parallel module, ``(forward, backward)`` seconds: a tiny
    transformer block parallelized with the runtime's plan (``block_plan``: six Linear styles)
    on a one-process mesh, against the same block plain, forward and backward timed apart
    (:func:`trimmed_mean` of the interleaved differences). The tensors are tiny, so the difference
    is DTensor's own work: redistributing inputs and outputs, sharding propagation, its autograd
    wrappers. Needs an initialized process group; every rank must call it."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor.parallel import parallelize_module

    from paratrain.runtime.models.layers import Block
    from paratrain.runtime.tensor_parallel import block_plan
    from paratrain.spec.model import resolve_model

    group, _ = dist.new_subgroups(group_size=1)
    mesh = DeviceMesh.from_group(group, "cpu")
    spec = dataclasses.replace(resolve_model("gpt-tiny"), hidden=16, heads=2, seq=8, ffn=64)
    plain = Block(spec, pre_norm=True)
    parallel = parallelize_module(Block(spec, pre_norm=True), mesh, block_plan(swiglu=False))
    modules = 6  # q, k, v, o, fc1, fc2
    x = torch.randn(1, spec.seq, spec.hidden, requires_grad=True)

    def times(block: Any) -> tuple[float, float]:
        t0 = time.perf_counter()
        y = block(x)
        t1 = time.perf_counter()
        y.sum().backward()
        return t1 - t0, time.perf_counter() - t1

    for _ in range(2):  # warm-up: DTensor caches its sharding decisions on first use
        times(plain), times(parallel)
    fwd, bwd = [], []
    for _ in range(_DISPATCH_REPEATS):  # interleaved, so that both see the same load
        (pf, pb), (df, db) = times(plain), times(parallel)
        fwd.append(df - pf)
        bwd.append(db - pb)
    return max(0.0, trimmed_mean(fwd) / modules), max(0.0, trimmed_mean(bwd) / modules)


def trimmed_mean(xs: list[float]) -> float:
    """Mean of ``xs`` without its lowest and highest sixth: the repeats a process spent
    descheduled by an unrelated job (tens of ms on a shared machine) do not decide the figure."""
    cut = len(xs) // 6
    kept = sorted(xs)[cut:len(xs) - cut]
    return statistics.fmean(kept)

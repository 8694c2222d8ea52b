"""Tensor-parallel measurements of ``paratrain calibrate``: what a collective adds to a step when
tensor parallelism issues it right after compute, the CPU it costs its process, and the host time
DTensor adds per parallelized module (the inputs of ``cost.tensor_parallel``)."""

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
_TP_REPEATS = 16
_DISPATCH_REPEATS = 24


def tp_group_sizes(world: int) -> list[int]:
    """Tensor-parallel group sizes a run of ``world`` processes can use: divisors of it from 2."""
    return [g for g in range(2, world + 1) if world % g == 0]


Row = tuple[str, int, int, float]


def measure_tp_collectives(
    rank: int, world: int, *, progress: Callable[[int, int, str], None] | None = None, done: int = 0,
    total: int | None = None,
) -> tuple[list[Row], list[Row]]:
    """Collectives as tensor parallelism issues them, for every group size ``g`` (divisors of
    ``world`` from 2; groups of ``g`` consecutive ranks, tp being the mesh's innermost axis): a
    DTensor redistributed as the runtime's styles do (all-reduce: ``Partial`` to ``Replicate``;
    all-gather: ``Shard(0)`` to ``Replicate``; reduce-scatter: ``Partial`` to ``Shard(0)``) right
    after a GEMM of a few ms (``TP_GEMM``) and waited for, against the same redistribution on a
    one-process mesh (DTensor's own work, which :func:`measure_tp_dispatch`'s figure holds), the
    two interleaved so that both see the same load. Two figures per kind, group size and size:

    - *time*: one group alone (the other ranks wait in a barrier, which takes no core: gloo
      blocks), the added wall time (:func:`trimmed_mean`), the mean over its ranks: what a
      collective adds to its group's step, the slowest peer and the wake-up of a blocked process
      included. One group, because several at once fill each other's waits with their work, so
      what they add depends on the work there is (the simulator models that, ``sim.sharing``);
    - *CPU*: every group at once, the added CPU time of the process (``time.process_time``: all
      threads, gloo's included), the mean over repeats and ranks: the work a collective costs,
      under the same sharing of the cores as the calibration's other per-core figures. Measured
      here on 2 cores with 4 processes, a DTensor all-reduce of 256 KiB over 2 processes cost
      1.95 ms of CPU where the bare functional collective cost 1.08 and the one-process
      redistribution 0.5: DTensor's path around the collective is part of the work. A layer
      costs more than its redistributions alone: a tiny block parallelized with the runtime's
      plan over the group costs more CPU per collective than its one-process twin plus those
      figures (autograd around DTensor's collectives, the column-parallel inputs' gradients),
      about 1 ms more per collective here. So each group size's rows get that excess added
      (:func:`_block_excess_cpu`): the CPU a collective costs inside a layer.

    Returns ``(times, cpus)``, rows ``(kind, g, bytes, seconds)``; every rank must call it."""
    import torch
    import torch.distributed as dist
    from torch.distributed._functional_collectives import AsyncCollectiveTensor
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

    tell = progress or (lambda done, total, what: None)
    of = total if total is not None else len(tp_group_sizes(world))
    m, k, n = TP_GEMM
    a, b = torch.randn(m, k), torch.randn(k, n)
    times: list[Row] = []
    cpus: list[Row] = []
    one, _ = dist.new_subgroups(group_size=1)
    mesh1 = DeviceMesh.from_group(one, "cpu")
    moves = {"all_reduce": (Partial(), Replicate()), "all_gather": (Shard(0), Replicate()),
             "reduce_scatter": (Partial(), Shard(0))}

    def redistribute(local: Any, mesh: Any, kind: str) -> Callable[[], Any]:
        src, dst = moves[kind]

        def op() -> Any:
            out = DTensor.from_local(local, mesh, [src], run_check=False).redistribute(mesh, [dst]).to_local()
            return out.wait() if isinstance(out, AsyncCollectiveTensor) else out
        return op

    def added(op: Callable[[], Any], base: Callable[[], Any], active: bool) -> tuple[float, float]:
        """(trimmed mean of the added wall time, mean of the added CPU time) of ``op`` over ``base``."""
        dist.barrier()
        if not active:
            dist.barrier()
            return 0.0, 0.0
        torch.matmul(a, b)
        op(), base()  # warm-up: a group's first call sets up its connections
        walls, cpu = [], 0.0
        for _ in range(_TP_REPEATS):
            t0, p0 = time.perf_counter(), time.process_time()
            torch.matmul(a, b)
            base()
            t1, p1 = time.perf_counter(), time.process_time()
            torch.matmul(a, b)
            op()
            t2, p2 = time.perf_counter(), time.process_time()
            walls.append((t2 - t1) - (t1 - t0))
            cpu += (p2 - p1) - (p1 - p0)
        dist.barrier()
        # CPU time is not trimmed: the gloo threads' share of one call can land in the next repeat
        return max(0.0, trimmed_mean(walls)), max(0.0, cpu / _TP_REPEATS)

    for i, g in enumerate(tp_group_sizes(world)):
        tell(done + i, of, f"tensor-parallel collectives over {g} processes")
        group, _ = dist.new_subgroups(group_size=g)
        mesh = DeviceMesh.from_group(group, "cpu")
        for nbytes in _TP_BYTES:
            full, shard = torch.randn(nbytes // 4), torch.randn(nbytes // 4 // g)
            for kind in moves:
                local = shard if kind == "all_gather" else full
                op, base = redistribute(local, mesh, kind), redistribute(local, mesh1, kind)
                _, cpu = added(op, base, True)
                wall, _ = added(op, base, rank < g)
                times.append((kind, g, nbytes, wall))
                cpus.append((kind, g, nbytes, cpu))
        small = next(c for kind, gg, nb, c in cpus if (kind, gg, nb) == ("all_reduce", g, _TP_BYTES[0]))
        excess = max(0.0, _block_cpu_per_collective(mesh, mesh1) - small)
        rows = len(moves) * len(_TP_BYTES)  # this group size's
        cpus[-rows:] = [(kind, gg, nb, c + excess) for kind, gg, nb, c in cpus[-rows:]]
    sums = torch.tensor([r[3] for r in times] + [r[3] for r in cpus], dtype=torch.float64)
    dist.all_reduce(sums)
    t, c = sums[:len(times)].tolist(), sums[len(times):].tolist()
    return ([(kind, g, nb, s / g) for (kind, g, nb, _), s in zip(times, t, strict=True)],
            [(kind, g, nb, s / world) for (kind, g, nb, _), s in zip(cpus, c, strict=True)])


# A block small enough that its compute is negligible beside DTensor's and the collectives' host
# work (messages of 2 KiB), with heads enough for tensor parallelism over up to 8 processes.
_CPU_BLOCK = {"hidden": 64, "heads": 8, "seq": 8, "ffn": 256}


def _block_cpu_per_collective(mesh: Any, mesh1: Any) -> float:
    """CPU seconds per collective of a tiny transformer block parallelized with the runtime's
    plan over ``mesh`` (every group at once), forward and backward, beyond the same block over
    the one-process ``mesh1`` (interleaved; the mean over repeats), per collective the block
    issues (``cost.tensor_parallel.tp_parts``: 2 forward and 4 backward all-reduces)."""
    import torch
    import torch.distributed as dist
    from torch.distributed.tensor.parallel import parallelize_module

    from paratrain.cost.tensor_parallel import tp_parts
    from paratrain.runtime.models.layers import Block
    from paratrain.runtime.tensor_parallel import block_plan
    from paratrain.spec.model import resolve_model

    spec = dataclasses.replace(resolve_model("gpt-tiny"), **_CPU_BLOCK)
    layer = tp_parts(spec, sequence_parallel=False, microbatch=1, dtype="fp32")["layer"]
    per_block = sum(c.count for c in (*layer.forward, *layer.backward))
    x = torch.randn(1, spec.seq, spec.hidden, requires_grad=True)
    blocks = [parallelize_module(Block(spec, pre_norm=True), m, block_plan(swiglu=False)) for m in (mesh, mesh1)]

    def cpu(block: Any) -> float:
        p0 = time.process_time()
        block(x).sum().backward()
        return time.process_time() - p0

    for _ in range(2):  # warm-up: DTensor caches its sharding decisions on first use
        cpu(blocks[0]), cpu(blocks[1])
    dist.barrier()
    diffs = [cpu(blocks[0]) - cpu(blocks[1]) for _ in range(_DISPATCH_REPEATS)]
    dist.barrier()
    return max(0.0, statistics.fmean(diffs)) / per_block


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

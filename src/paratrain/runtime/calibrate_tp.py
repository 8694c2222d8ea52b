"""Tensor-parallel measurements of ``paratrain calibrate``: what a collective adds to a layer when
the runtime's tensor parallelism issues it, the CPU it costs its process, and the host time DTensor
adds per parallelized module (the inputs of ``cost.tensor_parallel``).

Every figure comes from a transformer block parallelized with the runtime's plan
(``runtime.tensor_parallel.block_plan``) against the same block's work without DTensor, forward
and backward through autograd, as a training step runs it. Measured on a 2-core machine with four
processes, the raw collectives (a DTensor redistributed after a GEMM, what this module timed
before) accounted for half of what a layer's collectives cost in training: autograd around
DTensor's collectives, the wrapping of the column-parallel inputs' gradients and the gloo threads'
work grow with the message, and a layer of hidden 256 at tp 2 cost 5.3 / 8.0 ms more CPU forward /
backward than its local share of the work where the redistributions and the dispatch accounted for
2.7 / 5.2.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Callable
from functools import partial
from typing import Any

__all__ = ["BLOCK_SHAPES", "block_part", "measure_tp_collectives", "measure_tp_dispatch", "per_collective",
           "tp_group_sizes", "trimmed_mean"]

# (hidden, sequence, micro-batch) of the blocks timed per group size, in fp32: each collective
# moves T x hidden x 4 bytes per rank, 2 KiB, 64 KiB and 512 KiB. The hidden size grows with the
# messages, as in the models these hosts train: DTensor's work per layer grows with the weights
# (hidden²) as well as with the activations. The cost model fits a line in bytes through the three
# (cost.tensor_parallel).
BLOCK_SHAPES = ((64, 8, 1), (128, 32, 4), (256, 64, 8))
_BLOCK_REPEATS = 12
_DISPATCH_REPEATS = 24


def tp_group_sizes(world: int) -> list[int]:
    """Tensor-parallel group sizes a run of ``world`` processes can use: divisors of it from 2."""
    return [g for g in range(2, world + 1) if world % g == 0]


Row = tuple[str, int, int, float]


def _block_spec(g: int, hidden: int, seq: int) -> Any:
    """A GPT block of about ``hidden`` and ``seq`` whose heads and sequence split evenly over ``g``
    ranks: 8 heads when ``g`` divides 8, else ``g`` heads (the hidden size rounded up to a multiple
    of them); the sequence rounded up to a multiple of ``g`` (sequence parallelism splits it)."""
    from paratrain.spec.model import resolve_model

    heads = 8 if 8 % g == 0 else g
    hidden = -(-hidden // heads) * heads
    seq = -(-seq // g) * g
    return dataclasses.replace(resolve_model("gpt-tiny"), hidden=hidden, heads=heads, seq=seq, ffn=4 * hidden)


def block_part(spec: Any, sequence_parallel: bool, batch: int) -> Any:
    """The collectives and modules of one calibration block (a ``cost.tensor_parallel.TPPart``):
    the layer's as ``tp_parts`` counts them, less the norms' gradient all-reduces. Those are
    issued by the runtime's gradient hooks (``runtime.tensor_parallel``: a replicated parameter's
    partial gradient is reduced when it is accumulated); the bare block parallelized here has none,
    so its norms' gradients stay partial sums and it issues only the activations' collectives
    (recorded in tests/runtime/test_calibrate_tp.py)."""
    from paratrain.cost.tensor_parallel import tp_parts

    layer = tp_parts(spec, sequence_parallel=sequence_parallel, microbatch=batch, dtype="fp32")["layer"]
    act = batch * spec.seq * spec.hidden * 4
    backward = tuple(c for c in layer.backward if c.kind != "all_reduce" or c.nbytes == act)
    return dataclasses.replace(layer, backward=backward)


def _local_block(spec: Any, g: int) -> Any:
    """One tensor-parallel rank's share of a block's work without DTensor: the same block with
    its column-parallel linear layers ``1/g`` as wide and its row-parallel ones ``1/g`` as deep."""
    import torch.nn as nn

    from paratrain.runtime.models.layers import Block

    block = Block(spec, pre_norm=True)
    h, f, attn, mlp = spec.hidden, spec.ffn_size, block.attn, block.mlp
    attn.q, attn.k, attn.v = (nn.Linear(h, h // g, bias=spec.bias) for _ in range(3))
    attn.o = nn.Linear(h // g, h, bias=spec.bias)
    mlp.fc1, mlp.fc2 = nn.Linear(h, f // g, bias=spec.bias), nn.Linear(f // g, h, bias=spec.bias)
    return block


def measure_tp_collectives(
    rank: int, world: int, dispatch: tuple[float, float], *, progress: Callable[[int, int, str], None] | None = None,
    done: int = 0, total: int | None = None,
) -> tuple[list[Row], list[Row]]:
    """Collectives as tensor parallelism issues them inside a layer, for every group size ``g``
    (divisors of ``world`` from 2; groups of ``g`` consecutive ranks, tp being the mesh's
    innermost axis). A GPT block (:func:`_block_spec`) parallelized with the runtime's plan, without
    and with sequence parallelism, at the sizes of ``BLOCK_SHAPES``, against one rank's share of
    its work run without DTensor (:func:`_local_block`), forward and backward (interleaved, so that
    both see the same load). What the parallel block costs beyond its share of the work is
    DTensor's dispatch per module (``dispatch``: per-core CPU seconds forward and backward, from
    :func:`measure_tp_dispatch`) plus its collectives, as :func:`block_part` counts
    them; per collective:

    - *time*: one group alone (the other ranks wait in a barrier, which takes no core: gloo
      blocks), the added wall time (:func:`trimmed_mean`) less the dispatch at the group's speed
      (``min(1, cores / g)`` of a core each), the mean over its ranks: what a collective adds to
      its group's step, the slowest peer and the wake-up of a blocked process included;
    - *CPU*: every group at once, the added CPU time of the process (``time.process_time``: all
      threads, gloo's included) less the dispatch, the mean over repeats and ranks: the work a
      collective costs, under the same sharing of the cores as the calibration's other figures.

    The block without sequence parallelism issues all-reduces only (2 forward, 2 backward): its
    figure per collective is the ``all_reduce`` row at its message size. The one with sequence
    parallelism issues all-gathers and reduce-scatters only (4 forward, 4 backward; no
    norm-gradient all-reduces, :func:`block_part`): its figure per collective is both the
    ``all_gather`` and the ``reduce_scatter`` row. Returns ``(times, cpus)``, rows
    ``(kind, g, bytes, seconds)``; every rank must call it."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor.parallel import parallelize_module

    from paratrain.cost.tensor_parallel import fit_line
    from paratrain.runtime.calibrate import core_share, host_cores  # imports this module: not at its top
    from paratrain.runtime.models.layers import Block
    from paratrain.runtime.tensor_parallel import block_plan

    tell = progress or (lambda done, total, what: None)
    of = total if total is not None else len(tp_group_sizes(world))
    d = dispatch[0] + dispatch[1]
    times: list[Row] = []
    cpus: list[Row] = []
    for i, g in enumerate(tp_group_sizes(world)):
        tell(done + i, of, f"tensor-parallel collectives over {g} processes")
        group, _ = dist.new_subgroups(group_size=g)
        mesh = DeviceMesh.from_group(group, "cpu")
        rate = core_share(g, torch.get_num_threads(), host_cores())  # one group alone on the host's cores
        for sp in (False, True):  # the all-reduce rows first: the blocks with sequence parallelism use them
            rows_t: list[Row] = []
            rows_c: list[Row] = []
            for hidden, seq, batch in BLOCK_SHAPES:
                spec = _block_spec(g, hidden, seq)
                torch.manual_seed(0)
                par = parallelize_module(Block(spec, pre_norm=True), mesh,
                                         block_plan(swiglu=False, sequence_parallel=sp))
                local = _local_block(spec, g)
                x_par = torch.randn(batch, spec.seq // g if sp else spec.seq, spec.hidden, requires_grad=True)
                x_local = torch.randn(batch, spec.seq, spec.hidden, requires_grad=True)
                cpu = _added(par, x_par, local, x_local, time.process_time, True, statistics.fmean)
                wall = _added(par, x_par, local, x_local, time.perf_counter, rank < g, trimmed_mean)
                layer = block_part(spec, sp, batch)
                per_cpu = per_collective(cpu, layer, d, 1.0, partial(fit_line, tuple(cpus), "all_reduce", g))
                per_wall = (per_collective(wall, layer, d, rate, partial(fit_line, tuple(times), "all_reduce", g))
                            if rank < g else 0.0)
                act = batch * spec.seq * spec.hidden * 4
                for kind in ("all_gather", "reduce_scatter") if sp else ("all_reduce",):
                    rows_t.append((kind, g, act, per_wall))
                    rows_c.append((kind, g, act, per_cpu))
            # the group's figures: times the mean over its g ranks (the others measured nothing),
            # CPU the mean over every rank
            sums = torch.tensor([r[3] for r in rows_t] + [r[3] for r in rows_c], dtype=torch.float64)
            dist.all_reduce(sums)
            n = len(rows_t)
            times += [(k, gg, b, s / g) for (k, gg, b, _), s in zip(rows_t, sums[:n].tolist(), strict=True)]
            cpus += [(k, gg, b, s / world) for (k, gg, b, _), s in zip(rows_c, sums[n:].tolist(), strict=True)]
    return times, cpus


def per_collective(added_s: float, layer: Any, dispatch_s: float, rate: float,
                   all_reduce_s: Callable[[int], float | None]) -> float:
    """Seconds one collective of ``layer`` (a ``cost.tensor_parallel.TPPart``: its collectives and
    modules, forward and backward) accounts for in ``added_s``, what the parallel layer cost beyond
    its share of the work: ``added_s`` less the modules' dispatch (``dispatch_s`` per module,
    forward and backward together, at ``rate`` of a core) and, when ``layer`` also issues
    collectives of another kind than its own, the all-reduces at ``all_reduce_s(bytes)``, over the
    count of the others (at least 0). A layer without sequence parallelism issues all-reduces
    only; with it, all-gathers and reduce-scatters beside the backward's all-reduces."""
    kinds = {c.kind for c in (*layer.forward, *layer.backward)}
    rest = added_s - layer.modules * dispatch_s / rate
    count = 0
    for c in (*layer.forward, *layer.backward):
        if c.kind == "all_reduce" and kinds != {"all_reduce"}:
            rest -= c.count * (all_reduce_s(c.nbytes) or 0.0)
        else:
            count += c.count
    return max(0.0, rest / count)


def _added(par: Any, x_par: Any, local: Any, x_local: Any, clock: Callable[[], float], active: bool,
           average: Callable[[list[float]], float]) -> float:
    """What a forward and backward of ``par`` costs beyond one of ``local`` on ``clock``, averaged
    over interleaved repeats; 0 on a rank that is not ``active`` (it waits in the barrier)."""
    import torch.distributed as dist

    def run(block: Any, x: Any) -> float:
        t0 = clock()
        block(x).sum().backward()
        return clock() - t0

    dist.barrier()
    if not active:
        dist.barrier()
        return 0.0
    run(par, x_par), run(local, x_local)  # warm-up: DTensor caches its sharding decisions on first use
    diffs = [run(par, x_par) - run(local, x_local) for _ in range(_BLOCK_REPEATS)]
    dist.barrier()
    return average(diffs)


def measure_tp_dispatch() -> tuple[float, float]:
    """Host time DTensor adds per tensor-parallel module, ``(forward, backward)`` CPU seconds: a
    tiny transformer block parallelized with the runtime's plan (``block_plan``: six Linear
    styles and the two prepared inputs of attention and MLP) on a one-process mesh, against the
    same block plain, forward and backward apart (:func:`trimmed_mean` of the interleaved
    differences). The tensors are tiny, so the difference
    is DTensor's own work: redistributing inputs and outputs, sharding propagation, its autograd
    wrappers. Timed on the process's CPU clock, not the wall: while more processes compute than
    there are cores, a call shorter than the scheduler's time slice often runs whole at full speed
    and sometimes waits a slice, so its wall time is not the share of a core it cost (four
    processes on two cores measured 240-590 us per module forward by the wall, 240-330 us of CPU);
    the figure is per core, as the calibration's other per-kernel figures. Needs an initialized
    process group; every rank must call it."""
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
    # q, k, v, o, fc1, fc2 and the two shared inputs: the modules the cost model charges a dispatch
    modules = block_part(spec, False, 1).modules
    x = torch.randn(1, spec.seq, spec.hidden, requires_grad=True)

    def times(block: Any) -> tuple[float, float]:
        t0 = time.process_time()
        y = block(x)
        t1 = time.process_time()
        y.sum().backward()
        return t1 - t0, time.process_time() - t1

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

"""Closed-form iteration time, bubble, exposed communication and peak memory of a pipeline.

The planner ranks every candidate with these formulas and lets the discrete-event simulator
confirm the best few. Inputs are per-chunk costs of one micro-batch (``ChunkCost``), the
point-to-point time of one activation between neighbouring stages and the data-parallel gradient
reduction time of each chunk. Notation: ``p`` pipeline ranks, ``v`` chunks per rank, ``m``
micro-batches, ``F``/``B`` forward/backward time of a stage (backward includes recomputation),
``c`` one stage-to-stage transfer.

Sources of the closed forms:
- GPipe and 1F1B: idle time ``(p-1)(F+B)`` per iteration (Huang et al. 2019; Narayanan et al.
  SC 2021, eq. 1); the transfers of the first micro-batch add ``2(p-1)c``.
- Steady state with transfers: a receive is posted when the rank reaches it and takes ``c`` from
  then (the simulator's rule, as in an executor that waits on its receives), and in 1F1B two
  neighbours hand a micro-batch back and forth, so each micro-batch costs ``P + c`` with
  ``P = max_s(F_s+B_s)``. 1F1B also keeps at most ``p`` micro-batches in flight, so the round
  trip ``L = Σ_s(F_s+B_s) + 2(p-1)c`` of one micro-batch is shared by ``p``: the period is
  ``max(P + c, L/p)`` and the iteration ``L + (m-1)·max(P + c, L/p)``; with free communication and
  uniform stages this is the textbook ``(m+p-1)(F+B)``.
- Interleaved 1F1B: bubble ``(p-1)(f+b)`` for chunk times ``f``/``b``, i.e. ``1/v`` of 1F1B's
  (Narayanan et al. SC 2021, sec. 2.2), with ``v`` times as many transfers. Assumes equal chunks:
  a much heavier end chunk (the LM head on a one-layer chunk) makes the others wait, which this
  form does not count (up to 8 % optimistic against the simulator in that case).
- ZB-H1: bubble ``(p-1)(F + B_input - W)`` where ``W`` is the deferred weight-gradient part
  (Qi et al., "Zero Bubble Pipeline Parallelism", ICLR 2024, sec. 3.1).
- Chimera with two opposite pipelines: ``(p-2)`` idle forward slots for one basic unit of ``p``
  micro-batches with ``F = B`` (Li & Hoefler, SC 2021, Table 1); for ``k = m/p`` concatenated
  units the simulated construction idles ``(p-2)(f + k(b-f))``.
- PipeDream and 2BW: no flush; in steady state one micro-batch leaves every ``max_s(F_s+B_s)``.

Peak activation memory holds ``m`` micro-batches under GPipe, ``min(p-s, m)`` on stage ``s``
under 1F1B/PipeDream, ``p`` on every stage under ZB-H1, and for interleaved 1F1B
``min(v·m, (v-1)·p + 2(p-1-r) + 1)`` chunk-micro-batches on rank ``r`` (Megatron-LM's warm-up
count); a backward adds its recomputed working set on top.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from paratrain.cost.types import ChunkCost
from paratrain.parallel.config import ParallelConfig, ScheduleName

__all__ = [
    "PipelineInputs",
    "Estimate",
    "RankStats",
    "estimate",
    "inflight_per_chunk",
    "pipeline_time_s",
    "ideal_time_s",
    "memory_by_rank",
    "chimera_extra_bytes",
]


@dataclass(frozen=True)
class RankStats:
    """Per-rank and per-chunk sums of the chunk costs (``p`` ranks, chunk ``k`` on rank ``k % p``)."""

    fwd: tuple[float, ...]  # per rank: forward of all its chunks, one micro-batch
    bwd: tuple[float, ...]  # per rank: whole backward incl. recomputation
    wgt: tuple[float, ...]  # per rank: weight-gradient part of the backward
    chunk_work: tuple[float, ...]  # per chunk: forward + backward
    chunk_bwd_prefix: tuple[float, ...]  # prefix sums of per-chunk backward over chunk index
    static: tuple[float, ...]  # per rank: weights + gradients + optimizer state (+ cached FP8 weights)
    weight: tuple[float, ...]  # per rank: weights
    grad: tuple[float, ...]  # per rank: gradients
    optimizer: tuple[float, ...]  # per rank: optimizer state
    tp_comm: tuple[float, ...]  # per rank: tensor-parallel collectives, one micro-batch
    activation: tuple[float, ...]  # per chunk: bytes held per in-flight micro-batch
    transient: tuple[float, ...] = ()  # per rank: largest working set of one backward (recomputed layer)

    @classmethod
    def of(cls, chunks: Sequence[ChunkCost], p: int) -> RankStats:
        n = len(chunks)
        fwd, bwd, wgt, stat, wt, gr, opt, tpc = ([0.0] * p for _ in range(8))
        prefix = [0.0]
        for k, ck in enumerate(chunks):
            r = k % p
            fwd[r] += ck.forward_s
            b = ck.recompute_s + ck.backward_input_s + ck.backward_weight_s
            bwd[r] += b
            wgt[r] += ck.backward_weight_s
            stat[r] += ck.static_bytes
            wt[r] += ck.weight_bytes
            gr[r] += ck.grad_bytes
            opt[r] += ck.optimizer_bytes
            tpc[r] += ck.tp_comm_s
            prefix.append(prefix[-1] + b)
        return cls(
            fwd=tuple(fwd),
            bwd=tuple(bwd),
            wgt=tuple(wgt),
            chunk_work=tuple(chunks[k].forward_s + prefix[k + 1] - prefix[k] for k in range(n)),
            chunk_bwd_prefix=tuple(prefix),
            static=tuple(stat),
            weight=tuple(wt),
            grad=tuple(gr),
            optimizer=tuple(opt),
            tp_comm=tuple(tpc),
            activation=tuple(float(ck.activation_bytes) for ck in chunks),
            transient=tuple(
                max(float(getattr(chunks[k], "transient_bytes", 0)) for k in range(r, n, p)) for r in range(p)
            ),
        )


@dataclass(frozen=True)
class PipelineInputs:
    """Everything the closed forms need about one candidate.

    ``grad_reduce_s[k]`` is the data-parallel reduction of chunk ``k``'s gradients (all-reduce,
    or reduce-scatter with optimizer-state sharding); ``param_gather_s[k]`` the all-gather of the
    updated parameters that sharding adds (0 otherwise); ``optimizer_s[r]`` the optimizer step on
    rank ``r``; ``p2p_s`` one activation (or its gradient) between neighbouring stages.
    """

    stats: RankStats
    p2p_s: float
    grad_reduce_s: tuple[float, ...]
    param_gather_s: tuple[float, ...]
    optimizer_s: tuple[float, ...]
    overlap_grad_reduce: bool = True
    extra_static_bytes: tuple[float, ...] = ()  # per rank, e.g. Chimera's second replica
    step_wait_s: float = 0.0  # the step's wait for the slowest rank (cost.dp_reduction.skew_s)
    # Transfers of a rank that receives from both neighbours at once through one link (the
    # interleaved schedule's steady-state exchange across nodes) share it: 2 (cost.link_sharing).
    p2p_sharing: int = 1


@dataclass(frozen=True)
class Estimate:
    """The analytical prediction for one candidate (seconds and bytes, per iteration)."""

    iteration_time_s: float
    pipeline_time_s: float  # first forward to last backward, before gradient reduction
    bubble_fraction: float  # idle time / iteration time, mean over pipeline ranks
    exposed_comm_s: float  # communication on the critical path, not hidden behind compute
    exposed_grad_reduce_s: float
    optimizer_s: float
    memory_by_rank: tuple[float, ...]  # one entry per pipeline rank (all dp/tp ranks alike)

    @property
    def peak_memory_bytes(self) -> float:
        return max(self.memory_by_rank)


def inflight_per_chunk(config: ParallelConfig) -> list[float]:
    """Peak number of micro-batches whose activations each chunk holds."""
    p, v, m = config.pp, config.virtual_stages, config.num_microbatches
    s = config.schedule
    if s is ScheduleName.GPIPE:
        return [float(m)] * (p * v)
    if s is ScheduleName.INTERLEAVED:
        out = [0.0] * (p * v)
        for r in range(p):
            # Megatron's warm-up forwards on rank r, spread over its v chunks, plus the one in
            # the first steady-state step.
            total = min(v * m, (v - 1) * p + 2 * (p - 1 - r) + 1)
            for k in range(v):
                out[k * p + r] = total / v
        return out
    if s is ScheduleName.CHIMERA:
        # Rank r runs chunk r of the down replica and chunk p-1-r of the up one; a basic unit
        # admits min(p/2, p-c) micro-batches per chunk, so rank r holds p/2 + 1 + min(r, p-1-r)
        # (the construction in paratrain.schedule.chimera; Li & Hoefler 2021, sec. 3.2).
        return [float(min(m, p // 2 + 1 + min(r, p - 1 - r))) for r in range(p)]
    if s is ScheduleName.ZB_H1:
        # The deferred weight gradients keep activations alive: every rank holds p micro-batches
        # (Qi et al. 2024, sec. 3.1: ZB-H1 peaks at 1F1B's first-stage memory on every stage).
        return [float(min(p, m))] * p
    return [float(min(p - r, m)) for r in range(p)]


def pipeline_time_s(config: ParallelConfig, stats: RankStats, p2p_s: float, p2p_sharing: int = 1) -> float:
    """First forward to last backward of one iteration, by the schedule's closed form.

    ``p2p_sharing``: how many transfers of the interleaved schedule's steady-state exchange share
    a rank's link (:class:`PipelineInputs`); the fill and drain move one at a time."""
    p, v, m = config.pp, config.virtual_stages, config.num_microbatches
    c = p2p_s if p > 1 else 0.0
    sched = config.schedule
    fwd, bwd = stats.fwd, stats.bwd
    work = [f + b for f, b in zip(fwd, bwd, strict=True)]
    big_p, total = max(work), sum(work)
    if sched is ScheduleName.GPIPE:
        return total + 2 * (p - 1) * c + (m - 1) * (max(fwd) + max(bwd) + c)
    if sched in (ScheduleName.PIPEDREAM, ScheduleName.PIPEDREAM_2BW):
        # Throughput of the steady state; the one-off fill is amortized over training.
        return m * big_p
    if sched is ScheduleName.INTERLEAVED:
        n = p * v
        # Fill and drain: (p-1) chunk steps plus the transfers of the first micro-batch across
        # all n-1 chunk boundaries, forward and backward.
        fill = (p - 1) * total / n + 2 * (n - 1) * c
        # As in 1F1B, a micro-batch's round trip through all chunks, shared by the ~I/v
        # micro-batches in flight, bounds the steady-state period per micro-batch.
        inflight = (v - 1) * p + 2 * (p - 1) + 1
        cs = c * p2p_sharing  # the steady state's exchanges: both neighbours at once
        period = max(big_p + cs, (total + 2 * (n - 1) * cs) * v / inflight)
        return m * period + fill
    if sched is ScheduleName.ZB_H1:
        fill = max(0.0, max(f + b - 2 * w for f, b, w in zip(fwd, bwd, stats.wgt, strict=True)))
        return m * (big_p + c) + (p - 1) * fill + 2 * (p - 1) * c
    if sched is ScheduleName.CHIMERA:
        # Rank r does one forward and one backward per micro-batch, alternating its down chunk r
        # and its up chunk p-1-r. With k = m/p basic units the construction leaves (p-2) idle
        # forward slots per unit boundary plus (b-f) per unit: idle (p-2)(f + k(b-f)), which
        # for f = b and k = 1 is the paper's (p-2) slots (Li & Hoefler 2021, Table 1).
        f = max(fwd[r] + fwd[p - 1 - r] for r in range(p)) / 2
        b = max(bwd[r] + bwd[p - 1 - r] for r in range(p)) / 2
        k = m / p
        return m * (f + b) + max(0, p - 2) * (f + k * max(0.0, b - f)) + 2 * (p - 1) * c
    # 1F1B (PipeDream-Flush).
    loop = total + 2 * (p - 1) * c
    return loop + (m - 1) * max(big_p + c, loop / p)


def _finish_times(config: ParallelConfig, stats: RankStats, t_pipe: float, c: float) -> list[float]:
    """When each chunk finishes its last backward (the drain runs from the last chunk to chunk 0)."""
    p, v, m = config.pp, config.virtual_stages, config.num_microbatches
    n = p * v
    pre = stats.chunk_bwd_prefix
    if config.schedule is ScheduleName.CHIMERA:
        return [t_pipe] * n  # both replicas of a chunk reduce together once both are done
    if v > 1:
        out = []
        for k in range(n):
            r, local = k % p, k // p
            b = pre[k + 1] - pre[k]
            # Chunk `local` of rank r drains one round of min(m, p) micro-batches after the next.
            out.append(t_pipe - min(pre[k] + k * c, local * min(m, p) * b + r * (b + c)))
        return out
    return [t_pipe - pre[k] - k * c for k in range(n)]


def estimate(config: ParallelConfig, inputs: PipelineInputs) -> Estimate:
    """Iteration time, bubble, exposed communication and memory of one candidate."""
    st = inputs.stats
    p, v, m = config.pp, config.virtual_stages, config.num_microbatches
    c = inputs.p2p_s if p > 1 else 0.0
    t_pipe = pipeline_time_s(config, st, c, inputs.p2p_sharing)

    # Gradient reduction: each rank's communication stream reduces its chunks in the order they
    # finish; with overlap, only what outlasts the pipeline is exposed.
    finish = _finish_times(config, st, t_pipe, c)
    exposed_reduce = 0.0
    for r in range(p):
        ks = range(r + (v - 1) * p, r - 1, -p)  # chunks of rank r, last-finishing last
        if inputs.overlap_grad_reduce:
            t = 0.0
            for k in ks:
                t = max(t, finish[k]) + inputs.grad_reduce_s[k]
            end = max(t, t_pipe)
        else:
            end = t_pipe + sum(inputs.grad_reduce_s[k] for k in ks)
        end += sum(inputs.param_gather_s[k] for k in ks)
        exposed_reduce = max(exposed_reduce, end - t_pipe + inputs.optimizer_s[r])
    opt = max(inputs.optimizer_s)
    iteration = t_pipe + exposed_reduce + inputs.step_wait_s

    # Idle = iteration - busy, busy = compute and the optimizer step (the simulator's definition).
    busy = [m * (f + b) + o for f, b, o in zip(st.fwd, st.bwd, inputs.optimizer_s, strict=True)]
    if config.schedule is ScheduleName.CHIMERA:
        busy = [
            m * (st.fwd[r] + st.bwd[r] + st.fwd[p - 1 - r] + st.bwd[p - 1 - r]) / 2 + inputs.optimizer_s[r]
            for r in range(p)
        ]
    bubble = sum(max(0.0, iteration - b) for b in busy) / (p * iteration) if iteration > 0 else 0.0
    exposed_comm = m * max(st.tp_comm) + 2 * (p * v - 1) * c + exposed_reduce - opt

    memory = memory_by_rank(config, st, inputs.extra_static_bytes)
    return Estimate(
        iteration_time_s=iteration,
        pipeline_time_s=t_pipe,
        bubble_fraction=min(1.0, max(0.0, bubble)),
        exposed_comm_s=max(0.0, exposed_comm),
        exposed_grad_reduce_s=max(0.0, exposed_reduce - opt),
        optimizer_s=opt,
        memory_by_rank=memory,
    )


def chimera_extra_bytes(config: ParallelConfig, stats: RankStats) -> tuple[float, ...]:
    """Chimera: each rank also holds the mirrored stage (p-1-r) of the second model replica."""
    if config.schedule is not ScheduleName.CHIMERA:
        return ()
    p = config.pp
    return tuple(stats.static[p - 1 - r] for r in range(p))


def memory_by_rank(
    config: ParallelConfig, stats: RankStats, extra_static_bytes: Sequence[float] = ()
) -> tuple[float, ...]:
    """Peak bytes on each pipeline rank: static state plus the activations it holds at peak."""
    p, v = config.pp, config.virtual_stages
    held = inflight_per_chunk(config)
    extra = extra_static_bytes or (0.0,) * p
    act = stats.activation
    if config.schedule is ScheduleName.CHIMERA:
        act = tuple((act[r] + act[p - 1 - r]) / 2 for r in range(p))  # held over both chunks
    # A backward starts while the rank holds its peak of activations, and rebuilds one layer's
    # working set on top of them (the recomputed activations under recomputation).
    transient = stats.transient or (0.0,) * p
    memory = [
        extra[r] + stats.static[r] + transient[r] + sum(held[k] * act[k] for k in range(r, p * v, p)) for r in range(p)
    ]
    if config.schedule is ScheduleName.PIPEDREAM:
        # Weight stashing: stage s keeps one weight version per in-flight micro-batch.
        memory = [mem + (held[r] - 1) * stats.weight[r] for r, mem in enumerate(memory)]
    elif config.schedule is ScheduleName.PIPEDREAM_2BW:
        memory = [mem + stats.weight[r] for r, mem in enumerate(memory)]
    return tuple(memory)


def ideal_time_s(config: ParallelConfig, stats: RankStats) -> float:
    """Busiest rank's compute with no bubble and no exposed communication."""
    return config.num_microbatches * max(f + b for f, b in zip(stats.fwd, stats.bwd, strict=True))

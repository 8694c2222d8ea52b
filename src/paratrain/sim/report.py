"""From a run of the engine to the report: iteration time, bubbles, memory, throughput, MFU.

Definitions
-----------
* iteration time — synchronous schedules: from the first action to the last rank's finish (flush
  included). Asynchronous schedules (PipeDream, 2BW) have no flush; they are generated over
  ``K ≥ 3`` batches and the iteration time is the steady-state period: on each rank, the time from
  the end of batch 0's last backward to the end of batch ``K-2``'s, divided by ``K-2`` (mean over
  ranks), which leaves out the one-time fill and drain.
* bubble fraction — mean over ranks of idle time / iteration time, idle = iteration − busy, busy =
  compute actions and optimizer steps (communication that does not overlap counts as idle).
* memory per rank — weights, gradients and optimizer state of every chunk the rank holds (both
  replicas under Chimera), the extra weight versions an asynchronous schedule stashes, and the peak
  activation bytes of in-flight micro-batches (from a forward to the ``B`` or ``W`` that frees it).
* MFU — model matmul FLOPs per iteration (:func:`paratrain.cost.flops.model_flops_per_iteration`,
  no recomputation) / (iteration time × GPUs × peak dense FLOP/s of the dtype); HFU adds the
  recomputed matmuls.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from typing import TYPE_CHECKING, Any

from paratrain.cost.optimizer import OPTIMIZERS
from paratrain.cost.types import ChunkCost
from paratrain.errors import ConfigError
from paratrain.parallel.config import prefetch_receives_on
from paratrain.schedule.compiled import hosts_of
from paratrain.schedule.ir import ActionKind, Schedule
from paratrain.schedule.validate import inflight_and_versions
from paratrain.sim.engine import CommRecord, SimRun, TraceEvent, run_schedule
from paratrain.sim.timing import Timing, uniform_timing

if TYPE_CHECKING:
    from paratrain.parallel.config import ParallelConfig
    from paratrain.spec.cluster import ClusterSpec
    from paratrain.spec.model import ModelSpec

__all__ = ["MemoryBreakdown", "SimResult", "simulate", "simulate_config", "timing_for_config", "memory_by_rank"]

K = ActionKind


@dataclass(frozen=True)
class MemoryBreakdown:
    weight_bytes: int
    grad_bytes: int
    optimizer_bytes: int
    stashed_weight_bytes: int  # extra weight versions of asynchronous schedules
    activation_bytes: int  # peak over the iteration (incl. a backward's recomputed layer)
    fp8_weight_cache_bytes: int = 0  # Transformer Engine's cached FP8 weights (ChunkCost.fp8_cache_bytes)

    @property
    def total_bytes(self) -> int:
        return (
            self.weight_bytes
            + self.grad_bytes
            + self.optimizer_bytes
            + self.stashed_weight_bytes
            + self.activation_bytes
            + self.fp8_weight_cache_bytes
        )

    def to_dict(self) -> dict[str, int]:
        return {
            "weight_bytes": self.weight_bytes,
            "grad_bytes": self.grad_bytes,
            "optimizer_bytes": self.optimizer_bytes,
            "stashed_weight_bytes": self.stashed_weight_bytes,
            "activation_bytes": self.activation_bytes,
            "fp8_weight_cache_bytes": self.fp8_weight_cache_bytes,
            "total_bytes": self.total_bytes,
        }


@dataclass(frozen=True)
class SimResult:
    schedule: str
    stages: int
    microbatches: int
    iteration_time_s: float
    busy_s_by_rank: tuple[float, ...]
    idle_s_by_rank: tuple[float, ...]
    bubble_fraction: float
    peak_inflight_by_rank: tuple[int, ...]
    weight_versions_by_rank: tuple[int, ...]
    comm_time_by_kind: dict[str, float]
    events: tuple[TraceEvent, ...] = field(repr=False)
    comm_log: tuple[CommRecord, ...] = field(repr=False)
    actions: int = 0
    memory: tuple[MemoryBreakdown, ...] | None = None
    samples_per_s: float | None = None
    tokens_per_s: float | None = None
    tflops_per_gpu: float | None = None
    mfu: float | None = None
    hfu: float | None = None
    # variable durations (paratrain.sim.variability): the statistics above are means over samples
    samples: int = 0
    duration_cv: float = 0.0
    iteration_time_std_s: float | None = None
    nominal_iteration_time_s: float | None = None  # every action at its mean duration

    @property
    def peak_memory_bytes(self) -> int | None:
        return max(m.total_bytes for m in self.memory) if self.memory else None

    @property
    def memory_by_rank(self) -> list[int] | None:
        return [m.total_bytes for m in self.memory] if self.memory else None

    def to_dict(self, *, comm_log: bool = False) -> dict[str, Any]:
        d: dict[str, Any] = {
            "schedule": self.schedule,
            "stages": self.stages,
            "microbatches": self.microbatches,
            "iteration_time_s": self.iteration_time_s,
            "tokens_per_s": self.tokens_per_s,
            "samples_per_s": self.samples_per_s,
            "tflops_per_gpu": self.tflops_per_gpu,
            "mfu": self.mfu,
            "hfu": self.hfu,
            "bubble_fraction": self.bubble_fraction,
            "peak_memory_bytes": self.peak_memory_bytes,
            "memory_by_rank": self.memory_by_rank,
            "memory_breakdown_by_rank": [m.to_dict() for m in self.memory] if self.memory else None,
            "comm_time_by_kind": dict(self.comm_time_by_kind),
            "busy_s_by_rank": list(self.busy_s_by_rank),
            "idle_s_by_rank": list(self.idle_s_by_rank),
            "peak_inflight_by_rank": list(self.peak_inflight_by_rank),
            "weight_versions_by_rank": list(self.weight_versions_by_rank),
            "duration_cv": self.duration_cv,
            "samples": self.samples,
            "iteration_time_std_s": self.iteration_time_std_s,
            "nominal_iteration_time_s": self.nominal_iteration_time_s,
        }
        if comm_log:
            d["comm_log"] = [
                {"kind": c.kind, "bytes": c.bytes, "group": list(c.group), "start_s": c.start_s, "time_s": c.time_s}
                for c in self.comm_log
            ]
        return d


def _iteration(schedule: Schedule, run: SimRun) -> tuple[float, list[float], list[float]]:
    """(iteration time, busy per rank, idle per rank) as defined in the module docstring."""
    k = schedule.iterations
    p = schedule.stages
    if k < 3:
        it = max(run.finish_s) / k
        busy = [b / k for b in run.busy_s]
        return it, busy, [max(0.0, it - b) for b in busy]  # clip float rounding
    lo = [run.batch_end_s[r][0] for r in range(p)]
    hi = [run.batch_end_s[r][k - 2] for r in range(p)]
    win_busy = [0.0] * p
    for e in run.events:
        if e.stream == "compute" and lo[e.rank] <= e.start_s < hi[e.rank]:
            win_busy[e.rank] += e.duration_s
    periods = [(hi[r] - lo[r]) / (k - 2) for r in range(p)]
    it = sum(periods) / p
    busy = [b / (k - 2) for b in win_busy]
    return it, busy, [max(0.0, it - b) for b in busy]  # clip float rounding


def _inflight(schedule: Schedule) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Peak in-flight micro-batches and live weight versions per rank, without the validator's checks."""
    if schedule.weight_versions > 1:
        return inflight_and_versions(schedule)
    peaks = []
    f, freeing = K.FORWARD, (K.BACKWARD, K.BACKWARD_WEIGHT)
    for row in schedule.actions:
        cur = peak = 0
        for a in row:
            k = a.kind
            if k is f:
                cur += 1
                if cur > peak:
                    peak = cur
            elif k in freeing:
                cur -= 1
        peaks.append(peak)
    return tuple(peaks), (1,) * schedule.stages


def memory_by_rank(schedule: Schedule, costs: Sequence[ChunkCost]) -> tuple[MemoryBreakdown, ...]:
    """Memory of every pipeline rank (see the module docstring); order-based, no timing needed."""
    _, versions = _inflight(schedule)
    out = []
    for r, row in enumerate(schedule.actions):
        held = schedule.chunks_of(r)
        w = sum(costs[c].weight_bytes for c, _ in held)
        cur = peak = 0
        for a in row:
            k = a.kind
            if k is K.FORWARD:
                cur += costs[a.chunk].activation_bytes
                peak = max(peak, cur)
            elif k is K.BACKWARD or k is K.BACKWARD_INPUT:
                # recomputed activations of one layer live only during this backward
                peak = max(peak, cur + getattr(costs[a.chunk], "transient_bytes", 0))
            if k is K.BACKWARD or k is K.BACKWARD_WEIGHT:
                cur -= costs[a.chunk].activation_bytes
        out.append(
            MemoryBreakdown(
                weight_bytes=w,
                grad_bytes=sum(costs[c].grad_bytes for c, _ in held),
                optimizer_bytes=sum(costs[c].optimizer_bytes for c, _ in held),
                stashed_weight_bytes=(versions[r] - 1) * w,
                activation_bytes=peak,
                fp8_weight_cache_bytes=sum(costs[c].fp8_cache_bytes for c, _ in held),
            )
        )
    return tuple(out)


def simulate(
    schedule: Schedule,
    timing: Timing | None = None,
    *,
    overlap_grad_reduce: bool = True,
    record: bool = True,
    forward: float = 1.0,
    backward: float = 2.0,
) -> SimResult:
    """Simulate ``schedule``; without ``timing``, with uniform durations ``forward``/``backward``
    and free communication."""
    if timing is None:
        timing = uniform_timing(schedule, forward, backward)
    record = record or schedule.iterations >= 3  # the steady-state window needs the events
    run = run_schedule(schedule, timing, overlap_grad_reduce=overlap_grad_reduce, record=record)
    it, busy, idle = _iteration(schedule, run)
    inflight, versions = _inflight(schedule)
    return SimResult(
        schedule=schedule.name,
        stages=schedule.stages,
        microbatches=schedule.microbatches,
        iteration_time_s=it,
        busy_s_by_rank=tuple(busy),
        idle_s_by_rank=tuple(idle),
        bubble_fraction=sum(i / it for i in idle) / len(idle) if it > 0 else 0.0,
        peak_inflight_by_rank=inflight,
        weight_versions_by_rank=versions,
        comm_time_by_kind={
            k: v / schedule.iterations for k, v in run.comm_time_by_kind.items()
        },  # mean per batch, fill and drain included
        events=run.events,
        comm_log=run.comm_log,
        actions=run.actions,
    )


def timing_for_config(
    schedule: Schedule, costs: Sequence[ChunkCost], cluster: ClusterSpec, config: ParallelConfig,
    *, optimizer: str = "fused", grad_buckets: bool = False, skew_cv: float | None = None,
) -> Timing:
    """Durations from the cost model; communication timed between the ranks' places on ``cluster``.

    Gradients are reduced in fp32 when training in bf16 (:func:`paratrain.cost.dp_reduction.grad_reduce_bytes`).
    ``grad_buckets``: each chunk's reduction runs in Megatron-Core's buckets during the chunk's last
    backward and the distributed optimizer's all-gather ahead of its first forward, so only what
    :func:`~paratrain.cost.dp_reduction.bucketed_exposed_s` leaves is charged after the backward;
    the compute the hidden part slows (:func:`~paratrain.cost.dp_reduction.overlapped_s`) is added
    to the rank's step. ``skew_cv``: per-rank compute-time variation behind the wait for the slowest
    rank at the step's all-reduce over every rank (:func:`~paratrain.cost.dp_reduction.skew_s` of
    the busiest stage's compute, added to ``step_allreduce_s``; synchronous schedules only); default
    :func:`~paratrain.cost.dp_reduction.default_skew_cv` (1 % for the accelerator presets, none where
    the simulator draws durations around a measured variation).

    ``optimizer`` is how the optimizer step is implemented: ``fused`` (one pass: read the
    gradients, read and write the optimizer state, write the weights) or ``torch`` (PyTorch's
    AdamW with ``foreach=False`` and global-norm clipping, as ``paratrain train`` runs them: a
    pass per element-wise kernel, fp32 state). Synchronous schedules clip by the norm of the
    whole model, so every optimizer step waits for all ranks and all-reduces one scalar
    (``Timing.step_allreduce_s``); asynchronous ones reduce the norm only within their stage's
    data/tensor-parallel group, at the same time on every member (added to the step)."""
    if optimizer not in OPTIMIZERS:
        raise ConfigError("optimizer", f"unknown optimizer implementation {optimizer!r}",
                          f"use one of: {', '.join(OPTIMIZERS)}")
    from paratrain.cost.collectives import collective_time
    from paratrain.cost.compute import dtype_bytes
    from paratrain.cost.dp_reduction import (
        bucketed_exposed_s,
        default_overlap_slowdown,
        default_skew_cv,
        grad_reduce_bytes,
        megatron_bucket_elements,
        num_buckets,
        overlapped_s,
        skew_s,
    )
    from paratrain.cost.optimizer import optimizer_step_s
    from paratrain.sim.sharing import layout_sharing

    if len(costs) != schedule.num_chunks:
        raise ConfigError("costs", f"{len(costs)} chunk costs for {schedule.num_chunks} chunks", "give one per chunk")

    def grank(r: int) -> int:
        return config.rank_of(pp=r)

    memo: dict[tuple[int, int, int], float] = {}

    def p2p_s(src: int, dst: int, c: int) -> float:
        key = (src, dst, c)
        t = memo.get(key)
        if t is None:
            t = memo[key] = (collective_time("p2p", costs[c].p2p_bytes, (grank(src), grank(dst)), cluster).time_s
                             + costs[c].p2p_gather_s)
        return t

    def p2p_link(r: int, peer: int) -> object:
        """The GPU's NIC for a transfer to another node (one per GPU on the DGX presets: concurrent
        ones share it, cost.link_sharing); a transfer inside the node has its peer's link alone."""
        a, b = grank(r), grank(peer)
        return "nic" if cluster.node_of(a) != cluster.node_of(b) else ("node", b)

    def buckets(cost: ChunkCost) -> int:
        elements = cost.grad_reduce_bytes / dtype_bytes(config.dtype)
        return num_buckets(elements, megatron_bucket_elements(config.dp * config.cp))

    slowed = [0.0] * len(costs)  # compute lost beside each chunk's bucketed collectives

    def hidden(c: int, compute_s: float, comm_s: float, k: int) -> float:
        """The exposed tail of a bucketed collective; what it hides slows the compute beside it."""
        exposed = bucketed_exposed_s(compute_s, comm_s, k)
        slowed[c] += overlapped_s(compute_s, comm_s - exposed, default_overlap_slowdown(cluster.device)) - compute_s
        return exposed

    groups = []
    reduce_s = []
    for c, cost in enumerate(costs):
        hosts = hosts_of(schedule, c)
        # Gradients are reduced over the data- and context-parallel ranks together (Megatron's dp-cp group).
        ranks = tuple(config.rank_of(pp=h, dp=d, cp=k) for h in hosts for d in range(config.dp)
                      for k in range(config.cp))
        groups.append(ranks)
        if len(ranks) == 1:
            reduce_s.append(0.0)
        elif config.sharding in ("zero2", "zero3"):
            # FSDP: every micro-batch's backward reduce-scatters (in the chunk costs), and the next
            # forward gathers the updated shards; nothing is left for the step's end
            reduce_s.append(0.0)
        elif config.optimizer_sharding:
            # ZeRO-1: reduce-scatter the gradients, all-gather the updated parameters
            rs = collective_time("reduce_scatter", grad_reduce_bytes(cost.grad_reduce_bytes, config.dtype), ranks,
                                 cluster).time_s
            ag = collective_time("all_gather", cost.weight_bytes, ranks, cluster).time_s
            if grad_buckets:
                k = buckets(cost)
                rs, ag = hidden(c, cost.backward_s, rs, k), hidden(c, cost.forward_s, ag, k)
            reduce_s.append(rs + ag)
        elif config.compression != "none":  # sparse or low-rank reduction (cost.compress)
            from paratrain.cost.compress import compressed_reduce_s
            from paratrain.cost.compute import dtype_bytes

            reduce_s.append(compressed_reduce_s(config.compression, config.compression_density,
                                                cost.grad_reduce_bytes, dtype_bytes(config.dtype), ranks, cluster))
        else:
            ar = collective_time("all_reduce", grad_reduce_bytes(cost.grad_reduce_bytes, config.dtype), ranks,
                                 cluster).time_s
            reduce_s.append(hidden(c, cost.backward_s, ar, buckets(cost)) if grad_buckets else ar)

    def step_s(r: int) -> float:
        held = [costs[c] for c, _ in schedule.chunks_of(r)]
        return optimizer_step_s(
            sum(k.weight_bytes for k in held), sum(k.grad_bytes for k in held), sum(k.optimizer_bytes for k in held),
            cluster.device, optimizer=optimizer, dtype=config.dtype,
        )

    world = tuple(range(config.world_size))
    norm_s = collective_time("all_reduce", 4, world, cluster).time_s
    if config.schedule.is_async:
        stage = tuple(config.rank_of(dp=d, tp=k, cp=c) for d in range(config.dp) for k in range(config.tp)
                      for c in range(config.cp))
        stage_norm_s = collective_time("all_reduce", 4, stage, cluster).time_s
    else:
        stage_norm_s = 0.0
    if skew_cv is None:
        skew_cv = default_skew_cv(cluster.device)
    m = schedule.microbatches

    # The step's all-reduce over every rank starts when the slowest arrives (sync schedules).
    busiest = max(m * sum(costs[c].forward_s + costs[c].backward_s for c, _ in schedule.chunks_of(r))
                  for r in range(schedule.stages))
    norm_s += skew_s(busiest, config.world_size, skew_cv)

    def lost_s(r: int) -> float:  # compute the rank lost beside its overlapped gradient buckets
        return sum(slowed[c] for c, _ in schedule.chunks_of(r))

    opt = tuple(step_s(r) + stage_norm_s + lost_s(r) for r in range(schedule.stages))
    return Timing(
        forward_s=tuple(c.forward_s for c in costs),
        backward_s=tuple(c.backward_s for c in costs),
        input_s=tuple(c.recompute_s + c.backward_input_s for c in costs),
        weight_s=tuple(c.backward_weight_s for c in costs),
        p2p_s=p2p_s,
        reduce_s=tuple(reduce_s),
        optimizer_s=opt,
        p2p_bytes=tuple(c.p2p_bytes for c in costs),
        reduce_bytes=tuple(c.grad_reduce_bytes for c in costs),
        tp_comm_s=tuple(c.tp_comm_s for c in costs),
        cp_comm_s=tuple(c.cp_comm_s for c in costs) if config.cp > 1 else (),
        fsdp_comm_s=tuple(c.fsdp_comm_s for c in costs) if config.sharding in ("zero2", "zero3") else (),
        reduce_kind="fsdp" if config.sharding in ("zero2", "zero3")
        else "reduce_scatter+all_gather" if config.optimizer_sharding
        else config.compression if config.compression != "none" else "all_reduce",
        global_rank=grank,
        p2p_link=p2p_link,
        reduce_groups=tuple(groups),
        tp_groups=tuple(tuple(config.rank_of(pp=r, tp=k) for k in range(config.tp)) for r in range(schedule.stages)),
        step_allreduce_s=None if config.schedule.is_async else norm_s,
        core_sharing=layout_sharing(cluster, config),
        forward_wait_s=tuple(c.forward_wait_s for c in costs),
        backward_wait_s=tuple(c.backward_wait_s for c in costs),
        prefetch_receives=prefetch_receives_on(config, gloo=cluster.trains_with_gloo),
    )


def simulate_config(
    model: ModelSpec,
    cluster: ClusterSpec,
    config: ParallelConfig,
    *,
    overlap_grad_reduce: bool = True,
    record: bool = False,
    optimizer: str = "fused",
    duration_cv: float | None = None,
    samples: int | None = None,
    seed: int = 0,
) -> SimResult:
    """Simulate one iteration of ``config`` (what the planner calls). ``record=True`` keeps the
    trace events and the per-operation communication log; ``optimizer`` as in
    :func:`timing_for_config`. Action durations vary with coefficient ``duration_cv`` (default:
    the device's ``duration_cv``; 0 for the GPU presets), averaged over ``samples`` draws (default
    :data:`paratrain.sim.variability.DEFAULT_SAMPLES` when the variation is not 0)."""
    from paratrain.cost.flops import matmul_flops_per_iteration, model_flops_per_iteration
    from paratrain.cost.stage import chunk_costs
    from paratrain.cost.throughput import throughput
    from paratrain.sim.variability import DEFAULT_SAMPLES, simulate_variable

    config.validate_for(model, even_layers=config.partition is None)
    if config.world_size > cluster.num_devices:
        raise ConfigError(
            "cluster.gpus",
            f"{config.degrees_text} = {config.world_size} exceeds the cluster's "
            f"{cluster.num_devices} devices",
            "use a larger cluster (more GPUs or nodes) or smaller dp, tp or pp",
        )
    schedule = _generate_cached(config.schedule.value, config.pp, config.num_microbatches, config.virtual_stages)
    costs = chunk_costs(model, cluster, config)
    cv = cluster.device.duration_cv if duration_cv is None else duration_cv
    res = simulate_variable(
        schedule,
        timing_for_config(schedule, costs, cluster, config, optimizer=optimizer, grad_buckets=overlap_grad_reduce),
        cv,
        samples=(DEFAULT_SAMPLES if cv > 0 else 0) if samples is None else samples,
        seed=seed,
        overlap_grad_reduce=overlap_grad_reduce,
        record=record,
    )
    it = res.iteration_time_s
    gb = config.global_batch
    assert gb is not None
    rates = throughput(
        model, cluster.device, config, it, model_flops_per_iteration(model, gb),
        matmul_flops_per_iteration(model, gb, config.recompute),
    )
    return _with(
        res,
        memory=memory_by_rank(schedule, costs),
        samples_per_s=rates.samples_per_s,
        tokens_per_s=rates.tokens_per_s,
        tflops_per_gpu=rates.tflops_per_gpu,
        mfu=rates.mfu,
        hfu=rates.hfu,
    )


@lru_cache(maxsize=256)
def _generate_cached(name: str, stages: int, microbatches: int, virtual_stages: int) -> Schedule:
    """Schedules are immutable and a planner sweep asks for the same few many times."""
    from paratrain.schedule.registry import generate

    return generate(name, stages=stages, microbatches=microbatches, virtual_stages=virtual_stages)


def _with(res: SimResult, **kw: Any) -> SimResult:
    import dataclasses

    return dataclasses.replace(res, **kw)

"""Find the fastest memory-feasible configuration.

Two speeds: closed forms (:mod:`paratrain.plan.analytic`) rank every candidate of the search
space (:mod:`paratrain.plan.space`); the best are re-partitioned with the balancing partitioner
(:mod:`paratrain.plan.partition`) and the discrete-event simulator confirms the top ``confirm``.
The winner is the fastest candidate the simulator found memory-feasible.

Pruning: micro-batch sizes are walked upward and the walk stops at the first that runs out of
memory (activation memory only grows with the micro-batch); chunk costs are cached on what they
depend on, so the schedule and mesh-order variants of one layout share them.
"""

from __future__ import annotations

import heapq
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from paratrain.cost.compute import resolve_attention
from paratrain.cost.stage import partial_grad_accumulation
from paratrain.cost.throughput import throughput
from paratrain.cost.types import ChunkCost
from paratrain.errors import ConfigError, require_at_most
from paratrain.parallel.config import MAX_GLOBAL_BATCH, MAX_MICROBATCHES, ParallelConfig, Recompute, ScheduleName
from paratrain.plan.analytic import (
    Estimate,
    RankStats,
    chimera_extra_bytes,
    estimate,
    ideal_time_s,
    inflight_per_chunk,
    memory_by_rank,
)
from paratrain.plan.backend import CostBackend, PlanCache, default_backend, pipeline_inputs
from paratrain.plan.partition import LayerCost, partition_fast
from paratrain.plan.space import (
    CP_MIN_SEQ,
    Pins,
    Rejections,
    layouts,
    microbatches,
    schedule_rule_ok,
    variants,
)
from paratrain.spec.cluster import ClusterSpec
from paratrain.spec.model import ModelSpec

if TYPE_CHECKING:
    from paratrain.sim.report import SimResult

__all__ = ["CONFIRM_BUDGET_ACTIONS", "Candidate", "PlanResult", "plan", "evaluate", "Metrics", "simulated_actions"]

# The confirming simulations' budget in schedule actions (:func:`simulated_actions`). The simulator
# takes about 20–40 µs per action on a 2-core x86-64 VM (GPT-3 175B on 1,024 A100: 768 to 12,288
# actions, 16–280 ms; on 64 A100, 1,536 micro-batches of an interleaved 16-stage pipeline: 295k
# actions, ~6 s), so this is some 10–15 s there; only pipelines of thousands of micro-batch passes
# reach it.
CONFIRM_BUDGET_ACTIONS = 500_000

Progress = Callable[[int, int], None]


@dataclass(frozen=True)
class Metrics:
    """Throughput figures of one prediction (the interface keys other tools read)."""

    iteration_time_s: float
    tokens_per_s: float
    samples_per_s: float
    tflops_per_gpu: float
    mfu: float
    bubble_fraction: float
    peak_memory_bytes: float
    exposed_comm_s: float

    @classmethod
    def of(
        cls,
        model: ModelSpec,
        cluster: ClusterSpec,
        config: ParallelConfig,
        flops: float,
        t_s: float,
        bubble: float,
        peak: float,
        exposed: float,
    ) -> Metrics:
        """The figures of one iteration of ``t_s`` seconds doing ``flops`` model FLOPs."""
        rates = throughput(model, cluster.device, config, t_s, flops)
        return cls(
            iteration_time_s=t_s,
            tokens_per_s=rates.tokens_per_s,
            samples_per_s=rates.samples_per_s,
            tflops_per_gpu=rates.tflops_per_gpu,
            mfu=rates.mfu,
            bubble_fraction=bubble,
            peak_memory_bytes=peak,
            exposed_comm_s=exposed,
        )


@dataclass(frozen=True)
class Candidate:
    """One evaluated configuration: the analytic estimate and, for the top ones, the simulation."""

    config: ParallelConfig
    estimate: Estimate
    analytic: Metrics
    simulated: SimResult | None = None
    simulated_metrics: Metrics | None = None

    @property
    def metrics(self) -> Metrics:
        """The simulator's figures where it ran, the closed forms' otherwise."""
        return self.simulated_metrics or self.analytic

    @property
    def source(self) -> str:
        return "sim" if self.simulated is not None else "analytic"


@dataclass(frozen=True)
class PlanResult:
    ranked: tuple[Candidate, ...]  # best first
    evaluated: int  # candidates whose full closed form was computed (the others were pruned)
    memory_checked: int  # candidates whose memory was computed
    considered: int  # candidates in the search space, rejected ones included
    rejected: dict[str, int]
    search_time_s: float
    capacity_bytes: float

    @property
    def winner(self) -> Candidate:
        return self.ranked[0]


def _cost_key(config: ParallelConfig, cluster: ClusterSpec) -> tuple[object, ...]:
    # Chunk costs do not depend on the schedule, nor on the mesh order while tensor-parallel
    # groups stay inside one node.
    tp_inner = config.mesh_order[-1] == "tp" and config.tp <= cluster.devices_per_node
    return (
        "chunks",
        config.dp,
        config.tp,
        config.pp,
        config.cp,
        config.virtual_stages,
        config.microbatch,
        config.recompute,
        config.sequence_parallel,
        config.sharding,
        config.partition,
        config.dtype,
        config.attention,
        config.gemm_dtype,
        config.tp_overlap,
        config.fp8_weight_cache and config.num_microbatches,  # cached FP8 weights: one cast per step
        partial_grad_accumulation(config),  # partial norm gradients reduced once per step
        None if tp_inner else config.mesh_order,
        config.schedule is ScheduleName.ZB_H1,
    )


def _chunks(
    model: ModelSpec, cluster: ClusterSpec, config: ParallelConfig, backend: CostBackend
) -> Sequence[ChunkCost]:
    cache = backend.cache.scoped(model, cluster).chunks
    key = _cost_key(config, cluster)
    hit = cache.get(key)
    if hit is None:
        hit = cache[key] = tuple(backend.chunk_costs(model, cluster, config))
    return hit


def _stats(model: ModelSpec, cluster: ClusterSpec, config: ParallelConfig, backend: CostBackend) -> RankStats:
    cache = backend.cache.scoped(model, cluster).stats
    key = _cost_key(config, cluster)
    hit = cache.get(key)
    if hit is None:
        hit = cache[key] = RankStats.of(_chunks(model, cluster, config, backend), config.pp)
    return hit


def evaluate(
    model: ModelSpec,
    cluster: ClusterSpec,
    config: ParallelConfig,
    backend: CostBackend,
    flops: float,
    *,
    overlap_grad_reduce: bool = True,
) -> Candidate:
    """Analytic estimate of one configuration."""
    key = (_cost_key(config, cluster), config.mesh_order, config.schedule is ScheduleName.CHIMERA, overlap_grad_reduce)
    inputs = backend.cache.scoped(model, cluster).inputs.get(key)
    if inputs is None:
        chunks = _chunks(model, cluster, config, backend)
        inputs = pipeline_inputs(
            model,
            cluster,
            config,
            chunks,
            backend,
            overlap_grad_reduce=overlap_grad_reduce,
            stats=_stats(model, cluster, config, backend),
        )
        backend.cache.inputs[key] = inputs
    est = estimate(config, inputs)
    metrics = Metrics.of(
        model,
        cluster,
        config,
        flops,
        est.iteration_time_s,
        est.bubble_fraction,
        est.peak_memory_bytes,
        est.exposed_comm_s,
    )
    return Candidate(config=config, estimate=est, analytic=metrics)


def _even_partition(model: ModelSpec, config: ParallelConfig) -> tuple[int, ...] | None:
    """``None`` when the chunks split the layers evenly, else the near-even split made explicit."""
    if model.layers % config.num_chunks == 0:
        return None
    return config.layers_per_chunk(model.layers)


def _layer_list(
    model: ModelSpec, cluster: ClusterSpec, config: ParallelConfig, backend: CostBackend
) -> list[LayerCost]:
    """Per-layer costs (embedding folded into the first layer, the head into the last) measured
    by probing the cost model with one-layer end chunks."""
    n, layers = config.num_chunks, model.layers

    def probe(part: tuple[int, ...]) -> Sequence[ChunkCost]:
        return _chunks(model, cluster, replace(config, partition=part), backend)

    def cost(ck: ChunkCost) -> tuple[float, float, float]:
        return ck.forward_s + ck.backward_s, float(ck.static_bytes), float(ck.activation_bytes)

    if n >= 3:
        middle = [1] + [0] * (n - 2) + [1]
        for i in range(layers - 2):
            middle[1 + i % (n - 2)] += 1
        ck = probe(tuple(middle))
        per = tuple(x / middle[1] for x in cost(ck[1]))
        first, last = cost(ck[0]), cost(ck[-1])
    else:  # two chunks: the difference of two probes isolates one layer
        a, b = probe((1, layers - 1)), probe((2, layers - 2))
        per = tuple(y - x for x, y in zip(cost(a[0]), cost(b[0]), strict=True))
        first = cost(a[0])
        last = tuple(x - (layers - 2) * y for x, y in zip(cost(a[1]), per, strict=True))
    return [LayerCost(*first)] + [LayerCost(*per)] * (layers - 2) + [LayerCost(*last)]


def _balanced(
    model: ModelSpec,
    cluster: ClusterSpec,
    cand: Candidate,
    backend: CostBackend,
    capacity: float,
    flops: float,
    overlap: bool,
) -> Candidate:
    """The candidate with the time-balancing partition, if that is faster and fits."""
    config = cand.config
    # Interleaved chunks stay equal: with unequal chunks the ranks' turns stop lining up and the
    # closed form no longer holds, so only one chunk per rank is re-balanced.
    if config.num_chunks < 2 or model.layers < 3 or config.virtual_stages > 1:
        return cand
    units = _layer_list(model, cluster, config, backend)
    # The budget covers static state and held activations; the full memory model (with the
    # backward's transient working set) re-checks the result below.
    part = partition_fast(units, config.num_chunks, memory_budget_bytes=capacity, inflight=inflight_per_chunk(config))
    if part is None or part.layers == config.layers_per_chunk(model.layers):
        return cand
    trial = evaluate(
        model, cluster, replace(config, partition=part.layers), backend, flops, overlap_grad_reduce=overlap
    )
    if (
        trial.estimate.peak_memory_bytes <= capacity
        and trial.analytic.iteration_time_s < cand.analytic.iteration_time_s
    ):
        return trial
    return cand


def simulated_actions(config: ParallelConfig) -> int:
    """Compute actions in the schedule one pipeline runs: every chunk's forward and backward of every
    micro-batch, and ZB-H1's separate weight gradients (what a simulation's time grows with)."""
    per_microbatch = 3 if config.schedule is ScheduleName.ZB_H1 else 2
    return per_microbatch * config.num_chunks * config.num_microbatches


def _simulated(
    model: ModelSpec, cluster: ClusterSpec, cand: Candidate, backend: CostBackend, flops: float, overlap: bool
) -> Candidate:
    assert backend.simulate is not None
    res = backend.simulate(model, cluster, cand.config, overlap_grad_reduce=overlap)
    peak = res.peak_memory_bytes
    assert peak is not None  # simulate_config always reports memory
    # The simulator reports communication time by kind, not what of it was hidden: the exposed
    # share stays the closed forms'.
    m = Metrics.of(
        model, cluster, cand.config, flops, res.iteration_time_s, res.bubble_fraction, peak,
        cand.analytic.exposed_comm_s,
    )
    return replace(cand, simulated=res, simulated_metrics=m)


def plan(
    model: ModelSpec,
    cluster: ClusterSpec,
    global_batch: int,
    *,
    pins: Pins | None = None,
    top: int = 10,
    confirm: int = 5,
    refine: int = 30,
    backend: CostBackend | None = None,
    progress: Progress | None = None,
    memory_limit_bytes: float | None = None,
    overlap_grad_reduce: bool = True,
    confirm_budget_actions: int | None = None,
    with_cp: bool | None = None,
) -> PlanResult:
    """Search the configurations of ``model`` on all of ``cluster``'s devices.

    ``with_cp``: search every context-parallel degree (True), or only the pruned set of long
    sequences (None: :func:`paratrain.plan.space.layouts`; when nothing fits the search is repeated
    with every degree).

    ``confirm_budget_actions``: how many schedule actions (:func:`simulated_actions`) the
    confirming simulations may take together (default :data:`CONFIRM_BUDGET_ACTIONS`); the first
    candidate is always simulated.

    Raises:
        ConfigError: no configuration divides the batch, or none fits in memory (the message says
            how much memory the leanest configuration needs and the smallest GPU count that fits).
    """
    start = time.perf_counter()
    pins = pins or Pins()
    # Cached costs are valid for one model and cluster: every search starts a fresh cache.
    backend = replace(backend or default_backend(), cache=PlanCache())
    if not isinstance(global_batch, int) or global_batch <= 0:
        raise ConfigError("global_batch", f"must be a positive integer, got {global_batch!r}", "e.g. 512")
    require_at_most("global_batch", global_batch, MAX_GLOBAL_BATCH, "samples per iteration")
    if pins.partition is not None and sum(pins.partition) != model.layers:
        raise ConfigError(
            "partition",
            f"sums to {sum(pins.partition)} layers, {model.name} has {model.layers}",
            "give layer counts that add up to the model's layers",
        )
    # Default: what the device leaves to tensors after its context, buffers and fragmentation.
    capacity = float(memory_limit_bytes or cluster.device.usable_memory_bytes)
    flops = backend.model_flops(model, global_batch)
    rejected = Rejections()
    flash = resolve_attention(pins.attention, cluster.device) == "flash"
    grid: list[tuple[list[int], list[ParallelConfig]]] = []
    for lay in layouts(model, cluster, global_batch, pins, rejected, with_cp=with_cp):
        mbs = microbatches(global_batch, lay, pins, rejected)
        cfgs = list(variants(model, global_batch, lay, pins, mbs[0], flash=flash)) if mbs else []
        if cfgs:
            grid.append((mbs, cfgs))
    total = sum(len(m) * len(v) for m, v in grid)
    considered = total + sum(rejected.counts.values())
    if not grid:
        _no_layout(model, cluster, global_batch, pins, rejected)

    done = 0
    keep = max(refine, confirm, top)
    best: list[tuple[float, int, Candidate]] = []  # max-heap (negated time) of the `keep` fastest
    leanest: tuple[float, ParallelConfig] | None = None
    feasible: list[tuple[float, int, ParallelConfig]] = []
    n_memory = n_evaluated = 0
    for mbs, cfgs in grid:
        for cfg in cfgs:
            for i, mb in enumerate(mbs):
                done += 1
                if progress is not None and done % 512 == 0:
                    progress(done, total)
                m = global_batch // (cfg.dp * mb)
                if not schedule_rule_ok(cfg.schedule, cfg.pp, cfg.virtual_stages, m):
                    rejected.add("schedule_rule")
                    continue
                if pins.partition is not None and len(pins.partition) != cfg.num_chunks:
                    rejected.add("partition_mismatch")
                    continue
                config = cfg if mb == cfg.microbatch else replace(cfg, microbatch=mb)
                if pins.partition is not None:
                    config = replace(config, partition=pins.partition)
                elif (part := _even_partition(model, config)) is not None:
                    config = replace(config, partition=part)
                st = _stats(model, cluster, config, backend)
                n_memory += 1
                peak = max(memory_by_rank(config, st, chimera_extra_bytes(config, st)))
                if peak > capacity:
                    if leanest is None or peak < leanest[0]:
                        leanest = (peak, config)
                    # Larger micro-batches hold more activations: they cannot fit either.
                    rejected.add("out_of_memory", len(mbs) - i)
                    done += len(mbs) - i - 1
                    break
                feasible.append((ideal_time_s(config, st), done, config))
    # Branch and bound: no schedule beats the busiest rank's compute. Evaluate in order of that
    # bound and stop once it exceeds the slowest of the `keep` best found.
    feasible.sort(key=lambda x: (x[0], x[1]))
    for j, (bound, _, config) in enumerate(feasible):
        if len(best) >= keep and bound >= -best[0][0]:
            rejected.add("slower_than_top", len(feasible) - j)
            break
        cand = evaluate(model, cluster, config, backend, flops, overlap_grad_reduce=overlap_grad_reduce)
        n_evaluated += 1
        item = (-cand.analytic.iteration_time_s, j, cand)
        if len(best) < keep:
            heapq.heappush(best, item)
        elif item > best[0]:
            heapq.heapreplace(best, item)
    if progress is not None:
        progress(total, total)
    results = [c for _, _, c in sorted(best, reverse=True)]
    evaluated = n_evaluated
    if not results and with_cp is None and pins.cp is None:
        # Nothing fits: context parallelism divides the activations by cp, so search every degree
        # (short sequences included, rings across nodes included).
        return plan(model, cluster, global_batch, pins=pins, top=top, confirm=confirm, refine=refine,
                    backend=backend, progress=progress, memory_limit_bytes=memory_limit_bytes,
                    overlap_grad_reduce=overlap_grad_reduce, confirm_budget_actions=confirm_budget_actions,
                    with_cp=True)
    if not results:
        _nothing_fits(model, cluster, global_batch, rejected, leanest, capacity)

    results.sort(key=lambda c: c.analytic.iteration_time_s)
    head = results[:keep]
    if pins.partition is None:
        head = [_balanced(model, cluster, c, backend, capacity, flops, overlap_grad_reduce) for c in head]
        head.sort(key=lambda c: c.analytic.iteration_time_s)
    head = _distinct(head)
    confirmed: list[Candidate] = []
    rest = list(head)
    if backend.simulate is not None:
        tried = 0
        queue = list(rest)
        rest = []
        budget = CONFIRM_BUDGET_ACTIONS if confirm_budget_actions is None else confirm_budget_actions
        spent = 0
        while queue and len(confirmed) < confirm and tried < 4 * confirm:
            # A simulation's cost grows with its schedule's actions; the budget counts those, not
            # seconds, so the same command picks the same winner on any machine and at any load.
            cost = simulated_actions(queue[0].config)
            if confirmed and spent + cost > budget:
                break
            spent += cost
            cand = queue.pop(0)
            tried += 1
            sim = _simulated(model, cluster, cand, backend, flops, overlap_grad_reduce)
            if sim.simulated_metrics is not None and sim.simulated_metrics.peak_memory_bytes > capacity:
                rejected.add("simulator_out_of_memory")
                continue
            confirmed.append(sim)
        rest = queue
        if not confirmed:
            _nothing_fits(model, cluster, global_batch, rejected, leanest, capacity)
    confirmed.sort(key=lambda c: c.metrics.iteration_time_s)
    ranked = tuple(_distinct(confirmed + rest))[: max(top, len(confirmed))]
    return PlanResult(
        ranked=ranked,
        evaluated=evaluated,
        memory_checked=n_memory,
        considered=considered,
        rejected=dict(rejected.counts),
        search_time_s=time.perf_counter() - start,
        capacity_bytes=capacity,
    )


def _distinct(cands: list[Candidate]) -> list[Candidate]:
    """Drop candidates that differ from a better one only in mesh order and predict the same:
    the ranking should show different choices, not the same one twice."""
    seen: set[tuple[object, ...]] = set()
    out = []
    for c in cands:
        cfg = c.config
        key = (
            replace(cfg, mesh_order=("pp", "dp", "tp")),
            round(c.metrics.iteration_time_s, 9),
            round(c.metrics.peak_memory_bytes),
        )
        if key in seen:
            continue
        seen.add(key)
        out.append(c)
    return out


def _no_layout(model: ModelSpec, cluster: ClusterSpec, global_batch: int, pins: Pins, rejected: Rejections) -> None:
    counts = rejected.counts
    world = cluster.num_devices
    if counts.get("batch_indivisible"):
        raise ConfigError(
            "global_batch",
            f"no dp × micro-batch of {world} GPUs divides the global batch {global_batch}"
            + (f" with micro-batch {pins.microbatch}" if pins.microbatch else ""),
            "use a global batch with more factors of two (e.g. a multiple of the GPU count)",
        )
    pinned = [(n, getattr(pins, n)) for n in ("dp", "tp", "pp", "cp") if getattr(pins, n) is not None]
    product = math.prod(v for _, v in pinned)
    every = len(pinned) == 4 or (len(pinned) == 3 and pins.cp is None and model.seq < CP_MIN_SEQ)
    if (every and product != world) or world % product:
        shown = "*".join(f"{n}({v})" for n, v in pinned)
        raise ConfigError(pinned[-1][0], f"{shown} = {product} does not fit {world} GPUs",
                          f"pin degrees whose product divides {world} (all three: equals it)")
    if set(counts) == {"too_many_microbatches"}:
        raise ConfigError(
            "global_batch",
            f"every split of the global batch {global_batch:,} on {world} GPUs gives more micro-batches per"
            f" pipeline than the limit of {MAX_MICROBATCHES:,}",
            "use more GPUs, a smaller global batch or a larger micro-batch",
        )
    reasons = ", ".join(f"{k}: {v}" for k, v in sorted(counts.items())) or "the pins exclude every layout"
    raise ConfigError(
        "cluster.gpus",
        f"no dp × tp × pp layout of {world} GPUs fits {model.name} ({reasons})",
        "change the pinned degrees or the GPU count",
    )


def _nothing_fits(
    model: ModelSpec,
    cluster: ClusterSpec,
    global_batch: int,
    rejected: Rejections,
    leanest: tuple[float, ParallelConfig] | None,
    capacity: float,
) -> None:
    if rejected.counts.get("out_of_memory") or rejected.counts.get("simulator_out_of_memory"):
        need = leanest[0] if leanest is not None else float("nan")
        hint = _smallest_fitting_gpus(model, cluster, global_batch, capacity)
        fix = f"use at least {hint} GPUs" if hint else "use devices with more memory"
        raise ConfigError(
            "cluster.gpus",
            f"{model.name} fits no configuration on {cluster.num_devices} × {cluster.device.name}: the leanest needs"
            f" {need / 2**30:.1f} GiB per GPU, {capacity / 2**30:.1f} GiB are usable"
            f" ({cluster.device.memory_bytes / 2**30:.0f} GiB device)",
            fix,
        )
    reasons = ", ".join(f"{k}: {v}" for k, v in sorted(rejected.counts.items()))
    if rejected.counts.get("partition_mismatch"):
        raise ConfigError(
            "partition",
            f"no candidate has as many chunks as the pinned partition ({reasons})",
            "pin pp (and virtual_stages) so that pp × virtual_stages is the partition's length",
        )
    raise ConfigError(
        "schedule",
        f"no candidate satisfies the schedules' rules ({reasons})",
        "pin another schedule or change the global batch",
    )


def _smallest_fitting_gpus(model: ModelSpec, cluster: ClusterSpec, global_batch: int, capacity: float) -> int | None:
    """Double the GPU count until the leanest layout (full recomputation, sharded optimizer state,
    micro-batch 1, 1F1B) fits; a memory-only check, so cheap."""
    backend = default_backend()
    gpus = cluster.num_devices
    for _ in range(12):
        gpus *= 2
        try:
            big = cluster.resized(gpus=gpus)
        except ConfigError:
            return None
        pins = Pins(microbatch=1, recompute=Recompute.FULL, sharding="zero3", schedule=ScheduleName.ONE_F_ONE_B)
        rej = Rejections()
        for lay in layouts(model, big, global_batch, pins, rej):
            if global_batch % lay.dp:
                continue
            for config in variants(model, global_batch, lay, pins, 1):
                part = _even_partition(model, config)
                config = replace(config, partition=part) if part else config
                st = _stats(model, big, config, backend)
                if max(memory_by_rank(config, st, chimera_extra_bytes(config, st))) <= capacity:
                    return gpus
    return None

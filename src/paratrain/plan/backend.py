"""What the planner asks of the cost model and the simulator, behind one replaceable object.

Tests inject fake cost functions through :class:`CostBackend`; the default binds
:mod:`paratrain.cost` and :mod:`paratrain.sim`. This module also turns chunk costs into the
inputs of the closed forms (:class:`~paratrain.plan.analytic.PipelineInputs`), with the
communication times looked up for the ranks each group actually occupies.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from paratrain.cost.optimizer import optimizer_step_s
from paratrain.cost.types import ChunkCost, CollectiveCost
from paratrain.parallel.config import ParallelConfig, ScheduleName
from paratrain.plan.analytic import PipelineInputs, RankStats, chimera_extra_bytes
from paratrain.spec.cluster import ClusterSpec
from paratrain.spec.device import DeviceSpec
from paratrain.spec.model import ModelSpec

if TYPE_CHECKING:
    from paratrain.sim.report import SimResult

__all__ = [
    "ChunkCostsFn",
    "CollectiveFn",
    "CostBackend",
    "ModelFlopsFn",
    "OptimizerTimeFn",
    "PlanCache",
    "Simulator",
    "default_backend",
    "dp_group",
    "pipeline_inputs",
]

ChunkCostsFn = Callable[[ModelSpec, ClusterSpec, ParallelConfig], Sequence[ChunkCost]]
# (kind, bytes, global ranks, cluster) -> cost, as paratrain.cost.collectives.collective_time
CollectiveFn = Callable[[str, float, tuple[int, ...], ClusterSpec], CollectiveCost]
ModelFlopsFn = Callable[[ModelSpec, int], float]
# (weight, gradient, optimizer-state bytes of a rank, its device) -> seconds of the step
OptimizerTimeFn = Callable[[float, float, float, DeviceSpec], float]


class Simulator(Protocol):
    """Simulates one iteration of a configuration, as :func:`paratrain.sim.simulate_config`."""

    def __call__(
        self, model: ModelSpec, cluster: ClusterSpec, config: ParallelConfig, *, overlap_grad_reduce: bool = ...
    ) -> SimResult: ...


@dataclass
class PlanCache:
    """Costs one search computes once and looks up many times, each keyed on what it depends on
    within one model and cluster: :meth:`scoped` empties them when asked for another."""

    chunks: dict[Hashable, tuple[ChunkCost, ...]] = field(default_factory=dict)
    stats: dict[Hashable, RankStats] = field(default_factory=dict)
    inputs: dict[Hashable, PipelineInputs] = field(default_factory=dict)
    collectives: dict[Hashable, float] = field(default_factory=dict)
    problem: tuple[ModelSpec, ClusterSpec] | None = None

    def scoped(self, model: ModelSpec, cluster: ClusterSpec) -> PlanCache:
        """The caches for ``model`` on ``cluster``, emptied first if they hold another problem's
        costs (their keys leave both out: one backend reused for two models would otherwise
        return the first model's costs for the second)."""
        held = self.problem
        if held is None or not ((held[0] is model or held[0] == model) and (held[1] is cluster or held[1] == cluster)):
            for cache in (self.chunks, self.stats, self.inputs, self.collectives):
                cache.clear()
            self.problem = (model, cluster)
        return self


@dataclass(frozen=True)
class CostBackend:
    """The functions the planner calls. ``simulate`` may be ``None`` (analytic ranking only)."""

    chunk_costs: ChunkCostsFn
    collective_time: CollectiveFn
    model_flops: ModelFlopsFn
    simulate: Simulator | None = None
    optimizer_time: OptimizerTimeFn = optimizer_step_s
    cache: PlanCache = field(default_factory=PlanCache, compare=False, repr=False)


def default_backend(*, simulate: bool = True) -> CostBackend:
    """The real cost model and, with ``simulate``, the simulator."""
    from paratrain.cost.collectives import collective_time
    from paratrain.cost.flops import model_flops_per_iteration
    from paratrain.cost.stage import chunk_costs

    simulator: Simulator | None = None
    if simulate:
        from paratrain.sim import simulate_config

        simulator = simulate_config
    return CostBackend(
        chunk_costs=chunk_costs,
        collective_time=collective_time,
        model_flops=model_flops_per_iteration,
        simulate=simulator,
    )


def dp_group(config: ParallelConfig, stage: int) -> tuple[int, ...]:
    """Global ranks of the data-parallel group of pipeline rank ``stage`` (tensor rank 0).

    Ranks are mixed-radix numbers over ``mesh_order`` (outermost first), so the group is an
    arithmetic progression with the data-parallel axis's stride.
    """
    if config.cp > 1:
        # Parameters are replicated over cp too: gradients reduce over the dp-cp group (Megatron-LM).
        return tuple(config.rank_of(pp=stage, dp=d, cp=k) for d in range(config.dp) for k in range(config.cp))
    stride = 1
    for axis in reversed(config.mesh_order):
        if axis == "dp":
            break
        stride *= config.axis_size(axis)
    base = config.rank_of(pp=stage)
    return tuple(range(base, base + config.dp * stride, stride))


def _collective(backend: CostBackend, cluster: ClusterSpec, kind: str, nbytes: float, ranks: tuple[int, ...]) -> float:
    if len(ranks) <= 1 or nbytes <= 0:
        return 0.0
    # (a dp-cp group need not be an arithmetic progression: its last rank tells such groups apart)
    key = ("coll", kind, int(nbytes), ranks if len(ranks) <= 2 else (len(ranks), ranks[0], ranks[1], ranks[-1]))
    cache = backend.cache.collectives
    hit = cache.get(key)
    if hit is None:
        hit = cache[key] = backend.collective_time(kind, nbytes, ranks, cluster).time_s
    return hit


def pipeline_inputs(
    model: ModelSpec,
    cluster: ClusterSpec,
    config: ParallelConfig,
    chunks: Sequence[ChunkCost],
    backend: CostBackend,
    *,
    overlap_grad_reduce: bool = True,
    stats: RankStats | None = None,
) -> PipelineInputs:
    """Communication and optimizer times of one candidate, from its chunk costs.

    Every stage's data-parallel group is a shifted copy of stage 0's (ranks are a mixed-radix
    number over the mesh axes), so it occupies the nodes the same way and costs the same; stage
    0's group is costed for all.
    """
    backend.cache.scoped(model, cluster)  # the collective times below are cached per cluster
    p, v = config.pp, config.virtual_stages
    n = p * v
    p2p = 0.0
    sharing = 1
    if p > 1:
        # The slowest neighbour pair sets the pace: a pair on two nodes whenever there is one.
        pairs = [(config.rank_of(pp=s), config.rank_of(pp=s + 1)) for s in range(min(p - 1, 2))]
        pairs.sort(key=lambda pr: cluster.node_of(pr[0]) == cluster.node_of(pr[1]))
        p2p = _collective(backend, cluster, "p2p", chunks[0].p2p_bytes, pairs[0]) + chunks[0].p2p_gather_s
        # The interleaved steady state receives from both neighbours in one batch: through the
        # GPU's one NIC when both are on other nodes (cost.link_sharing, as the simulator shares it).
        if all(cluster.node_of(a) != cluster.node_of(b) for a, b in pairs):
            sharing = 2
    group = dp_group(config, 0)
    if config.schedule is ScheduleName.CHIMERA and p > 1:
        # The two replicas' copies of a stage live on ranks r and p-1-r: their data-parallel
        # groups reduce together.
        group = tuple(sorted(group + dp_group(config, p - 1)))
    # Under optimizer-state sharding the reduction is a reduce-scatter of the gradients and an
    # all-gather of the updated parameters (ZeRO-1, Rajbhandari et al. 2020), both on the
    # communication stream.
    from paratrain.cost.dp_reduction import default_skew_cv, grad_reduce_bytes, skew_s

    grad = []
    for ck in chunks:
        reduced = grad_reduce_bytes(ck.grad_reduce_bytes, config.dtype)  # bf16 gradients reduce in fp32
        if config.sharding in ("zero2", "zero3"):
            t = 0.0  # FSDP reduce-scatters inside every micro-batch's backward (in the chunk costs)
        elif config.optimizer_sharding:
            t = _collective(backend, cluster, "reduce_scatter", reduced, group) + _collective(
                backend, cluster, "all_gather", ck.weight_bytes, group
            )
        elif config.compression != "none" and len(group) > 1:  # sparse or low-rank (cost.compress)
            from paratrain.cost.compress import compressed_reduce_s
            from paratrain.cost.compute import dtype_bytes

            t = compressed_reduce_s(config.compression, config.compression_density, ck.grad_reduce_bytes,
                                    dtype_bytes(config.dtype), group, cluster)
        else:
            t = _collective(backend, cluster, "all_reduce", reduced, group)
        grad.append(t)
    gather = [0.0] * n
    st = stats if stats is not None else RankStats.of(chunks, p)
    opt = [backend.optimizer_time(st.weight[r], st.grad[r], st.optimizer[r], cluster.device) for r in range(p)]
    extra = chimera_extra_bytes(config, st)
    if extra:
        opt = [o + opt[p - 1 - r] for r, o in enumerate(opt)]
    # The step waits for the slowest of all ranks, as the simulator charges it (sync schedules).
    cv = 0.0 if config.schedule.is_async else default_skew_cv(cluster.device)
    wait = skew_s(config.num_microbatches * max(f + b for f, b in zip(st.fwd, st.bwd, strict=True)),
                  config.world_size, cv)
    return PipelineInputs(
        stats=st,
        p2p_s=p2p,
        grad_reduce_s=tuple(grad),
        param_gather_s=tuple(gather),
        optimizer_s=tuple(opt),
        overlap_grad_reduce=overlap_grad_reduce,
        extra_static_bytes=extra,
        step_wait_s=wait,
        p2p_sharing=sharing,
    )

"""The search space: every way to lay a model out on a cluster, with any dimension pinned.

Dimensions: data × tensor × pipeline parallel degrees (a factorization of the GPU count; tensor
parallelism as Megatron's column/row placements, with or without sequence parallelism),
micro-batch size, pipeline schedule and its virtual stages, recomputation, optimizer-state
sharding and the order of mesh axes on the nodes. Candidates that cannot run are counted by
reason instead of being silently dropped.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field

from paratrain.errors import ConfigError, require_positive_int
from paratrain.parallel.config import (
    MAX_MICROBATCHES,
    SHARDINGS,
    ParallelConfig,
    Recompute,
    ScheduleName,
    check_fp8_weight_cache,
    check_prefetch_receives,
    check_tp_overlap_name,
    mesh_order_of,
    sharding_level,
)
from paratrain.schedule.registry import rule_violation
from paratrain.spec.cluster import ClusterSpec
from paratrain.spec.model import ModelSpec

__all__ = [
    "Pins",
    "Layout",
    "Rejections",
    "DEFAULT_SCHEDULES",
    "REASONS",
    "CP_MIN_SEQ",
    "divisors",
    "layouts",
    "schedule_rule_ok",
    "variants",
]

# The sharding levels train runs with FSDP2 (--dp-impl fsdp).
FSDP_LEVELS = ("zero2", "zero3")

# Synchronous schedules searched by default. The asynchronous ones (PipeDream, 2BW) change the
# optimizer's semantics (stale weights), so they are considered only when asked for by name.
DEFAULT_SCHEDULES = (
    ScheduleName.ONE_F_ONE_B,
    ScheduleName.INTERLEAVED,
    ScheduleName.GPIPE,
    ScheduleName.ZB_H1,
    ScheduleName.CHIMERA,
)

# Context parallelism is searched from this sequence length on (Megatron-LM enables it for long
# contexts: Llama 3 405B trained at 8K with cp 1 and extended to 128K with cp 16, Dubey et al. 2024,
# sec. 3.3.2 / table 4); below it, only when no layout without it fits in memory (search.plan).
CP_MIN_SEQ = 4096
MAX_SEARCHED_CP = 16  # larger rings leave the node and hide less of their transfers
# Pruning (lifted when nothing fits): the ring stays inside a node with the tensor-parallel group
# (tp·cp ≤ GPUs per node, Megatron's placement of cp next to tp), and each rank keeps at least this
# many tokens, so that a block's attention (∝ (s/cp)²) can hide its K/V transfer (∝ s/cp). A search
# heuristic, not a measured threshold.
CP_MIN_TOKENS_PER_RANK = 2048

# Rejection reasons, in the order the table prints them.
REASONS = {
    "tp_indivisible": "tp does not divide heads / kv-heads / FFN",
    "pp_exceeds_layers": "more pipeline chunks than layers",
    "batch_indivisible": "global batch not divisible by dp × micro-batch",
    "too_many_microbatches": f"more micro-batches per pipeline than the limit ({MAX_MICROBATCHES:,})",
    "schedule_rule": "schedule's rule on stages / micro-batches violated",
    "tp_crosses_nodes": "tensor parallel group larger than a node",
    "cp_indivisible": "2 × cp does not divide the sequence",
    "partition_mismatch": "pinned partition has another number of chunks",
    "out_of_memory": "peak memory above usable device memory",
    "slower_than_top": "busiest rank's compute alone slower than the best found",
    "simulator_out_of_memory": "simulator found peak memory above usable device memory",
}


def divisors(n: int) -> list[int]:
    small = [d for d in range(1, int(n**0.5) + 1) if n % d == 0]
    return sorted(set(small + [n // d for d in small]))


@dataclass(frozen=True)
class Pins:
    """Dimensions fixed by the user; ``None`` means searched."""

    dp: int | None = None
    tp: int | None = None
    pp: int | None = None
    microbatch: int | None = None
    schedule: ScheduleName | None = None
    virtual_stages: int | None = None
    recompute: Recompute | None = None
    sequence_parallel: bool | None = None
    optimizer_sharding: bool | None = None  # the former flag: True pins the legacy level (zero2)
    sharding: str | None = None  # a level of SHARDINGS; None: every level where dp > 1
    # context-parallel degree; None: searched where the sequence is long (CP_MIN_SEQ) or memory needs it
    cp: int | None = None
    mesh_order: tuple[str, ...] | None = None
    partition: tuple[int, ...] | None = None
    schedules: tuple[ScheduleName, ...] = DEFAULT_SCHEDULES
    max_microbatch: int = 32
    max_virtual_stages: int = 16
    tp_across_nodes: bool = False  # allow tensor-parallel groups that leave the node
    attention: str | None = None  # flash or math; None: what the device runs
    gemm_dtype: str | None = None  # fp8 / fp8-delayed: FP8 linear layers (ParallelConfig.gemm_dtype)
    fp8_weight_cache: bool = False  # ParallelConfig.fp8_weight_cache: FP8 weights cast once per step
    # ParallelConfig.tp_overlap: every candidate with tp > 1 runs it, with sequence parallelism
    tp_overlap: str = "none"
    # ParallelConfig.prefetch_receives: every candidate with pp > 1 runs it; None: the backend's default
    prefetch_receives: int | None = None
    # gradient reductions weighed against each other where dp > 1 (ParallelConfig.compression)
    compressions: tuple[str, ...] = ("none",)
    compression_density: float = 0.01

    def __post_init__(self) -> None:
        check_fp8_weight_cache(self.fp8_weight_cache, self.gemm_dtype)
        check_prefetch_receives(self.prefetch_receives)
        check_tp_overlap_name(self.tp_overlap)
        if self.tp_overlap != "none" and self.sequence_parallel is False:
            raise ConfigError("tp_overlap", f"{self.tp_overlap} overlap splits sequence parallelism's collectives, "
                              "and sequence parallelism is pinned off", "drop --no-sequence-parallel or --tp-overlap")
        if self.sharding is not None:
            object.__setattr__(self, "sharding", sharding_level(self.sharding))
        elif self.optimizer_sharding is not None:
            object.__setattr__(self, "sharding", sharding_level(self.optimizer_sharding, "optimizer_sharding"))
        if self.schedule is not None:
            object.__setattr__(self, "schedule", ScheduleName(self.schedule))
        if self.recompute is not None:
            object.__setattr__(self, "recompute", Recompute(self.recompute))
        if self.mesh_order is not None:
            object.__setattr__(self, "mesh_order", mesh_order_of(self.mesh_order))
        # A pinned degree of 0 would divide the GPU count by zero in the search, a negative one
        # would exclude every layout and be reported as if the GPU count were at fault.
        for name in ("dp", "tp", "pp", "cp", "microbatch", "virtual_stages"):
            value = getattr(self, name)
            if value is not None:
                require_positive_int(name, value)
        if (self.schedule is not None and self.schedule.is_async and self.sharding in FSDP_LEVELS
                and (self.pp is None or self.pp > 1)):
            raise ConfigError("sharding", f"{self.sharding} is FSDP2, which does not run {self.schedule}'s weight "
                              "versions (train refuses the pair)", "use --sharding zero1 or none, or a "
                              "synchronous schedule")
        if (
            self.virtual_stages is not None
            and self.virtual_stages > 1
            and self.schedule not in (None, ScheduleName.INTERLEAVED)
        ):
            raise ConfigError(
                "virtual_stages",
                f"{self.virtual_stages} virtual stages need the interleaved schedule",
                "pin the interleaved schedule or leave the virtual stages unpinned",
            )


@dataclass(frozen=True)
class Layout:
    """A factorization of the GPU count."""

    dp: int
    tp: int
    pp: int
    cp: int = 1


@dataclass
class Rejections:
    counts: Counter[str] = field(default_factory=Counter)

    def add(self, reason: str, n: int = 1) -> None:
        if n:
            self.counts[reason] += n


def _cps(model: ModelSpec, rest: int, pins: Pins, with_cp: bool | None) -> list[int]:
    """Context-parallel degrees dividing ``rest`` GPUs: the pinned one, else 1 and, for long
    sequences (or ``with_cp``), the degrees up to :data:`MAX_SEARCHED_CP`."""
    if pins.cp is not None:
        return [pins.cp] if rest % pins.cp == 0 else []
    if not (model.seq >= CP_MIN_SEQ if with_cp is None else with_cp):
        return [1]
    return [c for c in divisors(rest) if c <= MAX_SEARCHED_CP]


def layouts(
    model: ModelSpec, cluster: ClusterSpec, global_batch: int, pins: Pins, rejected: Rejections,
    *, with_cp: bool | None = None,
) -> list[Layout]:
    """Every dp × tp × pp × cp = GPU count that the model's shape allows, rejections counted.

    ``with_cp``: search context parallelism (default: for sequences of :data:`CP_MIN_SEQ` or more)."""
    world = cluster.num_devices
    for name in ("dp", "tp", "pp", "cp"):
        v = getattr(pins, name)
        if v is not None and world % v:
            raise ConfigError(name, f"{name}({v}) does not divide the {world} GPUs", f"pick a divisor of {world}")
    out = []
    splits = [(tp, pp, cp) for tp in divisors(world) for pp in divisors(world // tp)
              for cp in _cps(model, world // (tp * pp), pins, with_cp)]
    for tp, pp, cp in splits:
        dp = world // (tp * pp * cp)
        if pins.dp not in (None, dp) or pins.tp not in (None, tp) or pins.pp not in (None, pp):
            continue
        if cp > 1 and model.seq % (2 * cp):
            rejected.add("cp_indivisible")
            continue
        if cp > 1 and pins.cp is None and not with_cp and (
                tp * cp > cluster.devices_per_node or model.seq // cp < CP_MIN_TOKENS_PER_RANK):
            continue  # pruned (CP_MIN_TOKENS_PER_RANK): not a rejection, a choice of where to look
        kv = model.num_kv_heads
        if model.heads % tp or model.ffn_size % tp or (kv % tp and tp % kv):
            rejected.add("tp_indivisible")
            continue
        if tp > cluster.devices_per_node and not pins.tp_across_nodes and pins.tp is None:
            rejected.add("tp_crosses_nodes")
            continue
        if pp > model.layers:
            rejected.add("pp_exceeds_layers")
            continue
        if global_batch % dp:
            rejected.add("batch_indivisible")
            continue
        out.append(Layout(dp=dp, tp=tp, pp=pp, cp=cp))
    return out


def microbatches(global_batch: int, layout: Layout, pins: Pins, rejected: Rejections) -> list[int]:
    """Micro-batch sizes that divide each replica's share of the global batch, ascending; sizes
    giving more micro-batches per pipeline than :data:`MAX_MICROBATCHES` are dropped (counted)."""
    per_replica = global_batch // layout.dp
    if pins.microbatch is not None:
        if per_replica % pins.microbatch:
            rejected.add("batch_indivisible")
            return []
        if per_replica // pins.microbatch > MAX_MICROBATCHES:
            rejected.add("too_many_microbatches")
            return []
        return [pins.microbatch]
    sizes = [b for b in divisors(per_replica) if b <= pins.max_microbatch]
    kept = [b for b in sizes if per_replica // b <= MAX_MICROBATCHES]
    rejected.add("too_many_microbatches", len(sizes) - len(kept))
    return kept


def _schedule_options(model: ModelSpec, layout: Layout, pins: Pins) -> Iterator[tuple[ScheduleName, int]]:
    p = layout.pp
    scheds = (pins.schedule,) if pins.schedule is not None else pins.schedules
    for s in scheds:
        if p == 1 and pins.schedule is None and s is not ScheduleName.ONE_F_ONE_B:
            continue  # with one stage every schedule is the same; keep one
        if pins.virtual_stages is not None and (pins.virtual_stages > 1) != (s is ScheduleName.INTERLEAVED):
            continue  # a pinned chunk count decides between interleaving and the one-chunk schedules
        if s is ScheduleName.INTERLEAVED:
            if pins.virtual_stages is not None:
                if p * pins.virtual_stages <= model.layers:
                    yield s, pins.virtual_stages
                continue
            for v in range(2, pins.max_virtual_stages + 1):
                if p * v <= model.layers and model.layers % (p * v) == 0:
                    yield s, v
        else:
            yield s, 1


def schedule_rule_ok(schedule: ScheduleName, pp: int, virtual_stages: int, num_microbatches: int) -> bool:
    """Whether the schedule's generator accepts these counts (its own rule, from the papers):
    the planner keeps exactly what the simulator can build."""
    return rule_violation(schedule, stages=pp, microbatches=num_microbatches, virtual_stages=virtual_stages) is None


def _mesh_orders(layout: Layout, pins: Pins) -> list[tuple[str, ...]]:
    if pins.mesh_order is not None:
        return [pins.mesh_order]
    # Megatron's default keeps tensor parallel inside a node, data parallel next, stages outermost;
    # swapping dp and pp puts pipeline neighbours on adjacent nodes and spreads data-parallel
    # groups instead. Other orders move tensor parallelism off the node and are never faster.
    orders = [("pp", "dp", "tp")]
    if layout.dp > 1 and layout.pp > 1:
        orders.append(("dp", "pp", "tp"))
    return orders


def _bools(pinned: bool | None, allowed: bool) -> list[bool]:
    if pinned is not None:
        return [pinned]
    return [False, True] if allowed else [False]


def variants(
    model: ModelSpec, global_batch: int, layout: Layout, pins: Pins, microbatch: int = 1, *, flash: bool = False
) -> Iterator[ParallelConfig]:
    """The configurations of one layout at micro-batch size ``microbatch`` (the search walks
    micro-batch sizes upward from the smallest and stops at the first that runs out of memory).

    ``flash``: the candidates run fused attention, which never stores the ``s×s`` activations
    selective recomputation would recompute: selective equals no recomputation there and is not
    offered twice (unless pinned)."""
    recomputes = [pins.recompute] if pins.recompute is not None else [
        r for r in Recompute if not (flash and r is Recompute.SELECTIVE)]
    sps = _bools(pins.sequence_parallel, layout.tp > 1 and (model.seq // layout.cp) % layout.tp == 0)
    if pins.tp_overlap != "none" and layout.tp > 1:
        sps = [sp for sp in sps if sp]  # the overlap splits sequence parallelism's collectives
    # sharding spans the dp-cp group (parameters are replicated over cp)
    zeros = [pins.sharding] if pins.sharding is not None else list(SHARDINGS) if layout.dp * layout.cp > 1 else ["none"]
    for order in _mesh_orders(layout, pins):
        for sched, v in _schedule_options(model, layout, pins):
            for zero, comp in _reductions(zeros, pins.compressions, layout.dp, sched, layout.pp):
                for sp in sps:
                    for rc in recomputes:
                        yield ParallelConfig(
                            dp=layout.dp,
                            tp=layout.tp,
                            pp=layout.pp,
                            cp=layout.cp,
                            microbatch=microbatch,
                            global_batch=global_batch,
                            schedule=sched,
                            virtual_stages=v,
                            recompute=rc,
                            sequence_parallel=sp,
                            sharding=zero,
                            mesh_order=order,
                            dtype=model.dtype,
                            attention=pins.attention,
                            gemm_dtype=pins.gemm_dtype,
                            fp8_weight_cache=pins.fp8_weight_cache,
                            tp_overlap=pins.tp_overlap if layout.tp > 1 else "none",
                            prefetch_receives=pins.prefetch_receives if layout.pp > 1 else None,
                            compression=comp,
                            compression_density=pins.compression_density,
                        )


def _reductions(zeros: list[str], compressions: tuple[str, ...], dp: int,
                schedule: ScheduleName, pp: int = 1) -> list[tuple[str, str]]:
    """(sharding level, compression) pairs: compression needs dp > 1, no sharding (FSDP2
    reduces itself), a synchronous schedule, and gTop-k a power-of-two dp; FSDP2 (zero2, zero3)
    does not run PipeDream's or 2BW's weight versions (runtime.config.validate_run)."""
    out = []
    for zero in zeros:
        if zero in FSDP_LEVELS and schedule.is_async and pp > 1:
            continue
        for comp in compressions:
            gtopk_needs_pow2 = comp == "gtopk" and dp & (dp - 1)
            if comp != "none" and (zero != "none" or dp == 1 or schedule.is_async or gtopk_needs_pow2):
                continue
            out.append((zero, comp))
    return out

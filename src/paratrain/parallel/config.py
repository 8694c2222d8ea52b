"""The one configuration consumed by planner, simulator and runtime.

Mesh layout: ``mesh_order`` lists the mesh axes from outermost to innermost, as the dims of a
``torch.distributed`` DeviceMesh. The default ``("pp", "dp", "tp")`` makes tensor-parallel ranks
consecutive (inside one node when ``tp`` ≤ devices per node), then data parallel, with pipeline
stages outermost — Megatron-LM's default layout. Rank of mesh coordinate ``c`` is the row-major
index of ``c`` over the axes in ``mesh_order``.
"""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import TYPE_CHECKING, Any

from paratrain.errors import ConfigError, parse_enum, require_at_most, require_bool, require_positive_int

if TYPE_CHECKING:
    from paratrain.spec.model import ModelSpec

__all__ = [
    "AXES",
    "COMPRESSIONS",
    "MAX_GLOBAL_BATCH",
    "MAX_MICROBATCHES",
    "MAX_WORLD_SIZE",
    "ParallelConfig",
    "Recompute",
    "SHARDINGS",
    "TP_OVERLAPS",
    "GLOO_PREFETCH_RECEIVES",
    "check_fp8_weight_cache",
    "check_prefetch_receives",
    "check_tp_overlap_name",
    "prefetch_receives_on",
    "ScheduleName",
    "mesh_order_of",
    "sharding_level",
]

# Outermost first. Context parallelism ("cp") sits next to tensor parallelism, as in Megatron-LM's
# RankGenerator order "tp-cp-ep-dp-pp" (innermost first): tp, then cp, then dp, then pp.
AXES = ("pp", "dp", "cp", "tp")
_AXES_BEFORE_CP = ("pp", "dp", "tp")  # mesh orders written before the cp axis existed


def mesh_order_of(order: Any, field: str = "mesh_order") -> tuple[str, ...]:
    """``order`` checked as a permutation of :data:`AXES`; a 3-axis order of :data:`_AXES_BEFORE_CP`
    (config files and flags written before the cp axis) gets "cp" just outside "tp"."""
    if not isinstance(order, (list, tuple)):
        raise ConfigError(field, f"must be a list of axes, got {order!r}", "e.g. pp,dp,cp,tp")
    out = tuple(str(a) for a in order)
    if sorted(out) == sorted(_AXES_BEFORE_CP):
        i = out.index("tp")
        out = (*out[:i], "cp", *out[i:])
    if sorted(out) != sorted(AXES):
        raise ConfigError(field, f"must be a permutation of {AXES} (or of {_AXES_BEFORE_CP}), got {out}",
                          "e.g. pp,dp,cp,tp")
    return out

# Bounds far past real jobs (the largest published runs use ~10^5 GPUs and a few hundred
# micro-batches per pipeline); beyond them the simulator and the planner would run for hours on a
# typo such as ``--gpus 1e9`` or ``--global-batch 1000000000``.
MAX_WORLD_SIZE = 2**20  # devices
MAX_MICROBATCH = 2**20  # samples per micro-batch
MAX_MICROBATCHES = 2**14  # micro-batches per pipeline per iteration (GPT-1T in Megatron-LM: 512)
MAX_GLOBAL_BATCH = 2**24  # samples per iteration (GPT-3 175B trained at 1,536)


class ScheduleName(str, Enum):
    GPIPE = "gpipe"
    ONE_F_ONE_B = "1f1b"
    INTERLEAVED = "interleaved"
    CHIMERA = "chimera"
    PIPEDREAM = "pipedream"
    PIPEDREAM_2BW = "2bw"
    ZB_H1 = "zb-h1"

    def __str__(self) -> str:
        return self.value

    @property
    def is_async(self) -> bool:
        """Asynchronous schedules update weights without a pipeline flush."""
        return self in (ScheduleName.PIPEDREAM, ScheduleName.PIPEDREAM_2BW)


class Recompute(str, Enum):
    NONE = "none"
    SELECTIVE = "selective"  # attention core only (Korthikanti et al. 2022)
    FULL = "full"  # whole layer; only the layer input is kept

    def __str__(self) -> str:
        return self.value



# Gradient compressors (paratrain.runtime.compress; Ok-Topk, Li & Hoefler PPoPP'22, and its baselines).
COMPRESSIONS = ("none", "oktopk", "topka", "gtopk", "gaussiank", "powersgd")
# The ones compression_density applies to; powersgd is low-rank, with a fixed rank instead.
SPARSE_COMPRESSIONS = ("oktopk", "topka", "gtopk", "gaussiank")


# Sharded data parallelism over dp (Rajbhandari et al. 2020, "ZeRO", sec. 5; Zhao et al. 2023, "PyTorch
# FSDP", sec. 3): zero1 shards the optimizer state, zero2 the gradients too (FSDP2
# reshard_after_forward=False: parameters gathered from each forward to the end of its backward),
# zero3 the parameters too (reshard_after_forward=True; "fsdp" is its alias).
SHARDINGS = ("none", "zero1", "zero2", "zero3")
_SHARDING_ALIASES = {"fsdp": "zero3", "fullshard": "zero3", "shardgradop": "zero2"}  # FSDP1's names
# What ``optimizer_sharding: true`` meant before the levels existed: the runtime ran FSDP2 with
# reshard_after_forward=False, i.e. zero2.
LEGACY_OPTIMIZER_SHARDING = "zero2"


def sharding_level(value: Any, field: str = "sharding") -> str:
    """The level of :data:`SHARDINGS` that ``value`` names (a level, an alias, or a bool for the
    former ``optimizer_sharding`` flag); ConfigError otherwise."""
    if isinstance(value, bool):
        return LEGACY_OPTIMIZER_SHARDING if value else "none"
    if isinstance(value, str):
        v = value.strip().lower().replace("-", "").replace("_", "")  # ZeRO-3, zero_3, FULL_SHARD
        v = _SHARDING_ALIASES.get(v, v)
        if v in SHARDINGS:
            return v
    raise ConfigError(field, f"unknown sharding level {value!r}",
                      f"use one of: {', '.join(SHARDINGS)} (or fsdp = zero3)")


# How the tensor-parallel collectives meet their GEMMs (ParallelConfig.tp_overlap; cost.async_tp).
TP_OVERLAPS = ("none", "async", "userbuffers")


def check_fp8_weight_cache(cache: Any, gemm_dtype: str | None) -> None:
    """``fp8_weight_cache`` must be a boolean, and true only beside FP8 linear layers."""
    require_bool("fp8_weight_cache", cache)
    if cache and gemm_dtype is None:
        raise ConfigError("fp8_weight_cache", "caches the FP8 copies of the weights, and the linear layers run in "
                          "the training dtype", "add --gemm-dtype fp8 or fp8-delayed, or drop --fp8-weight-cache")


# Pipeline receives the runtime posts ahead per peer on gloo, which moves each message on its own;
# none on NCCL, whose p2p operations on one communicator run in order on one stream
# (runtime.pipeline_engine). ParallelConfig.prefetch_receives None means this backend default.
GLOO_PREFETCH_RECEIVES = 2
MAX_PREFETCH_RECEIVES = 64


def check_prefetch_receives(value: Any, field: str = "prefetch_receives") -> None:
    """None (the backend's default) or a whole number of receives, 0 to :data:`MAX_PREFETCH_RECEIVES`."""
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ConfigError(field, f"must be a whole number of at least 0, got {value!r}",
                          "use 0 (each receive posted at its action), 1 (Megatron-Core's overlap_p2p_comm) or 2")
    require_at_most(field, value, MAX_PREFETCH_RECEIVES, "receives posted ahead")


def prefetch_receives_on(config: ParallelConfig, *, gloo: bool) -> int:
    """The receives posted ahead that ``config`` runs with: its own figure, else the runtime's
    default for its backend (gloo, as on the ``cpu`` device, or NCCL)."""
    if config.prefetch_receives is not None:
        return config.prefetch_receives
    return GLOO_PREFETCH_RECEIVES if gloo else 0


def check_tp_overlap_name(value: Any, field: str = "tp_overlap") -> None:
    """A ConfigError unless ``value`` is one of :data:`TP_OVERLAPS`."""
    if value not in TP_OVERLAPS:
        raise ConfigError(field, f"unknown tensor-parallel overlap {value!r}", f"use one of: {', '.join(TP_OVERLAPS)}")

def _check_compression(config: ParallelConfig) -> None:
    if config.compression not in COMPRESSIONS:
        raise ConfigError("compression", f"unknown compressor {config.compression!r}",
                          f"use one of: {', '.join(COMPRESSIONS)}")
    d = config.compression_density
    if isinstance(d, bool) or not isinstance(d, (int, float)) or not 0 < d <= 1:
        raise ConfigError("compression_density", f"must lie in (0, 1], got {d!r}", "use e.g. 0.01 (1 %)")
    if config.compression != "none" and config.optimizer_sharding:
        raise ConfigError("compression", f"{config.compression} does not compose with optimizer sharding "
                          "(FSDP2 reduce-scatters the gradients itself)",
                          "use --no-optimizer-sharding or --compress none")


@dataclass(frozen=True)
class ParallelConfig:
    """How one training job is parallelized.

    ``global_batch`` is in samples (sequences); ``microbatch`` is the per-pipeline micro-batch
    size. Each data-parallel replica processes ``global_batch / dp`` samples per iteration as
    :attr:`num_microbatches` micro-batches.
    """

    dp: int = 1
    tp: int = 1
    pp: int = 1
    microbatch: int = 1
    global_batch: int | None = None  # defaults to dp × microbatch × pp (one micro-batch per stage)
    schedule: ScheduleName = ScheduleName.ONE_F_ONE_B
    virtual_stages: int = 1  # model chunks per pipeline rank (interleaved schedules)
    recompute: Recompute = Recompute.NONE
    sequence_parallel: bool = False
    # Whether anything is sharded over dp (sharding != "none"). Kept for configs written before the
    # levels: ``optimizer_sharding: true`` with no ``sharding`` means LEGACY_OPTIMIZER_SHARDING.
    optimizer_sharding: bool = False
    # Gradient reduction over dp: "none" (dense all-reduce) or a compressor of COMPRESSIONS, keeping
    # the fraction compression_density of the gradient (sparse ones; powersgd has a fixed rank).
    compression: str = "none"
    compression_density: float = 0.01
    mesh_order: tuple[str, ...] = AXES
    partition: tuple[int, ...] | None = None  # layers per model chunk; None = as even as possible
    dtype: str = "bf16"
    # Attention kernels the cost model charges: "flash" (fused) or "math" (explicit s×s kernels);
    # None = what the device runs by default (cost.compute.default_attention).
    attention: str | None = None
    # Input dtype of the transformer layers' linear GEMMs: None = the training dtype; "fp8" = FP8
    # GEMMs with per-tensor current scaling (torchao Float8, Transformer Engine's current scaling),
    # "fp8-delayed" with delayed scaling (Transformer Engine's default); attention, norms, the LM head
    # and the rest stay in the training dtype (cost.fp8: the cast passes).
    gemm_dtype: str | None = None
    # Transformer Engine's FP8 weight caching (its modules' ``is_first_microbatch``, which
    # Megatron-Core passes): the weights' scaling and cast to FP8 run on a step's first micro-batch
    # only and the later ones reuse the cached copies. Needs gemm_dtype (cost.fp8).
    fp8_weight_cache: bool = False
    # Context parallelism: each of ``cp`` ranks holds 1/cp of every sequence and runs ring attention
    # (cost.context_parallel); parameters are replicated over cp. Run by runtime.context_parallel.
    cp: int = 1
    # Sharded data parallelism, a level of SHARDINGS (see there).
    sharding: str = "none"
    # Tensor-parallel collectives overlapped with their GEMMs (cost.async_tp), a value of
    # TP_OVERLAPS: "async" = torch's async TP (torchtitan; the forward's), "userbuffers" =
    # Transformer Engine's (Megatron-Core's tp_comm_overlap; forward and backward). Priced by plan
    # and simulate; paratrain train does not run it.
    tp_overlap: str = "none"
    # Pipeline receives posted ahead of their action, per peer, so that a transfer runs while the
    # receiving rank still computes (runtime.pipeline_engine's prefetch; Megatron-Core's interleaved
    # overlap_p2p_comm is about 1). None: the runtime's default for the backend (prefetch_receives_on).
    prefetch_receives: int | None = None

    def __post_init__(self) -> None:
        for f in ("dp", "tp", "pp", "cp", "microbatch", "virtual_stages"):
            require_positive_int(f, getattr(self, f))
        for f in ("dp", "tp", "pp", "cp"):
            require_at_most(f, getattr(self, f), MAX_WORLD_SIZE, "devices")
        if self.world_size > MAX_WORLD_SIZE:
            raise ConfigError(
                "dp*tp*pp*cp",
                f"{self.degrees_text} = {self.world_size:,} devices exceed the limit of {MAX_WORLD_SIZE:,}",
                "use fewer devices",
            )
        if isinstance(self.attention, str):
            # Case-insensitive, as schedule, recompute and sharding are (parse_enum, sharding_level).
            object.__setattr__(self, "attention", self.attention.lower())
        if self.cp > 1 and self.attention == "math":
            raise ConfigError("cp", f"context parallelism (cp {self.cp}) runs ring attention on fused attention "
                              "kernels, not on explicit s×s ones", "use --attention flash or --cp 1")
        require_at_most("microbatch", self.microbatch, MAX_MICROBATCH, "samples per micro-batch")
        require_at_most("virtual_stages", self.virtual_stages, 1024, "model chunks per pipeline rank")
        if self.global_batch is None:
            object.__setattr__(self, "global_batch", self.dp * self.microbatch * self.pp)
        require_positive_int("global_batch", self.global_batch)
        require_at_most("global_batch", self.global_batch, MAX_GLOBAL_BATCH, "samples per iteration")
        for f in ("sequence_parallel", "optimizer_sharding"):
            require_bool(f, getattr(self, f))
        level = sharding_level(self.sharding)
        if level == "none" and self.optimizer_sharding:
            level = LEGACY_OPTIMIZER_SHARDING
        object.__setattr__(self, "sharding", level)
        object.__setattr__(self, "optimizer_sharding", level != "none")
        if self.attention is not None and self.attention not in ("flash", "math"):
            raise ConfigError("attention", f"unknown attention {self.attention!r}", "use flash or math")
        if self.gemm_dtype is not None and self.gemm_dtype not in ("fp8", "fp8-delayed"):
            raise ConfigError("gemm_dtype", f"unknown GEMM dtype {self.gemm_dtype!r}",
                              "use fp8 (current scaling) or fp8-delayed (delayed scaling); leave it out for the "
                              "training dtype")
        check_fp8_weight_cache(self.fp8_weight_cache, self.gemm_dtype)
        object.__setattr__(self, "schedule", parse_enum(ScheduleName, "schedule", self.schedule))
        object.__setattr__(self, "recompute", parse_enum(Recompute, "recompute", self.recompute))
        _check_compression(self)
        object.__setattr__(self, "mesh_order", mesh_order_of(self.mesh_order))
        if self.global_batch % (self.dp * self.microbatch):
            raise ConfigError(
                "global_batch",
                f"global batch {self.global_batch} is not divisible by dp({self.dp}) * microbatch({self.microbatch})"
                f" = {self.dp * self.microbatch}",
                f"use a multiple of {self.dp * self.microbatch}",
            )
        if self.num_microbatches > MAX_MICROBATCHES:
            raise ConfigError(
                "global_batch",
                f"global batch {self.global_batch:,} / (dp({self.dp}) * microbatch({self.microbatch})) ="
                f" {self.num_microbatches:,} micro-batches per pipeline, over the limit of {MAX_MICROBATCHES:,}",
                "use a smaller global batch or a larger micro-batch",
            )
        if self.virtual_stages > 1 and self.schedule is not ScheduleName.INTERLEAVED:
            raise ConfigError(
                "virtual_stages",
                f"{self.virtual_stages} virtual stages need the interleaved schedule",
                "use --schedule interleaved or --virtual-stages 1",
            )
        if self.partition is not None:
            if not isinstance(self.partition, (list, tuple)) or not all(
                isinstance(x, int) and not isinstance(x, bool) for x in self.partition
            ):
                raise ConfigError(
                    "partition", f"must be a list of layer counts, got {self.partition!r}", "e.g. 13,12,12,11"
                )
            part = tuple(self.partition)
            object.__setattr__(self, "partition", part)
            if len(part) != self.num_chunks:
                raise ConfigError(
                    "partition",
                    f"has {len(part)} entries, the pipeline has {self.num_chunks} model chunks",
                    f"give one layer count per chunk (pp × virtual_stages = {self.num_chunks})",
                )
            if any(x <= 0 for x in part):
                raise ConfigError(
                    "partition", f"{list(part)} has an empty stage", "give every chunk at least one layer"
                )
        check_tp_overlap_name(self.tp_overlap)
        if self.tp_overlap != "none" and self.tp == 1:
            raise ConfigError("tp_overlap", "overlapping the tensor-parallel collectives needs them, and tp is 1",
                              "use tp > 1 with sequence parallelism, or --tp-overlap none")
        if self.tp_overlap != "none" and not self.sequence_parallel:
            raise ConfigError("tp_overlap", f"{self.tp_overlap} overlap splits sequence parallelism's all-gathers and "
                              "reduce-scatters, and sequence parallelism is off",
                              "turn on sequence parallelism (--sequence-parallel)")
        if self.sequence_parallel and self.tp == 1:
            object.__setattr__(self, "sequence_parallel", False)  # nothing to split with tp = 1
        check_prefetch_receives(self.prefetch_receives)
        if self.prefetch_receives and self.pp == 1:
            raise ConfigError("prefetch_receives", f"posts pipeline receives ahead ({self.prefetch_receives}), and "
                              "pp is 1: there are none", "use pp > 1, or post none ahead (0)")

    # ----- derived -------------------------------------------------------------------------
    @property
    def world_size(self) -> int:
        return self.dp * self.tp * self.pp * self.cp

    @property
    def degrees_text(self) -> str:
        """``dp(2)*tp(4)*pp(2)``, with ``*cp(N)`` when context parallel: the factors of the world size."""
        return f"dp({self.dp})*tp({self.tp})*pp({self.pp})" + (f"*cp({self.cp})" if self.cp > 1 else "")

    @property
    def num_microbatches(self) -> int:
        """Micro-batches per pipeline per iteration."""
        assert self.global_batch is not None
        return self.global_batch // (self.dp * self.microbatch)

    @property
    def num_chunks(self) -> int:
        """Model chunks in the pipeline (stages × virtual stages)."""
        return self.pp * self.virtual_stages

    def axis_size(self, axis: str) -> int:
        return {"dp": self.dp, "tp": self.tp, "pp": self.pp, "cp": self.cp}[axis]

    def rank_of(self, *, dp: int = 0, tp: int = 0, pp: int = 0, cp: int = 0) -> int:
        coords = {"dp": dp, "tp": tp, "pp": pp, "cp": cp}
        r = 0
        for a in self.mesh_order:
            r = r * self.axis_size(a) + coords[a]
        return r

    def coords_of(self, rank: int) -> dict[str, int]:
        out: dict[str, int] = {}
        for a in reversed(self.mesh_order):
            n = self.axis_size(a)
            out[a] = rank % n
            rank //= n
        return out

    def group_ranks(self, axis: str) -> list[tuple[int, ...]]:
        """Every communication group along ``axis``: tuples of global ranks."""
        others = [a for a in AXES if a != axis]
        groups = []
        for fixed in itertools.product(*(range(self.axis_size(a)) for a in others)):
            kw = dict(zip(others, fixed, strict=True))
            groups.append(tuple(self.rank_of(**{**kw, axis: i}) for i in range(self.axis_size(axis))))
        return groups

    def layers_per_chunk(self, layers: int) -> tuple[int, ...]:
        """The partition, or the even split (earlier chunks take the remainder)."""
        if self.partition is not None:
            return self.partition
        n = self.num_chunks
        base, extra = divmod(layers, n)
        return tuple(base + (1 if i < extra else 0) for i in range(n))

    # ----- checks against a model ------------------------------------------------------------
    def validate_for(self, model: ModelSpec, *, even_layers: bool = False) -> None:
        """Raise :class:`ConfigError` if this layout cannot run ``model``.

        ``even_layers`` demands that the pipeline chunks split the layers evenly (what the
        runtime and ``simulate`` require when no explicit partition is given).
        """
        if model.heads % self.tp:
            raise ConfigError(
                "tp",
                f"tp({self.tp}) does not divide the {model.heads} attention heads",
                f"use a tp among {[d for d in range(1, model.heads + 1) if model.heads % d == 0][:8]}",
            )
        kv = model.num_kv_heads
        if kv % self.tp and self.tp % kv:
            raise ConfigError(
                "tp",
                f"tp({self.tp}) and the {kv} key/value heads do not divide one another",
                "use a tp that divides kv_heads or is a multiple of it",
            )
        if model.ffn_size % self.tp:
            raise ConfigError(
                "tp", f"tp({self.tp}) does not divide the FFN size {model.ffn_size}", "pick tp dividing ffn"
            )
        if self.cp > 1 and model.seq % (2 * self.cp):
            # Causal load balance: the sequence is cut into 2·cp chunks, rank i keeps chunks i and
            # 2·cp−1−i (Megatron-LM / Transformer Engine context parallelism).
            raise ConfigError(
                "cp", f"sequence {model.seq} is not divisible by 2*cp = {2 * self.cp} (two chunks per cp rank)",
                f"use a cp among {[c for c in range(2, 65) if model.seq % (2 * c) == 0][:6]} or cp 1",
            )
        if self.sequence_parallel and (model.seq // self.cp) % self.tp:
            raise ConfigError(
                "sequence_parallel",
                f"sequence {model.seq} / cp({self.cp}) is not divisible by tp({self.tp})",
                "disable sequence parallelism",
            )
        if self.partition is not None:
            if sum(self.partition) != model.layers:
                raise ConfigError(
                    "partition",
                    f"sums to {sum(self.partition)} layers, the model has {model.layers}",
                    "make the layer counts add up to the model's layers",
                )
        elif self.num_chunks > model.layers:
            raise ConfigError(
                "pp",
                f"pp({self.pp}) * virtual_stages({self.virtual_stages}) = {self.num_chunks} chunks"
                f" exceed the {model.layers} layers",
                "use fewer pipeline stages",
            )
        elif even_layers and model.layers % self.num_chunks:
            raise ConfigError(
                "pp",
                f"pp({self.pp}) * virtual_stages({self.virtual_stages}) = {self.num_chunks} does not divide the"
                f" {model.layers} layers",
                "pick pp dividing the layer count, or give an explicit partition",
            )

    # ----- serialization -----------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["schedule"] = self.schedule.value
        d["recompute"] = self.recompute.value
        d["mesh_order"] = list(self.mesh_order)
        d["partition"] = list(self.partition) if self.partition is not None else None
        return d

    @classmethod
    def from_dict(cls, doc: dict[str, Any], field: str = "--config") -> ParallelConfig:
        from paratrain.spec._files import check_keys

        check_keys(doc, cls, field, "parallel-config", expected_kind="a parallel config", required=False)
        if isinstance(doc.get("optimizer_sharding"), bool) and "sharding" in doc and (
                sharding_level(doc["sharding"], f"{field} sharding") != "none") != doc["optimizer_sharding"]:
            raise ConfigError(f"{field} optimizer_sharding", f"{doc['optimizer_sharding']} contradicts sharding "
                              f"{doc['sharding']!r}", "drop optimizer_sharding (sharding supersedes it)")
        try:
            return cls(**doc)
        except TypeError as e:
            raise ConfigError(field, str(e), "check the config keys") from None

    def with_overrides(self, **kw: Any) -> ParallelConfig:
        changes = {k: v for k, v in kw.items() if v is not None}
        # The level and its "anything sharded" flag move together: a given sharding wins, a given
        # optimizer_sharding alone sets the legacy level (or none).
        if "sharding" in changes:
            changes["optimizer_sharding"] = sharding_level(changes["sharding"]) != "none"
        elif "optimizer_sharding" in changes and changes["optimizer_sharding"] != self.optimizer_sharding:
            changes["sharding"] = sharding_level(changes["optimizer_sharding"], "optimizer_sharding")
        return dataclasses.replace(self, **changes) if changes else self


def load_run_document(path: str | Path, field: str = "--config") -> dict[str, Any]:
    """A config document as ``paratrain plan --json`` writes it, or a bare ParallelConfig mapping.

    Returns a dict with keys ``parallel`` (ParallelConfig) and optionally ``model``/``cluster``
    (raw mappings or names, to be resolved by the caller).
    """
    from paratrain.spec._files import load_document

    doc = load_document(path, field)
    if "config" in doc:  # what plan -o and plan --json write; their other keys are the report
        if not isinstance(doc["config"], dict):
            raise ConfigError(f"{field} config", f"must be a mapping, got {doc['config']!r}",
                              "give {parallel: ..., model: ..., cluster: ...} as paratrain plan -o writes it")
        doc = doc["config"]
    for key in ("model", "cluster"):
        if key in doc and not isinstance(doc[key], (str, dict)):
            raise ConfigError(
                f"{field} {key}", f"must be a preset name or a mapping, got {doc[key]!r}", f"fix or remove {key}"
            )
    if "parallel" in doc:
        if not isinstance(doc["parallel"], dict):
            raise ConfigError(f"{field} parallel", f"must be a mapping, got {doc['parallel']!r}", "e.g. {dp: 2, tp: 4}")
        unknown = sorted(set(doc) - {"parallel", "model", "cluster"})
        if unknown:
            raise ConfigError(f"{field} key {unknown[0]!r}", "is not a run-document field",
                              "use keys among: cluster, model, parallel")
        out = {k: v for k, v in doc.items() if k != "parallel"}
        out["parallel"] = ParallelConfig.from_dict(doc["parallel"], field)
        return out
    return {"parallel": ParallelConfig.from_dict(doc, field)}

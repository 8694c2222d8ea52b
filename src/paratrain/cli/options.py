"""Options shared by every command that takes a model, a cluster or a parallel layout, and the
functions that turn them into specs. Every command spells these flags the same way."""

from __future__ import annotations

import functools
import json
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Annotated, Any, TypeVar, cast

import typer

from paratrain.errors import ConfigError
from paratrain.parallel.config import SPARSE_COMPRESSIONS, ParallelConfig, sharding_level
from paratrain.spec.cluster import ClusterSpec, resolve_cluster
from paratrain.spec.device import DeviceSpec, resolve_device
from paratrain.spec.model import ModelSpec, resolve_model

__all__ = [
    "ModelOpt",
    "LayersOpt",
    "HiddenOpt",
    "HeadsOpt",
    "KvHeadsOpt",
    "FfnOpt",
    "SeqOpt",
    "VocabOpt",
    "DropoutOpt",
    "ClusterOpt",
    "DeviceOpt",
    "NodesOpt",
    "GpusOpt",
    "JsonOpt",
    "DpOpt",
    "TpOpt",
    "PpOpt",
    "CpOpt",
    "MicrobatchOpt",
    "GlobalBatchOpt",
    "ScheduleOpt",
    "VirtualStagesOpt",
    "RecomputeOpt",
    "SequenceParallelOpt",
    "OptimizerShardingOpt",
    "CompressOpt",
    "DensityOpt",
    "MeshOrderOpt",
    "PartitionOpt",
    "AttentionOpt",
    "FIELD_FLAGS",
    "as_flag_error",
    "flag_errors",
    "parallel_from_opts",
    "check_density_applies",
    "parse_ints",
    "parse_mesh_order",
    "resolve_model_opts",
    "resolve_cluster_opts",
    "print_json",
]

_M = "Model"
_C = "Cluster"

ModelOpt = Annotated[
    str,
    typer.Option("--model", "-m", help="Model preset name or JSON/YAML/TOML/HF config.json file.", rich_help_panel=_M),
]
LayersOpt = Annotated[int | None, typer.Option("--layers", help="Override: transformer layers.", rich_help_panel=_M)]
HiddenOpt = Annotated[int | None, typer.Option("--hidden", help="Override: hidden size.", rich_help_panel=_M)]
HeadsOpt = Annotated[int | None, typer.Option("--heads", help="Override: attention heads.", rich_help_panel=_M)]
KvHeadsOpt = Annotated[
    int | None, typer.Option("--kv-heads", help="Override: key/value heads (GQA).", rich_help_panel=_M)
]
FfnOpt = Annotated[int | None, typer.Option("--ffn", help="Override: FFN size.", rich_help_panel=_M)]
SeqOpt = Annotated[int | None, typer.Option("--seq", help="Override: sequence length.", rich_help_panel=_M)]
VocabOpt = Annotated[int | None, typer.Option("--vocab", help="Override: vocabulary size.", rich_help_panel=_M)]
DropoutOpt = Annotated[
    bool | None,
    typer.Option("--dropout/--no-dropout", help="Override: dropout's kernels and masks in the cost (default: "
                 "GPT-2/3 and BERT yes, Llama no; paratrain train runs none).", rich_help_panel=_M),
]

ClusterOpt = Annotated[str, typer.Option("--cluster", "-c", help="Cluster preset or file.", rich_help_panel=_C)]
DeviceOpt = Annotated[
    str | None,
    typer.Option("--device", "-d", help="Device preset or file (overrides the cluster's).", rich_help_panel=_C),
]
NodesOpt = Annotated[
    int | None, typer.Option("--nodes", help="Size the cluster to this many nodes.", rich_help_panel=_C)
]
GpusOpt = Annotated[
    int | None, typer.Option("--gpus", help="Size the cluster to this many devices.", rich_help_panel=_C)
]

CalibrationOpt = Annotated[
    str | None,
    typer.Option(
        "--calibration",
        help="Efficiencies applied to the cluster. Default: the device's fitted calibration (fitted-a100, "
        "fitted-h100: paratrain validate all); none: the presets as they are; vtrain-a100: fitted on vTrain alone; "
        "measured: the GPU's kernel rates from `paratrain calibrate --gpu`.",
        rich_help_panel=_C,
    ),
]

JsonOpt = Annotated[bool, typer.Option("--json", help="Print one JSON object instead of tables.")]

# The parallel layout, declared once for every command that takes one (None: not given).
_P = "Parallel layout"
DpOpt = Annotated[int | None, typer.Option("--dp", help="Data-parallel degree.", rich_help_panel=_P)]
TpOpt = Annotated[int | None, typer.Option("--tp", help="Tensor-parallel degree.", rich_help_panel=_P)]
PpOpt = Annotated[int | None, typer.Option("--pp", help="Pipeline stages.", rich_help_panel=_P)]
CpOpt = Annotated[
    int | None,
    typer.Option("--cp", help="Context-parallel degree (ring attention over sequence chunks; gradients and "
                 "sharding over dp x cp).", rich_help_panel=_P),
]
MicrobatchOpt = Annotated[
    int | None, typer.Option("--microbatch", help="Micro-batch size (samples).", rich_help_panel=_P)
]
GlobalBatchOpt = Annotated[
    int | None, typer.Option("--global-batch", "-b", help="Global batch (samples per iteration).", rich_help_panel=_P)
]
ScheduleOpt = Annotated[
    str | None,
    typer.Option(
        "--schedule",
        "-s",
        help="Pipeline schedule: gpipe, 1f1b, interleaved, chimera, pipedream, 2bw, zb-h1.",
        rich_help_panel=_P,
    ),
]
VirtualStagesOpt = Annotated[
    int | None,
    typer.Option(
        "--virtual-stages", help="Model chunks per pipeline rank (interleaved; default 2 there).", rich_help_panel=_P
    ),
]
RecomputeOpt = Annotated[
    str | None,
    typer.Option("--recompute", help="Activation recomputation: none, selective or full.", rich_help_panel=_P),
]
SequenceParallelOpt = Annotated[
    bool | None,
    typer.Option(
        "--sequence-parallel/--no-sequence-parallel",
        help="Megatron sequence parallelism: norms and dropout split along the sequence over tp.",
        rich_help_panel=_P,
    ),
]
OptimizerShardingOpt = Annotated[
    bool | None,
    typer.Option(
        "--optimizer-sharding/--no-optimizer-sharding",
        help="Former switch of --sharding: on = zero2 (FSDP2 as train runs it), off = none.",
        rich_help_panel=_P,
    ),
]
ShardingOpt = Annotated[
    str | None,
    typer.Option(
        "--sharding",
        help="Sharded data parallelism over dp: none, zero1 (optimizer state), zero2 (+ gradients), zero3 or "
        "fsdp (+ parameters). plan: searched when not given.",
        rich_help_panel=_P,
    ),
]
CompressOpt = Annotated[
    str | None,
    typer.Option("--compress", help="Gradient compression over dp: none, oktopk, topka, gtopk, gaussiank, "
                 "powersgd (see README, Gradient compression).", rich_help_panel=_P),
]
DensityOpt = Annotated[
    float | None,
    typer.Option("--density", help="Fraction of the gradient a sparse compressor (oktopk, topka, gtopk, "
                 "gaussiank) keeps, in (0, 1] (default 0.01); not with powersgd.", rich_help_panel=_P),
]
MeshOrderOpt = Annotated[
    str | None,
    typer.Option("--mesh-order", help="Mesh axes outermost first, e.g. pp,dp,tp.", rich_help_panel=_P),
]
PartitionOpt = Annotated[
    str | None, typer.Option("--partition", help="Layers per chunk, e.g. 13,12,12,11.", rich_help_panel=_P)
]
AttentionOpt = Annotated[
    str | None,
    typer.Option(
        "--attention",
        help="Attention kernels: flash (fused) or math (explicit s×s); default: the device's (flash on A100/H100).",
        rich_help_panel=_P,
    ),
]
GemmDtypeOpt = Annotated[
    str | None,
    typer.Option(
        "--gemm-dtype",
        help="Linear layers' GEMMs: fp8 (current scaling, torchao Float8), fp8-delayed (Transformer Engine's "
        "delayed scaling); default: the training dtype. FP8 needs FP8 tensor cores (H100, H200).",
        rich_help_panel=_P,
    ),
]
Fp8WeightCacheOpt = Annotated[
    bool | None,
    typer.Option(
        "--fp8-weight-cache/--no-fp8-weight-cache",
        help="With --gemm-dtype: cast each FP8 weight once per step and reuse it for the step's other "
        "micro-batches (Transformer Engine's weight caching, as Megatron-Core runs it); default off.",
        rich_help_panel=_P,
    ),
]
TpOverlapOpt = Annotated[
    str | None,
    typer.Option(
        "--tp-overlap",
        help="Tensor-parallel collectives overlapped with their GEMMs: none (default), async (torch's async "
        "TP, torchtitan: the forward's) or userbuffers (Transformer Engine, Megatron-Core's tp_comm_overlap: "
        "forward and backward); needs --sequence-parallel. Priced here; paratrain train does not run it.",
        rich_help_panel=_P,
    ),
]
PrefetchReceivesOpt = Annotated[
    int | None,
    typer.Option(
        "--prefetch-receives",
        help="Pipeline receives posted ahead of their action, per peer, so that a transfer runs while the "
        "receiving rank still computes: 1 is about Megatron-Core's overlap_p2p_comm (interleaved); default "
        "what paratrain train runs: 2 on a CPU (gloo), 0 on GPUs (NCCL).",
        rich_help_panel=_P,
    ),
]

# The flag that sets each field the library names in a ConfigError.
FIELD_FLAGS: dict[str, str] = {
    "dp": "--dp",
    "tp": "--tp",
    "pp": "--pp",
    "cp": "--cp",
    "microbatch": "--microbatch",
    "global_batch": "--global-batch",
    "schedule": "--schedule",
    "virtual_stages": "--virtual-stages",
    "recompute": "--recompute",
    "sequence_parallel": "--sequence-parallel",
    "optimizer_sharding": "--optimizer-sharding",
    "sharding": "--sharding",
    "compression": "--compress",
    "compression_density": "--density",
    "mesh_order": "--mesh-order",
    "partition": "--partition",
    "attention": "--attention",
    "gemm_dtype": "--gemm-dtype",
    "fp8_weight_cache": "--fp8-weight-cache",
    "tp_overlap": "--tp-overlap",
    "prefetch_receives": "--prefetch-receives",
    "cluster.gpus": "--gpus",
    "cluster.nodes": "--nodes",
    "sweep": "--sweep",
    # the schedule generators' names
    "stages": "--pp",
    "microbatches": "--global-batch (micro-batches = global batch / (dp*microbatch))",
}

_F = TypeVar("_F", bound=Callable[..., Any])


def as_flag_error(err: ConfigError, flags: dict[str, str] = FIELD_FLAGS) -> ConfigError:
    """``err`` with its field renamed to the flag that sets it (as is when no flag does); ``flags``
    maps fields to a command's own flags where they differ from the shared ones."""
    flag = flags.get(err.field)
    return err if flag is None else ConfigError(flag, err.problem, err.fix)


def flag_errors(command: _F) -> _F:
    """``command`` whose ConfigErrors name this CLI's flags instead of the library's fields."""

    @functools.wraps(command)
    def run(*args: Any, **kwargs: Any) -> Any:
        try:
            return command(*args, **kwargs)
        except ConfigError as e:
            renamed = as_flag_error(e)
            if renamed is e:
                raise
            raise renamed from None

    return cast(_F, run)


def resolve_model_opts(
    model: str,
    layers: int | None = None,
    hidden: int | None = None,
    heads: int | None = None,
    kv_heads: int | None = None,
    ffn: int | None = None,
    seq: int | None = None,
    vocab: int | None = None,
    dropout: bool | None = None,
) -> ModelSpec:
    return resolve_model(
        model, "--model", layers=layers, hidden=hidden, heads=heads, kv_heads=kv_heads, ffn=ffn, seq=seq, vocab=vocab,
        dropout=dropout,
    )


def resolve_cluster_opts(
    cluster: str, device: str | None = None, nodes: int | None = None, gpus: int | None = None
) -> ClusterSpec:
    return resolve_cluster(cluster, "--cluster", nodes=nodes, gpus=gpus, device=device)


def apply_calibration(cluster: ClusterSpec, name: str | None) -> ClusterSpec:
    """``cluster`` with a named calibration's device efficiencies and link figures; ``None``: the
    device preset's fitted calibration where it has one; ``"none"``: as is."""
    from paratrain.errors import ConfigError
    from paratrain.plan.calibrated import CALIBRATIONS, FITTED_BY_DEVICE
    from paratrain.plan.validate import with_calibration

    if name is None:
        fitted = FITTED_BY_DEVICE.get(cluster.device.name)
        return cluster if fitted is None else with_calibration(cluster, fitted)
    if name == "none":
        return cluster
    if name == "measured":  # `paratrain calibrate --gpu`: the measured kernel rates over the fitted calibration
        import dataclasses

        from paratrain.runtime.gpu_calibrate import load_measured

        if cluster.device.peak_bf16_flops <= 0:  # calibrate --gpu measures tensor-core GPUs only
            raise ConfigError("--calibration", f"measured applies to GPUs that `paratrain calibrate --gpu` measures; "
                              f"{cluster.device.name} has no bf16 tensor cores",
                              "use --calibration none, or the default (the device's fitted calibration)")
        measured = load_measured(cluster.device.name)
        fitted = FITTED_BY_DEVICE.get(cluster.device.name)
        base = cluster if fitted is None else with_calibration(cluster, fitted)
        return dataclasses.replace(base, device=dataclasses.replace(base.device, **measured))
    if name not in CALIBRATIONS:
        raise ConfigError(
            "--calibration", f"unknown calibration {name!r}",
            f"use one of: none, measured, {', '.join(CALIBRATIONS)}",
        )
    return with_calibration(cluster, CALIBRATIONS[name])


def resolve_device_opt(device: str) -> DeviceSpec:
    return resolve_device(device, "--device")


def parse_ints(flag: str, text: str | None) -> tuple[int, ...] | None:
    """``"13,12,12,11"`` → ``(13, 12, 12, 11)``; ``None`` stays ``None``."""
    if text is None:
        return None
    try:
        vals = tuple(int(x) for x in text.replace(" ", "").split(",") if x)
    except ValueError:
        raise ConfigError(flag, f"{text!r} is not a comma-separated list of integers", "e.g. 13,12,12,11") from None
    if not vals or any(v <= 0 for v in vals):
        raise ConfigError(flag, f"{text!r} must list positive integers", "e.g. 13,12,12,11")
    return vals


def parse_mesh_order(text: str | None) -> tuple[str, ...] | None:
    """``"pp,dp,tp"`` → ``("pp", "dp", "tp")``; ``None`` or empty: not given."""
    return tuple(a.strip() for a in text.split(",")) if text else None


def parallel_from_opts(
    base: ParallelConfig | None = None,
    *,
    dp: int | None = None,
    tp: int | None = None,
    pp: int | None = None,
    microbatch: int | None = None,
    global_batch: int | None = None,
    schedule: str | None = None,
    virtual_stages: int | None = None,
    recompute: str | None = None,
    sequence_parallel: bool | None = None,
    optimizer_sharding: bool | None = None,
    compression: str | None = None,
    compression_density: float | None = None,
    mesh_order: str | None = None,
    partition: str | None = None,
    dtype: str | None = None,
    attention: str | None = None,
    cp: int | None = None,
    sharding: str | None = None,
    gemm_dtype: str | None = None,
    tp_overlap: str | None = None,
    fp8_weight_cache: bool | None = None,
    prefetch_receives: int | None = None,
) -> ParallelConfig:
    """The ParallelConfig the parallel-layout flags give (``None`` = not given), on top of ``base``
    if any, else of the defaults. Invalid values raise ConfigErrors naming the fields."""
    kw: dict[str, Any] = dict(
        dp=dp,
        tp=tp,
        pp=pp,
        microbatch=microbatch,
        global_batch=global_batch,
        schedule=schedule,
        virtual_stages=virtual_stages,
        recompute=recompute,
        sequence_parallel=sequence_parallel,
        optimizer_sharding=optimizer_sharding,
        compression=compression,
        compression_density=compression_density,
        mesh_order=parse_mesh_order(mesh_order),
        partition=parse_ints("--partition", partition),
        dtype=dtype,
        attention=attention,
        cp=cp,
        sharding=sharding,
        gemm_dtype=gemm_dtype,
        tp_overlap=tp_overlap,
        fp8_weight_cache=fp8_weight_cache,
        prefetch_receives=prefetch_receives,
    )
    if sharding is not None and optimizer_sharding is not None and (
            sharding_level(sharding, "--sharding") != "none") != optimizer_sharding:
        raise ConfigError("--sharding", f"{sharding} contradicts --{'' if optimizer_sharding else 'no-'}"
                          "optimizer-sharding", "give --sharding alone")
    given = {k: v for k, v in kw.items() if v is not None}
    if base is not None:
        return base.with_overrides(**given)
    if str(given.get("schedule", "")).lower() == "interleaved":
        given.setdefault("virtual_stages", 2)  # interleaving needs at least two chunks per rank
    return ParallelConfig(**given)


def check_density_applies(compression: str, density: float | None, none_is: str = "chosen") -> None:
    """``--density`` with no compressor it sets (none, or low-rank PowerSGD) is refused, not
    ignored: the run would not be the one the flag describes. ``compression``: the one the run
    uses (after any run document's); ``none_is``: how the command picks it, for the message."""
    if density is None:
        return
    if compression == "none":
        raise ConfigError("--density", f"sets the fraction a gradient compressor keeps, and none is {none_is}",
                          "add --compress NAME (e.g. oktopk), or drop --density")
    if compression not in SPARSE_COMPRESSIONS:
        raise ConfigError("--density", f"sets the fraction a sparse compressor keeps; {compression} is low-rank "
                          "(a fixed rank) and takes no density",
                          f"drop --density, or use a sparse --compress: {', '.join(SPARSE_COMPRESSIONS[:-1])} or "
                          f"{SPARSE_COMPRESSIONS[-1]}")


@contextmanager
def progress_bar(label: str, quiet: bool = False) -> Iterator[Callable[..., None]]:
    """A transient progress bar on stderr for long work, shown only when stderr is a terminal and
    ``quiet`` (``--json``) is not set. Yields ``tick(done, total, what=None)``; ``what`` names the
    current piece of work. Piped or quiet, ``tick`` does nothing and nothing is printed."""
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    console = Console(file=sys.stderr)
    with Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=console,
        transient=True,
        disable=quiet or not console.is_terminal,
    ) as bar:
        task = bar.add_task(label, total=None)

        def tick(done: int, total: int | None, what: str | None = None) -> None:
            bar.update(task, completed=done, total=total, description=f"{label}: {what}" if what else label)

        yield tick


def print_json(obj: Any) -> None:
    json.dump(obj, sys.stdout, indent=2, default=_default)
    sys.stdout.write("\n")


def _default(o: Any) -> Any:
    if hasattr(o, "to_dict"):
        return o.to_dict()
    if hasattr(o, "value"):
        return o.value
    if isinstance(o, (set, frozenset, tuple)):
        return list(o)
    raise TypeError(f"not JSON-serializable: {type(o).__name__}")

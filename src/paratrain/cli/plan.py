"""``paratrain plan``: search the fastest memory-feasible configuration; sweeps; shape advice.

paratrain plan --model gpt3-175b --cluster dgx-a100 --gpus 1024 --global-batch 1536
paratrain plan --model gpt-1t --gpus 3072 --global-batch 3072 --tp 8 --pp 64 --json
paratrain plan --model gpt3-13b --gpus 64 --global-batch 512 --sweep gpus=64,128,256 --plot s.png
paratrain plan --model gpt3-175b --gpus 1024 --global-batch 1536 --advise-shape
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.console import Console
from rich.table import Table

from paratrain.cli.options import (
    AttentionOpt,
    CalibrationOpt,
    ClusterOpt,
    CpOpt,
    DensityOpt,
    DeviceOpt,
    DpOpt,
    DropoutOpt,
    FfnOpt,
    Fp8WeightCacheOpt,
    GemmDtypeOpt,
    GlobalBatchOpt,
    GpusOpt,
    HeadsOpt,
    HiddenOpt,
    JsonOpt,
    KvHeadsOpt,
    LayersOpt,
    MeshOrderOpt,
    MicrobatchOpt,
    ModelOpt,
    NodesOpt,
    OptimizerShardingOpt,
    PartitionOpt,
    PpOpt,
    PrefetchReceivesOpt,
    RecomputeOpt,
    ScheduleOpt,
    SeqOpt,
    SequenceParallelOpt,
    ShardingOpt,
    TpOpt,
    TpOverlapOpt,
    VirtualStagesOpt,
    VocabOpt,
    apply_calibration,
    check_density_applies,
    flag_errors,
    parse_ints,
    parse_mesh_order,
    print_json,
    progress_bar,
    resolve_cluster_opts,
    resolve_model_opts,
)
from paratrain.errors import ConfigError
from paratrain.parallel.config import ParallelConfig, Recompute, ScheduleName

if TYPE_CHECKING:
    from paratrain.plan.search import PlanResult
    from paratrain.spec.cluster import ClusterSpec
    from paratrain.spec.model import ModelSpec

__all__ = ["register", "plan_command"]

_S = "Search"


def register(app: typer.Typer) -> None:
    app.command("plan", help="Find the fastest memory-feasible parallel configuration.")(flag_errors(plan_command))
    app.command("advise-shape", help="Nearby model shapes (same parameters ±1%) the GEMM model predicts faster.")(
        flag_errors(advise_shape_command)
    )


def _schedules(text: str | None) -> tuple[ScheduleName, ...] | None:
    if text is None:
        return None
    if text.strip().lower() == "all":
        return tuple(ScheduleName)
    out = []
    for name in text.split(","):
        try:
            out.append(ScheduleName(name.strip().lower()))
        except ValueError:
            choices = ", ".join(s.value for s in ScheduleName)
            raise ConfigError("--schedules", f"unknown schedule {name!r}", f"use names among: {choices}") from None
    return tuple(out)


def _enum(cls: Any, flag: str, value: str | None) -> Any:
    if value is None:
        return None
    try:
        return cls(value.lower())
    except ValueError:
        raise ConfigError(flag, f"unknown value {value!r}", f"use one of: {', '.join(m.value for m in cls)}") from None


def _compressions(name: str | None, density: float | None) -> tuple[str, ...]:
    """Dense all-reduce, and the compressor ``--compress`` names to weigh against it."""
    from paratrain.parallel.config import ParallelConfig

    # checked as the runtime checks them (unknown name, density outside (0, 1])
    ParallelConfig(compression=name or "none", compression_density=density if density is not None else 0.01)
    check_density_applies(name or "none", density, "weighed")
    return ("none",) if name in (None, "none") else ("none", name)


def _console() -> Console:
    # The ranking has 18 columns: give it room when the output is a file or a pipe.
    c = Console()
    return c if c.is_terminal and c.width >= 160 else Console(width=190)


def _gib(x: float) -> str:
    return f"{x / 2**30:.1f}"


def _layout_cells(row: dict[str, Any]) -> tuple[str, ...]:
    """The ranking's layout columns (``_LAYOUT_COLS``) from :func:`paratrain.plan.report.layout_row`."""
    v = row["virtual_stages"]
    return (
        str(row["dp"]),
        str(row["tp"]),
        str(row["pp"]),
        str(row["cp"]),
        str(row["microbatch"]),
        row["schedule"] + (f"(v={v})" if v > 1 else ""),
        row["recompute"],
        "y" if row["sequence_parallel"] else "n",
        "n" if row["sharding"] == "none" else row["sharding"].removeprefix("zero"),
        ",".join(row["mesh_order"]),
    )


_LAYOUT_COLS = ("dp", "tp", "pp", "cp", "mb", "schedule", "recomp", "sp", "zero", "mesh")


def print_ranking(console: Console, result: PlanResult, top: int) -> None:
    from paratrain.plan.report import layout_row
    from paratrain.plan.space import REASONS

    t = Table(
        title=f"Top {min(top, len(result.ranked))} of {result.considered} candidates "
        f"(searched in {result.search_time_s:.1f} s)"
    )
    cols = (
        "#",
        *_LAYOUT_COLS,
        "tokens/s",
        "TFLOP/s/GPU",
        "MFU",
        "iter s",
        "peak GiB",
        "bubble %",
        "exp. comm s",
        "by",
    )
    for col in cols:
        t.add_column(col, justify="left" if col in ("schedule", "recomp", "mesh", "by") else "right")
    for i, c in enumerate(result.ranked[:top], 1):
        m = c.metrics
        t.add_row(
            str(i),
            *_layout_cells(layout_row(c.config)),
            f"{m.tokens_per_s:,.0f}",
            f"{m.tflops_per_gpu:.1f}",
            f"{100 * m.mfu:.1f}%",
            f"{m.iteration_time_s:.3f}",
            _gib(m.peak_memory_bytes),
            f"{100 * m.bubble_fraction:.1f}",
            f"{m.exposed_comm_s:.3f}",
            c.source,
        )
    console.print(t)
    rej = Table(title="Rejected candidates")
    rej.add_column("reason")
    rej.add_column("count", justify="right")
    for k, v in sorted(result.rejected.items(), key=lambda kv: -kv[1]):
        rej.add_row(REASONS.get(k, k), f"{v:,}")
    console.print(rej)


def print_winner(console: Console, model: ModelSpec, cluster: ClusterSpec, result: PlanResult,
                 train_refusal: str | None = None) -> None:
    """The winner's breakdown, whether ``paratrain train`` runs it (``train_refusal``: its error
    line, None when it does), and the plausibility warnings."""
    from paratrain.plan.report import winner_breakdown, winner_plausibility

    console.print("[bold]Winner[/bold]")
    for k, v in winner_breakdown(model, cluster, result.winner, result.capacity_bytes):
        console.print(f"  {k:<28} {v}")
    runs = "runs it (plan -o FILE, then train --config FILE)"
    console.print(f"  {'paratrain train':<28} {runs if train_refusal is None else 'refuses it: ' + train_refusal}",
                  soft_wrap=True)
    for w in winner_plausibility(model, cluster, result.winner):
        console.print(f"[yellow]warning:[/yellow] {w}", soft_wrap=True)


def plan_command(
    model: ModelOpt,
    global_batch: GlobalBatchOpt,
    cluster: ClusterOpt = "dgx-a100",
    device: DeviceOpt = None,
    nodes: NodesOpt = None,
    gpus: GpusOpt = None,
    layers: LayersOpt = None,
    hidden: HiddenOpt = None,
    heads: HeadsOpt = None,
    kv_heads: KvHeadsOpt = None,
    ffn: FfnOpt = None,
    seq: SeqOpt = None,
    vocab: VocabOpt = None,
    dropout: DropoutOpt = None,
    dp: DpOpt = None,
    tp: TpOpt = None,
    pp: PpOpt = None,
    cp: CpOpt = None,
    microbatch: MicrobatchOpt = None,
    schedule: ScheduleOpt = None,
    virtual_stages: VirtualStagesOpt = None,
    recompute: RecomputeOpt = None,
    sequence_parallel: SequenceParallelOpt = None,
    optimizer_sharding: OptimizerShardingOpt = None,
    sharding: ShardingOpt = None,
    compress: Annotated[str | None, typer.Option("--compress", help="Also weigh this gradient compressor "
                        "(oktopk, topka, gtopk, gaussiank, powersgd) against dense all-reduce where dp > 1.",
                        rich_help_panel=_S)] = None,
    density: DensityOpt = None,
    attention: AttentionOpt = None,
    gemm_dtype: GemmDtypeOpt = None,
    fp8_weight_cache: Fp8WeightCacheOpt = None,
    tp_overlap: TpOverlapOpt = None,
    prefetch_receives: PrefetchReceivesOpt = None,
    mesh_order: MeshOrderOpt = None,
    partition: PartitionOpt = None,
    schedules: Annotated[
        str | None,
        typer.Option("--schedules", help="Schedules to search, or all (default: the synchronous).", rich_help_panel=_S),
    ] = None,
    top: Annotated[int, typer.Option("--top", help="Rows in the ranking.", rich_help_panel=_S)] = 10,
    # None: not given (5), so that --confirm with --no-simulate can be refused
    confirm: Annotated[
        int | None, typer.Option("--confirm", help="Candidates the simulator confirms (default 5).",
                                 rich_help_panel=_S)
    ] = None,
    simulate: Annotated[
        bool, typer.Option("--simulate/--no-simulate", help="Confirm with the simulator.", rich_help_panel=_S)
    ] = True,
    memory_limit_gib: Annotated[
        float | None,
        typer.Option(
            "--memory-limit", help="Usable GiB per GPU (default: the device's memory less its reserve).",
            rich_help_panel=_S,
        ),
    ] = None,
    tp_across_nodes: Annotated[
        bool, typer.Option("--tp-across-nodes", help="Allow tp larger than a node.", rich_help_panel=_S)
    ] = False,
    sweep: Annotated[
        str | None,
        typer.Option("--sweep", help="gpus=64,128,... | batch=... | seq=...: plan at each value.", rich_help_panel=_S),
    ] = None,
    plot: Annotated[
        Path | None, typer.Option("--plot", help="Sweep: PNG of throughput and MFU.", rich_help_panel=_S)
    ] = None,
    table_out: Annotated[Path | None, typer.Option("--table", help="Sweep: CSV table.", rich_help_panel=_S)] = None,
    advise_shape: Annotated[
        bool, typer.Option("--advise-shape", help="Also report faster nearby model shapes.", rich_help_panel=_S)
    ] = False,
    output: Annotated[Path | None, typer.Option("--output", "-o", help="Write the winner as a run document.")] = None,
    calibration: CalibrationOpt = None,
    json_out: JsonOpt = False,
) -> None:
    from paratrain.plan.search import plan
    from paratrain.plan.space import DEFAULT_SCHEDULES, Pins

    spec = resolve_model_opts(model, layers, hidden, heads, kv_heads, ffn, seq, vocab, dropout)
    clus = apply_calibration(resolve_cluster_opts(cluster, device, nodes, gpus), calibration)
    if confirm is not None and not simulate:
        raise ConfigError("--confirm", "counts the candidates the simulator confirms, and --no-simulate turns it "
                          "off", "drop --confirm or --no-simulate")
    if confirm is None:
        confirm = 5
    for flag, val in (("--top", top), ("--confirm", confirm)):
        if val < 1:
            raise ConfigError(flag, f"must be at least 1, got {val}", f"e.g. {flag} 5")
    if memory_limit_gib is not None:
        from paratrain.errors import require_positive

        require_positive("--memory-limit", memory_limit_gib)  # NaN and inf included
        device_gib = clus.device.memory_bytes / 2**30
        if memory_limit_gib > device_gib:
            raise ConfigError("--memory-limit", f"{memory_limit_gib:g} GiB is more than the device's {device_gib:g} GiB"
                              f" ({clus.device.name})", "give at most the device's memory (--device for another one)")
    if schedule is not None and schedules is not None:
        chosen = _enum(ScheduleName, "--schedule", schedule)
        if chosen not in _schedules(schedules):
            raise ConfigError("--schedule", f"pins {chosen.value}, which --schedules {schedules!r} leaves out",
                              "drop one of the two flags")
    # Flags the chosen mode would ignore are errors: exit 0 without a requested file misleads.
    if sweep is None:
        for flag, value in (("--plot", plot), ("--table", table_out)):
            if value is not None:
                raise ConfigError(flag, "is written only by a sweep", f"add --sweep VARIABLE=V1,V2 or drop {flag}")
    else:
        for flag, given in (("--output", output is not None), ("--advise-shape", advise_shape)):
            if given:
                raise ConfigError(flag, "has no single winner to use in a sweep", f"drop {flag} or --sweep")
    if output is not None:
        from paratrain.fileio import check_output_path

        check_output_path(output, "--output")
    from paratrain.fileio import check_distinct_paths

    check_distinct_paths({"--output": output, "--plot": plot, "--table": table_out},
                         {"--model": model, "--cluster": cluster, "--device": device})
    pins = Pins(
        dp=dp,
        tp=tp,
        pp=pp,
        cp=cp,
        microbatch=microbatch,
        schedule=_enum(ScheduleName, "--schedule", schedule),
        virtual_stages=virtual_stages,
        recompute=_enum(Recompute, "--recompute", recompute),
        sequence_parallel=sequence_parallel,
        optimizer_sharding=optimizer_sharding,
        sharding=sharding,
        mesh_order=parse_mesh_order(mesh_order),
        partition=parse_ints("--partition", partition),
        schedules=_schedules(schedules) or DEFAULT_SCHEDULES,
        tp_across_nodes=tp_across_nodes,
        attention=None if attention is None else attention.lower(),  # case as --schedule and --recompute
        gemm_dtype=gemm_dtype,
        fp8_weight_cache=bool(fp8_weight_cache),
        tp_overlap="none" if tp_overlap is None else tp_overlap,  # an empty flag is unknown, not "none"
        prefetch_receives=prefetch_receives,
        compressions=_compressions(compress, density),
        compression_density=density if density is not None else 0.01,
    )
    limit = memory_limit_gib * 2**30 if memory_limit_gib else None  # None: the device's usable memory
    from paratrain.plan.backend import default_backend

    backend = default_backend(simulate=simulate)
    kwargs = dict(pins=pins, top=top, confirm=confirm, backend=backend, memory_limit_bytes=limit)

    if sweep is not None:
        from paratrain.cli.plan_sweep import run_sweep

        run_sweep(spec, clus, global_batch, sweep, kwargs, plot=plot, table_out=table_out, json_out=json_out)
        return

    console = _console()
    with progress_bar("searching", json_out) as tick:
        result = plan(spec, clus, global_batch, progress=tick, **kwargs)
    from paratrain.plan.report import plan_document

    doc = plan_document(spec, clus, result)
    from paratrain.runtime.config import train_refusal

    # whether `paratrain train --config` runs the winner (the cost model prices more than the runtime runs)
    doc["train_refusal"] = train_refusal(spec, result.winner.config)
    if advise_shape:
        from paratrain.plan.shape import advise

        doc["shape_advice"] = [
            a.to_dict()
            for a in advise(spec, clus.device, tp=result.winner.config.tp, microbatch=result.winner.config.microbatch)
        ]
    if output is not None:
        import json

        from paratrain.fileio import atomic_write_text

        atomic_write_text(output, json.dumps({"config": doc["config"]}, indent=2) + "\n", "--output")
    if json_out:
        print_json(doc)
        return
    print_ranking(console, result, top)
    print_winner(console, spec, clus, result, doc["train_refusal"])
    if advise_shape:
        from paratrain.cli.plan_sweep import print_advice

        print_advice(console, spec, doc["shape_advice"])
    if output is not None:
        console.print(f"wrote {output} (use: paratrain simulate --config {output})")


def advise_shape_command(
    model: ModelOpt,
    cluster: ClusterOpt = "dgx-a100",
    device: DeviceOpt = None,
    layers: LayersOpt = None,
    hidden: HiddenOpt = None,
    heads: HeadsOpt = None,
    kv_heads: KvHeadsOpt = None,
    ffn: FfnOpt = None,
    seq: SeqOpt = None,
    vocab: VocabOpt = None,
    dropout: DropoutOpt = None,
    tp: Annotated[int, typer.Option("--tp", help="Tensor-parallel degree the layers run at.")] = 1,
    microbatch: Annotated[int, typer.Option("--microbatch", help="Micro-batch size.")] = 1,
    json_out: JsonOpt = False,
) -> None:
    from paratrain.cli.plan_sweep import print_advice
    from paratrain.plan.shape import advise

    spec = resolve_model_opts(model, layers, hidden, heads, kv_heads, ffn, seq, vocab, dropout)
    clus = resolve_cluster_opts(cluster, device)
    ParallelConfig(tp=tp, microbatch=microbatch)  # the layout's own checks and size limits
    rows = [a.to_dict() for a in advise(spec, clus.device, tp=tp, microbatch=microbatch)]
    if json_out:
        print_json({"model": spec.to_dict(), "params": spec.param_count(), "shapes": rows})
        return
    print_advice(_console(), spec, rows)

"""``paratrain simulate``: simulate one training iteration of a model on a cluster under a parallel
configuration and a pipeline schedule, with durations from the cost model.

Examples::

    paratrain simulate --model gpt3-1.3b --cluster dgx-a100 --gpus 16 --tp 2 --pp 4 --dp 2 \\
        --microbatch 2 --global-batch 64 --schedule 1f1b
    paratrain simulate --model gpt3-1.3b --gpus 16 --tp 2 --pp 4 --dp 2 --microbatch 2 --global-batch 64 \\
        --schedule interleaved --virtual-stages 2 --json --trace run.json --plot run.png
    paratrain simulate --config plan.json          # a run document written by ``paratrain plan -o``
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated, Any

import typer

from paratrain.cli.options import (
    AttentionOpt,
    CalibrationOpt,
    CompressOpt,
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
    MicrobatchOpt,
    NodesOpt,
    OptimizerShardingOpt,
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
    parallel_from_opts,
    print_json,
)
from paratrain.errors import ConfigError

__all__ = ["register", "simulate"]


def register(app: typer.Typer) -> None:
    app.command("simulate", help="Simulate one iteration: time, bubbles, memory, communication, MFU.")(
        flag_errors(simulate)
    )


def _resolve_model(arg: str | None, doc: dict[str, Any], overrides: dict[str, Any]) -> Any:
    from paratrain.spec.model import from_document, resolve_model

    if arg is not None:
        return resolve_model(arg, "--model", **overrides)
    m = doc.get("model")
    if m is None:
        raise ConfigError("--model", "no model given", "pass --model NAME|FILE or a --config document with a model")
    base = resolve_model(m, "--config model") if isinstance(m, str) else from_document(m, "--config model")
    given = {k: v for k, v in overrides.items() if v is not None}
    return base.with_overrides(**given) if given else base


def _resolve_cluster(
    arg: str | None, doc: dict[str, Any], device: str | None, nodes: int | None, gpus: int | None
) -> Any:
    from paratrain.spec.cluster import from_document, resolve_cluster

    if arg is None and isinstance(doc.get("cluster"), dict):
        base = from_document(doc["cluster"], "--config cluster")
        if device is not None:
            import dataclasses

            from paratrain.spec.device import resolve_device

            base = dataclasses.replace(base, device=resolve_device(device, "--device"))
        return base.resized(nodes=nodes, gpus=gpus)
    # `is None`, not `or`: an empty --cluster is a malformed flag, not a request for the default
    name = arg if arg is not None else (doc["cluster"] if isinstance(doc.get("cluster"), str) else "dgx-a100")
    return resolve_cluster(name, "--cluster", nodes=nodes, gpus=gpus, device=device)


def simulate(
    model: Annotated[
        str | None, typer.Option("--model", "-m", help="Model preset name or file.", rich_help_panel="Model")
    ] = None,
    layers: LayersOpt = None,
    hidden: HiddenOpt = None,
    heads: HeadsOpt = None,
    kv_heads: KvHeadsOpt = None,
    ffn: FfnOpt = None,
    seq: SeqOpt = None,
    vocab: VocabOpt = None,
    dropout: DropoutOpt = None,
    cluster: Annotated[
        str | None,
        typer.Option("--cluster", "-c", help="Cluster preset or file (default dgx-a100).", rich_help_panel="Cluster"),
    ] = None,
    device: DeviceOpt = None,
    nodes: NodesOpt = None,
    gpus: GpusOpt = None,
    tp: TpOpt = None,
    pp: PpOpt = None,
    cp: CpOpt = None,
    dp: DpOpt = None,  # default: GPUs / (tp*pp)
    microbatch: MicrobatchOpt = None,
    global_batch: GlobalBatchOpt = None,
    schedule: ScheduleOpt = None,
    virtual_stages: VirtualStagesOpt = None,
    recompute: RecomputeOpt = None,
    sequence_parallel: SequenceParallelOpt = None,
    optimizer_sharding: OptimizerShardingOpt = None,
    sharding: ShardingOpt = None,
    compress: CompressOpt = None,
    density: DensityOpt = None,
    attention: AttentionOpt = None,
    gemm_dtype: GemmDtypeOpt = None,
    fp8_weight_cache: Fp8WeightCacheOpt = None,
    tp_overlap: TpOverlapOpt = None,
    prefetch_receives: PrefetchReceivesOpt = None,
    config: Annotated[
        Path | None,
        typer.Option("--config", help="Run document (paratrain plan -o) or a ParallelConfig file; flags override it."),
    ] = None,
    overlap_grad_reduce: Annotated[
        bool,
        typer.Option(
            "--overlap-grad-reduce/--no-overlap-grad-reduce",
            help="Reduce each chunk's gradients as soon as its backward is done (default) or after all backward work.",
        ),
    ] = True,
    trace: Annotated[Path | None, typer.Option("--trace", help="Write a Chrome trace (Perfetto) JSON.")] = None,
    plot: Annotated[Path | None, typer.Option("--plot", help="Write a PNG timeline.")] = None,
    comm_log: Annotated[bool, typer.Option("--comm-log", help="Include every transfer/collective in --json.")] = False,
    duration_cv: Annotated[float | None, typer.Option(
        "--duration-cv", help="Variation of each action's duration (std / mean): report the mean over --samples "
        "draws. Default: the device's (paratrain calibrate measures it on a CPU; GPU presets 0).")] = None,
    samples: Annotated[int | None, typer.Option(
        "--samples", help="Draws of the action durations when they vary (default 32).")] = None,
    fill: Annotated[str | None, typer.Option(
        "--fill", help="Fill the bubbles with work: 'kfac' places K-FAC's curvature, factor all-reduce and "
        "inversions (PipeFisher); adds utilization with/without fillers and the refresh interval.")] = None,
    # None: not given (inverse), so that a --kfac-inversion without --fill can be refused
    kfac_inversion: Annotated[str | None, typer.Option(
        "--kfac-inversion", help="With --fill kfac: 'inverse' (Cholesky, ~n³ FLOPs; default) or 'eigen' (~9n³).")
    ] = None,
    calibration: CalibrationOpt = None,
    json_out: JsonOpt = False,
) -> None:
    from paratrain.fileio import check_distinct_paths, check_output_path
    from paratrain.parallel.config import load_run_document
    from paratrain.sim import simulate_config
    from paratrain.sim.trace import plot_timeline

    for flag, path in (("--trace", trace), ("--plot", plot)):
        if path is not None:
            check_output_path(path, flag)  # before any work: a typo costs seconds
    check_distinct_paths({"--trace": trace, "--plot": plot},
                         {"--config": config, "--model": model, "--cluster": cluster, "--device": device})
    if fill is not None and fill != "kfac":
        raise ConfigError("--fill", f"unknown filler work {fill!r}", "use --fill kfac")
    if kfac_inversion is not None and fill is None:
        raise ConfigError("--kfac-inversion", "inverts K-FAC's factors placed by --fill kfac, which is not given",
                          "add --fill kfac, or drop --kfac-inversion")
    if kfac_inversion is None:
        kfac_inversion = "inverse"
    if kfac_inversion not in ("inverse", "eigen"):
        raise ConfigError("--kfac-inversion", f"unknown method {kfac_inversion!r}", "use inverse or eigen")
    if comm_log and not json_out:  # the log is a key of the JSON report; the tables have no place for it
        raise ConfigError("--comm-log", "adds the transfers to the --json report, which is not asked for",
                          "add --json, or drop --comm-log")
    doc: dict[str, Any] = load_run_document(config) if config is not None else {}
    overrides = dict(layers=layers, hidden=hidden, heads=heads, kv_heads=kv_heads, ffn=ffn, seq=seq, vocab=vocab,
                     dropout=dropout)
    spec = _resolve_model(model, doc, overrides)
    base = doc.get("parallel")
    if gpus is not None:
        from paratrain.errors import require_at_most
        from paratrain.spec.cluster import MAX_DEVICES

        require_at_most("--gpus", gpus, MAX_DEVICES, "devices")
    if dp is None and gpus is not None and base is None:
        t_, p_, c_ = tp or 1, pp or 1, cp or 1
        if gpus % (t_ * p_ * c_):
            raise ConfigError(
                "--gpus",
                f"{gpus} GPUs are not divisible by tp({t_})*pp({p_})*cp({c_}) = {t_ * p_ * c_}",
                "pick tp, pp and cp whose product divides the GPU count",
            )
        dp = gpus // (t_ * p_ * c_)
    cfg = parallel_from_opts(
        base,
        dp=dp,
        tp=tp,
        pp=pp,
        cp=cp,
        microbatch=microbatch,
        global_batch=global_batch,
        schedule=schedule,
        virtual_stages=virtual_stages,
        recompute=recompute,
        sequence_parallel=sequence_parallel,
        optimizer_sharding=optimizer_sharding,
        sharding=sharding,
        compression=compress,
        compression_density=density,
        attention=attention,
        gemm_dtype=gemm_dtype,
        tp_overlap=tp_overlap,
        fp8_weight_cache=fp8_weight_cache,
        prefetch_receives=prefetch_receives,
    )
    check_density_applies(cfg.compression, density)  # after a run document's compression
    if gpus is not None and cfg.world_size != gpus:
        raise ConfigError(
            "--gpus",
            f"{cfg.degrees_text} = {cfg.world_size} != {gpus} GPUs",
            "make dp*tp*pp" + ("*cp" if cfg.cp > 1 else "") + " equal the GPU count",
        )
    if gpus is None and nodes is None:
        gpus = cfg.world_size  # size the cluster to the job
    clus = _resolve_cluster(cluster, doc, device, nodes, gpus)
    # A run document's own cluster is the one it was planned on, calibrated or not: the default
    # calibration applied again would scale its inter-node bandwidth a second time.
    if not (calibration is None and cluster is None and device is None and isinstance(doc.get("cluster"), dict)):
        clus = apply_calibration(clus, calibration)
    if cfg.world_size > clus.num_devices:
        raise ConfigError(
            "dp*tp*pp",
            f"{cfg.degrees_text} = {cfg.world_size} exceeds the "
            f"{clus.num_devices} devices of the cluster",
            "use more --nodes/--gpus or smaller sizes",
        )
    if duration_cv is not None and not 0 <= duration_cv <= 1:
        raise ConfigError("--duration-cv", f"must be in [0, 1], got {duration_cv}", "give e.g. 0.1, or 0 for none")
    # Each draw simulates the whole iteration again; the mean's standard error falls as 1/sqrt(n),
    # so past a thousand draws more buys nothing but time.
    if samples is not None and not 1 <= samples <= 1024:
        raise ConfigError("--samples", f"must be in 1..1,024, got {samples:,}", "give e.g. 32")
    cv = clus.device.duration_cv if duration_cv is None else duration_cv
    if cv > 0 and samples != 0:
        from paratrain.sim.limits import check_sample_size
        from paratrain.sim.variability import DEFAULT_SAMPLES

        # about six actions per (rank, micro-batch, chunk); asynchronous schedules cover four steps
        steps = 4 if cfg.schedule.is_async else 1
        actions = 6 * cfg.pp * cfg.num_microbatches * cfg.virtual_stages * steps
        check_sample_size(actions, DEFAULT_SAMPLES if samples is None else samples, "--samples")
    res = simulate_config(
        spec, clus, cfg, overlap_grad_reduce=overlap_grad_reduce, record=bool(trace or plot or comm_log),
        duration_cv=duration_cv, samples=samples,
    )
    kfac = None
    if fill is not None:
        from paratrain.sim.fill import fill_kfac_config

        kfac = fill_kfac_config(spec, clus, cfg, method=kfac_inversion, grad_buckets=overlap_grad_reduce)
    if trace is not None:
        from paratrain.trace import write_trace

        write_trace(
            trace,
            kfac.events if kfac is not None else res.events,
            field="--trace",
            title=f"{spec.name} {cfg.schedule}",
            metadata={"source": "paratrain simulate (predicted)", "model": spec.name, "model_spec": spec.to_dict(),
                      "cluster": clus.name, "parallel": cfg.to_dict()},
        )
    if plot is not None:
        title = (
            f"{spec.name}: {cfg.schedule}, pp={cfg.pp} tp={cfg.tp} dp={cfg.dp}, {cfg.num_microbatches} "
            f"micro-batches, bubble {res.bubble_fraction:.1%}"
        )
        if kfac is not None:
            title += (f"\nK-FAC in the bubbles: {kfac.refresh_steps} steps per refresh, utilization "
                      f"{kfac.utilization_without_fillers:.1%} → {kfac.utilization_with_fillers:.1%}")
        import matplotlib.pyplot as plt

        from paratrain.fileio import atomic_write_png

        fig = plot_timeline(kfac.events if kfac is not None else res.events, cfg.pp, title=title)
        try:
            atomic_write_png(plot, fig, "--plot")
        finally:
            plt.close(fig)
    out = res.to_dict(comm_log=comm_log)
    out = {
        "model": spec.name,
        "cluster": clus.name,
        "gpus": cfg.world_size,
        "cp": cfg.cp,
        "sharding": cfg.sharding,
        "config": cfg.to_dict(),
        **out,
        "microbatches_per_pipeline": cfg.num_microbatches,
        # a what-if may not fit: say so instead of printing a peak no device has
        "usable_memory_bytes": clus.device.usable_memory_bytes,
        "fits_in_memory": res.peak_memory_bytes <= clus.device.usable_memory_bytes,
    }
    if kfac is not None:
        out.update(kfac.to_dict())
        out["kfac_filled_schedule"] = kfac.filled.to_dict()
    if json_out:
        print_json(out)
        return
    _print(out, res)
    if kfac is not None:
        print(f"K-FAC in the bubbles: utilization {out['utilization_without_fillers']:.1%} without fillers, "
              f"{out['utilization_with_fillers']:.1%} with; one refresh (curvature, factor all-reduce, inversion) "
              f"every {out['kfac_refresh_steps']} steps; step time with fillers "
              f"{out['iteration_time_with_fillers_s'] * 1e3:,.2f} ms; {out['kfac_serial_pieces']} pieces fit no "
              "bubble and run at a step's end; with the preconditioning at every optimizer step "
              f"{out['iteration_time_with_kfac_s'] * 1e3:,.2f} ms")
    for what, path in (("trace", trace), ("plot", plot)):
        if path is not None:
            print(f"wrote {what}: {path}")


def _gib(n: float | None) -> str:
    return "-" if n is None else f"{n / 2**30:,.2f} GiB"


def _print(out: dict[str, Any], res: Any) -> None:
    from rich.console import Console
    from rich.table import Table

    con = Console() if sys.stdout.isatty() else Console(width=150)
    c = out["config"]
    con.print(
        f"{out['model']} on {out['gpus']} × {out['cluster']}: dp={c['dp']} tp={c['tp']} pp={c['pp']} "
        + (f"cp={c['cp']} " if c.get("cp", 1) > 1 else "") +
        f"schedule={c['schedule']} v={c['virtual_stages']} micro-batch={c['microbatch']} "
        f"global batch={c['global_batch']} ({out['microbatches_per_pipeline']} micro-batches per pipeline) "
        f"recompute={c['recompute']}"
    )
    t = Table(title="Iteration")
    for col in ("iteration", "samples/s", "tokens/s", "TFLOP/s/GPU", "MFU", "HFU", "bubble", "peak memory"):
        t.add_column(col, justify="right")
    t.add_row(
        f"{out['iteration_time_s'] * 1e3:,.2f} ms",
        f"{out['samples_per_s']:,.1f}",
        f"{out['tokens_per_s']:,.0f}",
        f"{out['tflops_per_gpu']:,.1f}",
        f"{out['mfu']:.1%}",
        f"{out['hfu']:.1%}",
        f"{out['bubble_fraction']:.1%}",
        _gib(out["peak_memory_bytes"]),
    )
    con.print(t)
    if not out["fits_in_memory"]:
        con.print(f"does not fit: peak memory {_gib(out['peak_memory_bytes'])} per GPU, "
                  f"{_gib(out['usable_memory_bytes'])} usable (paratrain plan finds a layout that fits)")
    if out["samples"]:
        con.print(
            f"action durations vary (std / mean {out['duration_cv']:.3f}): iteration, busy, idle and bubble are means "
            f"over {out['samples']} draws (iteration std {out['iteration_time_std_s'] * 1e3:,.2f} ms; every action "
            f"at its mean: {out['nominal_iteration_time_s'] * 1e3:,.2f} ms). The timeline shows mean durations."
        )
    t = Table(title="Per pipeline rank (one tensor-parallel rank)")
    cached = any(m["fp8_weight_cache_bytes"] for m in out["memory_breakdown_by_rank"])  # --fp8-weight-cache
    for col in ("rank", "busy", "idle", "in-flight", "weights", "grads", "optimizer", "stashed",
                *(["FP8 cache"] if cached else []), "activations", "total"):
        t.add_column(col, justify="right")
    for r, m in enumerate(out["memory_breakdown_by_rank"]):
        t.add_row(
            str(r),
            f"{out['busy_s_by_rank'][r] * 1e3:,.2f} ms",
            f"{out['idle_s_by_rank'][r] * 1e3:,.2f} ms",
            str(out["peak_inflight_by_rank"][r]),
            _gib(m["weight_bytes"]),
            _gib(m["grad_bytes"]),
            _gib(m["optimizer_bytes"]),
            _gib(m["stashed_weight_bytes"]),
            *([_gib(m["fp8_weight_cache_bytes"])] if cached else []),
            _gib(m["activation_bytes"]),
            _gib(m["total_bytes"]),
        )
    con.print(t)
    t = Table(title="Communication per iteration (summed over the pipeline's ranks)")
    t.add_column("kind")
    t.add_column("time", justify="right")
    for k, v in out["comm_time_by_kind"].items():
        t.add_row(k, f"{v * 1e3:,.3f} ms")
    con.print(t)

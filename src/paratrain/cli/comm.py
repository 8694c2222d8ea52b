"""``paratrain comm``: tune the communication backends and characterize a run's communication.

Examples::

    paratrain comm tune -o comm-table.json                       # 2 processes, 1 KiB .. 4 MiB
    paratrain comm tune --nproc 4 --max-bytes 256MiB -o table.json  # the full range
    paratrain comm characterize --comm-log run.comm.jsonl --metrics run.metrics.jsonl --plot comm.png
    paratrain comm characterize --model gpt3-175b --gpus 1024 --global-batch 1536 \\
        --layout 8x8x16 --layout 32x8x4 --layout 128x8x1

The measurements are :mod:`paratrain.runtime.comm.tune`'s, the table's format
:mod:`paratrain.runtime.comm.table`'s, the report :mod:`paratrain.sim.characterize`'s.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Annotated, Any

import typer

from paratrain.cli.options import (
    CalibrationOpt,
    DeviceOpt,
    GlobalBatchOpt,
    GpusOpt,
    JsonOpt,
    MicrobatchOpt,
    NodesOpt,
    OptimizerShardingOpt,
    RecomputeOpt,
    ScheduleOpt,
    SequenceParallelOpt,
    VirtualStagesOpt,
    apply_calibration,
    flag_errors,
    parallel_from_opts,
    print_json,
    progress_bar,
)
from paratrain.errors import ConfigError, require_at_most
from paratrain.fileio import check_not_special

__all__ = ["register", "tune", "characterize", "parse_bytes"]

comm_app = typer.Typer(help="Tune communication backends; characterize a run's communication.",
                       no_args_is_help=True)


def register(app: typer.Typer) -> None:
    app.add_typer(comm_app, name="comm")


_MAX_THREADS = 1024  # beyond the cores of any one machine

_UNITS = {"": 1, "b": 1, "k": 2**10, "kb": 2**10, "kib": 2**10, "m": 2**20, "mb": 2**20, "mib": 2**20,
          "g": 2**30, "gb": 2**30, "gib": 2**30}


def parse_bytes(flag: str, text: str) -> int:
    """``"4MiB"`` -> 4194304 (binary units: K, KiB, KB all 1024)."""
    m = re.fullmatch(r"\s*(\d+)\s*([a-zA-Z]*)\s*", text)
    unit = m.group(2).lower() if m else ""
    if not m or unit not in _UNITS:
        raise ConfigError(flag, f"{text!r} is not a size", "give bytes with an optional unit, e.g. 4096, 64KiB, 4MiB")
    return int(m.group(1)) * _UNITS[unit]


def _size(n: float) -> str:
    for unit, k in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= k:
            v = n / k
            return f"{v:.0f} {unit}" if v == int(v) else f"{v:.1f} {unit}"
    return f"{n:.0f} B"


def _us(t: float) -> str:
    if t >= 10:
        return f"{t:,.1f} s"
    return f"{t * 1e6:,.0f} us" if t < 0.01 else f"{t * 1e3:,.1f} ms"


# ---- tune -------------------------------------------------------------------------------------------


@comm_app.command("tune", help="Time every operation on every backend over message sizes; write the tuning table.")
@flag_errors
def tune(
    output: Annotated[Path, typer.Option("--output", "-o", help="Write the tuning table (JSON) here.")] = Path(
        "comm-table.json"),
    nproc: Annotated[int, typer.Option("--nproc", help="Local processes (the world; groups: it, its halves, …).")] = 2,
    # None: not given (4MiB, 1KiB), so that a bound beside --sizes or --quick can be refused
    max_bytes: Annotated[str | None, typer.Option("--max-bytes", help="Largest message (default 4MiB; the issue's "
                                                  "full range: 256MiB).")] = None,
    min_bytes: Annotated[str | None, typer.Option("--min-bytes", help="Smallest message (default 1KiB).")] = None,
    sizes: Annotated[str | None, typer.Option("--sizes", help="Exact sizes instead of the ×4 grid, e.g. "
                                              "1KiB,64KiB,4MiB.")] = None,
    quick: Annotated[bool, typer.Option("--quick", help="1 KiB .. 256 KiB, 5 repeats: a smoke test in seconds.")
                     ] = False,
    backend: Annotated[list[str] | None, typer.Option("--backend", help="Measure only these (repeatable): gloo, "
                                                      "gloo_1t, nccl, mpi. Default: every available one.")] = None,
    op: Annotated[list[str] | None, typer.Option("--op", help="Measure only these operations (repeatable).")] = None,
    repeats: Annotated[int, typer.Option("--repeats", help="Timed calls per point (median; fewer for big "
                                         "messages, at least 3).")] = 10,
    warmup: Annotated[int, typer.Option("--warmup", help="Untimed calls per point first.")] = 2,
    threads: Annotated[int, typer.Option("--threads", help="Torch threads per process.")] = 1,
    json_out: JsonOpt = False,
) -> None:
    from paratrain.fileio import check_output_path
    from paratrain.runtime.comm.table import write_table
    from paratrain.runtime.comm.tune import check_sizes, fit_alpha_beta_by_op, message_sizes
    from paratrain.runtime.comm.tune import tune as run_tune

    check_output_path(output, "--output")
    if threads < 1:
        raise ConfigError("--threads", f"must be at least 1, got {threads}", "use 1")
    # torch.set_num_threads overflows in the workers past an int, and far below that the
    # processes only oversubscribe the cores
    require_at_most("--threads", threads, _MAX_THREADS, "threads per process")
    # --sizes and --quick each give the whole list of message sizes: a flag beside them would be ignored
    if sizes is not None and quick:
        raise ConfigError("--quick", "measures its own sizes (1 KiB .. 256 KiB), and --sizes lists others",
                          "drop --quick or --sizes")
    grid_flag = "--sizes" if sizes is not None else "--quick" if quick else None
    for flag, value in (("--min-bytes", min_bytes), ("--max-bytes", max_bytes)):
        if value is not None and grid_flag is not None:
            raise ConfigError(flag, f"bounds the ×4 grid of message sizes, which {grid_flag} replaces",
                              f"drop {flag} or {grid_flag}")
    if sizes is not None:
        grid = tuple(parse_bytes("--sizes", s) for s in sizes.split(",") if s.strip())
        if not grid:
            raise ConfigError("--sizes", "lists no size", "e.g. --sizes 1KiB,64KiB,4MiB")
        check_sizes(grid)
    elif quick:
        grid = message_sizes(2**10, 2**18)
        repeats = min(repeats, 5)
    else:
        grid = message_sizes(parse_bytes("--min-bytes", "1KiB" if min_bytes is None else min_bytes),
                             parse_bytes("--max-bytes", "4MiB" if max_bytes is None else max_bytes))
    with progress_bar("tuning", json_out) as tick:
        res = run_tune(nproc, backends=backend or None, ops=op or None, sizes=grid, warmup=warmup, repeats=repeats,
                       threads=threads, progress=tick)
    write_table(output, res.table, "--output")
    fits = fit_alpha_beta_by_op(res.table)
    if json_out:
        print_json({"path": str(output), "seconds": res.seconds, "skipped_backends": res.skipped,
                    **res.table.to_dict(), "fit": [f.to_dict() for f in fits]})
        return
    t = res.table
    print(f"{nproc} processes, {threads} thread(s) each; backends: {', '.join(b for b in t.backends)}"
          + "".join(f"; skipped {b} ({why})" for b, why in res.skipped.items()))
    backends = [b for b in t.backends if any(m.backend == b for m in t.measurements)]
    keys = sorted({(m.op, m.group_size) for m in t.measurements}, key=lambda k: (_op_order(k[0]), -k[1]))
    for op_name, g in keys:
        print(f"\n{op_name} over {g} ranks (median per call)")
        print(f"  {'size':>9}  " + "  ".join(f"{b:>10}" for b in backends) + "  chosen")
        for s in sorted({m.bytes for m in t.measurements if (m.op, m.group_size) == (op_name, g)}):
            cells = [t.time_s(op_name, b, g, s) for b in backends]
            print(f"  {_size(s):>9}  " + "  ".join(f"{_us(c):>10}" if c is not None else f"{'-':>10}" for c in cells)
                  + f"  {t.choose(op_name, s, g)}")
    print("\nalpha-beta fitted on the ring formulas of the cost model (alpha per message, beta the link):")
    for f in fits:
        print(f"  {f.op:<15} {f.backend:<8} alpha {f.latency_s * 1e6:8.1f} us  beta {f.bandwidth_Bps / 1e9:7.2f} GB/s")
    print(f"wrote {output} in {res.seconds:.1f} s (paratrain train --comm-table {output}; "
          f"paratrain calibrate --comm-table {output})")


def _op_order(op: str) -> int:
    from paratrain.runtime.comm.table import OPS

    return OPS.index(op) if op in OPS else len(OPS)


# ---- characterize -----------------------------------------------------------------------------------


def _read_jsonl(path: Path, field: str) -> list[dict[str, Any]]:
    from paratrain.sim.characterize import parse_jsonl

    check_not_special(path, field, "give the file paratrain train wrote")
    if not path.is_file():  # a directory exists but is no log: say which
        problem = f"{str(path)!r} is a directory" if path.is_dir() else f"file {str(path)!r} does not exist"
        raise ConfigError(field, problem, "give the file paratrain train wrote")
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(field, f"cannot read {str(path)!r}: {e}", "check the file") from None
    return parse_jsonl(text, field)


def _parse_layout(text: str) -> tuple[int, int, int]:
    m = re.fullmatch(r"\s*(\d+)\s*[x×,]\s*(\d+)\s*[x×,]\s*(\d+)\s*", text)
    if not m or min(int(g) for g in m.groups()) < 1:
        raise ConfigError("--layout", f"{text!r} is not DPxTPxPP", "e.g. --layout 8x8x16")
    return int(m.group(1)), int(m.group(2)), int(m.group(3))


@comm_app.command("characterize", help="Communication volume and time by operation, axis and message size, "
                  "and its share of the step: of a measured run (--comm-log) or of simulated layouts (--model).")
@flag_errors
def characterize(
    comm_log: Annotated[list[Path] | None, typer.Option("--comm-log", help="JSON lines of paratrain train "
                                                         "--comm-log (repeatable: one file per rank).")] = None,
    metrics: Annotated[Path | None, typer.Option("--metrics", help="The run's paratrain train --metrics file "
                                                 "(for the step time).")] = None,
    model: Annotated[str | None, typer.Option("--model", "-m", help="Simulate this model instead.")] = None,
    config: Annotated[Path | None, typer.Option("--config", help="Run document (paratrain plan -o) to simulate.")
                      ] = None,
    cluster: Annotated[str | None, typer.Option("--cluster", "-c", help="Cluster preset or file (default "
                                                "dgx-a100).")] = None,
    device: DeviceOpt = None,
    nodes: NodesOpt = None,
    gpus: GpusOpt = None,
    dp: Annotated[int | None, typer.Option("--dp", help="Data-parallel degree (default GPUs / (tp*pp)).")] = None,
    tp: Annotated[int | None, typer.Option("--tp", help="Tensor-parallel degree.")] = None,
    pp: Annotated[int | None, typer.Option("--pp", help="Pipeline stages.")] = None,
    layout: Annotated[list[str] | None, typer.Option("--layout", help="DPxTPxPP to compare (repeatable), "
                                                     "e.g. 8x8x16.")] = None,
    microbatch: MicrobatchOpt = None,
    global_batch: GlobalBatchOpt = None,
    schedule: ScheduleOpt = None,
    virtual_stages: VirtualStagesOpt = None,
    recompute: RecomputeOpt = None,
    sequence_parallel: SequenceParallelOpt = None,
    optimizer_sharding: OptimizerShardingOpt = None,
    dtype: Annotated[str | None, typer.Option("--dtype", help="Training dtype of the simulated layout (default "
                                              "bf16; paratrain train runs fp32).")] = None,
    calibration: CalibrationOpt = None,
    plot: Annotated[Path | None, typer.Option("--plot", help="Write a PNG of the report.")] = None,
    json_out: JsonOpt = False,
) -> None:
    from paratrain.fileio import check_distinct_paths, check_output_path
    from paratrain.sim.characterize import CommProfile, calls_from_rows, simulate_profile, step_time_from_metrics
    from paratrain.sim.characterize import characterize as make_profile

    if plot is not None:
        check_output_path(plot, "--plot")
        check_distinct_paths({"--plot": plot}, {"--comm-log": comm_log, "--metrics": metrics, "--config": config,
                                                "--model": model, "--cluster": cluster, "--device": device})
    if layout:  # each --layout sets dp, tp and pp; a degree flag beside it would be ignored
        for flag, value in (("--dp", dp), ("--tp", tp), ("--pp", pp)):
            if value is not None:
                raise ConfigError(flag, "is set by each --layout DPxTPxPP", f"drop {flag} or put it in --layout")
    simulated = model is not None or config is not None
    profiles: list[CommProfile] = []
    # both: the measured run beside the simulator's prediction of its layout, one table
    if comm_log:
        if (layout or dp or tp or pp) and not simulated:
            raise ConfigError("--layout", "applies to simulated layouts only", "drop it or add --model")
        rows: list[dict[str, Any]] = []
        for p in comm_log:
            rows += _read_jsonl(p, "--comm-log")
        calls, ranks, steps = calls_from_rows(rows)
        step_s = step_time_from_metrics(_read_jsonl(metrics, "--metrics")) if metrics is not None else None
        profiles.append(make_profile(calls, ranks=ranks, steps=steps, step_time_s=step_s, source="measured",
                                     label="measured run"))
    if simulated:
        if metrics is not None and not comm_log:
            raise ConfigError("--metrics", "goes with --comm-log (a measured run)", "drop --metrics")
        from paratrain.cli.simulate import _resolve_cluster, _resolve_model
        from paratrain.parallel.config import load_run_document

        doc: dict[str, Any] = load_run_document(config) if config is not None else {}
        spec = _resolve_model(model, doc, {})
        layouts = [_parse_layout(s) for s in layout] if layout else [(dp, tp, pp)]
        for d, t, p in layouts:
            if d is None and gpus is not None and doc.get("parallel") is None:
                if gpus % ((t or 1) * (p or 1)):
                    raise ConfigError("--gpus", f"{gpus} GPUs are not divisible by tp*pp = {(t or 1) * (p or 1)}",
                                      "pick tp and pp whose product divides the GPU count")
                d = gpus // ((t or 1) * (p or 1))
            cfg = parallel_from_opts(doc.get("parallel"), dp=d, tp=t, pp=p, microbatch=microbatch,
                                     global_batch=global_batch, schedule=schedule, virtual_stages=virtual_stages,
                                     recompute=recompute, sequence_parallel=sequence_parallel, dtype=dtype,
                                     optimizer_sharding=optimizer_sharding)
            if gpus is not None and cfg.world_size != gpus:
                raise ConfigError("--layout", f"dp({cfg.dp})*tp({cfg.tp})*pp({cfg.pp}) = {cfg.world_size} != "
                                  f"{gpus} GPUs", "make dp*tp*pp equal the GPU count")
            clus = _resolve_cluster(cluster, doc, device, nodes, gpus if gpus is not None else cfg.world_size)
            # a run document's own cluster was planned calibrated already (as in paratrain simulate)
            own_cluster = cluster is None and device is None and isinstance(doc.get("cluster"), dict)
            if not (calibration is None and own_cluster):
                clus = apply_calibration(clus, calibration)
            profiles.append(simulate_profile(spec, clus, cfg, label=f"dp{cfg.dp} tp{cfg.tp} pp{cfg.pp}"))
    if not profiles:
        raise ConfigError("--comm-log", "nothing to characterize",
                          "give --comm-log FILE (a measured run) or --model NAME (a simulated layout)")
    if plot is not None:
        import matplotlib.pyplot as plt

        from paratrain.fileio import atomic_write_png
        from paratrain.sim.characterize import plot_profile

        fig = plot_profile(profiles)
        try:
            atomic_write_png(plot, fig, "--plot")
        finally:
            plt.close(fig)
    if json_out:
        print_json(profiles[0].to_dict() if len(profiles) == 1 else {"layouts": [p.to_dict() for p in profiles]})
        return
    if len(profiles) > 1:
        _print_comparison(profiles)
    else:
        _print_profile(profiles[0])
    if plot is not None:
        print(f"wrote {plot}")


def _share(p: Any, blocking: bool = False) -> str:
    s = p.blocking_share if blocking else p.comm_share
    return "-" if s is None else f"{s:.0%}"


def _print_profile(p: Any) -> None:
    step = "" if p.step_time_s is None else f", step {_us(p.step_time_s)}"
    blocking = "" if p.blocking_share is None else f" ({p.blocking_share:.0%} in blocking calls)"
    if p.fits_in_memory is False:
        print("(this layout does not fit in the device's memory: paratrain simulate shows the breakdown)")
    print(f"{p.label or p.source}: {p.ranks} rank(s), {p.steps} step(s){step}; per rank per step: "
          f"{p.total.calls:,.0f} calls, {_size(p.total.bytes)}, {_us(p.total.time_s)} = {_share(p)} of the step"
          f"{blocking}")
    for title, rows in (("by operation", p.by_op.items()), ("by axis", p.by_axis.items()),
                        ("by message size", [(f">= {_size(lo)}" if lo is not None else "unknown", s)
                                             for lo, s in p.histogram])):
        print(f"  {title}:")
        for k, s in rows:
            share = s.time_s / p.total.time_s if p.total.time_s > 0 else 0.0
            print(f"    {k:<26} {s.calls:>9,.1f} calls  {_size(s.bytes):>10}  {_us(s.time_s):>10}  "
                  f"{share:4.0%} of comm")


def _print_comparison(profiles: list[Any]) -> None:
    axes = [a for a in ("dp", "tp", "pp", "none") if any(a in p.by_axis for p in profiles)]
    head = f"{'layout':<16} {'fits':>4} {'step':>9} {'comm':>9} {'share':>6} {'block':>6} " + \
        " ".join(f"{a + ' vol':>10}" for a in axes) + " " + " ".join(f"{a + ' time':>10}" for a in axes)
    print("per rank per step (simulated)")
    print(head)
    for p in profiles:
        vol = " ".join(f"{_size(p.by_axis[a].bytes) if a in p.by_axis else '-':>10}" for a in axes)
        tim = " ".join(f"{_us(p.by_axis[a].time_s) if a in p.by_axis else '-':>10}" for a in axes)
        fits = {True: "yes", False: "no", None: "-"}[p.fits_in_memory]
        print(f"{p.label:<16} {fits:>4} {_us(p.step_time_s):>9} {_us(p.total.time_s):>9} {_share(p):>6} "
              f"{_share(p, True):>6} {vol} {tim}")

"""``paratrain schedule show``: generate (or load) a pipeline schedule, validate it, and show it.

Examples::

    paratrain schedule show --schedule chimera --stages 4 --microbatches 8
    paratrain schedule show --schedule interleaved --stages 4 --microbatches 8 --virtual-stages 2 --json
    paratrain schedule show --schedule zb-h1 --stages 4 --microbatches 8 --plot zb.png --trace zb.json
    paratrain schedule show --schedule 1f1b --stages 2 --microbatches 2 --save my.json   # then edit
    paratrain schedule show --file my.json                                                # validate + render
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

from paratrain.cli.options import JsonOpt, as_flag_error, print_json
from paratrain.errors import ConfigError

__all__ = ["register", "show"]

schedule_app = typer.Typer(help="Pipeline schedules: generate, validate, render.", no_args_is_help=True)

# schedule show names the generator's own parameters (not the parallel layout's --pp, --global-batch)
_SHOW_FLAGS = {"stages": "--stages", "microbatches": "--microbatches", "virtual_stages": "--virtual-stages",
               "iterations": "--iterations", "schedule": "--schedule"}


def register(app: typer.Typer) -> None:
    app.add_typer(schedule_app, name="schedule")


@schedule_app.command("show", help="Generate or load a schedule, validate it, and render its timeline.")
def show(
    schedule: Annotated[
        str | None,
        typer.Option("--schedule", "-s", help="gpipe, 1f1b, interleaved, chimera, pipedream, 2bw or zb-h1."),
    ] = None,
    stages: Annotated[int | None, typer.Option("--stages", "-p", help="Pipeline ranks (default 4).")] = None,
    microbatches: Annotated[
        int | None, typer.Option("--microbatches", "-m", help="Micro-batches per iteration (default 8).")
    ] = None,
    virtual_stages: Annotated[
        int | None, typer.Option("--virtual-stages", "-v", help="Chunks per rank (interleaved; default 2).")
    ] = None,
    iterations: Annotated[
        int | None, typer.Option("--iterations", help="Batches generated for pipedream/2bw (default 4).")
    ] = None,
    file: Annotated[Path | None, typer.Option("--file", "-f", help="Load a schedule from a JSON/YAML file.")] = None,
    forward_time: Annotated[float, typer.Option("--forward-time", help="Uniform forward duration.")] = 1.0,
    backward_time: Annotated[
        float, typer.Option("--backward-time", help="Uniform backward duration (I and W take half each).")
    ] = 2.0,
    plot: Annotated[Path | None, typer.Option("--plot", help="Write a PNG timeline.")] = None,
    trace: Annotated[Path | None, typer.Option("--trace", help="Write a Chrome trace (Perfetto) JSON.")] = None,
    save: Annotated[Path | None, typer.Option("--save", help="Write the schedule IR as JSON.")] = None,
    actions: Annotated[bool, typer.Option("--actions", help="Also print every rank's action list.")] = False,
    fill: Annotated[str | None, typer.Option(
        "--fill", help="'kfac': fill the bubbles with K-FAC pieces of uniform sizes (curvature 0.25 per micro-batch "
        "and chunk, all-reduce 0.5, two inversions of 1) and show the filled steps of one refresh cycle.")] = None,
    json_out: JsonOpt = False,
) -> None:
    from paratrain.fileio import atomic_write_png, atomic_write_text, check_distinct_paths, check_output_path
    from paratrain.schedule import Schedule, generate, validate
    from paratrain.schedule.pipedream import DEFAULT_ASYNC_ITERATIONS
    from paratrain.sim import simulate
    from paratrain.sim.limits import check_plot_size, check_show_actions, check_show_size
    from paratrain.sim.trace import ascii_timeline, plot_timeline
    from paratrain.trace import write_trace

    for flag, path in (("--plot", plot), ("--trace", trace), ("--save", save)):
        if path is not None:
            check_output_path(path, flag)
    check_distinct_paths({"--plot": plot, "--trace": trace, "--save": save}, {"--file": file})
    if file is not None:
        if schedule is not None:
            raise ConfigError("--file", "give either --file or --schedule, not both", "drop one of them")
        shape = {"--stages": stages, "--microbatches": microbatches, "--virtual-stages": virtual_stages,
                 "--iterations": iterations}
        for flag, value in shape.items():
            if value is not None:  # the file fixes the shape; a flag would be silently ignored
                raise ConfigError(flag, "sizes a generated schedule; the --file schedule has its own",
                                  f"drop {flag}, or generate with --schedule")
        from paratrain.spec._files import load_document

        doc = load_document(file, "--file")
        rows = doc.get("actions") if isinstance(doc, dict) else None
        if isinstance(rows, list):  # refuse a huge file before parsing every action
            check_show_actions(sum(len(row) for row in rows if isinstance(row, list)), "--file")
        sched = Schedule.from_dict(doc, "--file")
    else:
        if schedule is None:
            raise ConfigError("--schedule", "no schedule given", "pass --schedule NAME or --file FILE")
        stages = 4 if stages is None else stages
        microbatches = 8 if microbatches is None else microbatches
        v = virtual_stages if virtual_stages is not None else (2 if schedule.lower() == "interleaved" else 1)
        its = iterations if iterations is not None else (
            DEFAULT_ASYNC_ITERATIONS if schedule.lower() in ("pipedream", "2bw") else 1
        )
        if stages >= 1 and microbatches >= 1 and v >= 1 and its >= 1:  # else the generator names the bad flag
            check_show_size(stages, microbatches, v, its)
        try:
            sched = generate(
                schedule, stages=stages, microbatches=microbatches, virtual_stages=v, iterations=iterations
            )
        except ConfigError as e:
            raise as_flag_error(e, _SHOW_FLAGS) from None
    if plot is not None:  # one box per compute action
        check_plot_size([a for row in sched.actions for a in row if a.is_compute], "--plot")
    check = validate(sched)
    res = simulate(sched, forward=forward_time, backward=backward_time, record=True)
    kfac = None
    if fill is not None:
        if fill != "kfac":
            raise ConfigError("--fill", f"unknown filler work {fill!r}", "use --fill kfac")
        from paratrain.sim.fill import fill_kfac, uniform_kfac_work
        from paratrain.sim.timing import uniform_timing

        kfac = fill_kfac(sched, uniform_timing(sched, forward_time, backward_time), uniform_kfac_work(sched))
    if plot is not None:
        fig = plot_timeline(
            kfac.events if kfac is not None else res.events,
            sched.stages,
            unit_label="time (units of one forward)" if forward_time == 1 else "time",
            title=f"{sched.name}: {sched.stages} stages, {sched.microbatches} micro-batches"
            f", bubble {res.bubble_fraction:.1%}" + (
                f"; K-FAC fillers over {kfac.refresh_steps} steps" if kfac is not None else ""),
        )
        atomic_write_png(plot, fig, "--plot")
    if trace is not None:
        events = kfac.events if kfac is not None else res.events
        write_trace(trace, events, field="--trace", title=sched.name, time_unit_s=1.0,
                    metadata={"source": "paratrain schedule show (uniform durations)", "schedule": sched.name,
                              "stages": sched.stages, "microbatches": sched.microbatches,
                              "iterations": sched.iterations, "forward_time": forward_time,
                              "backward_time": backward_time})
    if save is not None:
        saved = kfac.filled.to_dict() if kfac is not None else sched.to_dict()
        atomic_write_text(save, json.dumps(saved, indent=1) + "\n", "--save")
    kfac_out = {} if kfac is None else {
        "utilization_without_fillers": kfac.utilization_without_fillers,
        "utilization_with_fillers": kfac.utilization_with_fillers,
        "kfac_refresh_steps": kfac.refresh_steps,
        "iteration_time_with_fillers": kfac.iteration_time_with_fillers_s / forward_time,
        "kfac_serial_pieces": kfac.serial_pieces,
        "kfac_filled_schedule": kfac.filled.to_dict(),
    }
    if json_out:
        print_json(
            {
                "schedule": sched.name,
                "stages": sched.stages,
                "microbatches": sched.microbatches,
                "virtual_stages": sched.virtual_stages,
                "replicas": sched.num_replicas,
                "iterations": sched.iterations,
                "forward_time": forward_time,
                "backward_time": backward_time,
                "iteration_time": res.iteration_time_s / forward_time,
                "bubble_fraction": res.bubble_fraction,
                "busy_by_rank": [b / forward_time for b in res.busy_s_by_rank],
                "idle_by_rank": [i / forward_time for i in res.idle_s_by_rank],
                "peak_inflight_by_rank": list(check.peak_inflight_by_rank),
                "weight_versions_by_rank": list(check.weight_versions_by_rank),
                "p2p_batches_by_rank": list(check.p2p_batches_by_rank),
                "actions": sum(len(row) for row in sched.actions),
                **kfac_out,
            }
        )
        return
    print(
        f"{sched.name}: {sched.stages} stages, {sched.microbatches} micro-batches, {sched.virtual_stages} chunk(s)"
        f" per rank, {sched.num_replicas} replica(s); forward {forward_time:g}, backward {backward_time:g}"
    )
    width = 160
    print(ascii_timeline(res.events, sched.stages, unit=min(forward_time, backward_time / 2), width=width))
    it = res.iteration_time_s
    if sched.iterations >= 3:
        print(f"steady-state iteration time: {it:g} (per batch of {sched.microbatches}; no flush)")
    else:
        print(f"iteration time: {it:g}")
    print(f"bubble fraction: {res.bubble_fraction:.4f}")
    print("peak in-flight micro-batches by rank: " + " ".join(map(str, check.peak_inflight_by_rank)))
    if max(check.weight_versions_by_rank) > 1:
        print("weight versions by rank: " + " ".join(map(str, check.weight_versions_by_rank)))
    if actions and kfac is None:
        print(sched.to_text())
    if kfac is not None:
        print(f"K-FAC in the bubbles: utilization {kfac.utilization_without_fillers:.4f} without fillers, "
              f"{kfac.utilization_with_fillers:.4f} with; one refresh every {kfac.refresh_steps} steps; "
              f"step time with fillers {kfac.iteration_time_with_fillers_s:g}")
        for i, s in enumerate(kfac.filled.iterations):
            print(f"step {i} of the cycle:")
            print(s.to_text())
    for what, path in (("plot", plot), ("trace", trace), ("schedule", save)):
        if path is not None:
            print(f"wrote {what}: {path}")

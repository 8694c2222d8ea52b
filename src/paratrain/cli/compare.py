"""``paratrain compare MEASURED SIMULATED``: a measured timeline next to the simulator's prediction.

Both files are Chrome traces in the simulator's format (``paratrain train --trace``,
``paratrain simulate --trace``): ``pid`` = pipeline rank, thread 0 = compute, thread 1 =
communication, times in microseconds. Example::

    paratrain train --model gpt-tiny --layers 4 --pp 2 --nproc 2 --schedule 1f1b --steps 5 --trace m.json
    paratrain simulate --model gpt-tiny --layers 4 --cluster cpu --gpus 2 --pp 2 --microbatch 2 \\
        --global-batch 8 --schedule 1f1b --trace s.json
    paratrain compare m.json s.json --plot both.png

Both sides are measured with the simulator's definitions (``paratrain.sim.report``): busy = compute
actions and optimizer steps on a rank; iteration time = first action to last finish of one step
(for asynchronous schedules covering ``K ≥ 3`` steps: the steady-state period between the ends of
batch 0 and batch ``K-2`` on each rank, averaged); bubble fraction = mean over ranks of
idle / iteration time. A measured trace holds every step (``args.step``); the last one is compared
unless ``--step`` says otherwise (the first step includes warm-up effects). A ``--step`` the trace
does not hold (or a trace without steps, or an asynchronous run's) is refused. It also reports how
much the durations of repeated actions vary in the measured run (:func:`duration_variation`), the
input of the simulator's variable-duration mode (``paratrain simulate --duration-cv``).
"""

from __future__ import annotations

from typing import Annotated, Any

import typer

from paratrain.cli.options import JsonOpt, print_json
from paratrain.errors import ConfigError
from paratrain.fileio import atomic_write_png, check_distinct_paths, check_output_path
from paratrain.sim.limits import check_plot_size
from paratrain.trace import (
    TraceEvent,
    check_same_run,
    read_trace,
    run_variation,
    select_step,
    shift_to_zero,
    timeline_stats,
    trace_origin,
)

__all__ = ["register", "compare"]


def register(app: typer.Typer) -> None:
    app.command("compare", help="Measured vs simulated timeline: busy time, bubble, iteration time; one PNG.")(compare)


def compare(
    measured: Annotated[str, typer.Argument(help="Measured trace (paratrain train --trace).")],
    simulated: Annotated[str, typer.Argument(help="Simulated trace (paratrain simulate --trace).")],
    step: Annotated[int | None, typer.Option("--step", help="Step of the measured trace (default: the last).")] = None,
    microbatches: Annotated[int | None, typer.Option("--microbatches", help="Micro-batches per step (default: "
                            "the measured trace's metadata).")] = None,
    iterations: Annotated[int | None, typer.Option("--iterations", help="Steps one timeline covers: 1 for "
                          "synchronous schedules; asynchronous: the generated batches (default: metadata).")] = None,
    sim_iterations: Annotated[int | None, typer.Option("--sim-iterations", help="Steps the simulated timeline "
                              "covers (default: 1 for synchronous, 4 for asynchronous schedules).")] = None,
    plot: Annotated[str | None, typer.Option("--plot", help="Write both timelines, one above the other, to this PNG.")]
    = None,
    json_out: JsonOpt = False,
) -> None:
    if plot is not None:
        check_output_path(plot, "--plot")
        check_distinct_paths({"--plot": plot}, {"MEASURED": measured, "SIMULATED": simulated})
    m_events, meta = read_trace(measured, "MEASURED")
    s_events, s_meta = read_trace(simulated, "SIMULATED")
    if trace_origin(meta) == "predicted":
        raise ConfigError("MEASURED", f"{measured} is a simulated trace ({meta['source']})",
                          "give the measured trace (paratrain train --trace) first, the simulated one second")
    if trace_origin(s_meta) == "measured":
        raise ConfigError("SIMULATED", f"{simulated} is a measured trace ({s_meta['source']})",
                          "give the simulated trace (paratrain simulate --trace) second")
    check_same_run(meta, s_meta, "MEASURED", f"SIMULATED ({simulated})")
    mb = _meta_int(meta, "microbatches", measured) if microbatches is None else microbatches
    m_its = _meta_int(meta, "iterations", measured) if iterations is None else iterations
    is_async = m_its > 1
    s_its = (4 if is_async else 1) if sim_iterations is None else sim_iterations
    for name, v in (("--microbatches", mb), ("--iterations", m_its), ("--sim-iterations", s_its)):
        if v < 1:
            raise ConfigError(name, f"must be at least 1, got {v}", f"use {name} 1 or more")
    if step is not None and is_async:  # the steady-state period spans steps: none can be picked
        raise ConfigError("--step", f"the measured run is asynchronous ({m_its} iterations per timeline): its "
                          "trace is compared whole, by the steady-state period", "drop --step")
    chosen = None
    cv = run_variation(m_events, is_async)
    if not is_async:
        m_events, chosen = select_step(m_events, step)
    m_events = shift_to_zero(m_events)
    if plot is not None:
        for what, evs in (("MEASURED", m_events), ("SIMULATED", s_events)):
            check_plot_size(evs, what)
    ms = timeline_stats(m_events, microbatches=mb, iterations=m_its, field="MEASURED")
    ss = timeline_stats(s_events, microbatches=mb, iterations=s_its, field="SIMULATED")
    ranks = max(len(ms.busy_s_by_rank), len(ss.busy_s_by_rank))
    err = (ss.iteration_time_s - ms.iteration_time_s) / ms.iteration_time_s if ms.iteration_time_s > 0 else None
    out = {"measured": ms.to_dict(), "simulated": ss.to_dict(), "step": chosen,
           "iteration_time_rel_error": err,
           "bubble_fraction_diff_points": 100 * (ss.bubble_fraction - ms.bubble_fraction),
           "measured_duration_cv": cv, "plot": plot}
    if plot is not None:
        _plot(m_events, s_events, ranks, plot, f"{meta.get('schedule', '')}".strip())
    if json_out:
        print_json(out)
        return
    print(f"{'':<22}{'measured':>12}{'simulated':>12}{'difference':>14}")
    diff = f"{100 * err:>+13.1f}%" if err is not None else f"{'n/a':>14}"
    print(f"{'iteration time (s)':<22}{ms.iteration_time_s:>12.4g}{ss.iteration_time_s:>12.4g}{diff}")
    print(f"{'bubble fraction':<22}{100 * ms.bubble_fraction:>11.1f}%{100 * ss.bubble_fraction:>11.1f}%"
          f"{out['bubble_fraction_diff_points']:>+10.1f} pts")
    for r in range(ranks):
        mbusy = ms.busy_s_by_rank[r] if r < len(ms.busy_s_by_rank) else float("nan")
        sbusy = ss.busy_s_by_rank[r] if r < len(ss.busy_s_by_rank) else float("nan")
        rel = 100 * (sbusy - mbusy) / mbusy if mbusy else float("nan")
        print(f"{f'rank {r} busy (s)':<22}{mbusy:>12.4g}{sbusy:>12.4g}{rel:>+13.1f}%")
    if chosen is not None:
        print(f"(measured: step {chosen})")
    if cv is not None:
        print(f"measured variation of action durations (std / mean, steps after the first): {cv:.3f}; "
              f"`paratrain simulate --duration-cv {cv:.2f}` simulates with it")
    if plot is not None:
        print(f"wrote {plot}")


def _meta_int(meta: dict[str, Any], key: str, path: str) -> int:
    """An integer of the measured trace's metadata (1 when absent)."""
    v = meta.get(key, 1)
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not float(v).is_integer():
        raise ConfigError("MEASURED", f"{path}: metadata {key!r} = {v!r} is not an integer",
                          f"pass --{key} explicitly")
    return int(v)


def _plot(m_events: list[TraceEvent], s_events: list[TraceEvent], ranks: int, path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from paratrain.sim.trace import plot_timeline

    fig, axes = plt.subplots(2, 1, figsize=(14, 1.1 * ranks + 3), sharex=True)
    plot_timeline(m_events, ranks, title=f"measured {title}".strip(), ax=axes[0])
    plot_timeline(s_events, ranks, title=f"simulated {title}".strip(), ax=axes[1])
    end = max(max(e.start_s + e.duration_s for e in m_events), max(e.start_s + e.duration_s for e in s_events))
    axes[0].set_xlim(0, end)
    fig.tight_layout()
    atomic_write_png(path, fig, "--plot")
    plt.close(fig)

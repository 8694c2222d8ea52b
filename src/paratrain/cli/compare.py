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
unless ``--step`` says otherwise (the first step includes warm-up effects). It also reports how
much the durations of repeated actions vary in the measured run (:func:`duration_variation`), the
input of the simulator's variable-duration mode (``paratrain simulate --duration-cv``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any

import typer

from paratrain.cli.options import JsonOpt, print_json
from paratrain.errors import ConfigError

__all__ = ["register", "compare", "TimelineStats", "timeline_stats", "load_trace", "duration_variation",
           "run_variation"]

_COMPUTE = {"forward", "backward", "input", "weight", "optimizer", "filler"}


@dataclass(frozen=True)
class Span:
    rank: int
    stream: str
    name: str
    start_s: float
    duration_s: float
    category: str
    microbatch: int | None
    step: int | None


@dataclass(frozen=True)
class TimelineStats:
    iteration_time_s: float
    busy_s_by_rank: tuple[float, ...]
    bubble_fraction: float

    def to_dict(self) -> dict[str, Any]:
        return {"iteration_time_s": self.iteration_time_s, "busy_s_by_rank": list(self.busy_s_by_rank),
                "bubble_fraction": self.bubble_fraction}


def load_trace(path: str, field: str) -> tuple[list[Span], dict[str, Any]]:
    """Complete events and metadata of a Chrome trace file (ConfigError on anything else)."""
    try:
        doc = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise ConfigError(field, f"{path} does not exist", "give the file written by --trace") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(field, f"{path} is not JSON ({e.__class__.__name__})", "give a Chrome trace file") from None
    events = doc.get("traceEvents") if isinstance(doc, dict) else None
    if not isinstance(events, list):
        raise ConfigError(field, f"{path} has no traceEvents list",
                          "give a Chrome trace (paratrain train/simulate --trace)")
    spans = []
    for ev in events:
        if not isinstance(ev, dict) or ev.get("ph") != "X":
            continue
        args = ev.get("args") or {}
        stream = "comm" if ev.get("tid") in (1, "comm") else "compute"
        spans.append(Span(int(ev["pid"]), stream, str(ev.get("name", "")), float(ev["ts"]) * 1e-6,
                          float(ev["dur"]) * 1e-6, str(ev.get("cat", "")), args.get("microbatch"), args.get("step")))
    if not any(s.stream == "compute" for s in spans):
        raise ConfigError(field, f"{path} has no compute events", "give a trace of a pipeline run")
    meta = doc.get("metadata") or doc.get("otherData") or {}
    return spans, meta if isinstance(meta, dict) else {}


def timeline_stats(spans: list[Span], *, microbatches: int, iterations: int) -> TimelineStats:
    """Iteration time, busy time per rank and bubble fraction (see the module docstring)."""
    compute = [s for s in spans if s.stream == "compute" and (s.category in _COMPUTE or not s.category)]
    ranks = sorted({s.rank for s in spans})
    if iterations < 3:
        t0 = min(s.start_s for s in spans)
        end = max(s.start_s + s.duration_s for s in spans)
        it = (end - t0) / iterations
        busy = [sum(s.duration_s for s in compute if s.rank == r) / iterations for r in ranks]
    else:
        periods, busy = [], []
        for r in ranks:
            ends: dict[int, float] = {}
            for s in compute:
                if s.rank == r and s.category in ("backward", "weight") and s.microbatch is not None \
                        and s.microbatch % microbatches == microbatches - 1:
                    ends[s.microbatch // microbatches] = s.start_s + s.duration_s
            if 0 not in ends or iterations - 2 not in ends:
                raise ConfigError("--iterations", f"rank {r} lacks the last backward of batch 0 or {iterations - 2}",
                                  "give the trace's --microbatches and --iterations")
            lo, hi = ends[0], ends[iterations - 2]
            periods.append((hi - lo) / (iterations - 2))
            busy.append(sum(s.duration_s for s in compute if s.rank == r and lo <= s.start_s < hi) / (iterations - 2))
        it = sum(periods) / len(periods)
    bubble = sum((it - b) / it for b in busy) / len(busy) if it > 0 else 0.0
    return TimelineStats(it, tuple(busy), bubble)


def duration_variation(spans: list[Span]) -> float | None:
    """How much the durations of repeated compute actions vary: the pooled coefficient of
    variation (root of the count-weighted mean of variance / mean² over groups of the same action
    kind on the same rank and chunk; groups of at least three). The optimizer step's parts before
    its wait (``U.norm``, ``U.stash``) are left out, ``U`` itself is in. None if no group has three
    spans. This is what ``paratrain simulate --duration-cv`` takes."""
    import re
    import statistics

    groups: dict[tuple[int, str, str], list[float]] = {}
    for s in spans:
        if s.stream != "compute" or s.category not in _COMPUTE or s.name.startswith("U."):
            continue
        m = re.search(r"@c(\d+)", s.name)
        groups.setdefault((s.rank, s.category, m.group(1) if m else ""), []).append(s.duration_s)
    weighted, n = 0.0, 0
    for ds in groups.values():
        mean = statistics.fmean(ds)
        if len(ds) >= 3 and mean > 0:
            weighted += len(ds) * statistics.pvariance(ds) / mean**2
            n += len(ds)
    return (weighted / n) ** 0.5 if n else None


def run_variation(spans: list[Span], is_async: bool) -> float | None:
    """:func:`duration_variation` of a measured run: every step but the first (warm-up) of a
    synchronous schedule; the whole list of an asynchronous one (it never restarts)."""
    steps = {s.step for s in spans if s.step is not None}
    if not is_async and len(steps) > 1:
        spans = [s for s in spans if s.step != min(steps)]
    return duration_variation(spans)


def _select_step(spans: list[Span], step: int | None) -> tuple[list[Span], int | None]:
    steps = sorted({s.step for s in spans if s.step is not None})
    if not steps:
        return spans, None
    chosen = steps[-1] if step is None else step
    if chosen not in steps:
        raise ConfigError("--step", f"the measured trace has steps {steps[0]}..{steps[-1]}, not {chosen}",
                          f"use --step between {steps[0]} and {steps[-1]}")
    return [s for s in spans if s.step == chosen], chosen


def _shift(spans: list[Span]) -> list[Span]:
    t0 = min(s.start_s for s in spans)
    return [Span(s.rank, s.stream, s.name, s.start_s - t0, s.duration_s, s.category, s.microbatch, s.step)
            for s in spans]


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
    m_spans, meta = load_trace(measured, "MEASURED")
    s_spans, _ = load_trace(simulated, "SIMULATED")
    mb = int(meta.get("microbatches", 1)) if microbatches is None else microbatches
    m_its = int(meta.get("iterations", 1)) if iterations is None else iterations
    is_async = m_its > 1
    s_its = (4 if is_async else 1) if sim_iterations is None else sim_iterations
    for name, v in (("--microbatches", mb), ("--iterations", m_its), ("--sim-iterations", s_its)):
        if v < 1:
            raise ConfigError(name, f"must be at least 1, got {v}", f"use {name} 1 or more")
    chosen = None
    cv = run_variation(m_spans, is_async)
    if not is_async:
        m_spans, chosen = _select_step(m_spans, step)
    m_spans = _shift(m_spans)
    ms = timeline_stats(m_spans, microbatches=mb, iterations=m_its)
    ss = timeline_stats(s_spans, microbatches=mb, iterations=s_its)
    ranks = max(len(ms.busy_s_by_rank), len(ss.busy_s_by_rank))
    err = (ss.iteration_time_s - ms.iteration_time_s) / ms.iteration_time_s
    out = {"measured": ms.to_dict(), "simulated": ss.to_dict(), "step": chosen,
           "iteration_time_rel_error": err,
           "bubble_fraction_diff_points": 100 * (ss.bubble_fraction - ms.bubble_fraction),
           "measured_duration_cv": cv, "plot": plot}
    if plot is not None:
        _plot(m_spans, s_spans, ranks, plot, f"{meta.get('schedule', '')}".strip())
    if json_out:
        print_json(out)
        return
    print(f"{'':<22}{'measured':>12}{'simulated':>12}{'difference':>14}")
    print(f"{'iteration time (s)':<22}{ms.iteration_time_s:>12.4g}{ss.iteration_time_s:>12.4g}{100 * err:>+13.1f}%")
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


def _plot(m_spans: list[Span], s_spans: list[Span], ranks: int, path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from paratrain.sim.engine import TraceEvent
    from paratrain.sim.trace import plot_timeline

    def events(spans: list[Span]) -> list[TraceEvent]:
        return [TraceEvent(s.rank, s.stream, s.name, s.start_s, s.duration_s, s.category or "forward", s.microbatch)
                for s in spans]

    fig, axes = plt.subplots(2, 1, figsize=(14, 1.1 * ranks + 3), sharex=True)
    plot_timeline(events(m_spans), ranks, title=f"measured {title}".strip(), ax=axes[0])
    plot_timeline(events(s_spans), ranks, title=f"simulated {title}".strip(), ax=axes[1])
    end = max(max(s.start_s + s.duration_s for s in m_spans), max(s.start_s + s.duration_s for s in s_spans))
    axes[0].set_xlim(0, end)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)

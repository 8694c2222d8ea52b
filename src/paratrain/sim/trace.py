"""Pictures of a simulated (or measured) run: Chrome trace JSON, ASCII timeline, PNG timeline.

The Chrome trace format is shared with the runtime's measured traces: one process per pipeline
rank (``pid`` = rank), thread 0 = compute stream, thread 1 = communication stream, one complete
event (``ph: "X"``) per action named by its text form (``F3@c1``), times in microseconds. It loads
in Perfetto (ui.perfetto.dev) and chrome://tracing.

The trace format itself lives in :mod:`paratrain.trace`; these functions draw it.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from paratrain.trace import TraceEvent, chrome_trace, events_from_chrome_trace

__all__ = ["chrome_trace", "ascii_timeline", "plot_timeline", "events_from_chrome_trace"]

_GLYPH = {"forward": "F", "backward": "B", "input": "I", "weight": "W", "optimizer": "U", "filler": "X"}


def ascii_timeline(events: Iterable[TraceEvent], ranks: int, *, unit: float = 1.0, width: int | None = None) -> str:
    """Two lines per rank, one character per ``unit`` of time: the action kind (``F``, ``B``,
    ``I``, ``W``, ``U`` optimizer, ``X`` filler; lower case for Chimera's replica 1) over the last
    digit of its micro-batch. Idle cells are ``.``. ``width`` caps the columns (time is rescaled)."""
    evs = [e for e in events if e.stream == "compute"]
    end = max((e.start_s + e.duration_s for e in evs), default=0.0)
    cols = int(round(end / unit))
    if width is not None and cols > width:
        unit = end / width
        cols = width
    kinds = [["."] * cols for _ in range(ranks)]
    mbs = [[" "] * cols for _ in range(ranks)]
    for e in evs:
        a = int(round(e.start_s / unit))
        b = max(a + 1, int(round((e.start_s + e.duration_s) / unit)))
        g = _GLYPH.get(e.category, "?")
        if "r1" in e.name:
            g = g.lower()
        digit = str(e.microbatch % 10) if e.microbatch is not None else " "
        for k in range(a, min(b, cols)):
            kinds[e.rank][k] = g
            mbs[e.rank][k] = digit
    lines = []
    for r in range(ranks):
        lines.append(f"rank {r:>2} |" + "".join(kinds[r]) + "|")
        lines.append("        |" + "".join(mbs[r]) + "|")
    return "\n".join(lines)


_COLORS = {
    "forward": "#4C9BE8",
    "backward": "#7BC67B",
    "input": "#7BC67B",
    "weight": "#2E8B57",
    "optimizer": "#B0B0B0",
    "filler": "#E8A33C",
    "p2p": "#F2C14E",
    "reduce": "#D9534F",
}


def plot_timeline(
    events: Iterable[TraceEvent],
    ranks: int,
    *,
    title: str = "",
    unit_label: str = "time (s)",
    show_comm: bool = True,
    ax: Any = None,
) -> Any:
    """A matplotlib figure in the style of the schedule papers: one row per rank, a box per action
    labelled with its micro-batch, replica-1 micro-batches hatched. Returns the figure."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    evs = list(events)
    end = max((e.start_s + e.duration_s for e in evs), default=1.0)
    fig = None
    if ax is None:
        fig, ax = plt.subplots(figsize=(max(8.0, min(24.0, end / max(end / 60, 1e-12) * 0.2)), 0.55 * ranks + 1.2))
    for e in evs:
        if e.stream == "comm" and not show_comm:
            continue
        y = e.rank + (0.3 if e.stream == "comm" else 0.0)
        h = 0.25 if e.stream == "comm" else 0.8
        color = _COLORS.get(e.category, "#999999")
        hatch = "//" if "r1" in e.name else None
        ax.broken_barh(
            [(e.start_s, e.duration_s)], (y - 0.4, h), facecolors=color, edgecolor="black", linewidth=0.4, hatch=hatch
        )
        if e.stream == "compute" and e.microbatch is not None and e.duration_s >= end / 120:
            ax.text(e.start_s + e.duration_s / 2, y, str(e.microbatch), ha="center", va="center", fontsize=7)
    ax.set_ylim(ranks - 0.5, -0.5)
    ax.set_yticks(range(ranks))
    ax.set_yticklabels([f"rank {r}" for r in range(ranks)])
    ax.set_xlim(0, end)
    ax.set_xlabel(unit_label)
    if title:
        ax.set_title(title)
    used = {e.category for e in evs if show_comm or e.stream == "compute"}
    handles = [Patch(facecolor=c, edgecolor="black", label=k) for k, c in _COLORS.items() if k in used]
    if any("r1" in e.name for e in evs):
        handles.append(Patch(facecolor="white", edgecolor="black", hatch="//", label="replica 1"))
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=7, frameon=False)
    if fig is not None:
        fig.tight_layout()
    return fig if fig is not None else ax.figure

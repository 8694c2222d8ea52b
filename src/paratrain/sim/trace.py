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
    window: tuple[float, float] | None = None,
) -> Any:
    """A matplotlib figure in the style of the schedule papers: one row per rank, a box per action
    labelled with its micro-batch, replica-1 micro-batches hatched. Returns the figure.

    ``window`` (start, end) draws only that stretch of time. A schedule with more than
    ``_DENSE_ACTIONS`` compute actions on a rank (24 micro-batches × 12 chunks is 576) would be a
    solid hatch of outlines: its boxes lose their outlines and, on a figure of its own (no ``ax``,
    no ``window``), a second panel zooms on ``_ZOOM_ACTIONS`` actions of rank 0, with
    labels ``<micro-batch>`` (``<micro-batch>c<chunk>`` for interleaved chunks), around rank 0's
    first backward (the end of the warm-up).
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    evs = [e for e in events if show_comm or e.stream == "compute"]
    end = max((e.start_s + e.duration_s for e in evs), default=1.0)
    per_rank: dict[int, int] = {}
    for e in evs:
        if e.stream == "compute":
            per_rank[e.rank] = per_rank.get(e.rank, 0) + 1
    dense = max(per_rank.values(), default=0) > _DENSE_ACTIONS

    def label(e: TraceEvent) -> str:
        chunk = e.name.rpartition("@c")[2] if "@c" in e.name else ""
        return f"{e.microbatch}c{chunk}" if dense and chunk.isdigit() else str(e.microbatch)

    def draw(ax: Any, lo: float, hi: float, outlines: bool, panel_title: str) -> None:
        # One broken_barh call per row and style, not per action: thousands of actions draw in
        # a second instead of a minute.
        groups: dict[tuple[float, float, str, str | None], list[tuple[float, float]]] = {}
        span = max(hi - lo, 1e-30)
        # A label is drawn where it fits its box: 7-point digits are about 4.4 points wide, and the
        # axes take about 85 % of the figure's width (72 points per inch).
        points_per_s = 0.85 * 72 * ax.figure.get_figwidth() / span
        for e in evs:
            if e.start_s + e.duration_s < lo or e.start_s > hi:
                continue
            y = e.rank + (0.3 if e.stream == "comm" else 0.0)
            h = 0.25 if e.stream == "comm" else 0.8
            key = (y - 0.4, h, _COLORS.get(e.category, "#999999"), "//" if "r1" in e.name else None)
            groups.setdefault(key, []).append((e.start_s, e.duration_s))
            if e.stream == "compute" and e.microbatch is not None:
                text = label(e)
                if e.duration_s * points_per_s >= 4.4 * len(text) + 2:
                    ax.text(e.start_s + e.duration_s / 2, y, text, ha="center", va="center", fontsize=7, clip_on=True)
        for (y0, h, color, hatch), bars in groups.items():
            ax.broken_barh(
                bars,
                (y0, h),
                facecolors=color,
                edgecolor="black" if outlines else color,
                linewidth=0.4 if outlines else 0.0,
                hatch=hatch,
            )
        ax.set_ylim(ranks - 0.5, -0.5)
        ax.set_yticks(range(ranks))
        ax.set_yticklabels([f"rank {r}" for r in range(ranks)])
        ax.set_xlim(lo, hi)
        ax.set_xlabel(unit_label)
        if panel_title:
            ax.set_title(panel_title)

    def legend(ax: Any) -> None:
        used = {e.category for e in evs}
        handles = [Patch(facecolor=c, edgecolor="black", label=k) for k, c in _COLORS.items() if k in used]
        if any("r1" in e.name for e in evs):
            handles.append(Patch(facecolor="white", edgecolor="black", hatch="//", label="replica 1"))
        ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=7, frameon=False)

    lo, hi = window if window is not None else (0.0, end)
    height = 0.55 * ranks + 1.2
    if ax is not None:
        draw(ax, lo, hi, not dense or window is not None, title)
        legend(ax)
        return ax.figure
    if not dense or window is not None:
        fig, ax = plt.subplots(figsize=(12.0, height))
        draw(ax, lo, hi, True, title)
        legend(ax)
        fig.tight_layout()
        return fig
    # The zoom: _ZOOM_ACTIONS actions of rank 0 around its first backward, where the warm-up's
    # forwards give way to the steady state (the whole warm-up when that is shorter).
    rank0 = sorted((e for e in evs if e.rank == 0 and e.stream == "compute"), key=lambda e: e.start_s)
    first_b = next((i for i, e in enumerate(rank0) if e.category != "forward"), 0)
    first = max(0, min(first_b - _ZOOM_ACTIONS // 2, len(rank0) - _ZOOM_ACTIONS))
    last = min(len(rank0), first + _ZOOM_ACTIONS) - 1
    z_lo, z_hi = rank0[first].start_s, rank0[last].start_s + rank0[last].duration_s
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(16.0, 2 * height + 0.6))
    draw(top, lo, hi, False, f"{title} (whole iteration; shaded: zoomed below)" if title else "whole iteration")
    top.axvspan(z_lo, z_hi, color="black", alpha=0.12, linewidth=0)
    draw(bottom, z_lo, z_hi, True, f"zoom: actions {first + 1}–{last + 1} of rank 0 (labels: micro-batch c chunk)")
    legend(top)
    fig.tight_layout()
    return fig


_DENSE_ACTIONS = 120  # compute actions on one rank past which outlines merge into a hatch at 16 in
_ZOOM_ACTIONS = 40  # actions of rank 0 in the zoomed panel: each box a few characters wide

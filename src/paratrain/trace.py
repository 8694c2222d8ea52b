"""The one trace format, shared by the simulator's predictions and the runtime's measurements.

Chrome trace JSON (loads in Perfetto, ui.perfetto.dev, and chrome://tracing): one process per
rank (``pid`` = global rank), thread 0 = compute stream, thread 1 = communication stream, one
complete event (``ph: "X"``) per action named by the schedule IR's text form (``F3@c1``), times in
microseconds, and a ``metadata`` object saying what was run.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from paratrain.fileio import atomic_write_text

__all__ = ["TraceEvent", "chrome_trace", "events_from_chrome_trace", "write_trace"]


@dataclass(frozen=True, slots=True)
class TraceEvent:
    """One action on one rank's stream: what ran, when (seconds from the run's origin), how long."""

    rank: int
    stream: str  # "compute" or "comm"
    name: str  # the action's text form, e.g. "F3@c1"
    start_s: float
    duration_s: float
    category: str  # "forward", "backward", "input", "weight", "p2p", "reduce", "optimizer", "filler"
    microbatch: int | None = None


_TID = {"compute": 0, "comm": 1}


def chrome_trace(events: Iterable[TraceEvent], *, time_unit_s: float = 1e-6, title: str = "") -> dict[str, Any]:
    """Chrome trace document. ``time_unit_s`` is what one trace microsecond stands for: the default
    keeps seconds as real microseconds; uniform-time runs pass 1e0 so one unit reads as 1 µs."""
    scale = 1.0 / time_unit_s if time_unit_s != 1e-6 else 1e6
    evs: list[dict[str, Any]] = []
    ranks = set()
    for e in events:
        ranks.add(e.rank)
        evs.append(
            {
                "name": e.name,
                "cat": e.category,
                "ph": "X",
                "pid": e.rank,
                "tid": _TID.get(e.stream, 0),
                "ts": e.start_s * scale,
                "dur": e.duration_s * scale,
                "args": {"microbatch": e.microbatch} if e.microbatch is not None else {},
            }
        )
    meta = []
    for r in sorted(ranks):
        meta.append({"name": "process_name", "ph": "M", "pid": r, "tid": 0, "args": {"name": f"rank {r}"}})
        meta.append({"name": "thread_name", "ph": "M", "pid": r, "tid": 0, "args": {"name": "compute"}})
        meta.append({"name": "thread_name", "ph": "M", "pid": r, "tid": 1, "args": {"name": "comm"}})
    doc: dict[str, Any] = {"traceEvents": meta + evs, "displayTimeUnit": "ms"}
    if title:
        doc["otherData"] = {"title": title}
    return doc


def events_from_chrome_trace(doc: dict[str, Any], *, time_unit_s: float = 1e-6) -> list[TraceEvent]:
    """Inverse of :func:`chrome_trace` (complete events only)."""
    out = []
    for ev in doc.get("traceEvents", []):
        if ev.get("ph") != "X":
            continue
        stream = "comm" if ev.get("tid") == 1 else "compute"
        mb = (ev.get("args") or {}).get("microbatch")
        out.append(
            TraceEvent(
                int(ev["pid"]),
                stream,
                str(ev["name"]),
                ev["ts"] * time_unit_s,
                ev["dur"] * time_unit_s,
                str(ev.get("cat", "")),
                mb,
            )
        )
    return out


def write_trace(
    path: str | os.PathLike[str],
    events: Iterable[TraceEvent],
    *,
    field: str,
    title: str = "",
    metadata: dict[str, Any] | None = None,
    time_unit_s: float = 1e-6,
) -> None:
    """Write ``events`` as a Chrome trace file, atomically, with ``metadata`` under ``"metadata"``."""
    doc = chrome_trace(events, time_unit_s=time_unit_s, title=title)
    doc["metadata"] = dict(metadata or {})
    atomic_write_text(path, json.dumps(doc) + "\n", field)

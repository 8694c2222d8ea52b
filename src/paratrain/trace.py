"""The one trace format, shared by the simulator's predictions and the runtime's measurements.

Chrome trace JSON (loads in Perfetto, ui.perfetto.dev, and chrome://tracing): one process per
rank (``pid`` = rank), thread 0 = compute stream, thread 1 = communication stream, one complete
event (``ph: "X"``) per action named by the schedule IR's text form (``F3@c1``), its category in
``cat`` (:data:`CATEGORIES`), times in microseconds, ``args.microbatch`` and, for measured runs,
``args.step``; and a ``metadata`` object saying what was run.

This module holds the event type, the category table, the writer (:func:`write_trace`, always with
metadata), the reader (:func:`read_trace`: every malformed input is one
:class:`~paratrain.errors.ConfigError`) and the statistics both sides are measured with
(:func:`timeline_stats`, :func:`duration_variation`, :func:`run_variation`).

Statistics (the simulator's definitions, :mod:`paratrain.sim.report`): busy = compute actions and
optimizer steps on a rank; iteration time = first action to last finish of one step (for
asynchronous schedules covering ``K ≥ 3`` steps: the steady-state period between the ends of batch
0 and batch ``K-2`` on each rank, averaged); bubble fraction = mean over ranks of idle / iteration
time.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import statistics
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from paratrain.errors import ConfigError
from paratrain.fileio import atomic_write_text, check_not_special
from paratrain.schedule.ir import ActionKind

__all__ = [
    "CATEGORIES",
    "CATEGORY_OF_KIND",
    "COMM_CATEGORIES",
    "COMPUTE_CATEGORIES",
    "TimelineStats",
    "TraceEvent",
    "category_of",
    "check_same_run",
    "chrome_trace",
    "duration_variation",
    "events_from_chrome_trace",
    "read_trace",
    "run_shape",
    "run_variation",
    "select_step",
    "shift_to_zero",
    "timeline_stats",
    "trace_origin",
    "write_trace",
]

# ----- categories ----------------------------------------------------------------------------------

K = ActionKind
# What each action kind is in a trace (``cat``). Compute categories run on thread 0 and count as busy
# time; communication categories run on thread 1.
CATEGORY_OF_KIND: dict[ActionKind, str] = {
    K.FORWARD: "forward",
    K.BACKWARD: "backward",
    K.BACKWARD_INPUT: "input",
    K.BACKWARD_WEIGHT: "weight",
    K.OPTIMIZER_STEP: "optimizer",
    K.FILLER: "filler",
    K.SEND_ACT: "p2p",
    K.RECV_ACT: "p2p",
    K.SEND_GRAD: "p2p",
    K.RECV_GRAD: "p2p",
    K.REDUCE_GRAD: "reduce",
}
CATEGORIES = ("forward", "backward", "input", "weight", "optimizer", "filler", "p2p", "reduce")
COMPUTE_CATEGORIES = frozenset(CATEGORIES[:6])
COMM_CATEGORIES = frozenset(CATEGORIES[6:])
_KIND_BY_TEXT = {k.value: k for k in ActionKind}
_LEADING = re.compile(r"[A-Z]+")


def category_of(action: ActionKind | str) -> str:
    """The trace category of an action kind, or of a span named by an action's text form
    (``F3@c1`` → forward, ``SF3@c1>2`` → p2p, ``U`` and its parts ``U.norm`` → optimizer,
    ``X:clip`` → filler). A name that is no action is filler work."""
    if isinstance(action, ActionKind):
        return CATEGORY_OF_KIND[action]
    m = _LEADING.match(action)
    kind = _KIND_BY_TEXT.get(m.group(0)) if m else None
    return CATEGORY_OF_KIND[kind] if kind is not None else "filler"


# ----- events and writer ---------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class TraceEvent:
    """One action on one rank's stream: what ran, when (seconds from the run's origin), how long.
    ``step`` is the optimizer step a measured span belongs to (None in simulated traces)."""

    rank: int
    stream: str  # "compute" or "comm"
    name: str  # the action's text form, e.g. "F3@c1"
    start_s: float
    duration_s: float
    category: str  # one of CATEGORIES
    microbatch: int | None = None
    step: int | None = None


_TID = {"compute": 0, "comm": 1}


def chrome_trace(events: Iterable[TraceEvent], *, time_unit_s: float = 1e-6, title: str = "") -> dict[str, Any]:
    """Chrome trace document. ``time_unit_s`` is what one trace microsecond stands for: the default
    keeps seconds as real microseconds; uniform-time runs pass 1e0 so one unit reads as 1 µs."""
    scale = 1.0 / time_unit_s if time_unit_s != 1e-6 else 1e6
    evs: list[dict[str, Any]] = []
    ranks = set()
    for e in events:
        ranks.add(e.rank)
        args: dict[str, Any] = {}
        if e.microbatch is not None:
            args["microbatch"] = e.microbatch
        if e.step is not None:
            args["step"] = e.step
        evs.append(
            {
                "name": e.name,
                "cat": e.category,
                "ph": "X",
                "pid": e.rank,
                "tid": _TID.get(e.stream, 0),
                "ts": e.start_s * scale,
                "dur": e.duration_s * scale,
                "args": args,
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


# ----- reader --------------------------------------------------------------------------------------

_FIX = "give a Chrome trace written by paratrain (train/simulate/schedule show --trace)"


def _number(ev: dict[str, Any], key: str, i: int, field: str) -> float:
    if key not in ev:
        raise ConfigError(field, f"trace event {i} ({ev.get('name', '?')!r}) has no {key!r}", _FIX)
    v = ev[key]
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise ConfigError(field, f"trace event {i} ({ev.get('name', '?')!r}) has {key!r} = {v!r}, not a finite "
                          "number", _FIX)
    return float(v)


def _int_or_none(v: Any, key: str, i: int, ev: dict[str, Any], field: str) -> int | None:
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not float(v).is_integer():
        raise ConfigError(field, f"trace event {i} ({ev.get('name', '?')!r}) has {key!r} = {v!r}, not an integer",
                          _FIX)
    return int(v)


def events_from_chrome_trace(
    doc: Any, *, time_unit_s: float = 1e-6, field: str = "trace"
) -> list[TraceEvent]:
    """The complete events of a Chrome trace document, as :class:`TraceEvent` (inverse of
    :func:`chrome_trace`). Anything malformed — no ``traceEvents`` list, an event without a
    numeric ``pid``, ``ts`` or ``dur``, a negative duration, a non-integer micro-batch or step — is
    a :class:`ConfigError` naming ``field``, the event and its key."""
    evs = doc.get("traceEvents") if isinstance(doc, dict) else None
    if not isinstance(evs, list):
        raise ConfigError(field, "has no traceEvents list", _FIX)
    out = []
    for i, ev in enumerate(evs):
        if not isinstance(ev, dict) or ev.get("ph") != "X":
            continue
        pid = _number(ev, "pid", i, field)
        if not pid.is_integer() or pid < 0:
            raise ConfigError(field, f"trace event {i} ({ev.get('name', '?')!r}) has 'pid' = {ev['pid']!r}, not a "
                              "rank (an integer ≥ 0)", _FIX)
        ts = _number(ev, "ts", i, field)
        dur = _number(ev, "dur", i, field)
        if dur < 0:
            raise ConfigError(field, f"trace event {i} ({ev.get('name', '?')!r}) has 'dur' = {dur!r} < 0", _FIX)
        args = ev.get("args") or {}
        if not isinstance(args, dict):
            raise ConfigError(field, f"trace event {i} ({ev.get('name', '?')!r}) has 'args' = {args!r}, not an "
                              "object", _FIX)
        name = str(ev.get("name", ""))
        cat = ev.get("cat")
        out.append(
            TraceEvent(
                int(pid),
                "comm" if ev.get("tid") in (1, "comm") else "compute",
                name,
                ts * time_unit_s,
                dur * time_unit_s,
                str(cat) if cat else category_of(name),
                _int_or_none(args.get("microbatch"), "args.microbatch", i, ev, field),
                _int_or_none(args.get("step"), "args.step", i, ev, field),
            )
        )
    return out


def read_trace(path: str | os.PathLike[str], field: str) -> tuple[list[TraceEvent], dict[str, Any]]:
    """Complete events and metadata of a Chrome trace file with at least one compute event; every
    problem (missing file, not JSON, malformed events) is one :class:`ConfigError` naming ``field``."""
    check_not_special(path, field, "give the file written by --trace")
    try:
        text = Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(field, f"{path} does not exist", "give the file written by --trace") from None
    except IsADirectoryError:
        raise ConfigError(field, f"{path} is a directory", "give the file written by --trace") from None
    except UnicodeDecodeError:
        raise ConfigError(field, f"{path} is not JSON (not UTF-8 text)", _FIX) from None
    except OSError as e:
        raise ConfigError(field, f"cannot read {path}: {e.strerror or e}", "give a readable file") from None
    try:
        # NaN and Infinity are not JSON; Python's parser accepts them unless told otherwise
        doc = json.loads(text, parse_constant=_reject_constant)
    except json.JSONDecodeError as e:
        raise ConfigError(field, f"{path} is not JSON ({e.msg} at line {e.lineno})", _FIX) from None
    except ValueError as e:
        raise ConfigError(field, f"{path} is not JSON ({e})", _FIX) from None
    if not isinstance(doc, dict):
        raise ConfigError(field, f"{path} holds a JSON {type(doc).__name__}, not a trace object", _FIX)
    events = events_from_chrome_trace(doc, field=f"{field} ({path})")
    if not any(e.stream == "compute" for e in events):
        raise ConfigError(field, f"{path} has no compute events", "give a trace of a pipeline run")
    meta = doc.get("metadata")
    if meta is None:
        meta = doc.get("otherData") or {}
    if not isinstance(meta, dict):
        raise ConfigError(field, f"{path}: 'metadata' is a {type(meta).__name__}, not an object", _FIX)
    return events, meta


def _reject_constant(name: str) -> float:
    raise ValueError(f"{name} is not a JSON number")


def trace_origin(meta: dict[str, Any]) -> str | None:
    """``"measured"`` (``paratrain train``), ``"predicted"`` (``paratrain simulate``, ``schedule
    show``) or None (a trace whose metadata does not say) from the metadata's ``source``."""
    src = meta.get("source")
    if not isinstance(src, str):
        return None
    if src.startswith("paratrain train") or src.endswith("(measured)"):
        return "measured"
    if src.startswith(("paratrain simulate", "paratrain schedule show")) or src.endswith("(predicted)"):
        return "predicted"
    return None


def run_shape(meta: dict[str, Any]) -> dict[str, Any]:
    """What a trace's metadata states about its run: pipeline stages, schedule, chunks per rank,
    micro-batches per step and the model's shape (only the keys it states)."""
    par = meta.get("parallel") if isinstance(meta.get("parallel"), dict) else {}
    out: dict[str, Any] = {}
    stages = par.get("pp", meta.get("stages"))
    if stages is not None:
        out["pipeline stages"] = stages
    sched = par.get("schedule", meta.get("schedule"))
    if sched is not None:
        out["schedule"] = str(sched).lower()
    if par.get("virtual_stages") is not None:
        out["chunks per rank"] = par["virtual_stages"]
    micro = meta.get("microbatches")
    if micro is None and all(isinstance(par.get(k), int) and par[k] > 0 for k in ("global_batch", "dp", "microbatch")):
        micro = par["global_batch"] // (par["dp"] * par["microbatch"])
    if micro is not None:
        out["micro-batches per step"] = micro
    spec = meta.get("model_spec")
    if isinstance(spec, dict):
        for k in ("layers", "hidden", "heads", "seq", "vocab"):
            if spec.get(k) is not None:
                out[f"model {k}"] = spec[k]
    return out


def check_same_run(meta: dict[str, Any], other: dict[str, Any], field: str, other_field: str) -> None:
    """A ConfigError naming ``other_field`` if the two traces' metadata describe different runs
    (another schedule, stage count, micro-batch count or model shape): their timelines would not
    be comparable. Keys only one side states are not compared."""
    a, b = run_shape(meta), run_shape(other)
    for key, value in a.items():
        if key in b and b[key] != value:
            raise ConfigError(other_field, f"describes another run than {field}: {key} {b[key]!r} against "
                              f"{value!r}", "trace the same model, schedule, stages and micro-batches on both sides")


# ----- statistics ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class TimelineStats:
    iteration_time_s: float
    busy_s_by_rank: tuple[float, ...]
    bubble_fraction: float

    def to_dict(self) -> dict[str, Any]:
        return {"iteration_time_s": self.iteration_time_s, "busy_s_by_rank": list(self.busy_s_by_rank),
                "bubble_fraction": self.bubble_fraction}


def timeline_stats(
    events: Sequence[TraceEvent], *, microbatches: int, iterations: int, field: str = "trace"
) -> TimelineStats:
    """Iteration time, busy time per rank and bubble fraction (see the module docstring) of a
    timeline covering ``iterations`` optimizer steps of ``microbatches`` micro-batches each.

    Raises:
        ConfigError: naming ``field``, if the timeline is empty or a rank's compute spans overlap
            (more busy time than the iteration lasts: two ranks' events under one ``pid``).
    """
    if not events:
        raise ConfigError(field, "has no events", _FIX)
    by_rank: dict[int, list[TraceEvent]] = {e.rank: [] for e in events}
    for e in events:
        if e.stream == "compute" and e.category in COMPUTE_CATEGORIES:
            by_rank[e.rank].append(e)
    ranks = sorted(by_rank)
    if iterations < 3:
        t0 = min(e.start_s for e in events)
        end = max(e.start_s + e.duration_s for e in events)
        it = (end - t0) / iterations
        busy = [sum(e.duration_s for e in by_rank[r]) / iterations for r in ranks]
        for r, b in zip(ranks, busy, strict=True):
            if b > it * (1 + 1e-9):  # one compute stream runs one action at a time
                raise ConfigError(field, f"rank {r} is busy {b:.4g} s in an iteration of {it:.4g} s: its compute "
                                  "spans overlap", "give a trace with one process (pid) per pipeline rank")
    else:
        periods, busy = [], []
        for r in ranks:
            ends: dict[int, float] = {}
            for e in by_rank[r]:
                if e.category in ("backward", "weight") and e.microbatch is not None \
                        and e.microbatch % microbatches == microbatches - 1:
                    ends[e.microbatch // microbatches] = e.start_s + e.duration_s
            if 0 not in ends or iterations - 2 not in ends:
                raise ConfigError("--iterations", f"rank {r} lacks the last backward of batch 0 or {iterations - 2}",
                                  "give the trace's --microbatches and --iterations")
            lo, hi = ends[0], ends[iterations - 2]
            periods.append((hi - lo) / (iterations - 2))
            busy.append(sum(e.duration_s for e in by_rank[r] if lo <= e.start_s < hi) / (iterations - 2))
        it = sum(periods) / len(periods)
    bubble = sum((it - b) / it for b in busy) / len(busy) if it > 0 else 0.0
    return TimelineStats(it, tuple(busy), bubble)


_CHUNK = re.compile(r"@c(\d+)")


def duration_variation(events: Iterable[TraceEvent]) -> float | None:
    """How much the durations of repeated compute actions vary: the pooled coefficient of
    variation (root of the count-weighted mean of variance / mean² over groups of the same action
    kind on the same rank and chunk; groups of at least three). The optimizer step's parts before
    its wait (``U.norm``, ``U.stash``) are left out, ``U`` itself is in. None if no group has three
    spans. This is what ``paratrain simulate --duration-cv`` takes."""
    groups: dict[tuple[int, str, str], list[float]] = {}
    for e in events:
        if e.stream != "compute" or e.category not in COMPUTE_CATEGORIES or e.name.startswith("U."):
            continue
        m = _CHUNK.search(e.name)
        groups.setdefault((e.rank, e.category, m.group(1) if m else ""), []).append(e.duration_s)
    weighted, n = 0.0, 0
    for ds in groups.values():
        mean = statistics.fmean(ds)
        if len(ds) >= 3 and mean > 0:
            weighted += len(ds) * statistics.pvariance(ds) / mean**2
            n += len(ds)
    return (weighted / n) ** 0.5 if n else None


def run_variation(events: Sequence[TraceEvent], is_async: bool) -> float | None:
    """:func:`duration_variation` of a measured run: every step but the first (warm-up) of a
    synchronous schedule; the whole list of an asynchronous one (it never restarts)."""
    steps = {e.step for e in events if e.step is not None}
    if not is_async and len(steps) > 1:
        events = [e for e in events if e.step != min(steps)]
    return duration_variation(events)


def select_step(events: Sequence[TraceEvent], step: int | None, field: str = "--step"
                ) -> tuple[list[TraceEvent], int | None]:
    """The events of measured step ``step`` (None: the last) and the step chosen; a trace without
    steps is returned whole with None when no step is asked for. A step the trace lacks is refused:
    comparing another step (or the whole trace) in its place would answer a different question."""
    steps = sorted({e.step for e in events if e.step is not None})
    if not steps:
        if step is not None:
            raise ConfigError(field, f"the measured trace has no steps (no event carries args.step), so no step "
                              f"{step}", f"drop {field}, or record the run with `paratrain train --trace FILE`, whose "
                              "events carry their steps")
        return list(events), None
    chosen = steps[-1] if step is None else step
    if chosen not in steps:
        raise ConfigError(field, f"the measured trace has steps {_steps_text(steps)}, not {chosen}",
                          f"use {field} {steps[-1]} (the last) or another step of the trace")
    return [e for e in events if e.step == chosen], chosen


def _steps_text(steps: Sequence[int]) -> str:
    """``0..4`` for consecutive steps, else the list (its ends only past eight)."""
    if steps[-1] - steps[0] == len(steps) - 1:
        return f"{steps[0]}..{steps[-1]}" if len(steps) > 1 else str(steps[0])
    if len(steps) > 8:
        return f"{', '.join(map(str, steps[:4]))}, ..., {', '.join(map(str, steps[-3:]))}"
    return ", ".join(map(str, steps))


def shift_to_zero(events: Sequence[TraceEvent]) -> list[TraceEvent]:
    """The events moved in time so that the first one starts at 0."""
    if not events:
        return []
    t0 = min(e.start_s for e in events)
    return [dataclasses.replace(e, start_s=e.start_s - t0) for e in events]

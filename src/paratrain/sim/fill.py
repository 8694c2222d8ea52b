"""Bubble filling: place K-FAC's work into a schedule's idle gaps as filler actions (PipeFisher).

The pass (:func:`fill_kfac`) simulates the base schedule once to find each rank's gaps: the idle
time between two compute actions (waiting for a receive, transfer time included) and the idle
time between the rank's last compute action and its optimizer step or the iteration's end. It then
places each rank's pieces (:class:`KfacWork`) first-fit, in PipeFisher's priority order
curvature → factor all-reduce → inversion: a piece goes into the earliest gap with room for its
duration plus a 5 % margin (``start + d·1.05 ≤ gap end``), many pieces per gap. A curvature piece
of micro-batch ``m`` may go only after the rank's last backward action (``B``/``W``) of ``m``;
the all-reduce after every curvature piece of every rank of its group, at a time window that is
inside a gap of each of them (it is a collective filler); inversions after the all-reduce. What
does not fit into step 1's gaps goes into the gaps of further copies of the step (step 2, 3, …,
every input already there); the number of steps used is the refresh interval. A piece larger than
every gap of a fresh step is appended at the end of the last step, before its optimizer step.

Where a filler goes in the action list: before the receives the rank waits on, after the sends
of the same p2p batch (the batch is split, so that the filler does not hold back the neighbours'
inputs, as PipeFisher's runtime issues sends before it works in a bubble). A split batch blocks
harder under the validator's rules; each split is validated together with the ones accepted
before it, and a gap whose split would deadlock is not used. Every filled step is validated.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from paratrain.errors import ConfigError
from paratrain.schedule.filled import CURV, INV, REDUCE, FilledSchedule, layer_groups
from paratrain.schedule.ir import COMPUTE_KINDS, Action, ActionKind, Schedule
from paratrain.sim.engine import TraceEvent, run_schedule
from paratrain.sim.timing import Timing

if TYPE_CHECKING:
    from paratrain.cost.kfac import KfacLayerCost
    from paratrain.parallel.config import ParallelConfig
    from paratrain.spec.cluster import ClusterSpec
    from paratrain.spec.model import ModelSpec

__all__ = ["KfacWork", "KfacFill", "MARGIN", "kfac_work", "uniform_kfac_work", "fill_kfac", "fill_kfac_config"]

K = ActionKind
MARGIN = 0.05  # PipeFisher's: a piece fits when start + duration·(1 + MARGIN) ≤ the gap's end
_MAX_STEPS = 256  # a cycle longer than this is appended serially instead
_EPS = 1e-12


@dataclass(frozen=True)
class KfacWork:
    """Per pipeline rank: ``curv_s[r][m]`` the curvature piece of micro-batch ``m``,
    ``reduce_s[r]`` the factor all-reduce, ``inv_s[r][k]`` the inversion of layer group ``k``;
    ``curv_parts_s[r][m][k]`` (optional) the part of ``curv_s[r][m]`` for layer group ``k``, used
    when the pass splits curvature by layer group (``split_curvature``)."""

    curv_s: tuple[dict[int, float], ...]
    reduce_s: tuple[float, ...]
    inv_s: tuple[tuple[float, ...], ...]
    curv_parts_s: tuple[dict[int, tuple[float, ...]], ...] = ()

    def total_s(self, rank: int) -> float:
        return sum(self.curv_s[rank].values()) + self.reduce_s[rank] + sum(self.inv_s[rank])


@dataclass(frozen=True)
class KfacFill:
    """Result of the pass: the filled schedule and what it does to utilization.

    ``utilization_without_fillers``: mean over ranks of busy / iteration time of the base schedule
    (1 − bubble fraction). ``utilization_with_fillers``: the same over the ``refresh_steps`` filled
    steps, fillers counted as busy (PipeFisher's usage: busy time / summed step time).
    ``iteration_time_with_fillers_s``: the mean step time over the cycle. Preconditioning is no
    filler: it lengthens every optimizer step by ``precondition_s_by_rank``, which
    ``iteration_time_with_kfac_s`` adds (the figures above leave it out, to show what the fillers
    do to the pipeline). ``events``: the cycle's steps one after the other (for timelines)."""

    filled: FilledSchedule
    iteration_time_s: float
    iteration_time_with_fillers_s: float
    utilization_without_fillers: float
    utilization_with_fillers: float
    serial_pieces: int  # pieces that fit no gap and were appended at a step's end
    work_s_by_rank: tuple[float, ...]
    events: tuple[TraceEvent, ...] = dataclasses.field(repr=False, default=())
    precondition_s_by_rank: tuple[float, ...] = ()
    iteration_time_with_kfac_s: float | None = None

    @property
    def refresh_steps(self) -> int:
        return self.filled.refresh_steps

    def to_dict(self) -> dict[str, Any]:
        return {
            "utilization_without_fillers": self.utilization_without_fillers,
            "utilization_with_fillers": self.utilization_with_fillers,
            "kfac_refresh_steps": self.refresh_steps,
            "iteration_time_with_fillers_s": self.iteration_time_with_fillers_s,
            "kfac_serial_pieces": self.serial_pieces,
            "kfac_work_s_by_rank": list(self.work_s_by_rank),
            "kfac_precondition_s_by_rank": list(self.precondition_s_by_rank),
            "iteration_time_with_kfac_s": self.iteration_time_with_kfac_s,
        }


# ----- the pieces -------------------------------------------------------------------------------


def _check_schedule(schedule: Schedule) -> None:
    if schedule.iterations != 1 or schedule.weight_versions != 1:
        raise ConfigError(
            "--fill kfac", f"schedule {schedule.name!r} is asynchronous (no flush): its steps overlap, so there "
            "is no step boundary at which a K-FAC cycle could start and no bubble to fill",
            "use gpipe, 1f1b, interleaved, chimera or zb-h1")
    for r, row in enumerate(schedule.actions):
        if sum(1 for a in row if a.kind is K.OPTIMIZER_STEP) != 1:
            raise ConfigError("--fill kfac", f"rank {r} of schedule {schedule.name!r} does not end its step with "
                              "one optimizer step U", "fill a synchronous schedule with one U per rank")


def kfac_work(schedule: Schedule, chunk_layers: Sequence[Sequence[KfacLayerCost]],
              reduce_s: Sequence[float], inv_groups: int | None = None) -> KfacWork:
    """The pieces of every rank from the per-chunk K-FAC layer costs: curvature per micro-batch
    (the layers of the chunks it passes on the rank), the all-reduce ``reduce_s[r]``, and the
    inversion of the rank's layers (its chunks' layers in :meth:`Schedule.chunks_of` order) in
    ``inv_groups`` groups (:func:`paratrain.schedule.filled.layer_groups`; default one per layer,
    as PipeFisher's pieces are)."""
    if inv_groups is not None and inv_groups < 1:
        raise ConfigError("--kfac-inv-groups", f"must be at least 1, got {inv_groups}", "give e.g. 4")
    curv, parts, inv = [], [], []
    for r, row in enumerate(schedule.actions):
        held = schedule.chunks_of(r)
        layers = [x for c, _ in held for x in chunk_layers[c]]
        n = max(1, len(layers))
        groups = layer_groups(len(layers), min(inv_groups or n, n))
        group_of = {i: k for k, g in enumerate(groups) for i in g}
        first: dict[int, int] = {}
        for c, _ in held:
            first[c] = sum(len(chunk_layers[q]) for q, _ in held[: held.index((c, _))])
        c_s: dict[int, float] = {}
        p_s: dict[int, list[float]] = {}
        for a in row:
            if a.kind is K.FORWARD:
                part = p_s.setdefault(a.microbatch, [0.0] * len(groups))
                for j, x in enumerate(chunk_layers[a.chunk]):
                    part[group_of[first[a.chunk] + j]] += x.curvature_s
                c_s[a.microbatch] = c_s.get(a.microbatch, 0.0) + sum(x.curvature_s for x in chunk_layers[a.chunk])
        curv.append(c_s)
        parts.append({m: tuple(v) for m, v in p_s.items()})
        inv.append(tuple(sum(layers[i].inversion_s for i in g) for g in groups))
    return KfacWork(tuple(curv), tuple(reduce_s), tuple(inv), tuple(parts))


def uniform_kfac_work(schedule: Schedule, curv: float = 0.25, reduce: float = 0.5, inv: float = 1.0,
                      inv_groups: int = 2) -> KfacWork:
    """Pieces in the units of :func:`paratrain.sim.timing.uniform_timing` (for ``schedule show``):
    ``curv`` per micro-batch and chunk, one ``reduce``, ``inv_groups`` inversions of ``inv``."""
    curv_s = []
    for row in schedule.actions:
        c_s: dict[int, float] = {}
        for a in row:
            if a.kind is K.FORWARD:
                c_s[a.microbatch] = c_s.get(a.microbatch, 0.0) + curv
        curv_s.append(c_s)
    return KfacWork(tuple(curv_s), (reduce,) * schedule.stages, ((inv,) * inv_groups,) * schedule.stages)


# ----- gaps -------------------------------------------------------------------------------------


@dataclass
class _Gap:
    pos: int  # index in the base list where fillers go (before it)
    after: int  # index of the compute action before the gap (-1: none)
    start: float
    end: float
    split: bool  # pos starts a p2p batch with sends and receives: the fillers go between them
    free: float = 0.0

    def room(self) -> float:
        return self.end - self.free


def _batch_end(row: Sequence[Action], i: int) -> int:
    j = i
    while j < len(row) and row[j].is_p2p:
        j += 1
    return j


def _base_gaps(schedule: Schedule, events: Sequence[TraceEvent], finish: Sequence[float],
               optimizer_s: Sequence[float]) -> list[list[_Gap]]:
    """Per rank, its gaps in time order (see the module docstring)."""
    makespan = max(finish)
    out = []
    for r, row in enumerate(schedule.actions):
        evs = iter([e for e in events if e.rank == r and e.stream == "compute" and e.name != "U"])
        times: dict[int, tuple[float, float]] = {}
        for i, a in enumerate(row):
            if a.kind in COMPUTE_KINDS or a.kind is K.FILLER:
                e = next(evs)
                times[i] = (e.start_s, e.start_s + e.duration_s)
        comp = [i for i, a in enumerate(row) if a.kind in COMPUTE_KINDS]
        u = next(i for i, a in enumerate(row) if a.kind is K.OPTIMIZER_STEP)
        gaps: list[_Gap] = []
        prev, prev_end = -1, 0.0
        for i in comp:
            start = times[i][0]
            if start - prev_end > _EPS:
                pos, split = _insertion(row, prev, i)
                gaps.append(_Gap(pos, prev, prev_end, start, split, prev_end))
            prev, prev_end = i, max(prev_end, times[i][1])
            # fillers already in the list occupy the rank too
            for j in range(i + 1, len(row)):
                if row[j].kind is K.FILLER:
                    prev_end = max(prev_end, times[j][1])
                elif row[j].kind in COMPUTE_KINDS:
                    break
        tail_end = max(finish[r], makespan) - optimizer_s[r]
        if tail_end - prev_end > _EPS:
            gaps.append(_Gap(u, prev, prev_end, tail_end, False, prev_end))
        out.append(gaps)
    return out


def _insertion(row: Sequence[Action], prev: int, nxt: int) -> tuple[int, bool]:
    """Where fillers of the gap before compute action ``nxt`` go: at the last p2p batch between
    ``prev`` and ``nxt`` that holds a receive (split when it also holds sends), else before ``nxt``."""
    best = None
    i = prev + 1
    while i < nxt:
        if row[i].is_p2p:
            j = _batch_end(row, i)
            if any(not a.is_send for a in row[i:j]):
                best = (i, any(a.is_send for a in row[i:j]))
            i = j
        else:
            i += 1
    if best is None:
        # no receive to wait for: insert right after the previous compute action's sends
        return nxt, False
    return best


def _build(base: Schedule, inserts: Sequence[dict[int, list[Action]]], split_at: Sequence[set[int]]) -> Schedule:
    """``base`` with ``inserts[r][pos]`` placed before action ``pos`` of rank ``r``; a batch starting
    at a position in ``split_at[r]`` has its sends before the fillers and its receives after."""
    rows = []
    for r, row in enumerate(base.actions):
        new: list[Action] = []
        i = 0
        while i < len(row):
            xs = inserts[r].get(i)
            if xs is not None and i in split_at[r]:
                j = _batch_end(row, i)
                new.extend(a for a in row[i:j] if a.is_send)
                new.extend(xs)
                new.extend(a for a in row[i:j] if not a.is_send)
                i = j
                continue
            if xs is not None:
                new.extend(xs)
            new.append(row[i])
            i += 1
        rows.append(tuple(new))
    return dataclasses.replace(base, actions=tuple(rows))


# ----- the pass ---------------------------------------------------------------------------------


@dataclass
class _Placed:
    step: int  # iteration of the cycle; -1: appended at the end of the last one
    gap: int
    start: float
    action: Action


def _x(tag: str, d: float) -> Action:
    return Action(K.FILLER, tag=tag, duration_s=d)


class _Filler:
    def __init__(self, schedule: Schedule, gaps: list[list[_Gap]], margin: float) -> None:
        self.schedule, self.base_gaps, self.margin = schedule, gaps, margin
        self.steps: list[list[list[_Gap]]] = []  # [step][rank] -> gaps (with their free time)
        self.placed: list[list[_Placed]] = [[] for _ in range(schedule.stages)]
        self.safe: list[dict[int, bool]] = [{} for _ in range(schedule.stages)]  # split positions checked
        self.splits: list[set[int]] = [set() for _ in range(schedule.stages)]
        # Usually every split is safe together: one validation instead of one per gap.
        every = [{g.pos for g in row if g.split} for row in gaps]
        if any(every) and self._deadlock_free(every):
            self.splits = every
            self.safe = [dict.fromkeys(s, True) for s in every]

    def _deadlock_free(self, splits: list[set[int]]) -> bool:
        from paratrain.schedule.validate import check_deadlock

        # splitting a batch changes nothing but the blocking structure: the deadlock check suffices
        marker = [{p: [_x("probe", 0.0)] for p in s} for s in splits]
        try:
            check_deadlock(_build(self.schedule, marker, splits))
        except ConfigError:
            return False
        return True

    def gaps(self, step: int, r: int) -> list[_Gap]:
        while len(self.steps) <= step:
            self.steps.append([[dataclasses.replace(g) for g in row] for row in self.base_gaps])
        return self.steps[step][r]

    def usable(self, r: int, g: _Gap) -> bool:
        """A gap whose fillers need a split batch is usable if the split, together with the splits
        accepted before, keeps the base schedule deadlock-free."""
        if not g.split:
            return True
        ok = self.safe[r].get(g.pos)
        if ok is None:
            trial = [set(s) for s in self.splits]
            trial[r].add(g.pos)
            ok = self.safe[r][g.pos] = self._deadlock_free(trial)
            if ok:
                self.splits = trial
        return ok

    def fits(self, g: _Gap, d: float, at: float | None = None) -> bool:
        return (g.free if at is None else at) + d * (1 + self.margin) <= g.end + _EPS

    def place(self, r: int, step: int, gi: int, start: float, a: Action) -> None:
        g = self.gaps(step, r)[gi]
        g.free = start + (a.duration_s or 0.0)
        self.placed[r].append(_Placed(step, gi, start, a))

    def first_fit(self, r: int, pieces: list[tuple[str, float, int]],
                  after: tuple[int, int]) -> list[tuple[str, float]]:
        """Place ``pieces`` (tag, duration, gate: the base index of the action it must follow in
        step 0, -1 for none) first-fit from position ``after`` = (step, gap index) on; returns
        the ones no gap of a fresh step can take."""
        todo = list(pieces)
        # the largest usable gap (checking splits from the largest gap down, only as far as needed)
        biggest = next((g.end - g.start for g in sorted(self.base_gaps[r], key=lambda g: g.start - g.end)
                        if self.usable(r, g)), 0.0)
        serial = [(t, d) for t, d, _ in todo if d * (1 + self.margin) > biggest + _EPS]
        todo = [p for p in todo if p[1] * (1 + self.margin) <= biggest + _EPS]
        step, gi = after
        while todo:
            if step >= _MAX_STEPS:
                serial.extend((t, d) for t, d, _ in todo)
                break
            gaps = self.gaps(step, r)
            smallest = min(d for _, d, _ in todo) * (1 + self.margin)
            for k in range(gi, len(gaps)):
                g = gaps[k]
                if g.room() < smallest - _EPS or not self.usable(r, g):
                    continue
                placed = True
                while placed and todo:
                    placed = False
                    for n, (tag, d, gate) in enumerate(todo):
                        if step == 0 and g.after < gate:
                            continue
                        if self.fits(g, d):
                            self.place(r, step, k, g.free, _x(tag, d))
                            del todo[n]
                            placed = True
                            break
            step, gi = step + 1, 0
        return serial

    def last(self, r: int) -> tuple[int, int]:
        """(step, gap) of the rank's last placed piece; (0, 0) if none."""
        return max(((p.step, p.gap) for p in self.placed[r] if p.step >= 0), default=(0, 0))

    def collective(self, group: tuple[int, ...], d: float) -> bool:
        """Place one collective piece for ``group``: the earliest window of length d·(1+margin)
        inside a gap of every member, after each member's placed pieces (same step for all)."""
        starts = {r: self.last(r) for r in group}
        if len(group) == 1:  # the earliest gap with room is the window
            (r,) = group
            left = self.first_fit(r, [(REDUCE, d, -1)], starts[r])
            return not left
        first = max(s for s, _ in starts.values())
        for step in range(first, min(first + 2 + max(len(self.steps), 1), _MAX_STEPS)):
            best: tuple[float, dict[int, int]] | None = None
            options = {}
            for r in group:
                s0, g0 = starts[r]
                lo = g0 if step == s0 else 0
                if step < s0:
                    options[r] = []
                    continue
                options[r] = [(k, g) for k, g in enumerate(self.gaps(step, r))
                              if k >= lo and g.room() >= d * (1 + self.margin) - _EPS and self.usable(r, g)]
            best = _common_window(group, options, d, self.margin)
            if best is not None:
                t, choice = best
                for r in group:
                    self.place(r, step, choice[r], t, _x(REDUCE, d))
                return True
        return False


def _common_window(group: tuple[int, ...], options: dict[int, list[tuple[int, _Gap]]], d: float,
                   margin: float) -> tuple[float, dict[int, int]] | None:
    """Earliest start t with one gap per member such that t ≥ its free time and t + d·(1+margin) ≤
    its end (exhaustive over the members' gaps: groups have one or two members)."""
    best: tuple[float, dict[int, int]] | None = None

    def rec(i: int, t: float, end: float, choice: dict[int, int]) -> None:
        nonlocal best
        if t + d * (1 + margin) > end + _EPS or (best is not None and t >= best[0]):
            return
        if i == len(group):
            best = (t, dict(choice))
            return
        r = group[i]
        for k, g in options[r]:
            choice[r] = k
            rec(i + 1, max(t, g.free), min(end, g.end), choice)
        choice.pop(r, None)

    rec(0, 0.0, float("inf"), {})
    return best


def fill_kfac(schedule: Schedule, timing: Timing, work: KfacWork, *, margin: float = MARGIN,
              split_curvature: bool = False, precondition_s: Sequence[float] = ()) -> KfacFill:
    """Fill ``schedule``'s bubbles with ``work`` (see the module docstring); validates every step.
    ``split_curvature``: one curvature piece per micro-batch and layer group
    (``kfac.curv.<m>.<k>``, PipeFisher's granularity) instead of one per micro-batch.
    ``precondition_s[r]``: the preconditioning rank ``r`` adds to every optimizer step (no filler:
    it runs at ``U``), for ``KfacFill.iteration_time_with_kfac_s``."""
    _check_schedule(schedule)
    if not 0 <= margin < 10:
        raise ConfigError("margin", f"must be in [0, 10), got {margin}", "use PipeFisher's 0.05")
    try:
        return _fill(schedule, timing, work, margin, split_curvature, precondition_s, reduce_at_end=False)
    except _Deadlock:
        # the all-reduce windows ordered the group's ranks against their sends and receives in a
        # way that blocks: run it at the end of the cycle instead, after all p2p work
        return _fill(schedule, timing, work, margin, split_curvature, precondition_s, reduce_at_end=True)


class _Deadlock(Exception):
    pass


def _fill(schedule: Schedule, timing: Timing, work: KfacWork, margin: float, split_curvature: bool,
          precondition_s: Sequence[float], reduce_at_end: bool) -> KfacFill:
    from paratrain.schedule.validate import validate

    p = schedule.stages
    base = run_schedule(schedule, timing, record=True)
    f = _Filler(schedule, _base_gaps(schedule, base.events, base.finish_s, timing.optimizer_s), margin)
    serial: list[list[tuple[str, float]]] = [[] for _ in range(p)]
    # 1. curvature: after the micro-batch's last backward action on the rank (B, or W under ZB-H1)
    for r, row in enumerate(schedule.actions):
        gate = {}
        for i, a in enumerate(row):
            if a.kind is K.BACKWARD or a.kind is K.BACKWARD_WEIGHT:
                gate[a.microbatch] = i
        if split_curvature and work.curv_parts_s:
            pieces = [(f"{CURV}.{m}.{k}", d, gate[m]) for m, ds in work.curv_parts_s[r].items()
                      for k, d in enumerate(ds) if d > 0]
        else:
            pieces = [(f"{CURV}.{m}", d, gate[m]) for m, d in work.curv_s[r].items()]
        pieces.sort(key=lambda x: x[2])  # stable: by the backward that releases them, then group
        serial[r].extend(f.first_fit(r, pieces, (0, 0)))
    # 2. the factor all-reduce of each filler group, 3. inversions
    groups = sorted({schedule.filler_group(r) for r in range(p)})
    for group in groups:
        d = max(work.reduce_s[r] for r in group)
        if reduce_at_end or any(serial[r] for r in group) or not f.collective(group, d):
            for r in group:
                serial[r].append((REDUCE, d))
    for r in range(p):
        pieces = [(f"{INV}.{k}", d, -1) for k, d in enumerate(work.inv_s[r])]
        if serial[r]:
            serial[r].extend((t, d) for t, d, _ in pieces)
        else:
            serial[r].extend(f.first_fit(r, pieces, f.last(r)))
    steps = max(1, max((x.step + 1 for row in f.placed for x in row), default=1))
    inserts: list[list[dict[int, list[Action]]]] = [[{} for _ in range(p)] for _ in range(steps)]
    for r in range(p):
        gaps0 = f.base_gaps[r]
        for x in sorted(f.placed[r], key=lambda x: (x.step, x.gap, x.start)):
            inserts[x.step][r].setdefault(gaps0[x.gap].pos, []).append(x.action)
        if serial[r]:
            u = next(i for i, a in enumerate(schedule.actions[r]) if a.kind is K.OPTIMIZER_STEP)
            inserts[-1][r].setdefault(u, []).extend(_x(t, d) for t, d in serial[r])
    its = []
    for s in range(steps):
        sched = _build(schedule, inserts[s], f.splits)
        try:
            validate(sched)
        except ConfigError as e:
            if not reduce_at_end and "deadlock" in str(e):
                raise _Deadlock from e
            raise
        its.append(sched)
    filled = FilledSchedule(tuple(its), steps)
    # utilization: base step, then the cycle's steps
    base_it = max(base.finish_s)
    u0 = sum(b / base_it for b in base.busy_s) / p
    busy = [0.0] * p
    total = 0.0
    events: list[TraceEvent] = []
    for sched in its:
        run = run_schedule(sched, timing, record=True)
        t_it = max(run.finish_s)
        events.extend(dataclasses.replace(e, start_s=e.start_s + total) for e in run.events)
        total += t_it
        for r in range(p):
            busy[r] += run.busy_s[r]
    with_kfac = total / steps
    if precondition_s:
        pre = dataclasses.replace(timing, optimizer_s=tuple(
            o + x for o, x in zip(timing.optimizer_s, precondition_s, strict=True)))
        with_kfac = sum(max(run_schedule(sched, pre, record=False).finish_s) for sched in its) / steps
    return KfacFill(
        filled=filled,
        iteration_time_s=base_it,
        iteration_time_with_fillers_s=total / steps,
        utilization_without_fillers=u0,
        utilization_with_fillers=sum(b / total for b in busy) / p,
        serial_pieces=sum(len(s) for s in serial),
        work_s_by_rank=tuple(work.total_s(r) for r in range(p)),
        events=tuple(events),
        precondition_s_by_rank=tuple(precondition_s),
        iteration_time_with_kfac_s=with_kfac,
    )


def fill_kfac_config(model: ModelSpec, cluster: ClusterSpec, config: ParallelConfig, *,
                     inv_groups: int | None = None, method: str = "inverse", margin: float = MARGIN,
                     optimizer: str = "fused", split_curvature: bool = True,
                     grad_buckets: bool = True) -> KfacFill:
    """:func:`fill_kfac` for a parallel layout: durations of the schedule from the cost model
    (:func:`paratrain.sim.report.timing_for_config`), of the K-FAC pieces from
    :mod:`paratrain.cost.kfac`; the factor all-reduce runs over the data-parallel copies of the
    rank's chunks (and, under Chimera, the mirror rank's) on ``cluster``; every filled step's
    optimizer step also preconditions the rank's layers. ``grad_buckets`` as in ``simulate_config``'s
    ``overlap_grad_reduce``, so the base step is the one ``simulate`` reports."""
    from paratrain.cost.collectives import collective_time
    from paratrain.cost.kfac import chunk_layer_costs
    from paratrain.cost.stage import chunk_costs
    from paratrain.sim.report import _generate_cached, timing_for_config

    config.validate_for(model, even_layers=config.partition is None)
    if config.schedule.is_async:
        raise ConfigError("--fill kfac", f"schedule {config.schedule} is asynchronous (no flush): its steps overlap, "
                          "so there is no step boundary at which a K-FAC cycle could start",
                          "use gpipe, 1f1b, interleaved, chimera or zb-h1")
    schedule = _generate_cached(config.schedule.value, config.pp, config.num_microbatches, config.virtual_stages)
    layers = chunk_layer_costs(model, cluster.device, config.layers_per_chunk(model.layers), config.microbatch,
                               config.dtype, tp=config.tp, method=method)
    timing = timing_for_config(schedule, chunk_costs(model, cluster, config), cluster, config, optimizer=optimizer,
                               grad_buckets=grad_buckets)
    reduce_s, prec_s = [], []
    for r in range(schedule.stages):
        ranks = tuple(config.rank_of(pp=q, dp=d) for q in schedule.filler_group(r) for d in range(config.dp))
        nbytes = sum(x.factor_bytes for c, _ in schedule.chunks_of(r) for x in layers[c])
        reduce_s.append(collective_time("all_reduce", nbytes, ranks, cluster).time_s if len(ranks) > 1 else 0.0)
        prec_s.append(sum(x.precondition_s for c, _ in schedule.chunks_of(r) for x in layers[c]))
    return fill_kfac(schedule, timing, kfac_work(schedule, layers, reduce_s, inv_groups), margin=margin,
                     split_curvature=split_curvature, precondition_s=prec_s)

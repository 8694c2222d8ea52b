"""Discrete-event execution of a schedule.

The engine runs each pipeline rank's action list in order under the semantics of
:mod:`paratrain.schedule.ir`: a compute action occupies the rank for its duration; a p2p batch is
posted when the rank reaches it and completes when every transfer in it has completed, a transfer
starting once both ends are posted and taking the link time between the two ranks' actual
locations; a gradient reduction is launched (non-blocking) on the rank's communication stream and
the next optimizer step waits for it. With ``Timing.prefetch_receives = k`` a receive is posted
ahead of its batch, as the runtime's pipeline engine posts it: each peer's first ``k`` at the
start, the next one when an earlier one's batch completes. Ranks advance until they block on a partner that has not
posted yet and are woken when it does, so the cost is O(actions) with plain lists and a deque.
Which receive matches which send and which reductions run together come from the schedule's
compiled form (:mod:`paratrain.schedule.compiled`, built once per schedule object); a run binds
the durations to its steps (:func:`paratrain.sim.program._program`) and executes them
(:class:`_Execution`). Where processes share a host's cores (``Timing.core_sharing``,
:mod:`paratrain.sim.sharing`) a compute step's duration depends on what the other ranks do
meanwhile, and the ranks advance in global time order instead (:meth:`_Execution.run_shared`).

Durations come from a :class:`paratrain.sim.timing.Timing` (per chunk, per p2p transfer, per
reduction, per optimizer step), built from the cost model by
:func:`paratrain.sim.report.timing_for_config` or uniform by
:func:`paratrain.sim.timing.uniform_timing`.
"""

from __future__ import annotations

import heapq
from collections import deque
from dataclasses import dataclass

from paratrain.errors import ConfigError
from paratrain.schedule.compiled import Compiled
from paratrain.schedule.ir import Action, ActionKind, Schedule
from paratrain.sim.program import _COLL, _COMPUTE, _P2P, _REDUCE, _STEP, _program
from paratrain.sim.sharing import CoreSharing
from paratrain.sim.timing import Timing
from paratrain.trace import TraceEvent, category_of

__all__ = ["TraceEvent", "CommRecord", "SimRun", "run_schedule"]

K = ActionKind


@dataclass(frozen=True, slots=True)
class CommRecord:
    """One collective or transfer: the per-operation characterization of the OSU study."""

    kind: str
    bytes: int | None
    group: tuple[int, ...]  # global ranks
    start_s: float
    time_s: float


@dataclass(frozen=True)
class SimRun:
    """Raw outcome of one run: per-rank finish and busy times, events if recorded."""

    finish_s: tuple[float, ...]
    busy_s: tuple[float, ...]
    events: tuple[TraceEvent, ...]
    comm_log: tuple[CommRecord, ...]
    comm_time_by_kind: dict[str, float]
    batch_end_s: tuple[tuple[float, ...], ...]  # [rank][batch]: end of the batch's last backward
    actions: int


def run_schedule(
    schedule: Schedule,
    timing: Timing,
    *,
    overlap_grad_reduce: bool = True,
    record: bool = True,
    blocking_sends: bool = False,
) -> SimRun:
    """Execute ``schedule`` (assumed valid: see :func:`paratrain.schedule.validate`) with ``timing``.

    By default sends are eager: a rank waits for the receives of a p2p batch but not for its sends,
    whose data leaves as soon as the receiver has posted (an executor that waits on ``isend``
    handles only before reusing the buffer, as torch.distributed.pipelining does). Receives take
    the transfer time from when both ends are posted. ``blocking_sends=True`` makes the rank wait
    for every operation of the batch, the rule under which the validator proves deadlock freedom
    (so a valid schedule cannot deadlock here either way; an invalid one raises ConfigError).

    ``overlap_grad_reduce=False`` starts every gradient reduction only when the rank reaches its
    optimizer step (after all its backward work), instead of when the ``R`` action is reached.
    ``record=False`` skips the trace events and the per-operation communication log.
    """
    comp = schedule.compiled  # matched sends/receives and reduction groups, built once per schedule
    program = _program(schedule, comp, timing)
    ex = _Execution(schedule, comp, timing, overlap_grad_reduce, record)
    if timing.core_sharing is None:
        ex.run(program, eager=not blocking_sends)
    else:
        ex.run_shared(program, timing.core_sharing, eager=not blocking_sends)
    ex.raise_if_stuck(program)
    return SimRun(
        finish_s=tuple(ex.clock),
        busy_s=tuple(ex.busy),
        events=tuple(ex.events),
        comm_log=tuple(ex.log),
        comm_time_by_kind=_comm_time_by_kind(schedule, timing, ex.p2p_total, ex.red_total),
        batch_end_s=tuple(tuple(x) for x in ex.batch_end),
        actions=comp.total,
    )


class _Execution:
    """State of one run: per rank its clock, position and busy time; per action the time it was
    posted (-1: not yet); who waits on which action; reductions in flight per rank."""

    def __init__(
        self, schedule: Schedule, comp: Compiled, timing: Timing, overlap_grad_reduce: bool, record: bool
    ) -> None:
        p = schedule.stages
        self.schedule, self.comp, self.timing = schedule, comp, timing
        self.overlap, self.record = overlap_grad_reduce, record
        self.post = [-1.0] * comp.total
        self.clock = [0.0] * p
        self.busy = [0.0] * p
        self.pc = [0] * p
        self.pending: list[list[int]] = [[] for _ in range(p)]  # reductions launched since the last step
        self.comm_free = [0.0] * p  # when each rank's communication stream is free
        self.red_finish: dict[int, float] = {}  # by the first member's global index
        self.waiters: dict[int, list[int]] = {}
        self.runnable = deque(range(p))
        self.events: list[TraceEvent] = []
        self.log: list[CommRecord] = []
        self.p2p_total = 0.0
        self.red_total = 0.0
        self.batch_end = [[0.0] * schedule.iterations for _ in range(p)]
        self.step_members = comp.step_members if timing.step_allreduce_s is not None else {}
        self.tp_share = tuple(x / 2 for x in timing.tp_comm_s)  # tp_comm_s covers one forward and one backward
        self.prefetch_next = self._prefetch_plan(timing.prefetch_receives)

    def _prefetch_plan(self, k: int) -> dict[int, int]:
        """Receives posted ahead, ``k`` per peer (the runtime engine's ``prefetch_receives``): each
        rank's first ``k`` receives from every peer are posted at the start; returned, for every
        receive, the one ``k`` later from the same peer, posted when the earlier one's batch completes."""
        if k <= 0:
            return {}
        nxt: dict[int, int] = {}
        for r, row in enumerate(self.schedule.actions):
            o = self.comp.offsets[r]
            by_peer: dict[int | None, list[int]] = {}
            for i, a in enumerate(row):
                if a.kind is K.RECV_ACT or a.kind is K.RECV_GRAD:
                    by_peer.setdefault(a.peer, []).append(o + i)
            for order in by_peer.values():
                for h in order[:k]:
                    self.post[h] = 0.0
                for j in range(len(order) - k):
                    nxt[order[j]] = order[j + k]
        return nxt

    def _prefetch_after(self, batch: tuple, t: float) -> None:
        """The batch's receives are done at ``t``: post each one's successor ``k`` later from its peer."""
        for h, _, _, snd in batch:
            if not snd:
                nx = self.prefetch_next.get(h)
                if nx is not None and self.post[nx] < 0:
                    self._post(nx, t)

    def _post(self, g: int, t: float) -> None:
        """Action ``g`` is posted at ``t``: wake the ranks waiting for it."""
        self.post[g] = t
        w = self.waiters.pop(g, None)
        if w:
            self.runnable.extend(w)

    def run(self, program: list[list[tuple]], eager: bool) -> None:
        """Advance ranks until every one has finished or blocks on a partner that is never posted.
        A rank runs until it blocks and is woken when the action it waits for is posted, so each
        step is executed once (the cost is O(actions)); compute and p2p steps, nearly all of them,
        are handled inline."""
        post, waiters, runnable = self.post, self.waiters, self.runnable
        record, batch_end = self.record, self.batch_end
        prefetch = bool(self.prefetch_next)
        while runnable:
            r = runnable.popleft()
            st = program[r]
            t, i, n = self.clock[r], self.pc[r], len(st)
            bz = 0.0
            while i < n:
                kind, val, g, extra = st[i]
                if kind == _COMPUTE:
                    if record:
                        self._record_compute(r, g, t, val)
                    t += val
                    bz += val
                    if extra >= 0:
                        batch_end[r][extra] = t
                elif kind == _P2P:
                    for h, _, _, _ in val:
                        if post[h] < 0:  # first reached (a prefetched receive was posted earlier)
                            post[h] = t
                            w = waiters.pop(h, None)
                            if w:
                                runnable.extend(w)
                    done = t
                    blocked = False
                    for h, ph, x, snd in val:
                        if snd and eager:
                            continue  # eager send: the rank does not wait for it
                        pt = post[ph]
                        if pt < 0:
                            waiters.setdefault(ph, []).append(r)
                            blocked = True
                            break
                        ph_ = post[h]
                        e = (ph_ if ph_ > pt else pt) + x
                        if e > done:
                            done = e
                    if blocked:
                        break
                    for h, ph, x, snd in val:
                        if not snd:
                            self.p2p_total += x
                            if record:
                                self._record_receive(r, h, ph, x)
                    t = done
                    if prefetch:
                        self._prefetch_after(val, t)
                elif kind == _REDUCE:
                    self.pending[r].append(g)
                    if self.overlap:
                        self._post(g, t)
                elif kind == _COLL:
                    if post[g] < 0:
                        self._post(g, t)
                    members = self.comp.collective_members[g]
                    late = next((m for m in members if post[m] < 0), None)
                    if late is not None:
                        waiters.setdefault(late, []).append(r)
                        break
                    t = max(post[m] for m in members)  # starts when the last member arrives
                    if record:
                        self._record_compute(r, g, t, val)
                    t += val
                    bz += val
                else:
                    ready = self._optimizer_step(r, g, t)
                    if ready is None:
                        break
                    t = ready
                    if record and val > 0:
                        self.events.append(TraceEvent(r, "compute", "U", t, val, "optimizer"))
                    t += val
                    bz += val
                i += 1
            self.clock[r], self.pc[r] = t, i
            self.busy[r] += bz

    def run_shared(self, program: list[list[tuple]], share: CoreSharing, eager: bool) -> None:
        """:meth:`run` under processor sharing: a compute step's duration depends on which other
        ranks compute meanwhile, so ranks advance in global time order. At the current time every
        runnable rank advances through its communication steps (as in :meth:`run`) until it starts
        a compute step, waits for a time ahead, or blocks; then time moves to the next event (a
        compute finishing at the ranks' current rates, or a waiting rank's time), every
        computing rank having done ``rate × elapsed`` of its work. A compute step's waits in
        collectives (``Timing.forward_wait_s``/``backward_wait_s``) follow its work, unshared;
        a rank of several independent groups (``CoreSharing.groups``) hides them in the time
        sharing added to its work, down to one group's own path (:mod:`paratrain.sim.sharing`)."""
        post, waiters, runnable = self.post, self.waiters, self.runnable
        p = len(program)
        now = 0.0
        work = [0.0] * p  # single-core seconds left of the compute in progress
        whole = [0.0] * p  # and all of it
        began = [0.0] * p
        tail = [0.0] * p  # its waits in collectives, unshared
        computing: dict[int, tuple] = {}  # rank -> the compute (or optimizer) step it runs
        sleeping: list[tuple[float, int]] = []  # (time, rank): ranks waiting for a time ahead
        stepped = [False] * p  # the optimizer step's waits are done, its compute is next
        while True:
            while runnable:
                r = runnable.popleft()
                st = program[r]
                # a rank woken by a post resumes from where it blocked: its waits resolve at or after now
                t, i, n = self.clock[r], self.pc[r], len(program[r])
                while i < n:
                    if t > now:
                        heapq.heappush(sleeping, (t, r))
                        break
                    kind, val, g, extra = st[i]
                    if kind == _COMPUTE or (kind == _STEP and stepped[r]):
                        x = self._wait_part(g, val) if kind == _COMPUTE else 0.0
                        work[r], tail[r], began[r] = val - x, x, max(t, now)
                        whole[r] = work[r]
                        computing[r] = st[i]
                        break
                    if kind == _P2P:
                        for h, _, _, _ in val:
                            if post[h] < 0:
                                self._post(h, t)
                        done, blocked = t, False
                        for h, ph, x, snd in val:
                            if snd and eager:
                                continue
                            pt = post[ph]
                            if pt < 0:
                                waiters.setdefault(ph, []).append(r)
                                blocked = True
                                break
                            done = max(done, max(post[h], pt) + x)
                        if blocked:
                            break
                        for h, ph, x, snd in val:
                            if not snd:
                                self.p2p_total += x
                                if self.record:
                                    self._record_receive(r, h, ph, x)
                        t = done
                        if self.prefetch_next:
                            self._prefetch_after(val, t)
                    elif kind == _REDUCE:
                        self.pending[r].append(g)
                        if self.overlap:
                            self._post(g, t)
                    elif kind == _COLL:  # a collective waits, taking no core
                        if post[g] < 0:
                            self._post(g, t)
                        late = next((m for m in self.comp.collective_members[g] if post[m] < 0), None)
                        if late is not None:
                            waiters.setdefault(late, []).append(r)
                            break
                        t = max(post[m] for m in self.comp.collective_members[g])
                        if self.record:
                            self._record_compute(r, g, t, val)
                        t += val
                        self.busy[r] += val
                    else:  # the optimizer step: its waits here, its compute as above once they are done
                        ready = self._optimizer_step(r, g, t)
                        if ready is None:
                            break
                        t, stepped[r] = ready, True
                        continue
                    i += 1
                self.clock[r], self.pc[r] = t, i
            if not computing and not sleeping:
                return
            rates = share.rates(computing)
            finish = {r: now + work[r] / rates[r] for r in computing}
            nxt = min(finish.values(), default=float("inf"))
            if sleeping and sleeping[0][0] < nxt:
                nxt = sleeping[0][0]
            for r in list(computing):
                if finish[r] <= nxt:
                    if tail[r] > 0 and share.groups_of(r) > 1:
                        # the groups' waits fill the time the sharing added beyond one group's path
                        slack = nxt - began[r] - whole[r] / share.one_group_rate(r, computing)
                        tail[r] = max(0.0, tail[r] - max(0.0, slack))
                    self._finish_compute(r, computing.pop(r), began[r], nxt, tail[r])
                    stepped[r] = False
                    runnable.append(r)
                else:
                    work[r] -= rates[r] * (nxt - now)
            now = nxt
            while sleeping and sleeping[0][0] <= now:
                runnable.append(heapq.heappop(sleeping)[1])

    def _wait_part(self, g: int, val: float) -> float:
        """The waits in collectives inside compute action ``g`` (``forward_wait_s`` of a forward,
        ``backward_wait_s`` of a B or I), at most its duration ``val``."""
        fw, bw = self.timing.forward_wait_s, self.timing.backward_wait_s
        if not fw and not bw:
            return 0.0
        a = self._action(g)
        if a.chunk is None:
            return 0.0
        waits = fw if a.kind is K.FORWARD else bw if a.kind in (K.BACKWARD, K.BACKWARD_INPUT) else ()
        return min(val, waits[a.chunk]) if waits else 0.0

    def _finish_compute(self, r: int, step: tuple, start: float, end: float, tail: float) -> None:
        """Rank ``r``'s compute ``step`` ran from ``start``, its work ending at ``end``, then ``tail``."""
        kind, val, g, extra = step
        dur = end - start + tail
        if self.record:
            if kind == _COMPUTE:
                self._record_compute(r, g, start, dur)
            elif val > 0:
                self.events.append(TraceEvent(r, "compute", "U", start, dur, "optimizer"))
        if kind == _COMPUTE and extra >= 0:
            self.batch_end[r][extra] = end + tail
        self.busy[r] += dur
        self.clock[r], self.pc[r] = end + tail, self.pc[r] + 1

    def _optimizer_step(self, r: int, g: int, t: float) -> float | None:
        """When rank ``r``'s optimizer step (action ``g``, reached at ``t``) can start: after every
        reduction it launched since its last step (and, with global-norm clipping, after the
        gradient-norm all-reduce over all ranks); None if a group member has not posted yet."""
        post, pending = self.post, self.pending[r]
        members_of = self.comp.reduce_members
        if not self.overlap:
            for h in pending:
                if post[h] < 0:
                    self._post(h, t)
        for h in pending:
            for m in members_of.get(h, (h,)):
                if post[m] < 0:
                    self.waiters.setdefault(m, []).append(r)
                    return None
        ready = t
        for h in pending:
            fin = self._reduction_finish(r, h)
            if fin > ready:
                ready = fin
        sync = self.step_members.get(g)
        if sync is not None:
            # the gradient-norm all-reduce: every rank's matching step must be ready first
            if post[g] < 0:
                self._post(g, ready)
            for m in sync:
                if post[m] < 0:
                    self.waiters.setdefault(m, []).append(r)
                    return None
            step_s = self.timing.step_allreduce_s
            assert step_s is not None
            start = max(post[m] for m in sync)
            done = start + step_s
            if self.record:
                grank = self.timing.global_rank
                if g == sync[0]:
                    group = tuple(grank(q) for q in range(self.schedule.stages))
                    self.log.append(CommRecord("all_reduce", 4, group, start, step_s))
                if done > ready:
                    self.events.append(TraceEvent(r, "comm", "allreduce(grad norm)", ready, done - ready, "reduce"))
            ready = done
        pending.clear()
        return ready

    def _reduction_finish(self, r: int, h: int) -> float:
        """Finish time of the reduction ``h`` (all members posted): it starts when the last member
        posted it and every member's communication stream is free; computed once per group."""
        ms = self.comp.reduce_members.get(h, (h,))
        fin = self.red_finish.get(ms[0])
        if fin is not None:
            return fin
        timing, comp = self.timing, self.comp
        rs = [comp.rank_of[m] for m in ms]
        c = self._action(h).chunk
        dur = timing.reduce_s[c]
        start = max(max(self.post[m] for m in ms), max(self.comm_free[q] for q in rs))
        fin = self.red_finish[ms[0]] = start + dur
        for q in rs:
            self.comm_free[q] = fin
        self.red_total += dur
        if self.record and (dur > 0 or timing.reduce_groups):
            grank = timing.global_rank
            group = timing.reduce_groups[c] if timing.reduce_groups else tuple(grank(q) for q in rs)
            nb = timing.reduce_bytes[c] if timing.reduce_bytes else None
            self.log.append(CommRecord(timing.reduce_kind, nb, group, start, dur))
            if dur > 0:
                for q in rs:
                    self.events.append(TraceEvent(q, "comm", f"R@c{c}", start, dur, "reduce"))
        return fin

    def _action(self, g: int) -> Action:
        r = self.comp.rank_of[g]
        return self.schedule.actions[r][g - self.comp.offsets[r]]

    def _record_compute(self, r: int, g: int, t: float, val: float) -> None:
        a = self._action(g)
        if self.tp_share and a.kind is not K.BACKWARD_WEIGHT and a.chunk is not None:
            # the tensor-parallel collectives inside the action (their time is part of val)
            x = self.tp_share[a.chunk]
            if x > 0:
                tp_groups = self.timing.tp_groups
                group = tp_groups[r] if tp_groups else (self.timing.global_rank(r),)
                self.log.append(CommRecord("tp", None, group, t, x))
        if self.timing.cp_comm_s and a.kind is not K.BACKWARD_WEIGHT and a.chunk is not None:
            # the context-parallel ring's exposed transfers inside the action (half per pass, as tp)
            x = self.timing.cp_comm_s[a.chunk] / 2
            if x > 0:
                self.log.append(CommRecord("cp", None, (self.timing.global_rank(r),), t, x))
        self.events.append(TraceEvent(r, "compute", str(a), t, val, category_of(a.kind), a.microbatch))

    def _record_receive(self, r: int, h: int, ph: int, x: float) -> None:
        """A transfer, logged on the receiving rank: from when both ends are posted, ``x`` long."""
        timing = self.timing
        a = self._action(h)
        s0 = max(self.post[h], self.post[ph])
        nbytes = timing.p2p_bytes[a.chunk] if timing.p2p_bytes else None
        self.log.append(CommRecord("p2p", nbytes, (timing.global_rank(self.comp.rank_of[ph]), timing.global_rank(r)),
                                   s0, x))
        if x > 0:
            self.events.append(TraceEvent(r, "comm", str(a), s0, x, "p2p", a.microbatch))

    def raise_if_stuck(self, program: list[list[tuple]]) -> None:
        stuck = [r for r in range(self.schedule.stages) if self.pc[r] < len(program[r])]
        if stuck:
            r = stuck[0]
            a = program[r][self.pc[r]][2] - self.comp.offsets[r]
            raise ConfigError(
                f"schedule rank {r} action {a} ({self.schedule.actions[r][a]})",
                "deadlock: the rank never gets past this action",
                "run paratrain.schedule.validate on the schedule for the full wait chain",
            )


def _comm_time_by_kind(schedule: Schedule, timing: Timing, p2p_total: float, red_total: float) -> dict[str, float]:
    comm_kind = {"p2p": p2p_total, timing.reduce_kind: red_total}
    if timing.tp_comm_s:
        # tp_comm_s covers one forward and one backward of a micro-batch: half to each
        tp = 0.0
        for row in schedule.actions:
            for a in row:
                if a.kind is K.FORWARD or a.kind is K.BACKWARD or a.kind is K.BACKWARD_INPUT:
                    tp += timing.tp_comm_s[a.chunk] / 2
        comm_kind["tp"] = tp
    if timing.cp_comm_s:
        # the context-parallel ring's exposed transfers, inside the forward and backward times
        comm_kind["cp"] = sum(timing.cp_comm_s[a.chunk] / 2 for row in schedule.actions for a in row
                              if a.kind is K.FORWARD or a.kind is K.BACKWARD or a.kind is K.BACKWARD_INPUT)
    if timing.fsdp_comm_s:
        # FSDP's exposed gathers and reduce-scatters, every micro-batch (the step's end has none)
        comm_kind["fsdp"] = comm_kind.get("fsdp", 0.0) + sum(
            timing.fsdp_comm_s[a.chunk] / 2 for row in schedule.actions for a in row
            if a.kind is K.FORWARD or a.kind is K.BACKWARD or a.kind is K.BACKWARD_INPUT)
    return comm_kind

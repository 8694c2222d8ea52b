"""Discrete-event execution of a schedule.

The engine runs each pipeline rank's action list in order under the semantics of
:mod:`paratrain.schedule.ir`: a compute action occupies the rank for its duration; a p2p batch is
posted when the rank reaches it and completes when every transfer in it has completed, a transfer
starting once both ends are posted and taking the link time between the two ranks' actual
locations; a gradient reduction is launched (non-blocking) on the rank's communication stream and
the next optimizer step waits for it. Ranks advance until they block on a partner that has not
posted yet and are woken when it does, so the cost is O(actions) with plain lists and a deque.

Durations come from a :class:`Timing` (per chunk, per p2p transfer, per reduction, per optimizer
step), built from the cost model by :func:`paratrain.sim.report.timing_for_config` or uniform by
:func:`uniform_timing`.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from paratrain.errors import ConfigError
from paratrain.schedule.ir import P2P_KINDS, ActionKind, Schedule
from paratrain.trace import TraceEvent

__all__ = ["Timing", "TraceEvent", "CommRecord", "SimRun", "run_schedule", "uniform_timing"]

K = ActionKind


@dataclass(frozen=True)
class Timing:
    """Durations in seconds (or any unit, consistently).

    Per chunk ``c``: ``forward_s[c]``, ``backward_s[c]`` (a full ``B``: recomputation, input and
    weight gradient), ``input_s[c]`` (an ``I``: recomputation and input gradient), ``weight_s[c]``
    (a ``W``). ``p2p_s(src_rank, dst_rank, chunk)`` is the transfer time of one activation or
    gradient between pipeline ranks; ``reduce_s[c]`` the gradient reduction of chunk ``c`` (all its
    replicas and data-parallel copies together); ``optimizer_s[r]`` the optimizer step of rank
    ``r``. ``tp_comm_s`` per chunk (tensor-parallel collectives of one forward + backward, already
    inside the compute times), ``p2p_bytes``/``reduce_bytes`` per chunk and the groups only feed the
    communication log and ``comm_time_by_kind``.
    """

    forward_s: tuple[float, ...]
    backward_s: tuple[float, ...]
    input_s: tuple[float, ...]
    weight_s: tuple[float, ...]
    p2p_s: Callable[[int, int, int], float]
    reduce_s: tuple[float, ...]
    optimizer_s: tuple[float, ...]
    p2p_bytes: tuple[int, ...] = ()
    reduce_bytes: tuple[int, ...] = ()
    tp_comm_s: tuple[float, ...] = ()
    reduce_kind: str = "all_reduce"
    global_rank: Callable[[int], int] = field(default=lambda r: r)
    reduce_groups: tuple[tuple[int, ...], ...] = ()
    tp_groups: tuple[tuple[int, ...], ...] = ()  # per pipeline rank: its tensor-parallel group
    # Global-norm gradient clipping across pipeline stages: the k-th optimizer step of every rank
    # first all-reduces the squared gradient norm (one scalar) over all ranks, so it starts when the
    # last rank is ready plus this all-reduce's time. None: the ranks' steps are independent.
    step_allreduce_s: float | None = None
    # Per-action override of compute durations: ``action_s(rank, index)`` for the action at
    # ``index`` of the rank's list, or None to keep the per-chunk time (replays of measured runs).
    action_s: Callable[[int, int], float | None] | None = None


def uniform_timing(schedule: Schedule, forward: float = 1.0, backward: float = 2.0) -> Timing:
    """Every chunk takes ``forward`` and ``backward`` (split in equal halves for ``I`` and ``W``);
    communication and optimizer steps are free: the setting of the schedule papers' figures."""
    if not forward > 0 or not backward > 0:
        raise ConfigError(
            "--forward-time/--backward-time", f"must be positive, got {forward} and {backward}", "use e.g. 1 and 2"
        )
    n = schedule.num_chunks
    return Timing(
        forward_s=(forward,) * n,
        backward_s=(backward,) * n,
        input_s=(backward / 2,) * n,
        weight_s=(backward / 2,) * n,
        p2p_s=_free_p2p,
        reduce_s=(0.0,) * n,
        optimizer_s=(0.0,) * schedule.stages,
    )


def _free_p2p(src: int, dst: int, chunk: int) -> float:
    return 0.0


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


_CATEGORY = {K.FORWARD: "forward", K.BACKWARD: "backward", K.BACKWARD_INPUT: "input", K.BACKWARD_WEIGHT: "weight"}


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
    p = schedule.stages
    acts = schedule.actions
    m_per = schedule.microbatches
    off = []
    total = 0
    for row in acts:
        off.append(total)
        total += len(row)
    rank_of_g = [r for r, row in enumerate(acts) for _ in row]
    dur_of = {
        K.FORWARD: timing.forward_s,
        K.BACKWARD: timing.backward_s,
        K.BACKWARD_INPUT: timing.input_s,
        K.BACKWARD_WEIGHT: timing.weight_s,
    }
    ends_batch = (K.BACKWARD, K.BACKWARD_WEIGHT)
    p2p, sends = P2P_KINDS, (K.SEND_ACT, K.SEND_GRAD)
    # --- pass 1: steps per rank, p2p queues per ordered pair, reductions per group ----------------
    steps: list[list[tuple]] = []
    sendq: dict[tuple[int, int], list[int]] = {}
    recvq: dict[tuple[int, int], list[int]] = {}
    groups_of_chunk = [tuple(sorted({row[c] for row in schedule.placement})) for c in range(schedule.num_chunks)]
    reds: dict[tuple[int, ...], dict[int, list[int]]] = {}
    for r, row in enumerate(acts):
        o = off[r]
        out: list[tuple] = []
        i, n = 0, len(row)
        while i < n:
            a = row[i]
            k = a.kind
            d = dur_of.get(k)
            if d is not None:
                mb = a.microbatch
                bidx = mb // m_per if k in ends_batch and mb % m_per == m_per - 1 else -1
                v = timing.action_s(r, i) if timing.action_s is not None else None
                out.append((0, d[a.chunk] if v is None else v, o + i, bidx))
                i += 1
                continue
            if k in p2p:
                j = i
                ops = []
                while j < n and row[j].kind in p2p:
                    b = row[j]
                    if b.kind in sends:
                        sendq.setdefault((r, b.peer), []).append(o + j)
                    else:
                        recvq.setdefault((b.peer, r), []).append(o + j)
                    ops.append(o + j)
                    j += 1
                out.append((1, ops, o + i, 0))
                i = j
                continue
            if k is K.REDUCE_GRAD:
                reds.setdefault(groups_of_chunk[a.chunk], {}).setdefault(r, []).append(o + i)
                out.append((2, timing.reduce_s[a.chunk], o + i, 0))
            elif k is K.OPTIMIZER_STEP:
                v = timing.action_s(r, i) if timing.action_s is not None else None
                out.append((3, timing.optimizer_s[r] if v is None else v, o + i, 0))
            else:  # filler work
                out.append((0, a.duration_s or 0.0, o + i, -1))
            i += 1
        steps.append(out)
    # --- pass 2: match p2p FIFO per pair, time transfers, match reductions ------------------------
    partner = [-1] * total
    xfer = [0.0] * total
    is_send = [False] * total
    p2p_s = timing.p2p_s
    for (src, dst), sl in sendq.items():
        rl = recvq.get((src, dst), ())
        if len(rl) != len(sl):
            raise ConfigError(
                f"schedule ranks {src}->{dst}",
                f"{len(sl)} sends but {len(rl)} receives",
                "validate the schedule (paratrain.schedule.validate) for the offending action",
            )
        o = off[src]
        row = acts[src]
        for gs, gr in zip(sl, rl, strict=True):
            partner[gs] = gr
            partner[gr] = gs
            is_send[gs] = True
            x = p2p_s(src, dst, row[gs - o].chunk)
            xfer[gs] = xfer[gr] = x
    for (src, dst), rl in recvq.items():
        if (src, dst) not in sendq:
            raise ConfigError(
                f"schedule ranks {src}->{dst}",
                f"{len(rl)} receives without sends",
                "validate the schedule (paratrain.schedule.validate) for the offending action",
            )
    members_of: dict[int, tuple[int, ...]] = {}
    step_members: dict[int, tuple[int, ...]] = {}
    if timing.step_allreduce_s is not None:
        ups = [[off[r] + i for i, a in enumerate(row) if a.kind is K.OPTIMIZER_STEP] for r, row in enumerate(acts)]
        for k_ in range(min(len(u) for u in ups)):
            ms = tuple(u[k_] for u in ups)
            for g in ms:
                step_members[g] = ms
    for members in reds.values():
        ranks = sorted(members)
        for t_ in range(min(len(v) for v in members.values())):
            ms = tuple(members[q][t_] for q in ranks)
            for g in ms:
                members_of[g] = ms
    for out in steps:
        for idx, st in enumerate(out):
            if st[0] == 1:
                out[idx] = (1, tuple((g, partner[g], xfer[g], is_send[g]) for g in st[1]), st[2], 0)
    # --- run ------------------------------------------------------------------------------------
    post = [-1.0] * total
    clock = [0.0] * p
    busy = [0.0] * p
    pc = [0] * p
    pending: list[list[int]] = [[] for _ in range(p)]
    comm_free = [0.0] * p
    red_finish: dict[int, float] = {}
    waiters: dict[int, list[int]] = {}
    events: list[TraceEvent] = []
    log: list[CommRecord] = []
    p2p_total = 0.0
    red_total = 0.0
    batch_end = [[0.0] * schedule.iterations for _ in range(p)]
    grank = timing.global_rank
    tp_share = tuple(x / 2 for x in timing.tp_comm_s)  # tp_comm_s covers one forward and one backward
    tp_groups = timing.tp_groups
    eager = not blocking_sends
    run = deque(range(p))
    while run:
        r = run.popleft()
        st = steps[r]
        t, i, n = clock[r], pc[r], len(st)
        bz = 0.0
        while i < n:
            kind, val, g, extra = st[i]
            if kind == 0:
                if record:
                    a = acts[r][g - off[r]]
                    if tp_share and a.kind is not K.BACKWARD_WEIGHT and a.chunk is not None:
                        # the tensor-parallel collectives inside the action (their time is part of val)
                        x = tp_share[a.chunk]
                        if x > 0:
                            log.append(CommRecord("tp", None, tp_groups[r] if tp_groups else (grank(r),), t, x))
                    events.append(
                        TraceEvent(r, "compute", str(a), t, val, _CATEGORY.get(a.kind, "filler"), a.microbatch)
                    )
                t += val
                bz += val
                if extra >= 0:
                    batch_end[r][extra] = t
                i += 1
                continue
            if kind == 1:
                if post[g] < 0:
                    for h, _, _, _ in val:
                        post[h] = t
                        w = waiters.pop(h, None)
                        if w:
                            run.extend(w)
                done = t
                blocked = False
                for _h, ph, x, snd in val:
                    if snd and eager:
                        continue  # eager send: the rank does not wait for it
                    pt = post[ph]
                    if pt < 0:
                        waiters.setdefault(ph, []).append(r)
                        blocked = True
                        break
                    e = (t if t > pt else pt) + x
                    if e > done:
                        done = e
                if blocked:
                    break
                for h, ph, x, snd in val:
                    if not snd:
                        p2p_total += x
                        if record:
                            q = rank_of_g[ph]
                            a = acts[r][h - off[r]]
                            s0 = max(t, post[ph])
                            nbytes = timing.p2p_bytes[a.chunk] if timing.p2p_bytes else None
                            log.append(CommRecord("p2p", nbytes, (grank(q), grank(r)), s0, x))
                            if x > 0:
                                events.append(TraceEvent(r, "comm", str(a), s0, x, "p2p", a.microbatch))
                t = done
                i += 1
                continue
            if kind == 2:
                pending[r].append(g)
                if overlap_grad_reduce:
                    post[g] = t
                    w = waiters.pop(g, None)
                    if w:
                        run.extend(w)
                i += 1
                continue
            # optimizer step: all reductions launched since the last step must finish first
            if not overlap_grad_reduce:
                for h in pending[r]:
                    if post[h] < 0:
                        post[h] = t
                        w = waiters.pop(h, None)
                        if w:
                            run.extend(w)
            blocked = False
            for h in pending[r]:
                for m in members_of.get(h, (h,)):
                    if post[m] < 0:
                        waiters.setdefault(m, []).append(r)
                        blocked = True
                        break
                if blocked:
                    break
            if blocked:
                break
            ready = t
            for h in pending[r]:
                ms = members_of.get(h, (h,))
                fin = red_finish.get(ms[0])
                if fin is None:
                    rs = [rank_of_g[m] for m in ms]
                    a = acts[r][h - off[r]]
                    dur = timing.reduce_s[a.chunk]
                    start = max(max(post[m] for m in ms), max(comm_free[q] for q in rs))
                    fin = red_finish[ms[0]] = start + dur
                    for q in rs:
                        comm_free[q] = fin
                    red_total += dur
                    if record and (dur > 0 or timing.reduce_groups):
                        c = a.chunk
                        group = timing.reduce_groups[c] if timing.reduce_groups else tuple(grank(q) for q in rs)
                        nb = timing.reduce_bytes[c] if timing.reduce_bytes else None
                        log.append(CommRecord(timing.reduce_kind, nb, group, start, dur))
                        if dur > 0:
                            for q in rs:
                                events.append(TraceEvent(q, "comm", f"R@c{c}", start, dur, "reduce"))
                if fin > ready:
                    ready = fin
            sync = step_members.get(g)
            if sync is not None:
                # the gradient-norm all-reduce: every rank's matching step must be ready first
                if post[g] < 0:
                    post[g] = ready
                    w = waiters.pop(g, None)
                    if w:
                        run.extend(w)
                for m in sync:
                    if post[m] < 0:
                        waiters.setdefault(m, []).append(r)
                        blocked = True
                        break
                if blocked:
                    break
                start = max(post[m] for m in sync)
                done = start + timing.step_allreduce_s
                if record and g == sync[0]:
                    log.append(CommRecord("all_reduce", 4, tuple(grank(q) for q in range(p)), start,
                                          timing.step_allreduce_s))
                if record and done > ready:
                    events.append(TraceEvent(r, "comm", "allreduce(grad norm)", ready, done - ready, "reduce"))
                ready = done
            pending[r].clear()
            t = ready
            if record and val > 0:
                events.append(TraceEvent(r, "compute", "U", t, val, "optimizer"))
            t += val
            bz += val
            i += 1
        clock[r], pc[r] = t, i
        busy[r] += bz
    stuck = [r for r in range(p) if pc[r] < len(steps[r])]
    if stuck:
        r = stuck[0]
        a = steps[r][pc[r]][2] - off[r]
        raise ConfigError(
            f"schedule rank {r} action {a} ({acts[r][a]})",
            "deadlock: the rank never gets past this action",
            "run paratrain.schedule.validate on the schedule for the full wait chain",
        )
    comm_kind = {"p2p": p2p_total, timing.reduce_kind: red_total}
    if timing.tp_comm_s:
        # tp_comm_s covers one forward and one backward of a micro-batch: half to each
        tp = 0.0
        for row in acts:
            for a in row:
                if a.kind is K.FORWARD or a.kind is K.BACKWARD or a.kind is K.BACKWARD_INPUT:
                    tp += timing.tp_comm_s[a.chunk] / 2
        comm_kind["tp"] = tp
    return SimRun(
        finish_s=tuple(clock),
        busy_s=tuple(busy),
        events=tuple(events),
        comm_log=tuple(log),
        comm_time_by_kind=comm_kind,
        batch_end_s=tuple(tuple(x) for x in batch_end),
        actions=total,
    )

"""Validation of any schedule, generated or written by hand.

Checks, in order (the first violation raises :class:`~paratrain.errors.ConfigError` whose field
names the rank, the action's index in the rank's list and its text form):

1. shape: one list per rank, placement consistent, every action on the rank that holds its chunk;
2. per rank, in list order: a backward after its forward, ``W`` after ``I``, inputs available
   (a receive, or the neighbouring chunk's action on the same rank, precedes each compute action),
   sends after the action producing their data, weight versions that exist and are stashed,
   gradients reduced before the optimizer step and not touched between reduction and step;
3. completeness: every micro-batch runs forward and backward (or ``I`` + ``W``) once on every chunk,
   on one replica;
4. p2p matching, FIFO per ordered rank pair (the k-th send from a to b is the k-th receive on b from a);
5. reductions issued in the same order by every rank of a reduction group;
6. deadlock freedom under the blocking semantics in :mod:`paratrain.schedule.ir` (each run of
   consecutive sends/receives is one batch that completes when all partners have been posted; a
   collective filler completes when every rank of its group has reached it).

It also counts in-flight micro-batches (activations held: from a forward to the backward that frees
them, ``B`` or ``W``) and live weight versions per rank.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from paratrain.errors import ConfigError
from paratrain.schedule.compiled import STEP_FILLER, STEP_P2P, STEP_REDUCE, STEP_STEP, Compiled, compile_schedule
from paratrain.schedule.ir import Action, ActionKind, Schedule

# Compiled and compile_schedule live in paratrain.schedule.compiled; importable from here too.
__all__ = ["ScheduleCheck", "Compiled", "validate", "check_deadlock", "compile_schedule", "inflight_and_versions"]

K = ActionKind

@dataclass(frozen=True)
class ScheduleCheck:
    """What validation learned about a valid schedule."""

    peak_inflight_by_rank: tuple[int, ...]
    weight_versions_by_rank: tuple[int, ...]
    p2p_batches_by_rank: tuple[int, ...]


def _fail(s: Schedule, r: int, i: int, problem: str, fix: str | None = None) -> None:
    raise ConfigError(f"schedule rank {r} action {i} ({s.actions[r][i]})", problem, fix)


def _check_shape(s: Schedule) -> None:
    if len(s.actions) != s.stages:
        raise ConfigError(
            "schedule", f"has {len(s.actions)} action lists for {s.stages} stages", "give one list per rank"
        )
    if not s.placement or not s.placement[0]:
        raise ConfigError("schedule.placement", "is empty", "give placement[replica][chunk] = rank")
    nc = len(s.placement[0])
    for rep, row in enumerate(s.placement):
        if len(row) != nc:
            raise ConfigError(
                "schedule.placement",
                f"replica {rep} has {len(row)} chunks, replica 0 has {nc}",
                "give every replica all chunks",
            )
        for c, r in enumerate(row):
            if not 0 <= r < s.stages:
                raise ConfigError(
                    "schedule.placement",
                    f"chunk {c} of replica {rep} is on rank {r}, outside 0..{s.stages - 1}",
                    "use ranks of the pipeline",
                )
    nmb = s.microbatches * s.iterations
    for r, row in enumerate(s.actions):
        for i, a in enumerate(row):
            if a.kind is K.OPTIMIZER_STEP or a.kind is K.FILLER:
                continue
            if not 0 <= a.replica < s.num_replicas:
                _fail(s, r, i, f"replica {a.replica} does not exist (the schedule has {s.num_replicas})")
            if a.chunk is None or not 0 <= a.chunk < nc:
                _fail(s, r, i, f"chunk {a.chunk} does not exist (the pipeline has chunks 0..{nc - 1})")
            if s.placement[a.replica][a.chunk] != r:
                _fail(
                    s,
                    r,
                    i,
                    f"chunk {a.chunk} (replica {a.replica}) is placed on rank"
                    f" {s.placement[a.replica][a.chunk]}, not here",
                    "move the action to that rank's list or change the placement",
                )
            if a.kind is not K.REDUCE_GRAD and not 0 <= a.microbatch < nmb:
                _fail(s, r, i, f"micro-batch {a.microbatch} is outside 0..{nmb - 1}")
            if a.is_p2p:
                want = _peer_of(s, a)
                if want is None:
                    _fail(s, r, i, "this chunk has no neighbour in that direction: nothing to send or receive")
                if a.peer != want:
                    _fail(
                        s,
                        r,
                        i,
                        f"peer is rank {a.peer} but the neighbouring chunk is on rank {want}",
                        f"use peer {want}",
                    )


def _peer_of(s: Schedule, a: Action) -> int | None:
    nc = s.num_chunks
    k, c = a.kind, a.chunk
    if k is K.SEND_ACT or k is K.RECV_GRAD:
        return s.placement[a.replica][c + 1] if c + 1 < nc else None
    return s.placement[a.replica][c - 1] if c > 0 else None


def _check_rank_order(s: Schedule, r: int) -> tuple[int, int]:
    """Scan rank ``r``'s list; return (peak in-flight micro-batches, peak live weight versions)."""
    nc = s.num_chunks
    pl = s.placement
    fwd: dict[tuple[int, int, int], int | None] = {}  # (chunk, replica, mb) -> version
    bwd_in: set[tuple[int, int, int]] = set()  # B or I done
    split: set[tuple[int, int, int]] = set()  # I done (W pending)
    freed: set[tuple[int, int, int]] = set()
    recv_act: set[tuple[int, int, int]] = set()
    recv_grad: set[tuple[int, int, int]] = set()
    dirty: set[tuple[int, int]] = set()  # chunks with gradients not yet reduced
    reduced: set[tuple[int, int]] = set()  # reduced since the last optimizer step
    live: dict[int, int] = {}  # version -> in-flight micro-batches using it
    steps = 0
    inflight = peak = 0
    peak_versions = 1
    for i, a in enumerate(s.actions[r]):
        k = a.kind
        key = (a.chunk, a.replica, a.microbatch)
        if k is K.FORWARD:
            if key in fwd:
                _fail(s, r, i, f"micro-batch {a.microbatch} already ran forward on chunk {a.chunk}")
            c = a.chunk
            if c > 0:
                src = pl[a.replica][c - 1]
                if src == r:
                    if (c - 1, a.replica, a.microbatch) not in fwd:
                        _fail(
                            s,
                            r,
                            i,
                            f"its input comes from chunk {c - 1} on this rank, whose forward of micro-batch "
                            f"{a.microbatch} has not run yet",
                            "order the forwards by chunk",
                        )
                elif key not in recv_act:
                    _fail(
                        s,
                        r,
                        i,
                        f"missing receive: no RF{a.microbatch}@c{c}<{src} (activation from rank {src}) precedes it",
                        f"add RF{a.microbatch}@c{c}<{src} before it",
                    )
            if a.version is not None and a.version > steps:
                _fail(
                    s,
                    r,
                    i,
                    f"uses weight version {a.version} but only {steps} optimizer steps ran before it",
                    f"use a version ≤ {steps}",
                )
            fwd[key] = a.version
            inflight += 1
            peak = max(peak, inflight)
            if a.version is not None:
                live[a.version] = live.get(a.version, 0) + 1
                peak_versions = max(peak_versions, len(live.keys() | {steps}))
        elif k is K.BACKWARD or k is K.BACKWARD_INPUT:
            if key not in fwd:
                _fail(
                    s,
                    r,
                    i,
                    f"backward before forward: micro-batch {a.microbatch} has not run forward on chunk {a.chunk} here",
                    "put the forward first",
                )
            if key in bwd_in:
                _fail(s, r, i, f"micro-batch {a.microbatch} already ran backward on chunk {a.chunk}")
            c = a.chunk
            if c < nc - 1:
                dst = pl[a.replica][c + 1]
                if dst == r:
                    if (c + 1, a.replica, a.microbatch) not in bwd_in:
                        _fail(
                            s,
                            r,
                            i,
                            f"its output gradient comes from chunk {c + 1} on this rank, whose backward of "
                            f"micro-batch {a.microbatch} has not run yet",
                            "order the backwards by decreasing chunk",
                        )
                elif key not in recv_grad:
                    _fail(
                        s,
                        r,
                        i,
                        f"missing receive: no RB{a.microbatch}@c{c}<{dst} (gradient from rank {dst}) precedes it",
                        f"add RB{a.microbatch}@c{c}<{dst} before it",
                    )
            _check_version(s, r, i, a, fwd[key])
            bwd_in.add(key)
            if k is K.BACKWARD:
                peak_versions = _free(live, fwd[key], peak_versions)
                freed.add(key)
                inflight -= 1
                dirty.add((c, a.replica))
                if (c, a.replica) in reduced:
                    _fail(
                        s,
                        r,
                        i,
                        f"gradient of chunk {c} changes after its reduction and before the optimizer step",
                        "move the R action after the chunk's last backward",
                    )
            else:
                split.add(key)
        elif k is K.BACKWARD_WEIGHT:
            if key not in split:
                _fail(
                    s,
                    r,
                    i,
                    f"weight gradient before the input gradient (I{a.microbatch}@c{a.chunk}) of this micro-batch",
                    "put the I action first",
                )
            if key in freed:
                _fail(s, r, i, f"micro-batch {a.microbatch} already ran its weight gradient on chunk {a.chunk}")
            _check_version(s, r, i, a, fwd[key])
            freed.add(key)
            peak_versions = _free(live, fwd[key], peak_versions)
            inflight -= 1
            dirty.add((a.chunk, a.replica))
            if (a.chunk, a.replica) in reduced:
                _fail(
                    s,
                    r,
                    i,
                    f"gradient of chunk {a.chunk} changes after its reduction and before the optimizer step",
                    "move the R action after the chunk's last backward",
                )
        elif k is K.SEND_ACT:
            if key not in fwd:
                _fail(
                    s, r, i, f"sends the activation of micro-batch {a.microbatch} before its forward on chunk {a.chunk}"
                )
        elif k is K.SEND_GRAD:
            if key not in bwd_in:
                _fail(
                    s,
                    r,
                    i,
                    f"sends the input gradient of micro-batch {a.microbatch} before its backward on chunk {a.chunk}",
                )
        elif k is K.RECV_ACT:
            recv_act.add(key)
        elif k is K.RECV_GRAD:
            recv_grad.add(key)
        elif k is K.REDUCE_GRAD:
            ck = (a.chunk, a.replica)
            if ck not in dirty:
                _fail(s, r, i, f"reduces chunk {a.chunk} but no backward of it ran since the last optimizer step")
            dirty.discard(ck)
            reduced.add(ck)
        elif k is K.OPTIMIZER_STEP:
            if dirty:
                c, rep = min(dirty)
                _fail(
                    s,
                    r,
                    i,
                    f"optimizer step before the gradients of chunk {c} (replica {rep}) were reduced",
                    f"add R@c{c}{'r1' if rep else ''} after the chunk's last backward",
                )
            reduced.clear()
            steps += 1
            if live:
                peak_versions = max(peak_versions, len(live.keys() | {steps}))
    if dirty or reduced:
        n = len(s.actions[r])
        raise ConfigError(
            f"schedule rank {r} end of list (after action {n - 1})",
            "gradients are computed but never reduced and applied",
            "end the list with R actions and U",
        )
    return peak, peak_versions


def _check_version(s: Schedule, r: int, i: int, a: Action, fwd_version: int | None) -> None:
    if a.version != fwd_version:
        _fail(
            s,
            r,
            i,
            f"uses weight version {a.version} but its forward used {fwd_version} (weight stashing)",
            f"use version {fwd_version}",
        )


def _free(live: dict[int, int], version: int | None, peak: int) -> int:
    if version is not None:
        live[version] -= 1
        if not live[version]:
            del live[version]
    return peak


def _check_complete(s: Schedule) -> None:
    seen: dict[int, int] = {}  # mb -> replica
    count: dict[tuple[int, int, int, str], int] = {}
    for r, row in enumerate(s.actions):
        for a in row:
            if a.is_compute:
                rep = seen.setdefault(a.microbatch, a.replica)
                if rep != a.replica:
                    raise ConfigError(
                        f"schedule rank {r} ({a})",
                        f"micro-batch {a.microbatch} runs on replicas {rep} and {a.replica}",
                        "send each micro-batch through one replica",
                    )
                kk = (a.chunk, a.replica, a.microbatch, a.kind.value)
                count[kk] = count.get(kk, 0) + 1
    for mb in range(s.microbatches * s.iterations):
        rep = seen.get(mb)
        if rep is None:
            raise ConfigError(
                "schedule",
                f"micro-batch {mb} never runs",
                f"add its forward and backward on chunks 0..{s.num_chunks - 1}",
            )
        for c in range(s.num_chunks):
            r = s.placement[rep][c]
            if count.get((c, rep, mb, "F"), 0) != 1:
                raise ConfigError(
                    f"schedule rank {r}", f"micro-batch {mb} never runs forward on chunk {c}", f"add F{mb}@c{c}"
                )
            b = count.get((c, rep, mb, "B"), 0)
            i = count.get((c, rep, mb, "I"), 0)
            w = count.get((c, rep, mb, "W"), 0)
            if not ((b == 1 and i == 0 and w == 0) or (b == 0 and i == 1 and w == 1)):
                raise ConfigError(
                    f"schedule rank {r}",
                    f"micro-batch {mb} never completes its backward on chunk {c}",
                    f"add B{mb}@c{c} (or I{mb}@c{c} and W{mb}@c{c})",
                )


def _check_deadlock(s: Schedule, comp: Compiled) -> None:
    """Run every rank under the blocking semantics (a p2p batch waits for all its partners to be
    posted, an optimizer step for every member of the reductions launched since the last one);
    a rank that can never move on is a deadlock, reported with its wait chain."""
    n = s.stages
    off, rank_of, partner, members_of = comp.offsets, comp.rank_of, comp.partner, comp.reduce_members
    coll = comp.collective_members
    posted = bytearray(comp.total)
    pc = [0] * n
    pending: list[list[int]] = [[] for _ in range(n)]  # reductions launched since the last step
    waiters: dict[int, list[int]] = {}
    waiting_on: list[tuple[int, int] | None] = [None] * n  # (own global action, awaited global action)
    run = deque(range(n))
    while run:
        r = run.popleft()
        steps, o = comp.steps[r], off[r]
        while pc[r] < len(steps):
            kind, a, b = steps[pc[r]]
            blocked = None
            if kind == STEP_P2P:
                for g in range(o + a, o + b):
                    if not posted[g]:
                        posted[g] = 1
                        run.extend(waiters.pop(g, ()))
                for g in range(o + a, o + b):
                    if not posted[partner[g]]:
                        blocked = (g, partner[g])
                        break
            elif kind == STEP_REDUCE:
                posted[o + a] = 1
                run.extend(waiters.pop(o + a, ()))
                pending[r].append(o + a)
            elif kind == STEP_FILLER and o + a in coll:
                # a collective filler blocks until every member of its group has reached it
                if not posted[o + a]:
                    posted[o + a] = 1
                    run.extend(waiters.pop(o + a, ()))
                for h in coll[o + a]:
                    if not posted[h]:
                        blocked = (o + a, h)
                        break
            elif kind == STEP_STEP:
                for g in pending[r]:
                    for h in members_of.get(g, ()):
                        if not posted[h]:
                            blocked = (o + a, h)
                            break
                    if blocked:
                        break
                else:
                    pending[r].clear()
            if blocked is not None:
                waiting_on[r] = blocked
                waiters.setdefault(blocked[1], []).append(r)
                break
            waiting_on[r] = None
            pc[r] += 1
    stuck = [r for r in range(n) if pc[r] < len(comp.steps[r])]
    if stuck:

        def text(g: int) -> tuple[int, int, str]:
            q = rank_of[g]
            return q, g - off[q], str(s.actions[q][g - off[q]])

        chain = []
        seen = set()
        r: int | None = stuck[0]
        while r is not None and r not in seen and waiting_on[r] is not None:
            seen.add(r)
            own, other = waiting_on[r]
            _, i, a_txt = text(own)
            q, _, b_txt = text(other)
            chain.append(f"rank {r} at action {i} ({a_txt}) waits for {b_txt} on rank {q}")
            r = q if pc[q] < len(comp.steps[q]) else None
        r0 = stuck[0]
        w = waiting_on[r0]
        i0 = w[0] - off[r0] if w else comp.steps[r0][pc[r0]][1]
        _fail(
            s,
            r0,
            i0,
            "deadlock under blocking p2p semantics: " + "; ".join(chain),
            "reorder sends/receives so that every batch's partners are posted (see the README, 'Pipeline schedules')",
        )


def check_deadlock(s: Schedule) -> None:
    """Only check 6 (matching and deadlock freedom): for a schedule whose other checks are known to
    pass, e.g. a valid one whose p2p batches were split around filler work."""
    _check_deadlock(s, s.compiled)


def inflight_and_versions(s: Schedule) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Per rank: peak in-flight micro-batches and peak live weight versions (runs the order checks)."""
    res = [_check_rank_order(s, r) for r in range(s.stages)]
    return tuple(p for p, _ in res), tuple(v for _, v in res)


def validate(s: Schedule) -> ScheduleCheck:
    """Raise :class:`ConfigError` naming the rank and action of the first violation; else return counts."""
    _check_shape(s)
    peak, versions = inflight_and_versions(s)
    _check_complete(s)
    comp = s.compiled
    _check_deadlock(s, comp)
    if max(versions) > s.weight_versions:
        r = versions.index(max(versions))
        raise ConfigError(
            f"schedule rank {r}",
            f"holds {versions[r]} weight versions, the schedule declares {s.weight_versions}",
            f"set weight_versions to {versions[r]}",
        )
    return ScheduleCheck(peak, versions, comp.p2p_batches_by_rank())

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
   consecutive sends/receives is one batch that completes when all partners have been posted).

It also counts in-flight micro-batches (activations held: from a forward to the backward that frees
them, ``B`` or ``W``) and live weight versions per rank.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from paratrain.errors import ConfigError
from paratrain.schedule.ir import Action, ActionKind, Schedule

__all__ = ["ScheduleCheck", "Compiled", "validate", "compile_schedule", "inflight_and_versions"]

K = ActionKind

# step kinds of the compiled form
STEP_COMPUTE, STEP_P2P, STEP_REDUCE, STEP_STEP, STEP_FILLER = range(5)


@dataclass(frozen=True)
class ScheduleCheck:
    """What validation learned about a valid schedule."""

    peak_inflight_by_rank: tuple[int, ...]
    weight_versions_by_rank: tuple[int, ...]
    p2p_batches_by_rank: tuple[int, ...]


@dataclass(frozen=True)
class Compiled:
    """Execution structure shared by the deadlock check and the simulator.

    ``steps[r]`` lists ``(step_kind, start, stop)`` over action indices of rank ``r``;
    ``partner[r][i]`` is, for a send/receive, the ``(rank, index)`` of its matching action, and for
    a reduction the tuple of ``(rank, index)`` of the same reduction on the other group members.
    """

    steps: tuple[tuple[tuple[int, int, int], ...], ...]
    partner: tuple[dict[int, object], ...]


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


_MATCH = {K.SEND_ACT: (K.RECV_ACT, 1), K.SEND_GRAD: (K.RECV_GRAD, -1)}


def compile_schedule(s: Schedule) -> Compiled:
    """Group actions into steps and match sends with receives and reductions across ranks."""
    steps = []
    partner: list[dict[int, object]] = [{} for _ in range(s.stages)]
    sends: dict[tuple[int, int], list[int]] = {}
    recvs: dict[tuple[int, int], list[int]] = {}
    groups: dict[tuple[int, ...], dict[int, list[int]]] = {}
    group_of_chunk = [tuple(sorted({row[c] for row in s.placement})) for c in range(s.num_chunks)]
    for r, row in enumerate(s.actions):
        rs: list[tuple[int, int, int]] = []
        i, n = 0, len(row)
        while i < n:
            a = row[i]
            k = a.kind
            if k in _P2P:
                j = i
                while j < n and row[j].kind in _P2P:
                    b = row[j]
                    if b.kind in _MATCH:
                        sends.setdefault((r, b.peer), []).append(j)
                    else:
                        recvs.setdefault((b.peer, r), []).append(j)
                    j += 1
                rs.append((STEP_P2P, i, j))
                i = j
                continue
            if k is K.REDUCE_GRAD:
                groups.setdefault(group_of_chunk[a.chunk], {}).setdefault(r, []).append(i)
                rs.append((STEP_REDUCE, i, i + 1))
            elif k is K.OPTIMIZER_STEP:
                rs.append((STEP_STEP, i, i + 1))
            elif k is K.FILLER:
                rs.append((STEP_FILLER, i, i + 1))
            else:
                rs.append((STEP_COMPUTE, i, i + 1))
            i += 1
        steps.append(tuple(rs))
    for (src, dst), idx in sends.items():
        ridx = recvs.get((src, dst), [])
        for n_, j in enumerate(idx):
            a = s.actions[src][j]
            want_kind, dc = _MATCH[a.kind]
            if n_ >= len(ridx):
                _fail(
                    s,
                    src,
                    j,
                    f"no matching receive: rank {dst} posts only {len(ridx)} receives from rank {src}, "
                    f"this is send #{n_ + 1}",
                    f"add {want_kind.value}{a.microbatch}@c{a.chunk + dc}<{src} on rank {dst}",
                )
            b = s.actions[dst][ridx[n_]]
            if (
                b.kind is not want_kind
                or b.chunk != a.chunk + dc
                or b.microbatch != a.microbatch
                or b.replica != a.replica
            ):
                _fail(
                    s,
                    dst,
                    ridx[n_],
                    f"receive #{n_ + 1} from rank {src} does not match send #{n_ + 1} of rank {src}, "
                    f"which is {a} (action {j}); matching is FIFO per rank pair",
                    "post receives in the order the peer sends",
                )
            partner[src][j] = (dst, ridx[n_])
            partner[dst][ridx[n_]] = (src, j)
    for (src, dst), ridx in recvs.items():
        nsend = len(sends.get((src, dst), []))
        if len(ridx) > nsend:
            j = ridx[nsend]
            _fail(
                s,
                dst,
                j,
                f"missing send: rank {src} sends only {nsend} messages to rank {dst}, this is receive #{nsend + 1}",
            )
    for members in groups.values():
        ranks = sorted(members)
        seqs = {r: [(s.actions[r][i].chunk) for i in members[r]] for r in ranks}
        ref = ranks[0]
        for r in ranks[1:]:
            if len(seqs[r]) != len(seqs[ref]) or seqs[r] != seqs[ref]:
                n_ = next(
                    (t for t, (x, y) in enumerate(zip(seqs[r], seqs[ref], strict=False)) if x != y),
                    min(len(seqs[r]), len(seqs[ref])),
                )
                i = members[r][min(n_, len(members[r]) - 1)]
                _fail(
                    s,
                    r,
                    i,
                    f"reduction #{n_ + 1} of the group shared with rank {ref} does not match rank {ref}'s "
                    f"(chunks {seqs[ref]} there, {seqs[r]} here)",
                    "issue reductions in the same order on every member",
                )
        for t in range(len(members[ref])):
            for r in ranks:
                partner[r][members[r][t]] = tuple((q, members[q][t]) for q in ranks if q != r)
    return Compiled(tuple(steps), tuple(partner))


_P2P = frozenset({K.SEND_ACT, K.RECV_ACT, K.SEND_GRAD, K.RECV_GRAD})


def _check_deadlock(s: Schedule, comp: Compiled) -> None:
    n = s.stages
    posted = [bytearray(len(row)) for row in s.actions]
    pc = [0] * n
    pending: list[list[int]] = [[] for _ in range(n)]  # reductions launched since the last step
    waiters: dict[tuple[int, int], list[int]] = {}
    waiting_on: list[tuple[int, int, int] | None] = [None] * n  # (own action, peer rank, peer action)
    run = deque(range(n))
    while run:
        r = run.popleft()
        steps, part = comp.steps[r], comp.partner[r]
        while pc[r] < len(steps):
            kind, a, b = steps[pc[r]]
            blocked = None
            if kind == STEP_P2P:
                for i in range(a, b):
                    if not posted[r][i]:
                        posted[r][i] = 1
                        run.extend(waiters.pop((r, i), ()))
                for i in range(a, b):
                    q, j = part[i]
                    if not posted[q][j]:
                        blocked = (i, q, j)
                        break
            elif kind == STEP_REDUCE:
                posted[r][a] = 1
                run.extend(waiters.pop((r, a), ()))
                pending[r].append(a)
            elif kind == STEP_STEP:
                for i in pending[r]:
                    for q, j in part.get(i, ()):
                        if not posted[q][j]:
                            blocked = (a, q, j)
                            break
                    if blocked:
                        break
                else:
                    pending[r].clear()
            if blocked is not None:
                waiting_on[r] = blocked
                waiters.setdefault((blocked[1], blocked[2]), []).append(r)
                break
            waiting_on[r] = None
            pc[r] += 1
    stuck = [r for r in range(n) if pc[r] < len(comp.steps[r])]
    if stuck:
        r = stuck[0]
        chain = []
        seen = set()
        while r is not None and r not in seen and waiting_on[r] is not None:
            seen.add(r)
            i, q, j = waiting_on[r]
            chain.append(f"rank {r} at action {i} ({s.actions[r][i]}) waits for {s.actions[q][j]} on rank {q}")
            r = q if pc[q] < len(comp.steps[q]) else None
        r0 = stuck[0]
        i0 = waiting_on[r0][0] if waiting_on[r0] else comp.steps[r0][pc[r0]][1]
        _fail(
            s,
            r0,
            i0,
            "deadlock under blocking p2p semantics: " + "; ".join(chain),
            "reorder sends/receives so that every batch's partners are posted (see the README, 'Pipeline schedules')",
        )


def inflight_and_versions(s: Schedule) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Per rank: peak in-flight micro-batches and peak live weight versions (runs the order checks)."""
    res = [_check_rank_order(s, r) for r in range(s.stages)]
    return tuple(p for p, _ in res), tuple(v for _, v in res)


def validate(s: Schedule) -> ScheduleCheck:
    """Raise :class:`ConfigError` naming the rank and action of the first violation; else return counts."""
    _check_shape(s)
    peak, versions = inflight_and_versions(s)
    _check_complete(s)
    comp = compile_schedule(s)
    _check_deadlock(s, comp)
    if max(versions) > s.weight_versions:
        r = versions.index(max(versions))
        raise ConfigError(
            f"schedule rank {r}",
            f"holds {versions[r]} weight versions, the schedule declares {s.weight_versions}",
            f"set weight_versions to {versions[r]}",
        )
    return ScheduleCheck(peak, versions, tuple(sum(1 for st in row if st[0] == STEP_P2P) for row in comp.steps))

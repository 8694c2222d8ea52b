"""The compiled form of a schedule: steps, matched sends and receives, reduction groups, hosts.

Every executor of the IR needs the same structure beyond the action lists: which consecutive
actions form one p2p batch, which receive matches which send (FIFO per ordered rank pair), which
reductions run together, which ranks hold a chunk. :func:`compile_schedule` derives it once,
checking the matching on the way (a mismatch is a :class:`~paratrain.errors.ConfigError` naming
rank, action and fix); the validator's deadlock check and the simulator's engine execute it, and
:attr:`Schedule.compiled` keeps it with the schedule object so that it is built once.

Actions are numbered globally, rank after rank: action ``i`` of rank ``r`` is
``offsets[r] + i``; flat lists indexed that way are cheap to read in the executors' inner loops.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from paratrain.errors import ConfigError
from paratrain.schedule.ir import ActionKind, Schedule

__all__ = ["Compiled", "compile_schedule", "hosts_of", "STEP_COMPUTE", "STEP_P2P", "STEP_REDUCE", "STEP_STEP",
           "STEP_FILLER"]

K = ActionKind

# Step kinds. A p2p step is a maximal run of consecutive sends/receives (one batch); every other
# action is a step of its own.
STEP_COMPUTE, STEP_P2P, STEP_REDUCE, STEP_STEP, STEP_FILLER = range(5)

_P2P = frozenset({K.SEND_ACT, K.RECV_ACT, K.SEND_GRAD, K.RECV_GRAD})
# a send's matching receive: its kind and the receiver's chunk relative to the sender's
_MATCH = {K.SEND_ACT: (K.RECV_ACT, 1), K.SEND_GRAD: (K.RECV_GRAD, -1)}


@dataclass(frozen=True)
class Compiled:
    """Execution structure of a schedule (see the module docstring for the global numbering).

    ``steps[r]``: rank ``r``'s steps as ``(step kind, start, stop)`` over its action indices.
    ``partner[g]``: for a send or receive, the global index of its matching action; else -1.
    ``reduce_members[g]``: for a reduction, the global indices of the same reduction on every rank
    of its group (itself included), by ascending rank. ``step_members[g]``: for the k-th optimizer
    step of a rank, the k-th step of every rank (k below the fewest steps any rank has).
    ``hosts[c]``: the ranks holding chunk ``c`` in any replica (its reduction group), ascending.
    """

    offsets: tuple[int, ...]
    rank_of: tuple[int, ...]
    steps: tuple[tuple[tuple[int, int, int], ...], ...]
    partner: tuple[int, ...]
    reduce_members: dict[int, tuple[int, ...]]
    step_members: dict[int, tuple[int, ...]]
    hosts: tuple[tuple[int, ...], ...]
    # for a collective filler (ir.Action.is_collective_filler), the global indices of the same
    # collective on every rank of its filler group (itself included), by ascending rank
    collective_members: dict[int, tuple[int, ...]] = field(default_factory=dict)

    @property
    def total(self) -> int:
        return len(self.rank_of)

    def p2p_batches_by_rank(self) -> tuple[int, ...]:
        return tuple(sum(1 for st in row if st[0] == STEP_P2P) for row in self.steps)


def hosts_of(schedule: Schedule, chunk: int) -> tuple[int, ...]:
    """The pipeline ranks that hold ``chunk`` in any replica, ascending: the ranks whose copies of
    the chunk's gradients one reduction combines (one rank, or two under Chimera)."""
    return tuple(sorted({row[chunk] for row in schedule.placement}))


def _fail(s: Schedule, r: int, i: int, problem: str, fix: str | None = None) -> None:
    raise ConfigError(f"schedule rank {r} action {i} ({s.actions[r][i]})", problem, fix)


def compile_schedule(s: Schedule) -> Compiled:
    """Group actions into steps and match sends with receives and reductions across ranks."""
    offsets: list[int] = []
    total = 0
    for row in s.actions:
        offsets.append(total)
        total += len(row)
    hosts = tuple(hosts_of(s, c) for c in range(s.num_chunks))
    steps, sends, recvs, groups, updates = _scan(s, hosts)
    partner = [-1] * total
    _match_p2p(s, offsets, sends, recvs, partner)
    reduce_members = _match_reductions(s, offsets, groups)
    step_members: dict[int, tuple[int, ...]] = {}
    for k in range(min((len(u) for u in updates), default=0)):
        ms = tuple(offsets[r] + u[k] for r, u in enumerate(updates))
        for g in ms:
            step_members[g] = ms
    return Compiled(
        offsets=tuple(offsets),
        rank_of=tuple(r for r, row in enumerate(s.actions) for _ in row),
        steps=steps,
        partner=tuple(partner),
        reduce_members=reduce_members,
        step_members=step_members,
        hosts=hosts,
        collective_members=_match_collective_fillers(s, offsets),
    )


def _match_collective_fillers(s: Schedule, offsets: list[int]) -> dict[int, tuple[int, ...]]:
    """The k-th collective filler of every rank of a filler group run together: the group must
    be the same seen from each member, and every member must issue the same tags in the same order."""
    mine: dict[int, list[int]] = {}
    for r, row in enumerate(s.actions):
        idx = [i for i, a in enumerate(row) if a.is_collective_filler]
        if idx:
            mine[r] = idx
    out: dict[int, tuple[int, ...]] = {}
    for r, idx in mine.items():
        group = s.filler_group(r)
        for q in group:
            if s.filler_group(q) != group:
                _fail(s, r, idx[0], f"ranks {list(group)} share chunks with rank {r}, but rank {q} shares chunks "
                      f"with {list(s.filler_group(q))}: no consistent group for a collective filler",
                      "place chunk copies so that the ranks sharing chunks form disjoint groups")
            tags_q = [s.actions[q][i].tag for i in mine.get(q, [])]
            tags_r = [s.actions[r][i].tag for i in idx]
            if tags_q != tags_r:
                n_ = next((t for t, (x, y) in enumerate(zip(tags_r, tags_q, strict=False)) if x != y),
                          min(len(tags_r), len(tags_q)))
                _fail(s, r, idx[min(n_, len(idx) - 1)],
                      f"collective filler #{n_ + 1} of the group shared with rank {q} does not match rank {q}'s "
                      f"({tags_q} there, {tags_r} here)",
                      "issue collective fillers with the same tags in the same order on every member")
        if r == group[0]:
            for k in range(len(idx)):
                ms = tuple(offsets[q] + mine[q][k] for q in group)
                for g in ms:
                    out[g] = ms
    return out


def _scan(s: Schedule, hosts: tuple[tuple[int, ...], ...]) -> tuple[
    tuple[tuple[tuple[int, int, int], ...], ...],
    dict[tuple[int, int], list[int]],
    dict[tuple[int, int], list[int]],
    dict[tuple[int, ...], dict[int, list[int]]],
    list[list[int]],
]:
    """Steps per rank; sends and receives per ordered rank pair, reductions per group and optimizer
    steps per rank, in list order (local indices)."""
    steps = []
    sends: dict[tuple[int, int], list[int]] = {}
    recvs: dict[tuple[int, int], list[int]] = {}
    groups: dict[tuple[int, ...], dict[int, list[int]]] = {}
    updates: list[list[int]] = []
    for r, row in enumerate(s.actions):
        rs: list[tuple[int, int, int]] = []
        ups: list[int] = []
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
                groups.setdefault(hosts[a.chunk], {}).setdefault(r, []).append(i)
                rs.append((STEP_REDUCE, i, i + 1))
            elif k is K.OPTIMIZER_STEP:
                ups.append(i)
                rs.append((STEP_STEP, i, i + 1))
            elif k is K.FILLER:
                rs.append((STEP_FILLER, i, i + 1))
            else:
                rs.append((STEP_COMPUTE, i, i + 1))
            i += 1
        steps.append(tuple(rs))
        updates.append(ups)
    return tuple(steps), sends, recvs, groups, updates


def _match_p2p(
    s: Schedule,
    offsets: list[int],
    sends: dict[tuple[int, int], list[int]],
    recvs: dict[tuple[int, int], list[int]],
    partner: list[int],
) -> None:
    """FIFO per ordered rank pair: the k-th send from a to b is the k-th receive on b from a."""
    for (src, dst), idx in sends.items():
        ridx = recvs.get((src, dst), [])
        so, do = offsets[src], offsets[dst]
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
            partner[so + j] = do + ridx[n_]
            partner[do + ridx[n_]] = so + j
    for (src, dst), ridx in recvs.items():
        nsend = len(sends.get((src, dst), []))
        if len(ridx) > nsend:
            _fail(
                s,
                dst,
                ridx[nsend],
                f"missing send: rank {src} sends only {nsend} messages to rank {dst}, this is receive #{nsend + 1}",
            )


def _match_reductions(
    s: Schedule, offsets: list[int], groups: dict[tuple[int, ...], dict[int, list[int]]]
) -> dict[int, tuple[int, ...]]:
    """The t-th reduction of a group on each member rank run together; every member must issue
    the group's reductions in the same order."""
    members_of: dict[int, tuple[int, ...]] = {}
    for members in groups.values():
        ranks = sorted(members)
        seqs = {r: [s.actions[r][i].chunk for i in members[r]] for r in ranks}
        ref = ranks[0]
        for r in ranks[1:]:
            if seqs[r] != seqs[ref]:
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
            ms = tuple(offsets[r] + members[r][t] for r in ranks)
            for g in ms:
                members_of[g] = ms
    return members_of

"""Chimera (Li & Hoefler, "Chimera: Efficiently Training Large-Scale Neural Networks with
Bidirectional Pipelines", SC'21).

Two pipelines run over the same ``D`` ranks: replica 0 ("down") places chunk ``c`` on rank ``c``,
replica 1 ("up") on rank ``D-1-c``, so every rank holds two model chunks (twice the weights,
gradients and optimizer state). Each group of ``D`` micro-batches sends its first ``D/2`` down and
the other ``D/2`` up; groups follow one another as earlier ones drain (the paper's concatenation of
basic units, Sec. 3.5). The two replicas of a chunk reduce their gradients together (rank ``c`` and
rank ``D-1-c``, times the data-parallel ranks) once both chunks of the rank are complete; with
several basic units that overlaps the draining of the last unit.

Per-rank orders come from the paper's construction: a unit-time simulation in which every forward
and every backward takes one slot and micro-batches advance one rank per slot. As in the lock-step
1F1B both Chimera directions are built from (DeepSpeed's ``TrainSchedule``), the forward of chunk
``c`` runs only in slots of the parity of ``c`` and the backward in the other parity; a rank
prefers a ready backward over a ready forward, and a replica's chunk ``c`` admits at most
``min(D/2, D-c)`` micro-batches at once (what one basic unit holds). With ``D`` even the two
directions never compete for a slot, leaving ``D-2`` idle slots per rank against 1F1B's ``2(D-1)``:
a bubble fraction of ``(D-2)/(2N+D-2)`` (paper, Table 1, forward and backward of equal length;
``tests/sim`` checks it for N = D up to N = 4D). With backward twice the forward this slot
structure idles more than the formula says (see the README, "Pipeline schedules").

Validity: ``D`` even (the two directions collide otherwise, paper Sec. 3.1) and ``N`` a multiple of
``D`` (whole basic units; the reference implementation asserts the same).
"""

from __future__ import annotations

from paratrain.errors import ConfigError
from paratrain.schedule._common import K, check_counts, with_reduce_and_step
from paratrain.schedule.ir import Action, Schedule

__all__ = ["chimera", "chimera_rules"]


def chimera_rules(stages: int, microbatches: int, virtual_stages: int = 1) -> None:
    """An even number of stages, micro-batches a multiple of it, one chunk per rank per direction."""
    check_counts("chimera", stages, microbatches, virtual_stages)
    d, n = stages, microbatches
    if d % 2:
        raise ConfigError(
            "stages", f"Chimera needs an even number of stages, got {d}", f"use {d + 1} or {d - 1} stages"
        )
    if n % d:
        raise ConfigError(
            "microbatches",
            f"Chimera needs micro-batches ({n}) to be a multiple of the stages ({d})",
            f"use {((n + d - 1) // d) * d} micro-batches",
        )


def chimera(stages: int, microbatches: int) -> Schedule:
    chimera_rules(stages, microbatches)
    d, n = stages, microbatches
    placement = (tuple(range(d)), tuple(d - 1 - c for c in range(d)))
    replica_of = [0 if (mb % d) < d // 2 else 1 for mb in range(n)]
    cap = [min(d // 2, d - c) for c in range(d)]
    # unit-time list scheduling; state per micro-batch: forwards done, backwards done
    f_done = [0] * n
    b_done = [0] * n
    f_ready_at = [0] * n  # slot from which the next forward of the micro-batch may run
    b_ready_at = [0] * n
    inflight = [[0] * d for _ in range(2)]  # [replica][chunk]
    rows: list[list[Action]] = [[] for _ in range(d)]
    slots: list[list[int]] = [[] for _ in range(d)]
    remaining = 2 * n * d
    t = 0
    while remaining:
        chosen: list[tuple[str, int, int] | None] = [None] * d
        # backwards first: oldest micro-batch whose gradient reached the chunk
        for mb in range(n):
            if f_done[mb] == d and b_done[mb] < d and b_ready_at[mb] <= t and (t - b_done[mb]) % 2 == 0:
                c = d - 1 - b_done[mb]
                r = placement[replica_of[mb]][c]
                if chosen[r] is None:
                    chosen[r] = ("B", mb, c)
        for mb in range(n):
            if f_done[mb] < d and f_ready_at[mb] <= t and (t - f_done[mb]) % 2 == 0:
                c = f_done[mb]
                rep = replica_of[mb]
                r = placement[rep][c]
                if chosen[r] is None and inflight[rep][c] < cap[c]:
                    chosen[r] = ("F", mb, c)
        progressed = False
        for r, ch in enumerate(chosen):
            if ch is None:
                continue
            progressed = True
            kind, mb, c = ch
            rep = replica_of[mb]
            if kind == "F":
                rows[r].append(Action(K.FORWARD, mb, c, rep))
                slots[r].append(t)
                f_done[mb] += 1
                f_ready_at[mb] = t + 1
                b_ready_at[mb] = t + 1
                inflight[rep][c] += 1
            else:
                rows[r].append(Action(K.BACKWARD, mb, c, rep))
                slots[r].append(t)
                b_done[mb] += 1
                b_ready_at[mb] = t + 1
                inflight[rep][c] -= 1
            remaining -= 1
        if not progressed and all(f_ready_at[mb] <= t and b_ready_at[mb] <= t for mb in range(n)):
            raise AssertionError(f"Chimera construction stalled at slot {t}")  # cannot happen for valid d, n
        t += 1
    actions = _lockstep_p2p(rows, slots, placement)
    actions = tuple(tuple(_pair_reductions(row)) for row in with_reduce_and_step(actions))
    return Schedule(name="chimera", stages=d, microbatches=n, placement=placement, actions=actions)


def _lockstep_p2p(
    rows: list[list[Action]], slots: list[list[int]], placement: tuple[tuple[int, ...], ...]
) -> list[list[Action]]:
    """Sends and receives in lock-step batches: after slot ``t`` every rank posts one batch with
    the sends of what it computed in slot ``t`` and the receives of what its neighbours sent in slot
    ``t`` (even if it uses the data later). Batch ``t`` of one rank thus only ever waits for batch
    ``t`` of others, which rules out deadlock; per-action placement of sends would not do here,
    because in the two directions neighbours send to each other at the same time and each would
    block on the other's receive."""
    d = len(rows)
    last = len(placement[0]) - 1
    batches: list[dict[int, list[Action]]] = [{} for _ in range(d)]
    for r in range(d):
        for a, t in zip(rows[r], slots[r], strict=True):
            c, rep, m = a.chunk, a.replica, a.microbatch
            if a.kind is K.FORWARD and c < last:
                q, kinds = placement[rep][c + 1], (K.SEND_ACT, K.RECV_ACT, c + 1)
            elif a.kind is K.BACKWARD and c > 0:
                q, kinds = placement[rep][c - 1], (K.SEND_GRAD, K.RECV_GRAD, c - 1)
            else:
                continue
            batches[r].setdefault(t, []).append(Action(kinds[0], m, c, rep, q))
            batches[q].setdefault(t, []).append(Action(kinds[1], m, kinds[2], rep, r))
    out = []
    for r in range(d):
        compute_at = dict(zip(slots[r], rows[r], strict=True))
        row: list[Action] = []
        for t in sorted(compute_at.keys() | batches[r].keys()):
            if t in compute_at:
                row.append(compute_at[t])
            # sends first, then receives: the same order on both ends of every rank pair
            row.extend(sorted(batches[r].get(t, []), key=lambda x: not x.is_send))
        out.append(row)
    return out


def _pair_reductions(row: list) -> list:
    """Ranks r and D-1-r share one reduction group for both of their chunks; issue the two
    reductions together, in chunk order, once both chunks' gradients are complete, so both
    ranks launch them in the same order (a requirement of NCCL-style communicators)."""
    reds = [a for a in row if isinstance(a, Action) and a.kind is K.REDUCE_GRAD]
    last = max(i for i, a in enumerate(row) if isinstance(a, Action) and a.kind is K.REDUCE_GRAD)
    out = []
    for i, a in enumerate(row):
        if isinstance(a, Action) and a.kind is K.REDUCE_GRAD:
            if i == last:
                out.extend(sorted(reds, key=lambda x: x.chunk))
            continue
        out.append(a)
    return out

"""The per-rank program of a run: a schedule's compiled steps with a :class:`Timing`'s durations
bound to them (:func:`_program`), the form the engine (:mod:`paratrain.sim.engine`) executes.
"""

from __future__ import annotations

from paratrain.cost.link_sharing import share_by_link
from paratrain.schedule.compiled import STEP_COMPUTE, STEP_P2P, STEP_REDUCE, STEP_STEP, Compiled
from paratrain.schedule.ir import ActionKind, Schedule
from paratrain.sim.timing import Timing

K = ActionKind


# Step kinds of a program, each step a tuple (kind, value, global action index, extra):
# compute (value: duration; extra: the batch a B/W of the batch's last micro-batch ends, else -1),
# p2p batch (value: per operation (global index, partner's index, transfer time, is a send)),
# gradient reduction (value: its duration), optimizer step (value: its duration).
_COMPUTE, _P2P, _REDUCE, _STEP, _COLL = range(5)  # _COLL: a collective filler (value: its duration)


def _program(schedule: Schedule, comp: Compiled, timing: Timing) -> list[list[tuple]]:
    """Per rank, the compiled steps with ``timing``'s durations bound to them."""
    m_per = schedule.microbatches
    dur_of = {
        K.FORWARD: timing.forward_s,
        K.BACKWARD: timing.backward_s,
        K.BACKWARD_INPUT: timing.input_s,
        K.BACKWARD_WEIGHT: timing.weight_s,
    }
    ends_batch = (K.BACKWARD, K.BACKWARD_WEIGHT)
    sends = (K.SEND_ACT, K.SEND_GRAD)
    p2p_s, action_s, partner, link = timing.p2p_s, timing.action_s, comp.partner, timing.p2p_link
    program: list[list[tuple]] = []
    for r, row in enumerate(schedule.actions):
        o = comp.offsets[r]
        out: list[tuple] = []
        for kind, i, j in comp.steps[r]:
            a = row[i]
            if kind == STEP_COMPUTE:
                k = a.kind
                mb = a.microbatch
                bidx = mb // m_per if k in ends_batch and mb % m_per == m_per - 1 else -1
                v = action_s(r, i) if action_s is not None else None
                out.append((_COMPUTE, dur_of[k][a.chunk] if v is None else v, o + i, bidx))
            elif kind == STEP_P2P:
                ops = []
                for h in range(i, j):
                    b = row[h]
                    if b.kind in sends:
                        ops.append((o + h, partner[o + h], p2p_s(r, b.peer, b.chunk), True))
                    else:  # timed like its send: from the peer's chunk (c-1 for an activation, c+1 for a gradient)
                        c = b.chunk - 1 if b.kind is K.RECV_ACT else b.chunk + 1
                        ops.append((o + h, partner[o + h], p2p_s(b.peer, r, c), False))
                if link is not None and len(ops) > 1:
                    ops = _share_links(ops, [link(r, row[h].peer) for h in range(i, j)])
                out.append((_P2P, tuple(ops), o + i, 0))
            elif kind == STEP_REDUCE:
                out.append((_REDUCE, timing.reduce_s[a.chunk], o + i, 0))
            elif kind == STEP_STEP:
                v = action_s(r, i) if action_s is not None else None
                out.append((_STEP, timing.optimizer_s[r] if v is None else v, o + i, 0))
            elif o + i in comp.collective_members:  # a collective filler: waits for its whole group
                out.append((_COLL, a.duration_s or 0.0, o + i, 0))
            else:  # filler work
                out.append((_COMPUTE, a.duration_s or 0.0, o + i, -1))
        program.append(out)
    return program


def _share_links(ops: list[tuple], links: list[object]) -> list[tuple]:
    """A p2p batch's operations with the times of the sends, and of the receives, that use the same
    link of the rank stretched by :func:`paratrain.cost.link_sharing.share_by_link`."""
    keys = [(op[3], k) for op, k in zip(ops, links, strict=True)]  # (is a send, link): one direction each
    times = share_by_link([op[2] for op in ops], keys)
    return [(h, ph, x, snd) for (h, ph, _, snd), x in zip(ops, times, strict=True)]


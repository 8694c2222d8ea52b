"""ZB-H1 (Qi, Wan, Huang, Lin: "Zero Bubble Pipeline Parallelism", ICLR'24, Sec. 3.1).

The backward is split into ``I`` (gradient of the chunk's input, on the critical path to the
previous stage) and ``W`` (gradient of the weights, deferrable). ZB-H1 keeps 1F1B's warm-up of
``p-1-r`` forwards and its peak of ``p`` in-flight micro-batches, and rank ``r`` delays its
weight-gradient work by ``r`` micro-batches so that the ``W`` passes fill the cooldown, where
1F1B idles. With times ``T_F``, ``T_B`` (input part) and ``T_W`` the bubble per rank is
``(p-1)(T_F + T_B - T_W)`` instead of 1F1B's ``(p-1)(T_F + T_B + T_W)`` (paper, Table/Fig. 3);
with ``T_F = T_B = T_W = 1`` that is ``p-1``, a third of 1F1B's, i.e. a bubble fraction of
``(p-1)/(3M + p-1)``.
"""

from __future__ import annotations

from paratrain.schedule._common import K, build, check_counts, plain_placement, with_reduce_and_step
from paratrain.schedule.ir import Action, Schedule

__all__ = ["zb_h1", "zb_h1_rules"]


def zb_h1_rules(stages: int, microbatches: int, virtual_stages: int = 1) -> None:
    """Any positive counts, one chunk per rank."""
    check_counts("zb-h1", stages, microbatches, virtual_stages)


def zb_h1(stages: int, microbatches: int) -> Schedule:
    zb_h1_rules(stages, microbatches)
    p, m = stages, microbatches
    rows = []
    for r in range(p):
        warmup = min(p - 1 - r, m)
        row = [Action(K.FORWARD, i, r) for i in range(warmup)]
        # (forward or None, input-gradient) pairs: steady state, then cooldown
        pairs = [(warmup + k, k) for k in range(m - warmup)] + [(None, k) for k in range(m - warmup, m)]
        next_w = 0
        for f, b in pairs:
            if f is not None:
                row.append(Action(K.FORWARD, f, r))
            row.append(Action(K.BACKWARD_INPUT, b, r))
            # keep r weight-gradient passes pending: they fill the cooldown
            if b + 1 - next_w > r:
                row.append(Action(K.BACKWARD_WEIGHT, next_w, r))
                next_w += 1
        row.extend(Action(K.BACKWARD_WEIGHT, i, r) for i in range(next_w, m))
        rows.append(row)
    return build("zb-h1", p, m, plain_placement(p), with_reduce_and_step(rows))

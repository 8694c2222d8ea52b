"""1F1B with a flush (PipeDream-Flush, Narayanan et al., ICML'21; DAPPLE's early backward).

Rank ``r`` runs ``min(p-1-r, M)`` warm-up forwards, then alternates one forward and one backward,
then drains the remaining backwards. Same bubble as GPipe, ``(p-1)/(M+p-1)``, but rank ``r`` holds
at most ``min(p-r, M)`` micro-batches' activations instead of ``M``.
"""

from __future__ import annotations

from paratrain.schedule._common import K, build, check_counts, plain_placement, with_reduce_and_step
from paratrain.schedule.ir import Action, Schedule

__all__ = ["one_f_one_b", "one_f_one_b_order", "one_f_one_b_rules"]


def one_f_one_b_rules(stages: int, microbatches: int, virtual_stages: int = 1) -> None:
    """Any positive counts, one chunk per rank (fewer micro-batches than stages only idle more)."""
    check_counts("1f1b", stages, microbatches, virtual_stages)


def one_f_one_b_order(rank: int, stages: int, microbatches: list[int], chunk: int, replica: int = 0) -> list[Action]:
    """The 1F1B compute order of one rank over the given micro-batches (in order)."""
    n = len(microbatches)
    warmup = min(stages - 1 - rank, n)
    row = [Action(K.FORWARD, microbatches[i], chunk, replica) for i in range(warmup)]
    for i in range(n - warmup):
        row.append(Action(K.FORWARD, microbatches[warmup + i], chunk, replica))
        row.append(Action(K.BACKWARD, microbatches[i], chunk, replica))
    row.extend(Action(K.BACKWARD, microbatches[i], chunk, replica) for i in range(n - warmup, n))
    return row


def one_f_one_b(stages: int, microbatches: int) -> Schedule:
    one_f_one_b_rules(stages, microbatches)
    mbs = list(range(microbatches))
    rows = [one_f_one_b_order(r, stages, mbs, r) for r in range(stages)]
    return build("1f1b", stages, microbatches, plain_placement(stages), with_reduce_and_step(rows))

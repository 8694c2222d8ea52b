"""GPipe (Huang et al., NeurIPS'19): all forwards, then all backwards, then one flush.

Rank ``r`` holds chunk ``r``. Every rank keeps the activations of all ``M`` micro-batches, and
with forward time F and backward time B each rank idles ``(p-1)(F+B)`` per iteration: bubble
fraction ``(p-1)/(M+p-1)`` (GPipe paper, Sec. 2.2).
"""

from __future__ import annotations

from paratrain.schedule._common import K, build, check_counts, plain_placement, with_reduce_and_step
from paratrain.schedule.ir import Action, Schedule

__all__ = ["gpipe", "gpipe_rules"]


def gpipe_rules(stages: int, microbatches: int, virtual_stages: int = 1) -> None:
    """Any positive counts, one chunk per rank."""
    check_counts("gpipe", stages, microbatches, virtual_stages)


def gpipe(stages: int, microbatches: int) -> Schedule:
    gpipe_rules(stages, microbatches)
    rows = [
        [Action(K.FORWARD, m, r) for m in range(microbatches)] + [Action(K.BACKWARD, m, r) for m in range(microbatches)]
        for r in range(stages)
    ]
    return build("gpipe", stages, microbatches, plain_placement(stages), with_reduce_and_step(rows))

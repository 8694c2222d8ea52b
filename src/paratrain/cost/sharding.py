"""Fully sharded data parallelism (FSDP / ZeRO-3, and ZeRO-2): per-unit parameter all-gather and
gradient reduce-scatter overlapped with compute by prefetching.

FSDP (Zhao et al. 2023, "PyTorch FSDP", sec. 3.3–3.4; FSDP2 ``fully_shard``) wraps the model in
units (a transformer block each, the embedding and the head); before a unit computes, its
parameters are all-gathered over the data-parallel ranks, and after its backward its gradients
are reduce-scattered. Communication runs on its own stream: while unit ``i`` computes its forward
the next unit's all-gather proceeds (forward prefetch); while unit ``i`` computes its backward the
comm stream re-gathers the unit before it (when parameters were freed after the forward,
``reshard_after_forward``, ZeRO-3) and reduce-scatters the gradients of the unit after it
(backward prefetch). Each step of the pipelined pair costs the longer of the two; the first
all-gather and the last reduce-scatter are exposed. ``reshard_after_forward=False`` (ZeRO-2,
Composer's SHARD_GRAD_OP) keeps the gathered parameters until the backward is done and gathers
them once per micro-batch.

Every micro-batch repeats the gathers and the reduce-scatter (FSDP reduce-scatters per backward
unless gradient synchronisation is switched off; the published runs do not say so).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from paratrain.errors import ConfigError

__all__ = ["ShardedUnit", "fsdp_microbatch_s"]


@dataclass(frozen=True)
class ShardedUnit:
    """One FSDP unit for one micro-batch: compute (forward; backward with any recomputation) and
    the times of its parameter all-gather and gradient reduce-scatter over the data-parallel group."""

    forward_s: float
    backward_s: float
    gather_s: float
    reduce_s: float


def fsdp_microbatch_s(units: Sequence[ShardedUnit], *, reshard_after_forward: bool = True) -> tuple[float, float]:
    """``(time, exposed communication)`` of the forward and backward of one micro-batch through
    ``units`` (in forward order) with one-unit prefetch (module docstring)."""
    if not units:
        raise ConfigError("units", "no FSDP units", "give at least one unit")
    n = len(units)
    fwd = units[0].gather_s
    for i in range(n):
        nxt = units[i + 1].gather_s if i + 1 < n else 0.0
        fwd += max(units[i].forward_s, nxt)
    rev = list(reversed(units))
    bwd = rev[0].gather_s if reshard_after_forward else 0.0
    for i in range(n):
        gather = rev[i + 1].gather_s if reshard_after_forward and i + 1 < n else 0.0
        reduce = rev[i - 1].reduce_s if i > 0 else 0.0
        bwd += max(rev[i].backward_s, gather + reduce)
    bwd += rev[-1].reduce_s
    compute = sum(u.forward_s + u.backward_s for u in units)
    total = fwd + bwd
    return total, total - compute

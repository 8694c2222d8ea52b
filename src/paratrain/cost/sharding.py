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
unless gradient synchronisation is switched off; the published runs do not say so, and paratrain's
runtime keeps it on so that gradients stay sharded between micro-batches).

Memory per rank of each level (:func:`static_shares`, :func:`gathered_bytes`; ZeRO, Rajbhandari et
al. 2020, sec. 5.1 and fig. 1: Ψ parameters, K bytes of optimizer state per parameter, N_d ranks):
``none`` keeps everything; ``zero1`` divides the optimizer state by ``dp``; ``zero2`` and
``zero3`` divide weights, gradients and optimizer state (FSDP keeps only shards between steps).
What is gathered during the step comes on top: under ``zero2`` every parameter the rank holds,
from its forward to the end of its backward, under ``zero3`` two units (the one computing and the
one prefetched); both hold one unit's unsharded gradient until its reduce-scatter is issued.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from paratrain.errors import ConfigError

__all__ = ["ShardedUnit", "fsdp_microbatch_s", "fsdp_phases_s", "gathered_bytes", "static_shares",
           "reshards_after_forward", "gathers_per_microbatch"]

# Levels of paratrain.parallel.config.SHARDINGS whose parameters FSDP gathers per micro-batch.
_FSDP_LEVELS = ("zero2", "zero3")


@dataclass(frozen=True)
class ShardedUnit:
    """One FSDP unit for one micro-batch: compute (forward; backward with any recomputation) and
    the times of its parameter all-gather and gradient reduce-scatter over the data-parallel group."""

    forward_s: float
    backward_s: float
    gather_s: float
    reduce_s: float


def fsdp_phases_s(
    units: Sequence[ShardedUnit], *, reshard_after_forward: bool = True, slowdown: float = 0.0,
) -> tuple[float, float]:
    """``(forward, backward)`` time of one micro-batch through ``units`` (in forward order) with
    one-unit prefetch (module docstring): each includes its exposed communication. ``slowdown``:
    compute beside a collective runs that much slower (:func:`paratrain.cost.dp_reduction.overlapped_s`;
    0: each pipelined step costs the longer of the two)."""
    from paratrain.cost.dp_reduction import overlapped_s

    if not units:
        raise ConfigError("units", "no FSDP units", "give at least one unit")
    seen: dict[tuple[float, float], float] = {}  # a model's layers are alike: few distinct steps

    def step(compute: float, comm: float) -> float:
        t = seen.get((compute, comm))
        if t is None:
            t = seen[compute, comm] = overlapped_s(compute, comm, slowdown)
        return t

    n = len(units)
    fwd = units[0].gather_s
    for i in range(n):
        nxt = units[i + 1].gather_s if i + 1 < n else 0.0
        fwd += step(units[i].forward_s, nxt)
    rev = list(reversed(units))
    bwd = rev[0].gather_s if reshard_after_forward else 0.0
    for i in range(n):
        gather = rev[i + 1].gather_s if reshard_after_forward and i + 1 < n else 0.0
        reduce = rev[i - 1].reduce_s if i > 0 else 0.0
        bwd += step(rev[i].backward_s, gather + reduce)
    bwd += rev[-1].reduce_s
    return fwd, bwd


def fsdp_microbatch_s(
    units: Sequence[ShardedUnit], *, reshard_after_forward: bool = True, slowdown: float = 0.0,
) -> tuple[float, float]:
    """``(time, exposed communication)`` of the forward and backward of one micro-batch through
    ``units`` (in forward order) with one-unit prefetch (module docstring); ``slowdown`` as in
    :func:`fsdp_phases_s`."""
    fwd, bwd = fsdp_phases_s(units, reshard_after_forward=reshard_after_forward, slowdown=slowdown)
    compute = sum(u.forward_s + u.backward_s for u in units)
    total = fwd + bwd
    return total, total - compute


def gathers_per_microbatch(level: str, dp: int) -> bool:
    """Whether ``level`` over ``dp`` ranks gathers parameters and reduce-scatters gradients inside
    every micro-batch (FSDP) rather than once at the step's end."""
    return level in _FSDP_LEVELS and dp > 1


def reshards_after_forward(level: str) -> bool:
    """FSDP2's ``reshard_after_forward`` for ``level``: True for zero3 (parameters freed after each
    unit's forward and gathered again for its backward), False for zero2."""
    return level == "zero3"


def static_shares(level: str, weight: int, grad: int, optimizer: int, dp: int) -> tuple[int, int, int]:
    """``(weights, gradients, optimizer state)`` in bytes one rank keeps between steps, of a part
    whose unsharded sizes are given (shards rounded up: the last is padded)."""
    def shard(n: int) -> int:
        return -(-n // dp)

    if level == "zero1":
        return weight, grad, shard(optimizer)
    if level in _FSDP_LEVELS:
        return shard(weight), shard(grad), shard(optimizer)
    return weight, grad, optimizer


def gathered_bytes(level: str, dp: int, *, unit_weight: int, unit_grad: int, rank_weight: int) -> int:
    """Bytes gathered on top of :func:`static_shares` while a micro-batch runs: ``rank_weight``
    (every parameter the rank holds) under zero2, two units' parameters (``unit_weight``: the
    largest unit) under zero3, and under both one unit's unsharded gradient (``unit_grad``)."""
    if not gathers_per_microbatch(level, dp):
        return 0
    if level == "zero2":
        return rank_weight + unit_grad
    return 2 * unit_weight + unit_grad

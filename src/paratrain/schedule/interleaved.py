"""Interleaved 1F1B (Narayanan et al., SC'21; Megatron-LM ``forward_backward_pipelining_with_interleaving``).

Each of the ``p`` ranks holds ``v`` chunks: chunk ``c`` lives on rank ``c % p`` (looped placement).
Micro-batches go through the chunks in groups of ``p``: the forward order of rank ``r`` is, for each
group of ``p`` micro-batches, all of them on local chunk 0, then on local chunk 1, ... (Megatron-core's
``microbatch_group_size_per_vp_stage`` left at its default ``p``). Rank ``r`` runs
``2(p-1-r) + (v-1)p`` warm-up forwards, then pairs (forward ``k + warmup``, backward ``k``), then
drains. Backwards visit the local chunks in reverse order. With uniform per-chunk times the
bubble shrinks by ``v``: ``(p-1)/(v·M + p-1)`` of the iteration (SC'21 paper, Sec. 2.2).

Validity as in Megatron-LM: ``p ≥ 2``, ``v ≥ 2`` and ``M`` a multiple of ``p`` (Megatron-core raises
when ``0 < M mod p``: otherwise the last group leaves dependency bubbles; with one stage there is
no pipeline to interleave).
"""

from __future__ import annotations

from paratrain.errors import ConfigError
from paratrain.schedule._common import K, build, check_counts, with_reduce_and_step
from paratrain.schedule.ir import Action, Schedule

__all__ = ["interleaved", "interleaved_rules"]


def interleaved_rules(stages: int, microbatches: int, virtual_stages: int = 2) -> None:
    """At least 2 stages and 2 chunks per rank, micro-batches a multiple of the stages."""
    check_counts("interleaved", stages, microbatches, virtual_stages)
    p, m, v = stages, microbatches, virtual_stages
    if v < 2:
        raise ConfigError(
            "virtual_stages",
            f"interleaved 1F1B needs at least 2 chunks per rank, got {v}",
            "use virtual_stages 2 or more, or the 1f1b schedule",
        )
    if p < 2:
        raise ConfigError(
            "stages",
            "interleaved 1F1B needs at least 2 pipeline stages, got 1",
            "use 2 or more stages, or the 1f1b schedule",
        )
    if m % p:
        raise ConfigError(
            "microbatches",
            f"interleaved 1F1B needs micro-batches ({m}) to be a multiple of the stages ({p})",
            f"use {((m + p - 1) // p) * p} micro-batches (Megatron-LM's rule)",
        )


def interleaved(stages: int, microbatches: int, virtual_stages: int = 2) -> Schedule:
    interleaved_rules(stages, microbatches, virtual_stages)
    p, m, v = stages, microbatches, virtual_stages
    # Megatron's virtual micro-batch table: (micro-batch, local chunk) in forward order.
    table = [(g0 + i, lc) for g0 in range(0, m, p) for lc in range(v) for i in range(p)]
    total = m * v
    rows = []
    for r in range(p):
        warmup = min(2 * (p - 1 - r) + (v - 1) * p, total)

        def fwd(k: int, r: int = r) -> Action:
            mb, lc = table[k]
            return Action(K.FORWARD, mb, lc * p + r)

        def bwd(k: int, r: int = r) -> Action:
            mb, lc = table[k]
            return Action(K.BACKWARD, mb, (v - 1 - lc) * p + r)

        row: list[Action | tuple[Action, ...]] = [fwd(k) for k in range(warmup)]
        for k in range(total - warmup):
            row.append((fwd(k + warmup), bwd(k)))  # one group: communication after both
        row.extend(bwd(k) for k in range(total - warmup, total))
        rows.append(row)
    placement = (tuple(c % p for c in range(p * v)),)
    return build("interleaved", p, m, placement, with_reduce_and_step(rows))

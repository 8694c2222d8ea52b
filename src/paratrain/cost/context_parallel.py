"""Context parallelism: ring attention over ``cp`` ranks that each hold 1/cp of every sequence.

As Megatron-LM runs it (``--context-parallel-size``; megatron/core/parallel_state.py places the cp
group next to tensor parallelism, order ``"tp-cp-ep-dp-pp"``) on Transformer Engine's ring
attention with point-to-point K/V exchange (transformer_engine/pytorch/attention.py,
``AttnFuncWithCPAndKVP2P``; Liu et al. 2023, "Ring Attention with Blockwise Transformers",
sec. 3):

- the sequence ``s`` is cut into ``2·cp`` chunks and rank ``i`` keeps chunks ``i`` and
  ``2·cp−1−i``, so under a causal mask every rank does the same attention work (load balance);
- every layer outside the attention core (QKV, projection, MLP, norms, embedding, head) runs on
  the rank's ``s/cp`` tokens, and so do its stored activations;
- attention runs ``cp`` block steps; before each of the first ``cp−1`` ends, the rank sends the
  K and V block it holds (``s/cp`` tokens, key/value heads only under GQA) to the next rank of the
  ring and receives the previous rank's, overlapped with the current block's attention. The
  backward runs the ring again and passes K, V and their gradients dK, dV (twice the bytes);
- per rank the attention FLOPs are the total's ``1/cp``: with the balanced split each step is
  ``(s/cp)²`` scores (half of them masked) per head, ``cp`` steps in all;
- parameters are replicated over cp; their gradients are reduced over the data- and
  context-parallel ranks together (Megatron's dp-cp group), and the distributed optimizer shards
  over that group as well.

Step ``k < cp−1`` takes ``max(A/cp, T)`` for block attention time ``A/cp`` and transfer time ``T``;
the last step is compute only. So the time the ring adds to a pass is
``(cp−1)·max(0, T − A/cp)`` (:func:`ring_exposed_s`).
"""

from __future__ import annotations

import dataclasses

from paratrain.cost.compute import dtype_bytes, kv_dim_per_rank
from paratrain.errors import ConfigError, require_positive_int
from paratrain.spec.model import ModelSpec, Position

__all__ = [
    "local_model",
    "ring_steps",
    "kv_block_bytes",
    "ring_step_bytes",
    "ring_exposed_s",
    "ring_buffer_bytes",
    "ring_neighbours",
]


def local_model(model: ModelSpec, cp: int) -> ModelSpec:
    """The model as one context-parallel rank sees it: ``s/cp`` tokens per sequence, the same
    parameters (a learned position table keeps all its rows)."""
    require_positive_int("cp", cp)
    if cp == 1:
        return model
    if model.seq % (2 * cp):
        raise ConfigError("cp", f"sequence {model.seq} is not divisible by 2*cp = {2 * cp}",
                          "pick cp with 2*cp dividing the sequence")
    keep = model.num_positions if model.position is Position.LEARNED else model.max_positions
    return dataclasses.replace(model, seq=model.seq // cp, max_positions=keep)


def ring_steps(cp: int) -> int:
    """K/V transfers per ring pass: each rank receives the other ``cp−1`` ranks' blocks."""
    require_positive_int("cp", cp)
    return cp - 1


def kv_block_bytes(model: ModelSpec, *, cp: int, tp: int = 1, microbatch: int = 1, dtype: str | None = None) -> int:
    """K and V of one rank's ``s/cp`` tokens on one tensor-parallel rank: ``2·b·(s/cp)·kv_r·E``
    bytes, ``kv_r`` the key/value width per tensor-parallel rank (GQA: kv heads × head size)."""
    e = dtype_bytes(dtype or model.dtype)
    return 2 * microbatch * (model.seq // cp) * kv_dim_per_rank(model, tp) * e


def ring_step_bytes(model: ModelSpec, *, cp: int, tp: int = 1, microbatch: int = 1, dtype: str | None = None,
                    backward: bool = False) -> int:
    """Bytes one rank sends (and receives) per ring step: K and V forward; K, V, dK and dV backward."""
    if cp == 1:
        return 0
    kv = kv_block_bytes(model, cp=cp, tp=tp, microbatch=microbatch, dtype=dtype)
    return 2 * kv if backward else kv


def ring_exposed_s(attention_s: float, transfer_s: float, cp: int) -> float:
    """Time a ring pass adds to ``attention_s`` (the rank's whole attention core of the pass, ``cp``
    equal blocks) when each of the ``cp−1`` transfers of ``transfer_s`` overlaps one block."""
    require_positive_int("cp", cp)
    if cp == 1:
        return 0.0
    return ring_steps(cp) * max(0.0, transfer_s - attention_s / cp)


def ring_buffer_bytes(model: ModelSpec, *, cp: int, tp: int = 1, microbatch: int = 1,
                      dtype: str | None = None) -> int:
    """Receive buffers live while one layer's backward runs: the next K, V, dK, dV block beside the
    current one (double buffering: two backward steps' bytes). Zero without context parallelism."""
    return 2 * ring_step_bytes(model, cp=cp, tp=tp, microbatch=microbatch, dtype=dtype, backward=True)


def ring_neighbours(cp_ranks: tuple[int, ...]) -> tuple[tuple[int, int], ...]:
    """The (sender, receiver) pairs of a ring over ``cp_ranks``, the last one closing it."""
    n = len(cp_ranks)
    if n < 2:
        return ()
    return tuple((cp_ranks[i], cp_ranks[(i + 1) % n]) for i in range(n))

"""Tensor parallelism through DTensor: a parallelization plan per model, applied with
``torch.distributed.tensor.parallel.parallelize_module`` (Megatron-LM's split, Shoeybi et al. 2019).

Placements (SBP names in brackets, as the planner uses them):
- Q/K/V projections and the first FFN matrices (and the SwiGLU gate): ``ColwiseParallel`` —
  weight ``Shard(0)`` [split(0)], output sharded over heads / FFN columns.
- attention output and second FFN matrix: ``RowwiseParallel`` — weight ``Shard(1)``, partial
  sums reduced to ``Replicate()`` [broadcast] by one all-reduce per block half.
- token embedding: vocabulary-parallel (``RowwiseParallel`` on an Embedding shards the ``[V, H]``
  table on V and all-reduces the partial lookups).
- output projection: ``ColwiseParallel`` with ``Shard(-1)`` logits kept as a DTensor, consumed by
  ``loss_parallel()`` (vocabulary-parallel cross-entropy: no rank ever holds ``[B, S, V]``).
  A tied projection shares the embedding's ``Shard(0)`` table: both shard the same ``[V, H]``
  matrix on V, so one DTensor Parameter serves both.
- norms, positions and BERT's MLM transform stay replicated (small), or, with sequence
  parallelism, norms and residual stream split on the sequence (``SequenceParallel``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
    loss_parallel,
    parallelize_module,
)

from .models.base import ModelChunk, TransformerLM

__all__ = ["apply_tensor_parallel", "loss_context", "block_plan", "accumulating_partial_grads", "is_partial_grad"]


def block_plan(swiglu: bool, sequence_parallel: bool = False) -> dict[str, object]:
    """Plan of one transformer block (module paths relative to the block)."""
    # With sequence parallelism the residual stream between the matmul regions is split on the
    # sequence (Shard(1)); the row-parallel projections reduce-scatter into it instead of
    # all-reducing, and the column-parallel ones all-gather out of it (Korthikanti et al. 2022).
    seq_out = Shard(1) if sequence_parallel else Replicate()
    plan: dict[str, object] = {
        "attn.q": ColwiseParallel(),
        "attn.k": ColwiseParallel(),
        "attn.v": ColwiseParallel(),
        "attn.o": RowwiseParallel(output_layouts=seq_out),
        "mlp.fc1": ColwiseParallel(),
        "mlp.fc2": RowwiseParallel(output_layouts=seq_out),
    }
    if swiglu:
        plan["mlp.gate"] = ColwiseParallel()
    if sequence_parallel:
        plan["norm1"] = SequenceParallel(use_local_output=True)
        plan["norm2"] = SequenceParallel(use_local_output=True)
    # Attention and MLP receive their input as one Replicate DTensor that the column-parallel
    # linears share (Q, K, V; fc1 and the gate): autograd sums their partial input gradients as
    # DTensors and the input's one conversion reduces the sum once per half-block (all-reduce, or
    # with sequence parallelism a reduce-scatter into the sequence shards), as Megatron-LM's fused
    # QKV does, instead of one all-reduce per linear. Post-norm blocks (BERT) feed the residual
    # stream itself to attention and MLP, pre-norm blocks the norms' outputs: with sequence
    # parallelism both arrive sequence-sharded and are gathered here.
    plan["attn"] = PrepareModuleInput(input_layouts=(seq_out, None), desired_input_layouts=(Replicate(), None),
                                      use_local_output=False)
    plan["mlp"] = PrepareModuleInput(input_layouts=(seq_out,), desired_input_layouts=(Replicate(),),
                                     use_local_output=False)
    return plan


def apply_tensor_parallel(model: TransformerLM | ModelChunk, tp_mesh: DeviceMesh, *,
                          sequence_parallel: bool = False) -> nn.Module:
    """Shard ``model`` or a pipeline chunk of it (full weights, same on every rank) in place.

    ``sequence_parallel`` also splits the norms' work on the sequence: the embedding's output is
    sliced on the sequence, the head gathers it back before the output projection (positions and
    BERT's MLM transform stay replicated); between them the residual stream is this rank's sequence
    slice as a plain tensor, which is also what a pipeline chunk sends to the next and receives.
    """
    if tp_mesh.size() == 1:
        return model
    embed, head = model.embed, model.head
    tied = embed is not None and head is not None and head.proj.weight is embed.tok.weight
    plan: dict[str, object] = {}
    if embed is not None:
        plan["embed.tok"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate())
        if sequence_parallel:
            # Positions are added to the full sequence, then each rank keeps its slice (no communication).
            plan["embed"] = PrepareModuleOutput(output_layouts=Replicate(), desired_output_layouts=Shard(1),
                                                use_local_output=True)
    if head is not None:
        plan["head.proj"] = ColwiseParallel(output_layouts=Shard(-1), use_local_output=False)
        if sequence_parallel:
            plan["head"] = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),),
                                              use_local_output=True)
    if plan:
        parallelize_module(model, tp_mesh, plan)
    if tied:
        head.proj.weight = embed.tok.weight  # the embedding's Parameter was replaced by its DTensor shard
    swiglu = model.blocks[0].mlp.gate is not None
    for block in model.blocks:
        parallelize_module(block, tp_mesh, block_plan(swiglu, sequence_parallel))
    for p in {id(p): p for p in model.parameters()}.values():
        if isinstance(p, DTensor):
            p.register_post_accumulate_grad_hook(_grad_like_param)
    return model


_accumulating = False  # inside a backward that more backward passes follow before the gradients are used


@contextlib.contextmanager
def accumulating_partial_grads(active: bool = True) -> Iterator[None]:
    """A backward inside leaves the gradients DTensor makes partial (the sequence-parallel norms'
    weights and biases, applied to sequence shards) partial: they accumulate locally, and the first
    backward outside all-reduces their sum once. Megatron-LM all-reduces these gradients once per
    step too (``finalize_model_grads``); DTensor's hook would otherwise reduce them after every
    micro-batch. Use it for every backward of a step but the last that reaches those weights."""
    global _accumulating
    before, _accumulating = _accumulating, active
    try:
        yield
    finally:
        _accumulating = before


def is_partial_grad(g: torch.Tensor | None) -> bool:
    """A tensor-parallel gradient DTensor left partial (one-dimensional tp mesh: FSDP2's
    two-dimensional parameters reduce their own): what accumulating_partial_grads defers."""
    return isinstance(g, DTensor) and g.device_mesh.ndim == 1 and any(pl.is_partial() for pl in g.placements)


def _grad_like_param(p: torch.Tensor) -> None:
    # The vocabulary-parallel embedding's backward yields a Replicate() gradient for its Shard(0)
    # table (DTensor's embedding-backward strategy). Give every gradient its parameter's placements
    # (Replicate -> Shard is a local slice, no communication) so gradient reduction, the norm and
    # AdamW see the shard this rank owns.
    g = p.grad
    if _accumulating and is_partial_grad(g):
        return  # summed locally until the last backward's hook reduces it (accumulating_partial_grads)
    if isinstance(g, DTensor) and g.placements != p.placements:
        p.grad = g.redistribute(p.device_mesh, p.placements)


@contextlib.contextmanager
def loss_context(tp: int) -> Iterator[None]:
    """Wrap the loss *and its backward* in this: vocabulary-parallel cross-entropy when tp > 1."""
    if tp > 1:
        with loss_parallel():
            yield
    else:
        yield

"""FLOPs of one training iteration: the matmul FLOPs (the one MFU / HFU numerator) and the
element-wise FLOPs reported apart from them.

MFU closed form (Narayanan et al. 2021, appendix): per layer and sample the forward matmuls are
QKV ``6sh²``, scores ``2s²h``, attention·V ``2s²h``, projection ``2sh²``, MLP ``16sh²`` =
``24sh²(1 + s/(6h))``; the logit layer adds ``2shV``. Forward + backward is 3× forward:
``72·B·s·l·h²·(1 + s/(6h)) + 6·B·s·h·V = 72·B·s·l·h²·(1 + s/(6h) + V/(12·l·h))``. Full
recomputation repeats every layer's forward (4× forward) but not the logit layer:
``96·B·s·l·h²·(1 + s/(6h)) + 6·B·s·h·V = 96·B·s·l·h²·(1 + s/(6h) + V/(16·l·h))``. For GPT shapes
(MHA, ``f = 4h``) :func:`matmul_flops_per_iteration` equals these sums term by term.
"""

from __future__ import annotations

from functools import lru_cache

from paratrain.cost.compute import _embedding_ops, _head_ops, _layer_ops
from paratrain.errors import require_positive_int
from paratrain.parallel.config import Recompute
from paratrain.spec.model import ModelSpec

__all__ = ["matmul_flops_per_iteration", "model_flops_per_iteration", "elementwise_flops_per_iteration"]


@lru_cache(maxsize=1024)
def _flops_per_sample(model: ModelSpec) -> tuple[float, float, float, float, float]:
    """Per sample, tp = 1: (layer matmul fwd, layer matmul fwd+bwd, selective-recompute matmul fwd,
    head+embedding matmul fwd+bwd, element-wise fwd+bwd of the whole model)."""
    layer = _layer_ops(model, tp=1, microbatch=1)
    ends = _embedding_ops(model, tp=1, microbatch=1) + _head_ops(model, tp=1, microbatch=1)
    layer_fwd = sum(o.fwd_flops for o in layer if o.is_matmul)
    layer_all = sum(o.fwd_flops + o.bwd_flops for o in layer if o.is_matmul)
    selective = sum(o.fwd_flops for o in layer if o.is_matmul and o.recompute_selective)
    ends_all = sum(o.fwd_flops + o.bwd_flops for o in ends if o.is_matmul)
    ew = model.layers * sum(o.fwd_flops + o.bwd_flops for o in layer if not o.is_matmul)
    ew += sum(o.fwd_flops + o.bwd_flops for o in ends if not o.is_matmul)
    return layer_fwd, layer_all, selective, ends_all, ew


def matmul_flops_per_iteration(
    model: ModelSpec, global_batch: int, recompute: Recompute | str = Recompute.NONE
) -> float:
    """Matrix-multiply FLOPs of one training iteration (forward + backward) over ``global_batch``
    samples, plus the recomputed forward matmuls: every layer's under ``full``, the attention
    core's (scores and attention·V) under ``selective``. The logit layer is never recomputed.

    With ``recompute="none"`` this is :func:`model_flops_per_iteration`, the numerator of MFU;
    with recomputation it is the numerator of HFU.
    """
    require_positive_int("global_batch", global_batch)
    rc = Recompute(str(recompute))
    layer_fwd, layer_all, selective, ends_all, _ = _flops_per_sample(model)
    extra = {Recompute.NONE: 0.0, Recompute.SELECTIVE: selective, Recompute.FULL: layer_fwd}[rc]
    return global_batch * (model.layers * (layer_all + extra) + ends_all)


def model_flops_per_iteration(model: ModelSpec, global_batch: int) -> float:
    """Useful matmul FLOPs per iteration (no recomputation): the MFU numerator."""
    return matmul_flops_per_iteration(model, global_batch, Recompute.NONE)


def elementwise_flops_per_iteration(model: ModelSpec, global_batch: int) -> float:
    """Norm, softmax, activation, dropout, residual and loss FLOPs (forward + backward), reported
    apart from the matmul FLOPs and not part of MFU."""
    require_positive_int("global_batch", global_batch)
    return global_batch * _flops_per_sample(model)[4]

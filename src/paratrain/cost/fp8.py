"""FP8 linear layers: the bytes and kernels of the scaling and cast passes around each FP8 GEMM, and
the rewrite of a layer's operator list that runs its linear GEMMs in FP8. What the FP8 layers keep
for their backward is in :mod:`paratrain.cost.memory`."""

from __future__ import annotations

from paratrain.cost.op import Op, _gemm_op
from paratrain.errors import require_positive_int

__all__ = ["FP8_GEMM_DTYPES", "fp8_cast_bytes", "cached_weight_bytes"]

# FP8 linear layers (ParallelConfig.gemm_dtype): current scaling, delayed scaling.
FP8_GEMM_DTYPES = ("fp8", "fp8-delayed")
# The layer's nn.Linear GEMMs: what torchao's Float8 conversion and Transformer Engine's FP8 run in
# FP8 (the attention core, the embedding and the LM head stay in the training dtype; torchtitan's
# Float8 conversion skips the output layer).
_LINEAR_GEMMS = ("qkv", "attn_proj", "fc1", "fc2")


def fp8_cast_bytes(
    x: int, w: int, y: int, e: int, *, delayed: bool, fused: bool, weight_reuse: int = 1
) -> tuple[float, float]:
    """``(forward, backward)`` bytes of the FP8 scaling and cast kernels around one linear layer
    whose input has ``x`` elements, its weight ``w`` and its output gradient ``y``, in a training
    dtype of ``e`` bytes, for one forward pass (and its backward).

    Per tensor cast to FP8 (torchao ``Float8Linear``, Transformer Engine): with *current* scaling
    an amax pass reads the tensor (``e``) before the cast can start; with *delayed* scaling the
    scale comes from the amax history and the cast records the new amax (no extra pass). The cast
    reads ``e`` and writes one byte. Hopper's FP8 GEMMs take K-major operands only (cuBLAS:
    ``CUBLASLT_MATMUL_DESC_TRANSA/B`` for FP8 must be "TN"), so the backward's GEMMs need the
    transposed FP8 copies of the weight (input gradient), the input and the output gradient
    (weight gradient): fused into the cast (``fused``: Transformer Engine's cast-transpose kernels,
    torch.compile's fusion of torchao's casts), the cast writes both layouts (2 bytes); otherwise
    each is a separate transpose pass (read 1, write 1). The forward casts the input and the weight,
    the backward the output gradient.

    ``weight_reuse`` > 1: the weight's FP8 copies (both layouts) are made once and serve that many
    forward passes, each charged ``1/weight_reuse`` of their bytes. Transformer Engine caches them
    across a step's micro-batches when told which one is first (``is_first_microbatch`` of its
    ``Linear``, ``LayerNormLinear`` and ``LayerNormMLP``; TE's guide, "Performance optimizations:
    FP8 weight caching"), and Megatron-Core's TE modules pass it: the weights do not change between
    micro-batches of a step, so neither do their casts.
    """
    require_positive_int("weight_reuse", weight_reuse)
    amax = 0 if delayed else e
    wk = w / weight_reuse
    if fused:
        per = amax + e + 2
        return float(per * (x + wk)), float(per * y)
    per = amax + e + 1
    return float(per * (x + wk)), float(per * y + 2 * (x + wk + y))


def _fp8_cast_op(
    name: str, tokens: int, k: int, n: int, e: int, *, delayed: bool, fused: bool, weight_reuse: int = 1
) -> Op:
    """The cast kernels of a ``tokens×k · k×n`` FP8 linear layer (:func:`fp8_cast_bytes`). With
    cached weights (``weight_reuse`` > 1) a forward pass launches the input's kernels only: the
    weight's run once per step (their launches, a few microseconds a step, are not charged)."""
    fwd, bwd = fp8_cast_bytes(tokens * k, k * n, tokens * n, e, delayed=delayed, fused=fused,
                              weight_reuse=weight_reuse)
    per_tensor = 1 if delayed else 2  # (amax +) cast
    transposes = 0 if fused else (3 if weight_reuse == 1 else 2)
    return Op(
        name=f"{name}_fp8_cast", kind="cast", fwd_flops=0.0, bwd_flops=0.0, fwd_bytes=fwd, bwd_bytes=bwd,
        fwd_kernels=(2 if weight_reuse == 1 else 1) * per_tensor, bwd_kernels=per_tensor + transposes,
    )


def _fp8_linears(ops: tuple[Op, ...], e: int, gemm_dtype: str, fused: bool, weight_reuse: int = 1) -> tuple[Op, ...]:
    out: list[Op] = []
    for op in ops:
        if op.name in _LINEAR_GEMMS and op.gemm is not None:
            m, n, k = op.gemm
            out.append(_fp8_cast_op(op.name, m, k, n, e, delayed=gemm_dtype == "fp8-delayed", fused=fused,
                                    weight_reuse=weight_reuse))
            out.append(_gemm_op(op.name, m, n, k, e, weight=True, gemm_dtype="fp8"))
        else:
            out.append(op)
    return tuple(out)


def cached_weight_bytes(ops: tuple[Op, ...]) -> int:
    """Memory of Transformer Engine's FP8 weight cache for a layer of ``ops`` (``fp8_weight_cache``):
    every linear layer keeps its weight's FP8 copy and the transposed copy the backward's GEMM reads,
    one byte an element each, from the step's first micro-batch to its end."""
    return 2 * sum(op.gemm[1] * op.gemm[2] for op in ops if op.name in _LINEAR_GEMMS and op.gemm is not None)

"""The operator record of the cost model: :class:`Op`, one operator's FLOPs, bytes, GEMM shape and
kernels for one micro-batch on one tensor-parallel rank, and the builder of a GEMM operator."""

from __future__ import annotations

from dataclasses import dataclass

from paratrain.spec.model import _DTYPE_BYTES

__all__ = ["Op"]


@dataclass(frozen=True)
class Op:
    """One operator for one micro-batch on one tensor-parallel rank.

    ``gemm`` is the forward GEMM shape ``(m, n, k)`` (``C[m×n] = A[m×k]·B[k×n]``), repeated
    ``batch`` times (attention: micro-batch × heads). ``has_weight``: B is a parameter, so half of
    the backward is a weight gradient (deferrable). ``recompute_selective``: recomputed under
    selective recomputation (the attention core).
    """

    name: str
    kind: str  # gemm | attention | activation | elementwise | norm | softmax | dropout | embedding | loss
    fwd_flops: float
    bwd_flops: float
    fwd_bytes: float
    bwd_bytes: float
    gemm: tuple[int, int, int] | None = None
    batch: int = 1
    is_matmul: bool = False
    has_weight: bool = False
    recompute_selective: bool = False
    bwd_weight_flops: float = 0.0
    bwd_weight_bytes: float = 0.0
    fwd_kernels: int = 1  # kernels of a non-GEMM op's forward / backward input-gradient
    bwd_kernels: int = 1
    # Fused attention (kind "attention"): the s×s×d block shape (m, n, k) and batch of its GEMMs and
    # the FLOPs its kernels execute (causal skipping, backward recomputation), which differ from the
    # MFU convention's fwd_flops / bwd_flops.
    attention_shape: tuple[int, int, int] | None = None
    exec_fwd_flops: float = 0.0
    exec_bwd_flops: float = 0.0
    # Input dtype of a GEMM that differs from the training dtype ("fp8": FP8 linear layers).
    dtype: str | None = None


def _gemm_op(
    name: str, m: int, n: int, k: int, e: int, *, batch: int = 1, weight: bool, selective: bool = False,
    gemm_dtype: str | None = None,
) -> Op:
    """``gemm_dtype`` "fp8": one-byte inputs, the output in the training dtype (``e`` bytes)."""
    flops = 2.0 * batch * m * n * k
    e_in = _DTYPE_BYTES["fp8"] if gemm_dtype == "fp8" else e
    moved = float(batch * ((m * k + k * n) * e_in + m * n * e))
    return Op(
        name=name, kind="gemm", fwd_flops=flops, bwd_flops=2 * flops, fwd_bytes=moved, bwd_bytes=2 * moved,
        gemm=(m, n, k), batch=batch, is_matmul=True, has_weight=weight, recompute_selective=selective,
        bwd_weight_flops=flops if weight else 0.0, bwd_weight_bytes=moved if weight else 0.0,
        dtype=gemm_dtype if gemm_dtype == "fp8" else None,
    )

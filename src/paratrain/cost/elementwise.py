"""Element-wise operators of a transformer layer (norms, rotary embedding, bias/dropout/residual,
GeLU, SwiGLU and GeGLU): their FLOPs per element, the bytes they move and the kernels they launch, fused
or as eager PyTorch's composites of ATen operators."""

from __future__ import annotations

from paratrain.cost.op import Op
from paratrain.spec.model import Activation, ModelSpec, Norm

__all__ = ["uses_dropout"]

# Element-wise FLOPs per element, counted operation by operation:
_LN_FLOPS = 7  # mean 1, centre 1, variance 2 (square, accumulate), normalise 1, scale 1, shift 1
_RMS_FLOPS = 4  # square 1, accumulate 1, normalise 1, scale 1
_SOFTMAX_FLOPS = 5  # max 1, subtract 1, exp 1, sum 1, divide 1
_SCALE_MASK_FLOPS = 2  # scale by 1/sqrt(d) 1, add causal/padding mask 1
_DROPOUT_FLOPS = 2  # compare against a random number 1, scale by 1/(1-p) 1
_GELU_FLOPS = 8  # tanh approximation: x³, 2 multiply-adds, tanh, 1+, ×x, ×0.5
_SWIGLU_FLOPS = 5  # sigmoid (exp, add, divide) 3, ×gate 1, ×up 1
_GEGLU_FLOPS = _GELU_FLOPS + 1  # tanh-GeLU of the gate, ×up 1
_LOSS_FLOPS = 5  # max, subtract, exp, sum, pick target
_MASK_BYTES = 1  # dropout masks are stored as bytes (Korthikanti et al. 2022, sec. 4.1)


def _ew_op(
    name: str, kind: str, n: int, e: int, *, reads: float, writes: float, flops: float,
    bwd_reads: float, bwd_writes: float, extra_fwd: float = 0.0, extra_bwd: float = 0.0, selective: bool = False,
    kernels: int = 1, bwd_kernels: int = 1,
) -> Op:
    """An element-wise op over ``n`` elements reading/writing whole tensors of ``n`` elements.

    ``extra_*`` are additional bytes (dropout masks, fp32 buffers). Backward FLOPs are taken as
    twice the forward's (the derivative costs about as much as the function, plus the chain product).
    """
    return Op(
        name=name, kind=kind, fwd_flops=float(flops * n), bwd_flops=float(2 * flops * n),
        fwd_bytes=float((reads + writes) * n * e + extra_fwd),
        bwd_bytes=float((bwd_reads + bwd_writes) * n * e + extra_bwd),
        recompute_selective=selective, fwd_kernels=kernels, bwd_kernels=bwd_kernels,
    )


# Eager PyTorch's RMSNorm (torchtitan's ``RMSNorm`` of 2024 and Hugging Face's ``LlamaRMSNorm`` are
# the same composite): ``xf = x.float(); (xf * rsqrt(xf.pow(2).mean(-1) + eps)).type_as(x) * w``,
# one kernel per ATen operator, the backward autograd's. Bytes per element of x, as (multiple of e,
# fp32 bytes) with e the training dtype's bytes, and kernels; per-row statistics and the weight are
# negligible in bytes. Forward: the cast (read e, write 4), pow (4, 4), mean (4, -), + eps and
# rsqrt (per row), x·rsqrt (4, 4), type_as (4, e), ·w (e, e). Backward: ·w's two gradients (dy·o:
# 2e, e, then its row sum: e, -; dy·w: e, e), type_as's cast (e, 4), x·rsqrt's two (8, 4 and its
# row sum 4, -; 4, 4), three per-row kernels for rsqrt and + eps, mean's expanded division (4, 4),
# pow's 2·x·g as x¹ (4, 4), ·2 (4, 4) and the product (8, 4), the two paths' sum (8, 4), the cast
# back (4, e). Counted at the ATen dispatch of torch 2.13 by tests/cost/test_eager_elementwise.py.
# In fp32 the four casts are no-ops (-8 bytes read, -8 written and 2 kernels each way).
_EAGER_RMS_FWD = ((2, 16), (2, 12), 8)  # (reads, writes) as (multiple of e, fp32 bytes), kernels
_EAGER_RMS_BWD = ((5, 48), (3, 32), 16)
# Eager rotary embedding (torchtitan's ``apply_rotary_emb``: ``view_as_complex(x.float()) · freqs``,
# ``view_as_real``, ``type_as``) on each of q and k: the cast (read e, write 4), the complex product
# (4, 4; the frequencies are one s×d/2 table), the cast back (4, e); backward the same in reverse
# plus a copy of the conjugated table (4 kernels). Fused (Transformer Engine's fused RoPE,
# torch.compile): one kernel reading and writing the tensor each way.
_EAGER_ROPE_FWD = ((1, 8), (1, 8), 3)
_EAGER_ROPE_BWD = ((1, 8), (1, 8), 4)


def _eager_bytes(counts: tuple[tuple[int, int], tuple[int, int], int], e: int, casts: int) -> tuple[float, float, int]:
    """(reads, writes) per element in units of ``e`` bytes, and kernels, of an eager composite
    whose ``casts`` fp32 casts (each reading e and writing 4 bytes, or the reverse) vanish in fp32."""
    (re_, rb), (we, wb), k = counts
    if e == 4:
        rb, wb, k = rb - 4 * casts, wb - 4 * casts, k - casts
    return re_ + rb / e, we + wb / e, k


def uses_dropout(model: ModelSpec) -> bool:
    """Whether the layers run dropout (:attr:`ModelSpec.uses_dropout`: GPT-2/3 and BERT by default,
    not the Llama family; ``dropout`` in the spec decides)."""
    return model.uses_dropout


def _norm_op(name: str, model: ModelSpec, n: int, e: int, fused: bool = True) -> Op:
    """LayerNorm is one kernel each way in every framework (torch's native ``layer_norm``, apex,
    Transformer Engine); RMSNorm is one fused kernel (``fused``: Transformer Engine, Apex,
    torch.compile), or eager PyTorch's composite of fp32 operators (:data:`_EAGER_RMS_FWD`)."""
    flops = _RMS_FLOPS if model.norm is Norm.RMSNORM else _LN_FLOPS
    if model.norm is Norm.RMSNORM and not fused:
        fr, fw, fk = _eager_bytes(_EAGER_RMS_FWD, e, 2)
        br, bw, bk = _eager_bytes(_EAGER_RMS_BWD, e, 2)
        return _ew_op(name, "norm", n, e, reads=fr, writes=fw, flops=flops, bwd_reads=br, bwd_writes=bw,
                      kernels=fk, bwd_kernels=bk)
    # forward reads x, writes y; backward reads dy and x, writes dx (statistics are tiny).
    return _ew_op(name, "norm", n, e, reads=1, writes=1, flops=flops, bwd_reads=2, bwd_writes=1)


def _rope_op(n: int, e: int, fused: bool) -> Op:
    """Rotary position embedding of q and k (``n`` elements of both together): 6 FLOPs per pair of
    elements (a complex product), 3 per element."""
    if fused:
        return _ew_op("rotary", "elementwise", n, e, reads=1, writes=1, flops=3, bwd_reads=1, bwd_writes=1,
                      kernels=2, bwd_kernels=2)  # one kernel for q, one for k
    fr, fw, fk = _eager_bytes(_EAGER_ROPE_FWD, e, 2)
    br, bw, bk = _eager_bytes(_EAGER_ROPE_BWD, e, 2)
    return _ew_op("rotary", "elementwise", n, e, reads=fr, writes=fw, flops=3, bwd_reads=br, bwd_writes=bw,
                  kernels=2 * fk, bwd_kernels=2 * bk)


def _residual_op(name: str, model: ModelSpec, n: int, e: int, fused: bool) -> Op:
    """Bias add, dropout and residual add after a row-parallel GEMM.

    Fused (Megatron-LM's bias-dropout-add): one kernel. Eager PyTorch: ``nn.Linear`` adds the bias
    inside its GEMM (``addmm``), then dropout (one kernel writing the output and its mask) and the
    residual add run as kernels of their own. Either way the backward reduces the output gradient
    over the tokens for the bias gradient and applies the dropout mask.
    """
    drop = uses_dropout(model)
    bias = model.bias
    flops = (1 if bias else 0) + (_DROPOUT_FLOPS if drop else 0) + 1
    mask = n * _MASK_BYTES if drop else 0
    bwd_reads, bwd_writes = (1.0 if drop else 0.0) + (1.0 if bias else 0.0), 1.0 if drop else 0.0
    if fused:
        # One kernel: read x and the residual, write the sum (and the mask). The backward is counted
        # as one kernel, as the stored calibrations (plan/calibrated.py) were fitted with.
        reads, writes, kernels, bwd_kernels = 2.0, 1.0, 1, 1
    else:
        # dropout (r1 w1), add (r2 w1); the bias is in the GEMM. Backward: the mask applied to dy,
        # the bias gradient's sum of dy over the tokens (counted at ATen's dispatch in
        # tests/cost/test_eager_elementwise.py; the add passes dy through).
        reads, writes, kernels = 2.0 + (1 if drop else 0), 1.0 + (1 if drop else 0), 1 + (1 if drop else 0)
        bwd_kernels = max(1, (1 if drop else 0) + (1 if bias else 0))
    return _ew_op(
        name, "elementwise", n, e, reads=reads, writes=writes, flops=flops, bwd_reads=bwd_reads,
        bwd_writes=bwd_writes, extra_fwd=mask, extra_bwd=mask, kernels=kernels, bwd_kernels=bwd_kernels,
    )


def _activation_ops(model: ModelSpec, n: int, e: int, fused: bool) -> list[Op]:
    """The MLP's activation over the ``n`` elements of the first GEMM's output (per half when gated):
    SwiGLU or GeGLU, or GeLU with the first GEMM's bias add (fused: Megatron-LM's bias-GeLU kernel).
    GeGLU moves what SwiGLU moves (``gelu`` and ``gelu_backward`` read and write as ``silu`` and
    ``silu_backward`` do); only its FLOPs differ."""
    if model.activation.gated:
        name, flops = ("swiglu", _SWIGLU_FLOPS) if model.activation is Activation.SWIGLU else ("geglu", _GEGLU_FLOPS)
        if fused:
            # act(gate)·up: read both halves, write the product; backward reads dy, gate, up, writes both grads.
            return [_ew_op(name, "activation", n, e, reads=2, writes=1, flops=flops, bwd_reads=3, bwd_writes=2)]
        # eager ``silu(w1(x)) * w3(x)`` (or gelu): the activation (read 1, write 1) then the product
        # (2, 1); backward: the product's two gradients (dy·up and dy·act: reads 2 + 2, writes 2;
        # act(gate) is saved) and the activation's (dy and gate, write 1)
        return [_ew_op(name, "activation", n, e, reads=3, writes=2, flops=flops,
                       bwd_reads=6, bwd_writes=3, kernels=2, bwd_kernels=3)]
    bias = 1 if model.bias else 0
    if fused:
        # Megatron-LM's bias-GeLU: one kernel each way (backward: read dy and x, write dx), as the
        # stored calibrations were fitted with.
        return [_ew_op("bias_gelu" if model.bias else "gelu", "activation", n, e, reads=1, writes=1,
                       flops=_GELU_FLOPS + bias, bwd_reads=2, bwd_writes=1)]
    # Eager GeLU after an ``nn.Linear`` whose GEMM added the bias. Backward: gelu_backward (read dy
    # and x, write dx), then the bias gradient, a sum of dx over the tokens (one more read, one kernel).
    return [_ew_op("gelu", "activation", n, e, reads=1, writes=1, flops=_GELU_FLOPS + bias,
                   bwd_reads=2 + bias, bwd_writes=1, bwd_kernels=1 + bias)]

"""Operators of a transformer layer: FLOPs, bytes moved and roofline time.

Legend: ``b`` micro-batch, ``s`` sequence, ``h`` hidden, ``a`` heads, ``d = h/a`` head size,
``f`` FFN size, ``V`` vocabulary, ``t`` tensor-parallel degree, ``T = b·s`` tokens,
``E`` bytes per element of the training dtype.

Placement follows Megatron-LM (Shoeybi et al. 2019): QKV and the first MLP GEMM are split by
columns over ``t`` ranks, the attention output projection and the second MLP GEMM by rows;
attention runs on ``a/t`` heads per rank; norms, dropout and residual adds work on the full
``T×h`` activation, or on ``T/t × h`` with sequence parallelism (Korthikanti et al. 2022).
Key/value heads (GQA) are split over ranks while ``t`` ≤ kv heads and replicated beyond.

Matmul FLOPs count ``2·m·n·k`` per GEMM and the full ``s×s`` score matrix also for causal
models (no causal savings), as Narayanan et al. 2021 (eq. 3) and the MFU convention do.

Attention runs one of two ways (``attention``): ``"math"`` materializes the ``s×s`` scores
(QKᵀ GEMM, scale/mask, softmax, dropout, ·V GEMM: Megatron-LM without fused attention), or
``"flash"``, one fused kernel per pass (FlashAttention, Dao et al. 2022; FlashAttention-2, Dao
2023): the scores live in on-chip memory only, so the kernel moves ``O(s·h)`` bytes (Q, K, V, O
and the fp32 row log-sum-exp) and stores no ``s×s`` activation; its backward recomputes the
scores (5 matmuls against the forward's 2, FlashAttention-2 sec. 3.2: 2.5× the forward's FLOPs)
and causal kernels skip the blocks above the diagonal (half the work). The MFU FLOPs stay the
convention's. Its rate is ``device.attention_efficiency`` × the tile shape efficiency of the
``s×s×d`` block GEMMs. :func:`default_attention` is what the device runs by default.
Backward of a GEMM is two GEMMs of the same FLOPs (input gradient, weight gradient).

MFU closed form (Narayanan et al. 2021, appendix): per layer and sample the forward matmuls are
QKV ``6sh²``, scores ``2s²h``, attention·V ``2s²h``, projection ``2sh²``, MLP ``16sh²`` =
``24sh²(1 + s/(6h))``; the logit layer adds ``2shV``. Forward + backward is 3× forward:
``72·B·s·l·h²·(1 + s/(6h)) + 6·B·s·h·V = 72·B·s·l·h²·(1 + s/(6h) + V/(12·l·h))``. Full
recomputation repeats every layer's forward (4× forward) but not the logit layer:
``96·B·s·l·h²·(1 + s/(6h)) + 6·B·s·h·V = 96·B·s·l·h²·(1 + s/(6h) + V/(16·l·h))``. For GPT shapes
(MHA, ``f = 4h``) :func:`matmul_flops_per_iteration` equals these sums term by term.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from paratrain.cost.gemm import gemm_efficiency, gemm_peak_flops, gemm_tile_choice
from paratrain.errors import ConfigError, require_positive_int
from paratrain.parallel.config import Recompute
from paratrain.spec.device import DeviceSpec
from paratrain.spec.model import _DTYPE_BYTES, Activation, Arch, ModelSpec, Norm, Position

__all__ = [
    "Op",
    "layer_ops",
    "embedding_ops",
    "head_ops",
    "op_time",
    "op_time_split",
    "op_bound",
    "op_kernels",
    "host_bound_time",
    "matmul_flops_per_iteration",
    "model_flops_per_iteration",
    "elementwise_flops_per_iteration",
    "uses_dropout",
    "kv_dim_per_rank",
    "dtype_bytes",
    "ATTENTION_KINDS",
    "FP8_GEMM_DTYPES",
    "fp8_cast_bytes",
    "default_attention",
    "resolve_attention",
]

ATTENTION_KINDS = ("flash", "math")
# FlashAttention-2 (Dao 2023, sec. 3.2): the backward runs 5 matmuls of the forward's 2 (it recomputes
# the scores), 2.5x the forward's FLOPs.
_FLASH_BWD_FLOPS_RATIO = 2.5
_FLASH_BWD_KERNELS = 3  # dot(dO, O) preprocessing, the main kernel, dQ conversion from fp32

# Element-wise FLOPs per element, counted operation by operation:
_LN_FLOPS = 7  # mean 1, centre 1, variance 2 (square, accumulate), normalise 1, scale 1, shift 1
_RMS_FLOPS = 4  # square 1, accumulate 1, normalise 1, scale 1
_SOFTMAX_FLOPS = 5  # max 1, subtract 1, exp 1, sum 1, divide 1
_SCALE_MASK_FLOPS = 2  # scale by 1/sqrt(d) 1, add causal/padding mask 1
_DROPOUT_FLOPS = 2  # compare against a random number 1, scale by 1/(1-p) 1
_GELU_FLOPS = 8  # tanh approximation: x³, 2 multiply-adds, tanh, 1+, ×x, ×0.5
_SWIGLU_FLOPS = 5  # sigmoid (exp, add, divide) 3, ×gate 1, ×up 1
_LOSS_FLOPS = 5  # max, subtract, exp, sum, pick target
_MASK_BYTES = 1  # dropout masks are stored as bytes (Korthikanti et al. 2022, sec. 4.1)


def default_attention(device: DeviceSpec) -> str:
    """What the frameworks run on ``device``: fused attention where the device has the kernels
    (``device.fused_attention``: Megatron-LM's Transformer Engine and torch's SDPA pick flash
    attention on NVIDIA Ampere and newer), the explicit ``s×s`` kernels elsewhere."""
    return "flash" if device.fused_attention else "math"


def resolve_attention(attention: str | None, device: DeviceSpec) -> str:
    """``attention`` checked, or the device's default when ``None``."""
    if attention is None:
        return default_attention(device)
    if attention not in ATTENTION_KINDS:
        raise ConfigError("attention", f"unknown attention {attention!r}", f"use one of: {', '.join(ATTENTION_KINDS)}")
    return attention


def dtype_bytes(dtype: str) -> int:
    if dtype not in _DTYPE_BYTES:
        raise ConfigError("dtype", f"unknown dtype {dtype!r}", f"use one of: {', '.join(_DTYPE_BYTES)}")
    return _DTYPE_BYTES[dtype]


@dataclass(frozen=True)
class Op:
    """One operator for one micro-batch on one tensor-parallel rank.

    ``gemm`` is the forward GEMM shape ``(m, n, k)`` (``C[m×n] = A[m×k]·B[k×n]``), repeated
    ``batch`` times (attention: micro-batch × heads). ``has_weight``: B is a parameter, so half of
    the backward is a weight gradient (deferrable). ``recompute_selective``: recomputed under
    selective recomputation (the attention core).
    """

    name: str
    kind: str  # gemm | elementwise | norm | softmax | dropout | embedding | loss
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


def fp8_cast_bytes(x: int, w: int, y: int, e: int, *, delayed: bool, fused: bool) -> tuple[float, float]:
    """``(forward, backward)`` bytes of the FP8 scaling and cast kernels around one linear layer
    whose input has ``x`` elements, its weight ``w`` and its output gradient ``y``, in a training
    dtype of ``e`` bytes.

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
    """
    amax = 0 if delayed else e
    if fused:
        per = amax + e + 2
        return float(per * (x + w)), float(per * y)
    per = amax + e + 1
    return float(per * (x + w)), float(per * y + 2 * (x + w + y))


def _fp8_cast_op(name: str, tokens: int, k: int, n: int, e: int, *, delayed: bool, fused: bool) -> Op:
    """The cast kernels of a ``tokens×k · k×n`` FP8 linear layer (:func:`fp8_cast_bytes`)."""
    fwd, bwd = fp8_cast_bytes(tokens * k, k * n, tokens * n, e, delayed=delayed, fused=fused)
    per_tensor = 1 if delayed else 2  # (amax +) cast
    return Op(
        name=f"{name}_fp8_cast", kind="cast", fwd_flops=0.0, bwd_flops=0.0, fwd_bytes=fwd, bwd_bytes=bwd,
        fwd_kernels=2 * per_tensor, bwd_kernels=per_tensor + (0 if fused else 3),
    )


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
    """GPT-2/3 and BERT train with dropout; the Llama family (rotary positions) does not."""
    return model.position is Position.LEARNED


def kv_dim_per_rank(model: ModelSpec, tp: int) -> int:
    """Width of one rank's K (and V) projection: kv heads are split, or replicated when tp > kv."""
    return max(1, model.num_kv_heads // tp) * model.head_dim


def _check(model: ModelSpec, tp: int, sequence_parallel: bool, microbatch: int) -> None:
    require_positive_int("tp", tp)
    require_positive_int("microbatch", microbatch)
    if model.heads % tp:
        raise ConfigError("tp", f"tp({tp}) does not divide the {model.heads} attention heads", "pick tp dividing heads")
    if model.ffn_size % tp:
        raise ConfigError("tp", f"tp({tp}) does not divide the FFN size {model.ffn_size}", "pick tp dividing ffn")
    if sequence_parallel and model.seq % tp:
        raise ConfigError("sequence_parallel", f"sequence {model.seq} not divisible by tp({tp})", "disable it")


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
    """Bias add, dropout and residual add after a row-parallel GEMM."""
    drop = uses_dropout(model)
    bias = model.bias
    flops = (1 if bias else 0) + (_DROPOUT_FLOPS if drop else 0) + 1
    mask = n * _MASK_BYTES if drop else 0
    if fused:
        # One kernel: read x and the residual, write the sum (and the mask).
        reads, writes = 2.0, 1.0
        bwd_reads, bwd_writes = (1.0 if drop else 0.0) + (1.0 if bias else 0.0), 1.0 if drop else 0.0
    else:
        # Separate kernels: bias (r1 w1), dropout (r1 w1), add (r2 w1).
        reads = 2.0 + (1 if bias else 0) + (1 if drop else 0)
        writes = 1.0 + (1 if bias else 0) + (1 if drop else 0)
        bwd_reads, bwd_writes = (1.0 if drop else 0.0) + (1.0 if bias else 0.0), 1.0 if drop else 0.0
    return _ew_op(
        name, "elementwise", n, e, reads=reads, writes=writes, flops=flops, bwd_reads=bwd_reads,
        bwd_writes=bwd_writes, extra_fwd=mask, extra_bwd=mask,
    )


def _flash_op(model: ModelSpec, b: int, heads_r: int, q_r: int, kv_r: int, e: int) -> Op:
    """One fused attention kernel per pass over ``b × heads_r`` heads (see the module docstring).

    Bytes: the forward reads Q, K, V and writes O and the fp32 log-sum-exp per row; the backward
    reads Q, K, V, O, dO and the log-sum-exp, writes dQ, dK, dV, and accumulates dQ in fp32
    (FlashAttention-2's backward: one fp32 read-modify-write of dQ per key block pass is counted once).
    """
    s, d = model.seq, model.head_dim
    tokens = b * s
    flops = 4.0 * b * heads_r * s * s * d  # QKᵀ and ·V, full square (the MFU convention)
    executed = flops * (0.5 if model.arch is Arch.GPT else 1.0)  # causal kernels skip masked blocks
    lse = 4.0 * b * heads_r * s
    fwd_bytes = e * tokens * (2 * q_r + 2 * kv_r) + lse
    bwd_bytes = e * tokens * (2 * q_r + 2 * kv_r) + e * tokens * (q_r + 2 * kv_r) + e * tokens * q_r + lse
    bwd_bytes += 2 * 4 * tokens * q_r  # fp32 dQ accumulator
    return Op(
        name="flash_attention", kind="attention", fwd_flops=flops, bwd_flops=2 * flops, fwd_bytes=fwd_bytes,
        bwd_bytes=bwd_bytes, batch=b * heads_r, is_matmul=True, bwd_kernels=_FLASH_BWD_KERNELS,
        attention_shape=(s, s, d), exec_fwd_flops=executed, exec_bwd_flops=_FLASH_BWD_FLOPS_RATIO * executed,
    )


@lru_cache(maxsize=4096)
def _layer_ops(
    model: ModelSpec, *, tp: int = 1, sequence_parallel: bool = False, microbatch: int = 1, fused: bool = False,
    dtype: str | None = None, attention: str = "math", gemm_dtype: str | None = None,
) -> tuple[Op, ...]:
    """Operators of one transformer layer on one tensor-parallel rank, in execution order.

    ``dtype`` defaults to the model's; ``attention`` is ``"math"`` or ``"flash"`` (module docstring).
    ``gemm_dtype`` "fp8" / "fp8-delayed": the four linear GEMMs in FP8, each after its cast kernels
    (:func:`fp8_cast_bytes`). Cached: callers get a tuple they must not rely on mutating.
    """
    if attention not in ATTENTION_KINDS:
        raise ConfigError("attention", f"unknown attention {attention!r}", f"use one of: {', '.join(ATTENTION_KINDS)}")
    _check(model, tp, sequence_parallel, microbatch)
    e = dtype_bytes(dtype or model.dtype)
    b, h, t = microbatch, model.hidden, tp
    tokens = b * model.seq
    tokens_sp = tokens // t if sequence_parallel else tokens  # rows of norms/dropout/residual
    heads_r = model.heads // t
    q_r, kv_r, f_r = h // t, kv_dim_per_rank(model, t), model.ffn_size // t
    drop = uses_dropout(model)

    ops: list[Op] = [_norm_op("ln_1", model, tokens_sp * h, e, fused)]
    ops.append(_gemm_op("qkv", tokens, q_r + 2 * kv_r, h, e, weight=True))
    if model.position is Position.ROTARY:
        ops.append(_rope_op(tokens * (q_r + kv_r), e, fused))
    if attention == "flash":
        ops.append(_flash_op(model, b, heads_r, q_r, kv_r, e))
    else:
        ops.extend(_math_attention_ops(model, b, heads_r, e, fused, drop))
    ops.append(_gemm_op("attn_proj", tokens, h, q_r, e, weight=True))
    out = tuple(ops) + _mlp_ops(model, tokens, tokens_sp, f_r, e, fused)
    return _fp8_linears(out, e, gemm_dtype, fused) if gemm_dtype in FP8_GEMM_DTYPES else out


# FP8 linear layers (ParallelConfig.gemm_dtype): current scaling, delayed scaling.
FP8_GEMM_DTYPES = ("fp8", "fp8-delayed")
# The layer's nn.Linear GEMMs: what torchao's Float8 conversion and Transformer Engine's FP8 run in
# FP8 (the attention core, the embedding and the LM head stay in the training dtype; torchtitan's
# Float8 conversion skips the output layer).
_LINEAR_GEMMS = ("qkv", "attn_proj", "fc1", "fc2")


def _fp8_linears(ops: tuple[Op, ...], e: int, gemm_dtype: str, fused: bool) -> tuple[Op, ...]:
    out: list[Op] = []
    for op in ops:
        if op.name in _LINEAR_GEMMS and op.gemm is not None:
            m, n, k = op.gemm
            out.append(_fp8_cast_op(op.name, m, k, n, e, delayed=gemm_dtype == "fp8-delayed", fused=fused))
            out.append(_gemm_op(op.name, m, n, k, e, weight=True, gemm_dtype="fp8"))
        else:
            out.append(op)
    return tuple(out)


def _math_attention_ops(model: ModelSpec, b: int, heads_r: int, e: int, fused: bool, drop: bool) -> list[Op]:
    """The attention core as explicit kernels over the ``s×s`` scores (the selectively recomputed part)."""
    s, d = model.seq, model.head_dim
    scores = b * heads_r * s * s
    ops = [_gemm_op("attn_scores", s, s, d, e, batch=b * heads_r, weight=False, selective=True)]
    if fused:
        ops.append(_ew_op("scale_mask_softmax", "softmax", scores, e, reads=1, writes=1,
                          flops=_SCALE_MASK_FLOPS + _SOFTMAX_FLOPS, bwd_reads=2, bwd_writes=1, selective=True))
    else:
        ops.append(_ew_op("scale_mask", "elementwise", scores, e, reads=1, writes=1, flops=_SCALE_MASK_FLOPS,
                          bwd_reads=1, bwd_writes=1, selective=True))
        ops.append(_ew_op("softmax", "softmax", scores, e, reads=1, writes=1, flops=_SOFTMAX_FLOPS,
                          bwd_reads=2, bwd_writes=1, selective=True))
    if drop:
        ops.append(_ew_op("attn_dropout", "dropout", scores, e, reads=1, writes=1, flops=_DROPOUT_FLOPS,
                          bwd_reads=1, bwd_writes=1, extra_fwd=scores * _MASK_BYTES,
                          extra_bwd=scores * _MASK_BYTES, selective=True))
    ops.append(_gemm_op("attn_v", s, d, s, e, batch=b * heads_r, weight=False, selective=True))
    return ops


def _mlp_ops(model: ModelSpec, tokens: int, tokens_sp: int, f_r: int, e: int, fused: bool) -> tuple[Op, ...]:
    """Residual after the attention, second norm, MLP and its residual."""
    h = model.hidden
    ops: list[Op] = []
    ops.append(_residual_op("attn_residual", model, tokens_sp * h, e, fused))
    ops.append(_norm_op("ln_2", model, tokens_sp * h, e, fused))
    gated = model.activation is Activation.SWIGLU
    ops.append(_gemm_op("fc1", tokens, (2 if gated else 1) * f_r, h, e, weight=True))
    act_n = tokens * f_r
    if gated and fused:
        # silu(gate)·up: read both halves, write the product; backward reads dy, gate, up, writes both grads.
        ops.append(_ew_op("swiglu", "elementwise", act_n, e, reads=2, writes=1, flops=_SWIGLU_FLOPS,
                          bwd_reads=3, bwd_writes=2))
    elif gated:
        # eager ``silu(w1(x)) * w3(x)``: silu (read 1, write 1) then the product (2, 1); backward: the
        # product's two gradients (dy·up and dy·silu: reads 2 + 2, writes 2; silu(gate) is saved)
        # and silu's (dy and gate, write 1)
        ops.append(_ew_op("swiglu", "elementwise", act_n, e, reads=3, writes=2, flops=_SWIGLU_FLOPS,
                          bwd_reads=6, bwd_writes=3, kernels=2, bwd_kernels=3))
    elif fused or not model.bias:
        ops.append(_ew_op("bias_gelu" if model.bias else "gelu", "elementwise", act_n, e, reads=1, writes=1,
                          flops=_GELU_FLOPS + (1 if model.bias else 0), bwd_reads=2, bwd_writes=1))
    else:
        ops.append(_ew_op("fc1_bias", "elementwise", act_n, e, reads=1, writes=1, flops=1, bwd_reads=1, bwd_writes=0))
        ops.append(_ew_op("gelu", "elementwise", act_n, e, reads=1, writes=1, flops=_GELU_FLOPS,
                          bwd_reads=2, bwd_writes=1))
    ops.append(_gemm_op("fc2", tokens, h, f_r, e, weight=True))
    ops.append(_residual_op("mlp_residual", model, tokens_sp * h, e, fused))
    return tuple(ops)


@lru_cache(maxsize=1024)
def _embedding_ops(
    model: ModelSpec, *, tp: int = 1, sequence_parallel: bool = False, microbatch: int = 1, fused: bool = False,
    dtype: str | None = None,
) -> tuple[Op, ...]:
    """Token (vocab-parallel over ``tp``) and position embeddings, BERT's token types and norm, dropout."""
    _check(model, tp, sequence_parallel, microbatch)
    e = dtype_bytes(dtype or model.dtype)
    h, t = model.hidden, tp
    tokens = microbatch * model.seq
    tokens_sp = tokens // t if sequence_parallel else tokens
    vocab_r = -(-model.vocab // t)
    # Gather T rows (each rank masks the ids outside its vocabulary shard). Backward accumulates
    # into a dense V/t × h gradient (Megatron-LM zeroes and scatter-adds it): a weight gradient.
    gather = Op(
        name="token_embedding", kind="embedding", fwd_flops=0.0, bwd_flops=float(tokens * h),
        fwd_bytes=float(2 * tokens * h * e), bwd_bytes=float((tokens * h + 2 * vocab_r * h) * e),
        bwd_weight_flops=float(tokens * h), bwd_weight_bytes=float((tokens * h + 2 * vocab_r * h) * e),
    )
    ops = [gather]
    extra_adds = (1 if model.position is Position.LEARNED else 0) + (1 if model.arch is Arch.BERT else 0)
    if extra_adds:
        ops.append(_ew_op("position_add", "elementwise", tokens_sp * h, e, reads=1 + extra_adds, writes=1,
                          flops=extra_adds, bwd_reads=1, bwd_writes=extra_adds))
    if model.arch is Arch.BERT:
        ops.append(_norm_op("embedding_norm", model, tokens_sp * h, e))
    if uses_dropout(model):
        ops.append(_ew_op("embedding_dropout", "dropout", tokens_sp * h, e, reads=1, writes=1,
                          flops=_DROPOUT_FLOPS, bwd_reads=1, bwd_writes=1, extra_fwd=tokens_sp * h * _MASK_BYTES,
                          extra_bwd=tokens_sp * h * _MASK_BYTES))
    return tuple(ops)


@lru_cache(maxsize=1024)
def _head_ops(
    model: ModelSpec, *, tp: int = 1, sequence_parallel: bool = False, microbatch: int = 1, fused: bool = False,
    dtype: str | None = None,
) -> tuple[Op, ...]:
    """After the last layer: final norm + LM head (GPT) or the MLM head (BERT), then the loss.

    The output projection is vocab-parallel (``V/t`` columns per rank) and the cross entropy is
    computed on the sharded logits in fp32 (Megatron-LM's vocab-parallel cross entropy).
    """
    _check(model, tp, sequence_parallel, microbatch)
    e = dtype_bytes(dtype or model.dtype)
    h, t = model.hidden, tp
    tokens = microbatch * model.seq
    tokens_sp = tokens // t if sequence_parallel else tokens
    vocab_r = -(-model.vocab // t)
    ops: list[Op] = []
    if model.arch is Arch.BERT:
        # MLM transform: dense h×h (replicated), GELU, LayerNorm (Devlin et al. 2019; HF BertLMPredictionHead).
        ops.append(_gemm_op("mlm_dense", tokens, h, h, e, weight=True))
        ops.append(_ew_op("mlm_gelu", "elementwise", tokens * h, e, reads=1, writes=1, flops=_GELU_FLOPS,
                          bwd_reads=2, bwd_writes=1))
        ops.append(_norm_op("mlm_norm", model, tokens * h, e))
    else:
        ops.append(_norm_op("ln_f", model, tokens_sp * h, e))
    ops.append(_gemm_op("lm_head", tokens, vocab_r, h, e, weight=True))
    logits = tokens * vocab_r
    # Megatron-LM's vocab-parallel cross entropy (tensor_parallel/cross_entropy.py,
    # _VocabParallelCrossEntropy) on the logits cast to fp32 (GPT model: ``output.float()`` unless
    # --fp16-lm-cross-entropy), one kernel per pass over the T×V/t logits, in bytes per element:
    # forward cast (read e, write 4), max (r4), subtract the max (r4 w4), exp (r4 w4), sum (r4),
    # divide by the sum in place (r4 w4) = e + 36; backward multiply the saved softmax by the loss
    # gradient in place (r4 w4) and cast back (r4 w e) = 12 + e (the target-index update touches T
    # elements and is not counted).
    ops.append(Op(
        name="cross_entropy", kind="loss", fwd_flops=float(_LOSS_FLOPS * logits), bwd_flops=float(2 * logits),
        fwd_bytes=float(logits * (e + 36)), bwd_bytes=float(logits * (12 + e)), fwd_kernels=6, bwd_kernels=2,
    ))
    return tuple(ops)


def layer_ops(
    model: ModelSpec, *, tp: int = 1, sequence_parallel: bool = False, microbatch: int = 1, fused: bool = False,
    dtype: str | None = None, attention: str = "math", gemm_dtype: str | None = None,
) -> list[Op]:
    """Operators of one transformer layer on one tensor-parallel rank for one micro-batch, in order.

    ``fused`` models Megatron-LM's fused kernels (scale-mask-softmax, bias-GeLU, bias-dropout-add):
    same FLOPs, fewer bytes. ``dtype`` defaults to the model's. ``attention``: ``"math"`` (explicit
    ``s×s`` kernels) or ``"flash"`` (one fused kernel per pass). ``gemm_dtype``: ``"fp8"`` or
    ``"fp8-delayed"`` runs the linear layers' GEMMs in FP8 (``None``: the training dtype).
    """
    return list(_layer_ops(model, tp=tp, sequence_parallel=sequence_parallel, microbatch=microbatch,
                           fused=fused, dtype=dtype, attention=attention, gemm_dtype=gemm_dtype))


def embedding_ops(
    model: ModelSpec, *, tp: int = 1, sequence_parallel: bool = False, microbatch: int = 1, fused: bool = False,
    dtype: str | None = None,
) -> list[Op]:
    """Operators of the embedding (first model chunk) on one tensor-parallel rank."""
    return list(_embedding_ops(model, tp=tp, sequence_parallel=sequence_parallel, microbatch=microbatch,
                               fused=fused, dtype=dtype))


def head_ops(
    model: ModelSpec, *, tp: int = 1, sequence_parallel: bool = False, microbatch: int = 1, fused: bool = False,
    dtype: str | None = None,
) -> list[Op]:
    """Operators after the last layer (final norm, LM or MLM head, loss) on one tensor-parallel rank."""
    return list(_head_ops(model, tp=tp, sequence_parallel=sequence_parallel, microbatch=microbatch,
                          fused=fused, dtype=dtype))


# ----- time --------------------------------------------------------------------------------------

def _roofline(flops: float, nbytes: float, peak: float, eff: float, device: DeviceSpec) -> float:
    compute = flops / (peak * eff) if flops else 0.0
    memory = nbytes / (device.memory_bandwidth_Bps * device.memory_efficiency)
    return max(compute, memory) + device.kernel_overhead_s


def _attention_efficiency(op: Op, device: DeviceSpec) -> float:
    assert op.attention_shape is not None
    m, n, k = op.attention_shape
    return gemm_tile_choice(m, n, k, device, op.batch)[0] * device.attention_efficiency


def op_time_split(op: Op, device: DeviceSpec, dtype: str) -> tuple[float, float, float]:
    """``(forward, backward input-gradient, backward weight-gradient)`` time of ``op`` in seconds."""
    if op.attention_shape is not None:  # fused attention: tensor cores, the FLOPs its kernels execute
        peak, eff = device.peak_flops(dtype), _attention_efficiency(op, device)
        fwd = _roofline(op.exec_fwd_flops, op.fwd_bytes, peak, eff, device)
        bwd = _roofline(op.exec_bwd_flops, op.bwd_bytes, peak, eff, device)
        bwd += (op.bwd_kernels - 1) * device.kernel_overhead_s
        return fwd, bwd, 0.0
    if op.gemm is not None:
        m, n, k = op.gemm
        g = op.dtype or dtype
        peak = gemm_peak_flops(device, g)
        fwd = _roofline(op.fwd_flops, op.fwd_bytes, peak, gemm_efficiency(m, n, k, device, op.batch, g), device)
        # dA = dC·Bᵀ is an (m, k, n) GEMM; dB = Aᵀ·dC is a (k, n, m) GEMM; each moves the forward's bytes.
        d_a = _roofline(op.fwd_flops, op.fwd_bytes, peak, gemm_efficiency(m, k, n, device, op.batch, g), device)
        d_b = _roofline(op.fwd_flops, op.fwd_bytes, peak, gemm_efficiency(k, n, m, device, op.batch, g), device)
        return (fwd, d_a, d_b) if op.has_weight else (fwd, d_a + d_b, 0.0)
    # Element-wise kernels run on the vector units at the fp32 rate; they are memory-bound anyway.
    peak = device.peak_fp32_flops
    eff = 1.0
    fwd = _roofline(op.fwd_flops, op.fwd_bytes, peak, eff, device)
    bwd_in_flops = op.bwd_flops - op.bwd_weight_flops
    bwd_in_bytes = op.bwd_bytes - op.bwd_weight_bytes
    bwd_in = _roofline(bwd_in_flops, bwd_in_bytes, peak, eff, device) if (bwd_in_flops or bwd_in_bytes) else 0.0
    bwd_w = _roofline(op.bwd_weight_flops, op.bwd_weight_bytes, peak, eff, device) if op.bwd_weight_bytes else 0.0
    return fwd, bwd_in, bwd_w


def op_kernels(op: Op) -> tuple[int, int, int]:
    """Kernels the host issues for ``(forward, backward input-gradient, backward weight-gradient)``
    of ``op``: one per roofline term of :func:`op_time_split` (a GEMM's backward is two GEMMs)."""
    if op.gemm is not None:
        return (1, 1, 1) if op.has_weight else (1, 2, 0)
    bwd_in = op.bwd_kernels if (op.bwd_flops - op.bwd_weight_flops or op.bwd_bytes - op.bwd_weight_bytes) else 0
    return op.fwd_kernels, bwd_in, 1 if op.bwd_weight_bytes else 0


def host_bound_time(device_time_s: float, kernels: int, device: DeviceSpec) -> float:
    """Time of a sequence of ``kernels`` kernels whose device times sum to ``device_time_s``.

    The framework issues kernels from one host thread onto an asynchronous CUDA stream (CUDA C++
    Programming Guide, "Asynchronous Concurrent Execution"): while kernels are long the host runs
    ahead and its issue time is hidden; when they are short the device drains the queue and waits
    for the host. Over a sequence the time is therefore bounded by both the device's work and the
    host's issue rate, ``max(device_time_s, kernels·host_issue_s)`` (the roofline of the two
    pipelined resources); the queue is taken to persist within a model part (a transformer layer,
    the embedding, the head), which is issued without host synchronisation.
    """
    return max(device_time_s, kernels * device.host_issue_s)


def op_time(op: Op, device: DeviceSpec, dtype: str, *, backward: bool = False) -> float:
    """Roofline time of ``op``: max(FLOPs / (peak·efficiency), bytes / (bandwidth·memory efficiency))
    plus ``device.kernel_overhead_s`` per kernel. ``backward`` gives the whole backward."""
    fwd, bwd_in, bwd_w = op_time_split(op, device, dtype)
    return bwd_in + bwd_w if backward else fwd


def op_bound(op: Op, device: DeviceSpec, dtype: str) -> str:
    """``"compute"`` or ``"memory"``: which roofline term limits the forward of ``op``."""
    if op.attention_shape is not None:
        compute = op.exec_fwd_flops / (device.peak_flops(dtype) * _attention_efficiency(op, device))
    elif op.gemm is not None:
        m, n, k = op.gemm
        g = op.dtype or dtype
        compute = op.fwd_flops / (gemm_peak_flops(device, g) * gemm_efficiency(m, n, k, device, op.batch, g))
    else:
        compute = op.fwd_flops / device.peak_fp32_flops
    memory = op.fwd_bytes / (device.memory_bandwidth_Bps * device.memory_efficiency)
    return "compute" if compute >= memory else "memory"


# ----- FLOPs per iteration (the one MFU function) ---------------------------------------------

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

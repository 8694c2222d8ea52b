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

The operator record is :class:`paratrain.cost.op.Op`, the element-wise operators come from
:mod:`paratrain.cost.elementwise`, the FP8 cast passes from :mod:`paratrain.cost.fp8`, and the
FLOPs per iteration (MFU) from :mod:`paratrain.cost.flops`.
"""

from __future__ import annotations

from functools import lru_cache

from paratrain.cost.elementwise import (
    _DROPOUT_FLOPS,
    _GELU_FLOPS,
    _LOSS_FLOPS,
    _MASK_BYTES,
    _SCALE_MASK_FLOPS,
    _SOFTMAX_FLOPS,
    _activation_ops,
    _ew_op,
    _norm_op,
    _residual_op,
    _rope_op,
    uses_dropout,
)
from paratrain.cost.fp8 import FP8_GEMM_DTYPES, _fp8_linears
from paratrain.cost.gemm import gemm_efficiency, gemm_peak_flops, gemm_tile_choice
from paratrain.cost.op import Op, _gemm_op
from paratrain.errors import ConfigError, require_positive_int
from paratrain.spec.device import DeviceSpec
from paratrain.spec.model import _DTYPE_BYTES, Arch, ModelSpec, Position

__all__ = [
    "layer_ops",
    "embedding_ops",
    "head_ops",
    "op_time",
    "op_time_split",
    "op_bound",
    "memory_efficiency",
    "op_kernels",
    "host_bound_time",
    "kv_dim_per_rank",
    "dtype_bytes",
    "ATTENTION_KINDS",
    "default_attention",
    "resolve_attention",
]

ATTENTION_KINDS = ("flash", "math")
# FlashAttention-2 (Dao 2023, sec. 3.2): the backward runs 5 matmuls of the forward's 2 (it recomputes
# the scores), 2.5x the forward's FLOPs.
_FLASH_BWD_FLOPS_RATIO = 2.5
_FLASH_BWD_KERNELS = 3  # dot(dO, O) preprocessing, the main kernel, dQ conversion from fp32


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
    dtype: str | None = None, attention: str = "math", gemm_dtype: str | None = None, fp8_weight_reuse: int = 1,
) -> tuple[Op, ...]:
    """Operators of one transformer layer on one tensor-parallel rank, in execution order.

    ``dtype`` defaults to the model's; ``attention`` is ``"math"`` or ``"flash"`` (module docstring).
    ``gemm_dtype`` "fp8" / "fp8-delayed": the four linear GEMMs in FP8, each after its cast kernels
    (:func:`paratrain.cost.fp8.fp8_cast_bytes`; ``fp8_weight_reuse``: forward passes one cast of the
    weights serves). Cached: callers get a tuple they must not rely on mutating.
    """
    if attention not in ATTENTION_KINDS:
        raise ConfigError("attention", f"unknown attention {attention!r}", f"use one of: {', '.join(ATTENTION_KINDS)}")
    _check(model, tp, sequence_parallel, microbatch)
    e = dtype_bytes(dtype or model.dtype)
    b, h, t = microbatch, model.hidden, tp
    tokens = b * model.seq
    tokens_sp = tokens // t if sequence_parallel else tokens  # rows of norms/dropout/residual
    heads_r = model.heads // t
    q_r, kv_r, f_r = model.q_dim // t, kv_dim_per_rank(model, t), model.ffn_size // t
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
    return _fp8_linears(out, e, gemm_dtype, fused, fp8_weight_reuse) if gemm_dtype in FP8_GEMM_DTYPES else out


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
    gated = model.activation.gated
    ops.append(_gemm_op("fc1", tokens, (2 if gated else 1) * f_r, h, e, weight=True))
    ops.extend(_activation_ops(model, tokens * f_r, e, fused))
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
    dtype: str | None = None, attention: str = "math", gemm_dtype: str | None = None, fp8_weight_reuse: int = 1,
) -> list[Op]:
    """Operators of one transformer layer on one tensor-parallel rank for one micro-batch, in order.

    ``fused`` models Megatron-LM's fused kernels (scale-mask-softmax, bias-GeLU, bias-dropout-add):
    same FLOPs, fewer bytes. ``dtype`` defaults to the model's. ``attention``: ``"math"`` (explicit
    ``s×s`` kernels) or ``"flash"`` (one fused kernel per pass). ``gemm_dtype``: ``"fp8"`` or
    ``"fp8-delayed"`` runs the linear layers' GEMMs in FP8 (``None``: the training dtype);
    ``fp8_weight_reuse``: forward passes that one FP8 cast of the weights serves (cached weights).
    """
    return list(_layer_ops(model, tp=tp, sequence_parallel=sequence_parallel, microbatch=microbatch,
                           fused=fused, dtype=dtype, attention=attention, gemm_dtype=gemm_dtype,
                           fp8_weight_reuse=fp8_weight_reuse))


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

def _roofline(flops: float, nbytes: float, peak: float, eff: float, device: DeviceSpec,
              mem_eff: float | None = None) -> float:
    compute = flops / (peak * eff) if flops else 0.0
    memory = nbytes / (device.memory_bandwidth_Bps * (device.memory_efficiency if mem_eff is None else mem_eff))
    return max(compute, memory) + device.kernel_overhead_s


def memory_efficiency(op: Op, device: DeviceSpec) -> float:
    """The fraction of peak bandwidth ``op``'s memory traffic sustains: the MLP's activation at the
    device's own rate for it where it has one (a CPU's tanh), everything else at ``memory_efficiency``."""
    return device.activation_memory_efficiency if op.kind == "activation" else device.memory_efficiency


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
    # Element-wise kernels run on the vector units at the fp32 rate; they are memory-bound anyway,
    # the MLP's activation at its own rate where the device has one (a CPU's tanh).
    peak = device.peak_fp32_flops
    eff = 1.0
    mem = memory_efficiency(op, device)
    # one kernel overhead per kernel of a multi-kernel composite (eager PyTorch's), as op_kernels counts
    extra = device.kernel_overhead_s
    fwd = _roofline(op.fwd_flops, op.fwd_bytes, peak, eff, device, mem) + (op.fwd_kernels - 1) * extra
    bwd_in_flops = op.bwd_flops - op.bwd_weight_flops
    bwd_in_bytes = op.bwd_bytes - op.bwd_weight_bytes
    bwd_in = (_roofline(bwd_in_flops, bwd_in_bytes, peak, eff, device, mem) + (op.bwd_kernels - 1) * extra
              if (bwd_in_flops or bwd_in_bytes) else 0.0)
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
    mem = memory_efficiency(op, device)
    memory = op.fwd_bytes / (device.memory_bandwidth_Bps * mem)
    return "compute" if compute >= memory else "memory"

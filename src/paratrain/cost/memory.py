"""Memory: parameters, gradients, optimizer state and activations per transformer layer.

Static memory follows mixed-precision Adam (Micikevicius et al. 2018; Rajbhandari et al. 2020,
"ZeRO", sec. 3.1): 16-bit weights (2 B/param) and gradients (2 B), plus an fp32 master copy and
two fp32 moments (12 B) — 16 B per parameter. Training in bf16, the gradients are accumulated and
reduced in an fp32 buffer (4 B): Megatron-LM forces ``accumulate_allreduce_grads_in_fp32`` with
``--bf16``, and Megatron-Core's distributed-optimizer guide counts "bf16 parameters, fp32
gradients" at 18 B per parameter, ``6 + 12/d`` with the optimizer state sharded over ``d`` ranks
(docs.nvidia.com/megatron-core, "Distributed Optimizer", the bytes-per-parameter table); fp16
keeps 16-bit gradients. Training in fp32 keeps no master copy (4 + 4 + 8). ZeRO stage 1 shards
the optimizer state over the data-parallel ranks.

Activations follow Korthikanti et al. 2022, "Reducing Activation Recomputation in Large
Transformer Models", sec. 4: per layer, ``s·b·h·(34 + 5·a·s/h)`` bytes with 16-bit activations and
1-byte dropout masks. :func:`activation_terms` lists every stored tensor, generalized to GQA
(K and V of width ``kv``), any FFN size, gated MLPs, models without dropout and any dtype; with
``kv = h``, ``f = 4h``, 2-byte activations and dropout it reduces exactly to the paper's formulas:

- no parallelism: ``sbh(34 + 5as/h)``;
- tensor parallel ``t``: ``sbh(10 + 24/t + 5as/(ht))``;
- tensor + sequence parallel: ``sbh/t·(34 + 5as/h)``;
- selective recomputation (attention core) with TP + SP: ``sbh·34/t``;
- full recomputation: the layer input only, ``2sbh`` (``2sbh/t`` when SP shards it).

With fused (flash) attention no ``s×s`` tensor is stored: the kernel keeps Q, K, V, its output
and the fp32 log-sum-exp of each row (Dao et al. 2022, sec. 3.1), so a layer holds what selective
recomputation holds plus ``4·b·(a/t)·s`` bytes — Korthikanti's selective recomputation comes free.

Per-row statistics (a norm's mean and reciprocal standard deviation: ``4·s·b`` bytes, ``1/h`` of one
activation) are left out, as Korthikanti leaves them out. The terms above are the fused kernels'
(``fused=True``, the default): a fused norm keeps its input, a fused SwiGLU or GeGLU its two inputs. Eager
PyTorch's composites (``fused=False``, as :mod:`paratrain.cost.elementwise` times them) keep more:

- RMSNorm (``xf = x.float(); xf·rsqrt(mean(xf²) + ε)``, ``type_as``, ``·w``): ``pow`` and the
  product keep the fp32 copy ``xf`` (4 bytes an element; ``x`` itself in fp32), ``·w`` keeps the
  normalized tensor before the weight (``e`` bytes), and the input ``x`` is kept by nothing — 4
  bytes an element more than the fused kernel, in any dtype (the final norm before the head too);
- SwiGLU (``silu(gate)·up``): SiLU keeps the gate, the product keeps ``up`` and SiLU's output — one
  ``e``-byte tensor of the FFN width more than the fused kernel, which recomputes SiLU; GeGLU
  (``gelu(gate, approximate="tanh")·up``) keeps the same tensors;
- rotary (``view_as_complex(x.float())·freqs``, ``type_as``): the complex product keeps only the
  frequency table (the casts keep nothing), one buffer shared by every layer — nothing per layer.

Checked by ``tests/cost/test_memory_eager_saved.py``: the composites run under
``torch.autograd.graph.saved_tensors_hooks``, the distinct storages they save summed.

FP8 linear layers (``gemm_dtype``, :mod:`paratrain.cost.fp8`) change what the four linear layers
keep for their weight gradient, depending on who runs them:

- torchao's ``Float8Linear`` run eagerly (``fused=False``) keeps the high-precision input: its
  autograd function ``matmul_with_hp_or_float8_args`` calls ``ctx.save_for_backward(input_hp,
  weight_hp_t)`` and casts the input to FP8 again in the backward (pytorch/ao,
  ``torchao/float8/float8_linear.py``; its maintainers on pytorch/ao#1850: saving the FP8 input
  instead is left to torch.compile) — activations are those of the training dtype;
- Transformer Engine (``_Linear.forward`` saves the quantized ``inputmat``, column-wise data only:
  NVIDIA/TransformerEngine, ``transformer_engine/pytorch/module/linear.py``) and torch.compile of
  torchao (``fused=True``) keep the FP8 cast of the input, one byte an element (its per-tensor
  scale is one float). A bf16 tensor another operator also keeps stays: with fused attention the
  kernel keeps its output for its backward, so the projection keeps its FP8 copy beside it. The
  inputs of QKV, of the MLP's first GEMM (the norms keep their own inputs) and of its second GEMM
  shrink to one byte.

Not modelled: the FP8 weight copies torchao saves per micro-batch unless
``force_recompute_fp8_weight_in_bwd``, and Transformer Engine's cached FP8 weights.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from paratrain.cost.compute import _check, dtype_bytes, kv_dim_per_rank
from paratrain.cost.elementwise import uses_dropout
from paratrain.cost.fp8 import FP8_GEMM_DTYPES
from paratrain.errors import require_positive_int
from paratrain.parallel.config import Recompute
from paratrain.spec.model import Activation, ModelSpec, Norm

__all__ = [
    "StaticMemory",
    "static_memory",
    "weight_bytes",
    "grad_bytes",
    "grad_dtype_bytes",
    "optimizer_bytes",
    "activation_terms",
    "activation_bytes_per_layer",
    "norm_terms",
]

_FP32 = 4
_FP8 = 1
_ADAM_MOMENTS = 2


def weight_bytes(params: int, dtype: str) -> int:
    """Bytes of the working weights (in the training dtype)."""
    return params * dtype_bytes(dtype)


def grad_dtype_bytes(dtype: str) -> int:
    """Bytes per element of the gradient buffer: fp32 main gradients when training in bf16, the
    training dtype otherwise (module docstring: Megatron-Core's distributed-optimizer table)."""
    return _FP32 if dtype == "bf16" else dtype_bytes(dtype)


def grad_bytes(params: int, dtype: str) -> int:
    """Bytes of the gradient buffer (:func:`grad_dtype_bytes` per parameter)."""
    return params * grad_dtype_bytes(dtype)


def optimizer_bytes(params: int, dtype: str, *, dp: int = 1, sharded: bool = False) -> int:
    """Adam state: two fp32 moments, plus an fp32 master copy when training below fp32.

    ``sharded`` (ZeRO-1) splits it evenly over ``dp`` ranks (rounded up: the last shard is padded).
    """
    require_positive_int("dp", dp)
    per_param = _ADAM_MOMENTS * _FP32 + (_FP32 if dtype_bytes(dtype) < _FP32 else 0)
    total = params * per_param
    return -(-total // dp) if sharded else total


@dataclass(frozen=True)
class StaticMemory:
    """Memory that does not depend on in-flight micro-batches, in bytes."""

    weight_bytes: int
    grad_bytes: int
    optimizer_bytes: int

    @property
    def total_bytes(self) -> int:
        return self.weight_bytes + self.grad_bytes + self.optimizer_bytes


def static_memory(params: int, dtype: str, *, dp: int = 1, optimizer_sharding: bool = False) -> StaticMemory:
    """Weights, gradients and optimizer state of ``params`` parameters on one rank."""
    return StaticMemory(
        weight_bytes=weight_bytes(params, dtype),
        grad_bytes=grad_bytes(params, dtype),
        optimizer_bytes=optimizer_bytes(params, dtype, dp=dp, sharded=optimizer_sharding),
    )


def norm_terms(name: str, model: ModelSpec, rows: int, e: int, *, fused: bool = True) -> list[tuple[str, int, bool]]:
    """What a norm over ``rows`` tokens keeps for its backward (module docstring): its input; eager
    RMSNorm the fp32 copy of its input and its normalized output before the weight instead."""
    h = model.hidden
    if model.norm is Norm.RMSNORM and not fused:
        return [(f"{name} input in fp32", _FP32 * rows * h, False),
                (f"{name} normalized (weight's input)", e * rows * h, False)]
    return [(f"{name} input", e * rows * h, False)]


@lru_cache(maxsize=4096)
def activation_terms(
    model: ModelSpec, *, microbatch: int = 1, tp: int = 1, sequence_parallel: bool = False, dtype: str | None = None,
    attention: str = "math", fused: bool = True, gemm_dtype: str | None = None,
) -> tuple[tuple[str, int, bool], ...]:
    """Every tensor one layer stores for its backward, on one tensor-parallel rank.

    Returns ``(name, bytes, attention_core)`` triples; ``attention_core`` tensors are the ones
    selective recomputation drops (Korthikanti et al. 2022, sec. 5). Tensors outside the
    tensor-parallel regions (layer norm inputs, the inputs of QKV and of the first MLP GEMM,
    dropout masks after the row-parallel GEMMs) are replicated over ``t`` ranks unless sequence
    parallelism shards them along the sequence. ``fused=False``: eager PyTorch's element-wise
    composites; ``gemm_dtype``: FP8 linear layers (both in the module docstring).
    """
    _check(model, tp, sequence_parallel, microbatch)
    e = dtype_bytes(dtype or model.dtype)
    s, b, h, t = model.seq, microbatch, model.hidden, tp
    sb = s * b
    rep = sb // t if sequence_parallel else sb  # tokens of a replicated (or sequence-sharded) tensor
    heads_r, q_r, kv_r, f_r = model.heads // t, model.q_dim // t, kv_dim_per_rank(model, t), model.ffn_size // t
    drop = uses_dropout(model)
    mask = 1  # byte per dropout-mask element
    scores = heads_r * s * s * b
    flash = attention == "flash"
    # Bytes per element of a linear layer's saved input: its FP8 cast where Transformer Engine or
    # torch.compile keep it, the training dtype where eager torchao keeps the input itself.
    lin = _FP8 if gemm_dtype in FP8_GEMM_DTYPES and fused else e
    terms: list[tuple[str, int, bool]] = norm_terms("ln_1", model, rep, e, fused=fused)
    terms += [
        ("qkv input", lin * rep * h, False),
        ("Q", e * sb * q_r, False),
        ("K", e * sb * kv_r, False),
        ("attention log-sum-exp", _FP32 * b * heads_r * s, False) if flash else ("softmax output", e * scores, True),
    ]
    if drop and not flash:
        terms += [("attention dropout mask", mask * scores, True), ("attention dropout output", e * scores, True)]
    terms.append(("V", e * sb * kv_r, False))
    if flash and lin != e:  # the attention kernel keeps its output; the projection keeps its FP8 cast
        terms += [("attention output", e * sb * q_r, False), ("projection input", lin * sb * q_r, False)]
    else:
        terms.append(("projection input", lin * sb * q_r, False))
    if drop:
        terms.append(("attention residual dropout mask", mask * rep * h, False))
    terms += norm_terms("ln_2", model, rep, e, fused=fused)
    terms.append(("fc1 input", lin * rep * h, False))
    if model.activation.gated:
        terms.append(("gate and up (activation input)", e * sb * 2 * f_r, False))
        if not fused:
            gate = "SiLU" if model.activation is Activation.SWIGLU else "GELU"
            terms.append((f"{gate} output (product's input)", e * sb * f_r, False))
        terms.append(("fc2 input", lin * sb * f_r, False))
    else:
        terms += [("activation input", e * sb * f_r, False), ("fc2 input", lin * sb * f_r, False)]
    if drop:
        terms.append(("MLP residual dropout mask", mask * rep * h, False))
    return tuple(terms)


def activation_bytes_per_layer(
    model: ModelSpec,
    *,
    microbatch: int = 1,
    tp: int = 1,
    sequence_parallel: bool = False,
    recompute: Recompute | str = Recompute.NONE,
    dtype: str | None = None,
    attention: str = "math",
    fused: bool = True,
    gemm_dtype: str | None = None,
) -> int:
    """Bytes one layer holds per in-flight micro-batch between its forward and its backward.

    ``full`` keeps only the layer input (``2sbh``; ``/t`` under sequence parallelism); the
    recomputed activations exist only while that one layer runs its backward. ``attention``:
    ``"math"`` or ``"flash"`` (no ``s×s`` tensors); ``fused``, ``gemm_dtype``: see
    :func:`activation_terms`.
    """
    rc = Recompute(str(recompute))
    if rc is Recompute.FULL:
        _check(model, tp, sequence_parallel, microbatch)
        rows = model.seq * microbatch // (tp if sequence_parallel else 1)
        return dtype_bytes(dtype or model.dtype) * rows * model.hidden
    terms = activation_terms(
        model, microbatch=microbatch, tp=tp, sequence_parallel=sequence_parallel, dtype=dtype, attention=attention,
        fused=fused, gemm_dtype=gemm_dtype,
    )
    if rc is Recompute.SELECTIVE:
        return sum(n for _, n, core in terms if not core)
    return sum(n for _, n, _ in terms)

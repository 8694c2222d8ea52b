"""Cost of K-FAC's pieces per pipeline chunk: curvature, factor all-reduce, inversion, preconditioning.

K-FAC (Martens & Grosse, 2015) approximates the Fisher block of a linear layer ``y = W x``
(``W``: ``d_out × d_in``) by ``A ⊗ G`` with ``A = E[x xᵀ]`` (``d_in × d_in``) and
``G = E[g gᵀ]`` (``d_out × d_out``, ``g`` = dL/dy). Per layer, with ``t`` tokens per micro-batch:

* curvature of one micro-batch: ``Xᵀ X`` and ``Gᵀ G`` — ``2·t·(d_in² + d_out²)`` FLOPs (a
  multiply-add is 2 FLOPs), timed as two GEMMs of shapes ``(d_in, d_in, t)`` and
  ``(d_out, d_out, t)`` in the model's dtype with the operator roofline
  (:func:`paratrain.cost.compute.op_time`);
* factors: fp32, ``4·(d_in² + d_out²)`` bytes, all-reduced over the ranks holding the chunk;
* inversion of an ``n × n`` factor: ``c·n³`` FLOPs, ``c = 1`` for a Cholesky-based inverse
  (factor n³/3, triangular inverse n³/3, product n³/3) and ``c = 9`` for a symmetric
  eigendecomposition with eigenvectors (tridiagonalisation and QR iteration, Golub & Van Loan,
  *Matrix Computations*, §8.3); timed in fp32 at the roofline of an ``n×n×n`` GEMM — a lower
  bound, since the solvers reach only part of the GEMM rate;
* preconditioning: ``G⁻¹ ∇W A⁻¹``, two GEMMs, ``2·d_out²·d_in + 2·d_out·d_in²`` FLOPs, fp32.

The K-FAC layers are the four linear layers of each transformer layer (QKV, attention output,
FFN up — gate and up together for gated FFNs — and FFN down); the bias column and the embedding
and head are left out (the head's ``vocab²`` factor is not inverted by PipeFisher either).
Tensor-parallel shards are not modelled: ``tp > 1`` is refused.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from paratrain.cost.compute import op_time
from paratrain.cost.op import Op
from paratrain.errors import ConfigError
from paratrain.spec.model import ModelSpec

if TYPE_CHECKING:
    from paratrain.spec.device import DeviceSpec

__all__ = [
    "INVERSION_CONSTANT",
    "FACTOR_BYTES",
    "KfacLayerCost",
    "linear_shapes",
    "curvature_flops",
    "factor_bytes",
    "inversion_flops",
    "precondition_flops",
    "layer_cost",
    "chunk_layer_costs",
]

INVERSION_CONSTANT = {"inverse": 1.0, "eigen": 9.0}
FACTOR_BYTES = 4  # factors and inverses are kept in fp32


def linear_shapes(model: ModelSpec) -> tuple[tuple[int, int], ...]:
    """``(d_in, d_out)`` of the K-FAC layers of one transformer layer, in forward order."""
    h, q, f = model.hidden, model.q_dim, model.ffn_size
    gated = model.activation.gated
    return ((h, q + 2 * model.kv_dim), (q, h), (h, (2 if gated else 1) * f), (f, h))


def curvature_flops(d_in: int, d_out: int, tokens: int) -> float:
    return 2.0 * tokens * (d_in * d_in + d_out * d_out)


def factor_bytes(d_in: int, d_out: int) -> int:
    return FACTOR_BYTES * (d_in * d_in + d_out * d_out)


def inversion_flops(n: int, method: str = "inverse") -> float:
    if method not in INVERSION_CONSTANT:
        raise ConfigError("kfac inversion", f"unknown method {method!r}",
                          f"use one of: {', '.join(INVERSION_CONSTANT)}")
    return INVERSION_CONSTANT[method] * float(n) ** 3


def precondition_flops(d_in: int, d_out: int) -> float:
    return 2.0 * d_out * d_out * d_in + 2.0 * d_out * d_in * d_in


@dataclass(frozen=True)
class KfacLayerCost:
    """One K-FAC layer: curvature time per micro-batch, factor bytes, inversion and
    preconditioning time (seconds, one device)."""

    d_in: int
    d_out: int
    curvature_s: float
    factor_bytes: int
    inversion_s: float
    precondition_s: float


def _gemm(name: str, m: int, n: int, k: int, flops: float, e: int) -> Op:
    moved = float((m * k + k * n + m * n) * e)
    return Op(name=name, kind="gemm", fwd_flops=flops, bwd_flops=0.0, fwd_bytes=moved, bwd_bytes=0.0,
              gemm=(m, n, k), is_matmul=True)


def layer_cost(d_in: int, d_out: int, tokens: int, device: DeviceSpec, dtype: str,
               method: str = "inverse") -> KfacLayerCost:
    """Times of the K-FAC pieces of one ``d_in → d_out`` linear layer (see the module docstring)."""
    from paratrain.cost.compute import dtype_bytes

    e = dtype_bytes(dtype)
    curv = sum(op_time(_gemm("kfac_cov", n, n, tokens, 2.0 * tokens * n * n, e), device, dtype) for n in (d_in, d_out))
    inv = sum(op_time(_gemm("kfac_inv", n, n, n, inversion_flops(n, method), FACTOR_BYTES), device, "fp32")
              for n in (d_in, d_out))
    prec = (op_time(_gemm("kfac_prec_g", d_out, d_in, d_out, 2.0 * d_out * d_out * d_in, FACTOR_BYTES), device, "fp32")
            + op_time(_gemm("kfac_prec_a", d_out, d_in, d_in, 2.0 * d_out * d_in * d_in, FACTOR_BYTES), device,
                      "fp32"))
    return KfacLayerCost(d_in, d_out, curv, factor_bytes(d_in, d_out), inv, prec)


def chunk_layer_costs(model: ModelSpec, device: DeviceSpec, layers_per_chunk: tuple[int, ...], microbatch: int,
                      dtype: str, *, tp: int = 1, method: str = "inverse") -> tuple[tuple[KfacLayerCost, ...], ...]:
    """Per chunk, its K-FAC layers in forward order (``layers_per_chunk[c]`` transformer layers)."""
    if tp != 1:
        raise ConfigError("--tp", f"K-FAC bubble filling models whole layers, got tp={tp}",
                          "use tp=1 with --fill kfac")
    tokens = microbatch * model.seq
    one = tuple(layer_cost(i, o, tokens, device, dtype, method) for i, o in linear_shapes(model))
    return tuple(one * n for n in layers_per_chunk)

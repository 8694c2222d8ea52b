"""Async tensor parallelism: sequence parallelism's all-gathers and reduce-scatters decomposed and
overlapped with the GEMMs that consume or produce them.

What runs it: torchtitan's async TP (``enable_async_tensor_parallel``: torch.compile's micro-pipeline
TP rewrites each all-gather → matmul into ``fused_all_gather_matmul`` and each matmul →
reduce-scatter into ``fused_matmul_reduce_scatter`` over CUDA symmetric memory) and Megatron-Core's
``tp_comm_overlap`` (Transformer Engine's userbuffers). Both split the collective into ``tp`` pieces
and work on one piece while the next travels (Wang et al., ASPLOS'23, "Overlap Communication with
Dependent Computation via Decomposition in Large Deep Learning Models").

**One fused pair.** A collective of ``c`` seconds beside a GEMM of ``g`` seconds split into ``tp``
row blocks of ``g/tp``: for all-gather → matmul the local block is multiplied while the ``tp − 1``
remote ones arrive, and each later block as soon as it has; for matmul → reduce-scatter the first
block's partial sums leave once it is computed. Either way the pair ends at ``max(g, c + g/tp)``, so
what it adds to the GEMM alone is ``max(0, c − g·(tp − 1)/tp)`` (:func:`fused_exposed_s`). The
decomposed GEMMs are ``tp`` GEMMs of ``m/tp`` rows; where that shape runs less efficiently (tile and
wave effects of :mod:`paratrain.cost.gemm`) the difference is charged to the pair as well.

**Which pairs** (Megatron-LM's layer with sequence parallelism, Korthikanti et al. 2022 sec. 4.2.2;
the collectives of :func:`paratrain.cost.tensor_parallel.tp_parts` with ``runtime="megatron"``):

- forward: all-gather → QKV, attention projection → reduce-scatter, all-gather → first MLP GEMM,
  second MLP GEMM → reduce-scatter;
- backward: the reduce-scatters' backward all-gathers the output gradient → the attention
  projection's and the second MLP GEMM's input-gradient GEMMs; the all-gathers' backward
  reduce-scatters the input gradient ← QKV's and the first MLP GEMM's input-gradient GEMMs.

The embedding's and the head's collectives stay exposed. The collectives are timed as without
overlap (:mod:`paratrain.cost.tensor_parallel`); whether the copies take streaming multiprocessors
from the GEMMs (userbuffers' ring exchange does, symmetric memory's copy engines do not) is not
modelled.
"""

from __future__ import annotations

from collections.abc import Sequence

from paratrain.cost.compute import dtype_bytes, op_time_split
from paratrain.cost.op import Op, _gemm_op
from paratrain.errors import ConfigError
from paratrain.spec.device import DeviceSpec

__all__ = ["FORWARD_PAIRS", "BACKWARD_PAIRS", "fused_exposed_s", "decomposed_gemm_s", "layer_exposed_s"]

# (collective, GEMM): forward GEMMs consume a gathered input or produce a scattered output.
FORWARD_PAIRS = (("all_gather", "qkv"), ("reduce_scatter", "attn_proj"), ("all_gather", "fc1"),
                 ("reduce_scatter", "fc2"))
# (collective, GEMM whose input-gradient GEMM it overlaps) in the backward.
BACKWARD_PAIRS = (("all_gather", "fc2"), ("reduce_scatter", "fc1"), ("all_gather", "attn_proj"),
                  ("reduce_scatter", "qkv"))


def fused_exposed_s(comm_s: float, gemm_s: float, tp: int) -> float:
    """Time a collective of ``comm_s`` adds to the GEMM of ``gemm_s`` it is fused with, both split
    in ``tp`` pieces: ``max(0, comm_s − gemm_s·(tp − 1)/tp)`` (module docstring)."""
    if tp < 2:
        raise ConfigError("tp", f"the overlap splits over the tensor-parallel group; tp is {tp}", "use tp >= 2")
    if comm_s < 0 or gemm_s < 0:
        raise ConfigError("tp_overlap", f"negative time (collective {comm_s}, GEMM {gemm_s})", "give times >= 0")
    return max(0.0, comm_s - gemm_s * (tp - 1) / tp)


def decomposed_gemm_s(op: Op, tp: int, device: DeviceSpec, dtype: str) -> tuple[float, float]:
    """``(forward, input-gradient)`` time of ``op``'s GEMM run as ``tp`` GEMMs of ``m/tp`` rows."""
    assert op.gemm is not None
    m, n, k = op.gemm
    piece = _gemm_op(op.name, max(1, m // tp), n, k, dtype_bytes(dtype), batch=op.batch, weight=op.has_weight,
                     gemm_dtype=op.dtype)
    f, bi, _ = op_time_split(piece, device, dtype)
    return tp * f, tp * bi


def layer_exposed_s(
    ops: Sequence[Op], device: DeviceSpec, dtype: str, tp: int, all_gather_s: float, reduce_scatter_s: float
) -> tuple[float, float]:
    """``(forward, backward)`` tensor-parallel time one layer adds to its GEMMs under async TP:
    each collective of :data:`FORWARD_PAIRS` / :data:`BACKWARD_PAIRS` (``all_gather_s`` /
    ``reduce_scatter_s`` each, one micro-batch's activation) fused with its GEMM, plus what the
    decomposition costs the GEMM."""
    gemms = {op.name: op for op in ops if op.gemm is not None and op.has_weight}
    comm = {"all_gather": all_gather_s, "reduce_scatter": reduce_scatter_s}
    out = []
    for pairs, part in ((FORWARD_PAIRS, 0), (BACKWARD_PAIRS, 1)):
        total = 0.0
        for kind, name in pairs:
            op = gemms[name]
            whole = op_time_split(op, device, dtype)[part]
            split = decomposed_gemm_s(op, tp, device, dtype)[part]
            total += fused_exposed_s(comm[kind], split, tp) + max(0.0, split - whole)
        out.append(total)
    return out[0], out[1]

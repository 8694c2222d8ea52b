"""The cost of one transformer model on one tensor-parallel rank for one micro-batch, as rows:
every operator's FLOPs, bytes, time and bound, the totals of one layer, and the model's times,
FLOPs and memory (what ``paratrain cost`` prints)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Literal

from paratrain.cost.compute import (
    dtype_bytes,
    embedding_ops,
    head_ops,
    layer_ops,
    op_bound,
    op_time_split,
    resolve_attention,
)
from paratrain.cost.flops import (
    elementwise_flops_per_iteration,
    matmul_flops_per_iteration,
    model_flops_per_iteration,
)
from paratrain.cost.memory import activation_bytes_per_layer
from paratrain.cost.op import Op
from paratrain.cost.stage import chunk_costs, layer_params_per_rank
from paratrain.parallel.config import ParallelConfig
from paratrain.spec.cluster import ClusterSpec
from paratrain.spec.device import DeviceSpec
from paratrain.spec.model import ModelSpec

__all__ = ["OpRow", "LayerTotals", "CostReport", "op_rows", "layer_totals", "cost_report"]

Part = Literal["embedding", "layer", "head"]


def _fields(obj: Any) -> dict[str, Any]:
    """A dataclass's fields by name, in declaration order (the JSON keys of ``paratrain cost``)."""
    return {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj)}


@dataclass(frozen=True)
class OpRow:
    """One operator on one tensor-parallel rank for one micro-batch; ``count`` is how many times the
    model runs it (the layer count for a layer's operators, 1 for the embedding and the head)."""

    part: Part
    name: str
    kind: str
    count: int
    gemm_mnk: tuple[int, int, int] | None  # forward GEMM shape, repeated gemm_batch times
    gemm_batch: int | None
    matmul: bool
    fwd_flops: float
    bwd_flops: float
    fwd_bytes: float
    bwd_bytes: float
    fwd_s: float
    bwd_s: float  # input and weight gradients
    bound: str

    def to_dict(self) -> dict[str, Any]:
        return {**_fields(self), "gemm_mnk": list(self.gemm_mnk) if self.gemm_mnk else None}


@dataclass(frozen=True)
class LayerTotals:
    """Sums over one transformer layer's operators on one tensor-parallel rank."""

    fwd_flops: float
    bwd_flops: float
    matmul_flops: float  # forward and backward
    fwd_bytes: float
    bwd_bytes: float
    fwd_s: float
    bwd_s: float
    params_per_rank: int

    def to_dict(self) -> dict[str, Any]:
        return _fields(self)


@dataclass(frozen=True)
class CostReport:
    """The model on one tensor-parallel rank for one micro-batch (whole model in one chunk)."""

    model: str
    device: str
    cluster: str  # the cluster whose links time the tensor-parallel collectives
    tp: int
    microbatch: int
    recompute: str
    sequence_parallel: bool
    dtype: str
    gemm_dtype: str  # the layers' linear GEMMs: the training dtype, fp8 or fp8-delayed
    fused: bool
    attention: str
    params: int
    params_per_rank: int
    matmul_flops_per_sample: float  # forward, backward and recomputation
    model_flops_per_sample: float
    elementwise_flops_per_sample: float
    time_per_microbatch_s: float
    forward_s: float
    backward_s: float
    recompute_s: float
    tp_comm_s: float
    activation_bytes_per_layer: int
    activation_bytes: int
    weight_bytes: int
    grad_bytes: int
    optimizer_bytes: int
    model_tflops_per_device: float
    mfu: float
    peak_flops: float
    per_layer: LayerTotals
    ops: tuple[OpRow, ...]

    def to_dict(self) -> dict[str, Any]:
        return {**_fields(self), "per_layer": self.per_layer.to_dict(), "ops": [r.to_dict() for r in self.ops]}


def _row(part: Part, op: Op, device: DeviceSpec, dtype: str, count: int) -> OpRow:
    fwd, bwd_in, bwd_w = op_time_split(op, device, dtype)
    return OpRow(
        part=part, name=op.name, kind=op.kind, count=count, gemm_mnk=op.gemm, gemm_batch=op.batch if op.gemm else None,
        matmul=op.is_matmul, fwd_flops=op.fwd_flops, bwd_flops=op.bwd_flops, fwd_bytes=op.fwd_bytes,
        bwd_bytes=op.bwd_bytes, fwd_s=fwd, bwd_s=bwd_in + bwd_w, bound=op_bound(op, device, dtype),
    )


def op_rows(
    model: ModelSpec, device: DeviceSpec, *, tp: int, sequence_parallel: bool, microbatch: int, fused: bool, dtype: str,
    attention: str = "math", gemm_dtype: str | None = None,
) -> tuple[OpRow, ...]:
    """The embedding's, one layer's and the head's operators, in that order. ``gemm_dtype``: the
    layers' linear GEMMs in FP8 with their cast kernels (the embedding and the head keep ``dtype``,
    as Transformer Engine and torchao leave them)."""
    kw: dict[str, Any] = dict(
        tp=tp, sequence_parallel=sequence_parallel, microbatch=microbatch, fused=fused, dtype=dtype
    )
    rows = [_row("embedding", op, device, dtype, 1) for op in embedding_ops(model, **kw)]
    rows += [_row("layer", op, device, dtype, model.layers)
             for op in layer_ops(model, attention=attention, gemm_dtype=gemm_dtype, **kw)]
    rows += [_row("head", op, device, dtype, 1) for op in head_ops(model, **kw)]
    return tuple(rows)


def layer_totals(rows: tuple[OpRow, ...], model: ModelSpec, tp: int) -> LayerTotals:
    """Sums over the ``layer`` rows of :func:`op_rows`."""
    layer = [r for r in rows if r.part == "layer"]
    return LayerTotals(
        fwd_flops=sum(r.fwd_flops for r in layer),
        bwd_flops=sum(r.bwd_flops for r in layer),
        matmul_flops=sum(r.fwd_flops + r.bwd_flops for r in layer if r.matmul),
        fwd_bytes=sum(r.fwd_bytes for r in layer),
        bwd_bytes=sum(r.bwd_bytes for r in layer),
        fwd_s=sum(r.fwd_s for r in layer),
        bwd_s=sum(r.bwd_s for r in layer),
        params_per_rank=layer_params_per_rank(model, tp),
    )


def cost_report(
    model: ModelSpec,
    cluster: ClusterSpec,
    config: ParallelConfig,
    *,
    fused: bool = False,
    sequence_parallel: bool | None = None,
) -> CostReport:
    """The cost of ``model`` on one tensor-parallel rank of ``cluster.device`` for one micro-batch
    of ``config`` (its ``tp``, ``microbatch``, ``recompute``, ``dtype``; the whole model as one
    chunk). ``sequence_parallel`` (default: the config's) is what the operator rows and the
    activation bytes use: a caller may ask for it where ``tp = 1`` makes it a no-op, which the
    config would have dropped."""
    config.validate_for(model)
    device = cluster.device
    dt = config.dtype
    tp, microbatch, rc = config.tp, config.microbatch, config.recompute
    sp = config.sequence_parallel if sequence_parallel is None else bool(sequence_parallel)
    (chunk,) = chunk_costs(model, cluster, config, fused=fused)
    attention = resolve_attention(config.attention, device)
    rows = op_rows(model, device, tp=tp, sequence_parallel=sp, microbatch=microbatch, fused=fused, dtype=dt,
                   attention=attention, gemm_dtype=config.gemm_dtype)
    time_mb = chunk.forward_s + chunk.backward_s
    peak = device.peak_flops(dt)
    return CostReport(
        model=model.name, device=device.name, cluster=cluster.name, tp=tp, microbatch=microbatch,
        recompute=rc.value, sequence_parallel=sp, dtype=dt, gemm_dtype=config.gemm_dtype or dt, fused=fused,
        attention=attention,
        params=model.param_count(),
        params_per_rank=chunk.weight_bytes // dtype_bytes(dt),
        matmul_flops_per_sample=matmul_flops_per_iteration(model, 1, rc),
        model_flops_per_sample=model_flops_per_iteration(model, 1),
        elementwise_flops_per_sample=elementwise_flops_per_iteration(model, 1),
        time_per_microbatch_s=time_mb,
        forward_s=chunk.forward_s,
        backward_s=chunk.backward_input_s + chunk.backward_weight_s,
        recompute_s=chunk.recompute_s,
        tp_comm_s=chunk.tp_comm_s,
        activation_bytes_per_layer=activation_bytes_per_layer(
            model, microbatch=microbatch, tp=tp, sequence_parallel=sp, recompute=rc, dtype=dt, attention=attention,
            fused=fused, gemm_dtype=config.gemm_dtype,
        ),
        activation_bytes=chunk.activation_bytes,
        weight_bytes=chunk.weight_bytes,
        grad_bytes=chunk.grad_bytes,
        optimizer_bytes=chunk.optimizer_bytes,
        model_tflops_per_device=chunk.model_flops / time_mb / 1e12,
        mfu=chunk.model_flops / time_mb / peak,
        peak_flops=peak,
        per_layer=layer_totals(rows, model, tp),
        ops=rows,
    )

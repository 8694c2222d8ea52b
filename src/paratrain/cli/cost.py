"""``paratrain cost``: per-operator FLOPs, bytes, time and bound of one transformer layer, with
totals per layer and per model, for one tensor-parallel rank and one micro-batch.

Example::

    paratrain cost --model gpt3-175b --device a100-80gb --tp 8 --microbatch 1 --recompute selective \\
        --sequence-parallel
"""

from __future__ import annotations

import dataclasses
import sys
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

from paratrain.cli.options import (
    AttentionOpt,
    DropoutOpt,
    FfnOpt,
    GemmDtypeOpt,
    HeadsOpt,
    HiddenOpt,
    JsonOpt,
    KvHeadsOpt,
    LayersOpt,
    MicrobatchOpt,
    ModelOpt,
    RecomputeOpt,
    SeqOpt,
    SequenceParallelOpt,
    TpOpt,
    VocabOpt,
    flag_errors,
    parallel_from_opts,
    print_json,
    resolve_model_opts,
)
from paratrain.cost.report import CostReport, cost_report
from paratrain.errors import ConfigError
from paratrain.spec.cluster import ClusterSpec, resolve_cluster
from paratrain.spec.device import DeviceSpec, resolve_device

__all__ = ["register", "cost"]

def register(app: typer.Typer) -> None:
    app.command("cost", help="Per-operator FLOPs, bytes and time of a transformer layer; totals per layer and model.")(
        flag_errors(cost)
    )


def _cluster_for(device: DeviceSpec, cluster: str | None, tp: int) -> ClusterSpec:
    """The cluster whose links time the TP collectives: the given one, or the DGX node matching the
    device (NVLink 4 for Hopper, NVLink 3 otherwise), sized to hold the TP group, with ``device``."""
    # `is None`, not `or`: an empty --cluster is a malformed flag, not a request for the default
    name = cluster if cluster is not None else ("dgx-h100" if device.name.startswith(("h100", "h200")) else "dgx-a100")
    spec = resolve_cluster(name, "--cluster")
    per_node = spec.devices_per_node
    nodes = max(spec.nodes, -(-tp // per_node))
    return dataclasses.replace(spec.resized(nodes=nodes), device=device)


def cost(
    model: ModelOpt,
    layers: LayersOpt = None,
    hidden: HiddenOpt = None,
    heads: HeadsOpt = None,
    kv_heads: KvHeadsOpt = None,
    ffn: FfnOpt = None,
    seq: SeqOpt = None,
    vocab: VocabOpt = None,
    dropout: DropoutOpt = None,
    device: Annotated[str, typer.Option("--device", "-d", help="Device preset or file.")] = "a100-80gb",
    cluster: Annotated[
        str | None, typer.Option("--cluster", "-c", help="Cluster whose links time TP collectives (default: DGX node).")
    ] = None,
    tp: TpOpt = None,
    microbatch: MicrobatchOpt = None,
    recompute: RecomputeOpt = None,
    sequence_parallel: SequenceParallelOpt = None,
    dtype: Annotated[str | None, typer.Option("--dtype", help="Training dtype (default: the model's).")] = None,
    fused: Annotated[bool, typer.Option("--fused", help="Model fused element-wise kernels.")] = False,
    attention: AttentionOpt = None,
    gemm_dtype: GemmDtypeOpt = None,
    json_out: JsonOpt = False,
) -> None:
    spec = resolve_model_opts(model, layers, hidden, heads, kv_heads, ffn, seq, vocab, dropout)
    dev = resolve_device(device, "--device")
    dt = dtype if dtype is not None else spec.dtype  # an empty --dtype is unknown, not the default
    if dt not in ("fp32", "tf32", "bf16", "fp16", "fp8"):
        raise ConfigError("--dtype", f"unknown dtype {dt!r}", "use one of: fp32, tf32, bf16, fp16, fp8")
    config = parallel_from_opts(
        tp=tp, microbatch=microbatch, recompute=recompute, sequence_parallel=sequence_parallel, dtype=dt,
        attention=attention, gemm_dtype=gemm_dtype,
    )
    # Sequence parallelism is reported as asked, even where tp = 1 makes it a no-op.
    report = cost_report(
        spec, _cluster_for(dev, cluster, config.tp), config, fused=fused, sequence_parallel=bool(sequence_parallel)
    )
    if json_out:
        print_json(report.to_dict())
        return
    _print_tables(report, spec.layers)


def _fmt_time(t: float) -> str:
    return f"{t * 1e6:,.1f} µs" if t < 1e-3 else f"{t * 1e3:,.2f} ms"


def _fmt_bytes(n: float) -> str:
    for unit, f in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= f:
            return f"{n / f:,.1f} {unit}"
    return f"{n:,.0f} B"


def _print_tables(rep: CostReport, layers: int) -> None:
    # Piped output (docs, CI logs) gets a wide table instead of rich's 80-column default.
    con = Console() if sys.stdout.isatty() else Console(width=150)
    title = (f"{rep.model} on {rep.device}: tp={rep.tp} micro-batch={rep.microbatch} "
             f"recompute={rep.recompute} sp={rep.sequence_parallel} {rep.dtype}"
             f"{f' {rep.gemm_dtype} GEMMs' if rep.gemm_dtype != rep.dtype else ''}"
             f"{' fused' if rep.fused else ''} {rep.attention} attention (one TP rank)")
    t = Table(title=title)
    for col in ("part", "operator", "GEMM m×n×k", "fwd GFLOP", "bwd GFLOP", "fwd bytes", "bwd bytes",
                "fwd time", "bwd time", "bound"):
        t.add_column(col, justify="left" if col in ("part", "operator", "bound") else "right")
    for r in rep.ops:
        shape = "×".join(map(str, r.gemm_mnk)) if r.gemm_mnk else "-"
        if r.gemm_batch and r.gemm_batch > 1:
            shape = f"{r.gemm_batch}·{shape}"
        part = r.part if r.part != "layer" else f"layer ×{layers}"
        t.add_row(part, r.name, shape, f"{r.fwd_flops / 1e9:,.2f}", f"{r.bwd_flops / 1e9:,.2f}",
                  _fmt_bytes(r.fwd_bytes), _fmt_bytes(r.bwd_bytes), _fmt_time(r.fwd_s), _fmt_time(r.bwd_s), r.bound)
    con.print(t)
    pl = rep.per_layer
    s = Table(title="Totals")
    s.add_column("quantity")
    s.add_column("value", justify="right")
    s.add_row("parameters (model)", f"{rep.params:,}")
    s.add_row("parameters per TP rank", f"{rep.params_per_rank:,}")
    s.add_row("per layer: compute fwd / bwd", f"{_fmt_time(pl.fwd_s)} / {_fmt_time(pl.bwd_s)}")
    s.add_row("per layer: activations held", _fmt_bytes(rep.activation_bytes_per_layer))
    s.add_row("model: matmul FLOPs per sample (fwd+bwd+recompute)", f"{rep.matmul_flops_per_sample:.4e}")
    s.add_row("model: element-wise FLOPs per sample", f"{rep.elementwise_flops_per_sample:.4e}")
    s.add_row("model: forward / backward / recompute", f"{_fmt_time(rep.forward_s)} / "
              f"{_fmt_time(rep.backward_s)} / {_fmt_time(rep.recompute_s)}")
    s.add_row(f"model: TP collectives ({rep.cluster})", _fmt_time(rep.tp_comm_s))
    s.add_row("model: time per micro-batch", _fmt_time(rep.time_per_microbatch_s))
    s.add_row("model: activations per micro-batch", _fmt_bytes(rep.activation_bytes))
    s.add_row("model: weights + grads + Adam state per rank",
              _fmt_bytes(rep.weight_bytes + rep.grad_bytes + rep.optimizer_bytes))
    s.add_row("model TFLOP/s per device (MFU)", f"{rep.model_tflops_per_device:.1f} ({rep.mfu:.1%})")
    con.print(s)

"""``paratrain cost``: per-operator FLOPs, bytes, time and bound of one transformer layer, with
totals per layer and per model, for one tensor-parallel rank and one micro-batch.

Example::

    paratrain cost --model gpt3-175b --device a100-80gb --tp 8 --microbatch 1 --recompute selective \\
        --sequence-parallel
"""

from __future__ import annotations

import dataclasses
import sys
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.table import Table

from paratrain.cli.options import (
    FfnOpt,
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
from paratrain.cost.compute import (
    Op,
    dtype_bytes,
    elementwise_flops_per_iteration,
    embedding_ops,
    head_ops,
    layer_ops,
    matmul_flops_per_iteration,
    model_flops_per_iteration,
    op_bound,
    op_time_split,
)
from paratrain.cost.memory import activation_bytes_per_layer
from paratrain.cost.stage import chunk_costs, layer_params_per_rank
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
    name = cluster or ("dgx-h100" if device.name.startswith(("h100", "h200")) else "dgx-a100")
    spec = resolve_cluster(name, "--cluster")
    per_node = spec.devices_per_node
    nodes = max(spec.nodes, -(-tp // per_node))
    return dataclasses.replace(spec.resized(nodes=nodes), device=device)


def _op_row(part: str, op: Op, device: DeviceSpec, dtype: str, count: int) -> dict[str, Any]:
    fwd, bwd_in, bwd_w = op_time_split(op, device, dtype)
    return {
        "part": part, "name": op.name, "kind": op.kind, "count": count,
        "gemm_mnk": list(op.gemm) if op.gemm else None, "gemm_batch": op.batch if op.gemm else None,
        "matmul": op.is_matmul, "fwd_flops": op.fwd_flops, "bwd_flops": op.bwd_flops,
        "fwd_bytes": op.fwd_bytes, "bwd_bytes": op.bwd_bytes, "fwd_s": fwd, "bwd_s": bwd_in + bwd_w,
        "bound": op_bound(op, device, dtype),
    }


def cost(
    model: ModelOpt,
    layers: LayersOpt = None,
    hidden: HiddenOpt = None,
    heads: HeadsOpt = None,
    kv_heads: KvHeadsOpt = None,
    ffn: FfnOpt = None,
    seq: SeqOpt = None,
    vocab: VocabOpt = None,
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
    json_out: JsonOpt = False,
) -> None:
    spec = resolve_model_opts(model, layers, hidden, heads, kv_heads, ffn, seq, vocab)
    dev = resolve_device(device, "--device")
    dt = dtype or spec.dtype
    if dt not in ("fp32", "tf32", "bf16", "fp16", "fp8"):
        raise ConfigError("--dtype", f"unknown dtype {dt!r}", "use one of: fp32, tf32, bf16, fp16, fp8")
    config = parallel_from_opts(
        tp=tp, microbatch=microbatch, recompute=recompute, sequence_parallel=sequence_parallel, dtype=dt
    )
    config.validate_for(spec)
    # One TP rank of one micro-batch: the flags as given (sequence parallelism is reported as asked
    # even where tp = 1 makes it a no-op).
    tp, microbatch, rc = config.tp, config.microbatch, config.recompute
    sequence_parallel = bool(sequence_parallel)
    clus = _cluster_for(dev, cluster, tp)
    (chunk,) = chunk_costs(spec, clus, config, fused=fused)
    kw = dict(tp=tp, sequence_parallel=sequence_parallel, microbatch=microbatch, fused=fused, dtype=dt)
    rows = [_op_row("embedding", op, dev, dt, 1) for op in embedding_ops(spec, **kw)]
    rows += [_op_row("layer", op, dev, dt, spec.layers) for op in layer_ops(spec, **kw)]
    rows += [_op_row("head", op, dev, dt, 1) for op in head_ops(spec, **kw)]
    layer_rows = [r for r in rows if r["part"] == "layer"]
    per_layer = {
        "fwd_flops": sum(r["fwd_flops"] for r in layer_rows),
        "bwd_flops": sum(r["bwd_flops"] for r in layer_rows),
        "matmul_flops": sum(r["fwd_flops"] + r["bwd_flops"] for r in layer_rows if r["matmul"]),
        "fwd_bytes": sum(r["fwd_bytes"] for r in layer_rows),
        "bwd_bytes": sum(r["bwd_bytes"] for r in layer_rows),
        "fwd_s": sum(r["fwd_s"] for r in layer_rows),
        "bwd_s": sum(r["bwd_s"] for r in layer_rows),
        "params_per_rank": layer_params_per_rank(spec, tp),
    }
    time_mb = chunk.forward_s + chunk.backward_s
    peak = dev.peak_flops(dt)
    out = {
        "model": spec.name, "device": dev.name, "cluster": clus.name, "tp": tp, "microbatch": microbatch,
        "recompute": rc.value, "sequence_parallel": sequence_parallel, "dtype": dt, "fused": fused,
        "params": spec.param_count(),
        "params_per_rank": chunk.weight_bytes // dtype_bytes(dt),
        "matmul_flops_per_sample": matmul_flops_per_iteration(spec, 1, rc),
        "model_flops_per_sample": model_flops_per_iteration(spec, 1),
        "elementwise_flops_per_sample": elementwise_flops_per_iteration(spec, 1),
        "time_per_microbatch_s": time_mb,
        "forward_s": chunk.forward_s,
        "backward_s": chunk.backward_input_s + chunk.backward_weight_s,
        "recompute_s": chunk.recompute_s,
        "tp_comm_s": chunk.tp_comm_s,
        "activation_bytes_per_layer": activation_bytes_per_layer(
            spec, microbatch=microbatch, tp=tp, sequence_parallel=sequence_parallel, recompute=rc, dtype=dt
        ),
        "activation_bytes": chunk.activation_bytes,
        "weight_bytes": chunk.weight_bytes, "grad_bytes": chunk.grad_bytes, "optimizer_bytes": chunk.optimizer_bytes,
        "model_tflops_per_device": chunk.model_flops / time_mb / 1e12,
        "mfu": chunk.model_flops / time_mb / peak,
        "peak_flops": peak,
        "per_layer": per_layer,
        "ops": rows,
    }
    if json_out:
        print_json(out)
        return
    _print_tables(out, spec.layers)


def _fmt_time(t: float) -> str:
    return f"{t * 1e6:,.1f} µs" if t < 1e-3 else f"{t * 1e3:,.2f} ms"


def _fmt_bytes(n: float) -> str:
    for unit, f in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= f:
            return f"{n / f:,.1f} {unit}"
    return f"{n:,.0f} B"


def _print_tables(out: dict[str, Any], layers: int) -> None:
    # Piped output (docs, CI logs) gets a wide table instead of rich's 80-column default.
    con = Console() if sys.stdout.isatty() else Console(width=150)
    title = (f"{out['model']} on {out['device']}: tp={out['tp']} micro-batch={out['microbatch']} "
             f"recompute={out['recompute']} sp={out['sequence_parallel']} {out['dtype']}"
             f"{' fused' if out['fused'] else ''} (one TP rank)")
    t = Table(title=title)
    for col in ("part", "operator", "GEMM m×n×k", "fwd GFLOP", "bwd GFLOP", "fwd bytes", "bwd bytes",
                "fwd time", "bwd time", "bound"):
        t.add_column(col, justify="left" if col in ("part", "operator", "bound") else "right")
    for r in out["ops"]:
        shape = "×".join(map(str, r["gemm_mnk"])) if r["gemm_mnk"] else "-"
        if r["gemm_batch"] and r["gemm_batch"] > 1:
            shape = f"{r['gemm_batch']}·{shape}"
        part = r["part"] if r["part"] != "layer" else f"layer ×{layers}"
        t.add_row(part, r["name"], shape, f"{r['fwd_flops'] / 1e9:,.2f}", f"{r['bwd_flops'] / 1e9:,.2f}",
                  _fmt_bytes(r["fwd_bytes"]), _fmt_bytes(r["bwd_bytes"]), _fmt_time(r["fwd_s"]), _fmt_time(r["bwd_s"]),
                  r["bound"])
    con.print(t)
    pl = out["per_layer"]
    s = Table(title="Totals")
    s.add_column("quantity")
    s.add_column("value", justify="right")
    s.add_row("parameters (model)", f"{out['params']:,}")
    s.add_row("parameters per TP rank", f"{out['params_per_rank']:,}")
    s.add_row("per layer: compute fwd / bwd", f"{_fmt_time(pl['fwd_s'])} / {_fmt_time(pl['bwd_s'])}")
    s.add_row("per layer: activations held", _fmt_bytes(out["activation_bytes_per_layer"]))
    s.add_row("model: matmul FLOPs per sample (fwd+bwd+recompute)", f"{out['matmul_flops_per_sample']:.4e}")
    s.add_row("model: element-wise FLOPs per sample", f"{out['elementwise_flops_per_sample']:.4e}")
    s.add_row("model: forward / backward / recompute", f"{_fmt_time(out['forward_s'])} / "
              f"{_fmt_time(out['backward_s'])} / {_fmt_time(out['recompute_s'])}")
    s.add_row(f"model: TP collectives ({out['cluster']})", _fmt_time(out["tp_comm_s"]))
    s.add_row("model: time per micro-batch", _fmt_time(out["time_per_microbatch_s"]))
    s.add_row("model: activations per micro-batch", _fmt_bytes(out["activation_bytes"]))
    s.add_row("model: weights + grads + Adam state per rank",
              _fmt_bytes(out["weight_bytes"] + out["grad_bytes"] + out["optimizer_bytes"]))
    s.add_row("model TFLOP/s per device (MFU)", f"{out['model_tflops_per_device']:.1f} ({out['mfu']:.1%})")
    con.print(s)

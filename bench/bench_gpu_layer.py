"""One transformer layer on one GPU: measured forward and backward vs the cost model.

The runtime's GPT layer (``runtime.models.layers.Block``: LayerNorm, separate Q/K/V projections,
causal ``scaled_dot_product_attention``, GeLU MLP, no dropout) in bf16 (parameters and
activations, as Megatron-LM trains; no autocast casts), over a few GPT shapes. Each shape:
a warm-up, then ``--repeats`` forward + backward passes timed with CUDA events (the mean), one
more pass under the torch profiler (every pass starts with no gradients, as a step's first
micro-batch: no accumulation adds) for the device time per operator group. The prediction is
``cost.stage.layer_cost`` (eager path, fused attention, no recomputation, tp 1) of the
``--preset`` device three ways: raw (``--calibration none``), with the preset's fitted
calibration (the default everywhere) and, given ``--measured FILE`` (what ``paratrain calibrate
--gpu PRESET`` wrote), with the measured GEMM, memory and attention efficiencies over the
fitted calibration.

    python bench/bench_gpu_layer.py --measured ~/.cache/paratrain/measured-h100.json --json out.json
    python bench/bench_gpu_layer.py --device cpu --shapes 64,4,32,1 --repeats 2   # the code path

Prints per shape the measured and predicted milliseconds and their error, then per operator
group (GEMMs, attention, element-wise, norms) device milliseconds measured vs modelled.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path
from typing import Any

# (hidden, heads, sequence, micro-batch): GPT-3 350M, 1.3B, 6.7B-like and 13B-like layers.
GPU_SHAPES: tuple[tuple[int, int, int, int], ...] = (
    (1024, 16, 2048, 8), (2048, 16, 2048, 4), (4096, 32, 2048, 2), (4096, 32, 2048, 8),
    (5120, 40, 2048, 2), (8192, 64, 2048, 1),
)
GROUPS = ("gemm", "attention", "elementwise", "norm", "other")


def _group(aten_name: str) -> str:
    if aten_name in ("aten::mm", "aten::addmm", "aten::bmm", "aten::matmul", "aten::linear"):
        return "gemm"
    if "attention" in aten_name or "flash" in aten_name or "efficient" in aten_name or "cudnn" in aten_name:
        return "attention"
    if "layer_norm" in aten_name:
        return "norm"
    if any(k in aten_name for k in ("gelu", "add", "sum", "mul", "copy", "fill", "clone")):
        return "elementwise"
    return "other"


def measure(spec: Any, microbatch: int, device: str, repeats: int) -> dict[str, Any]:
    """Mean forward and backward seconds of one layer, and device seconds per operator group."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from paratrain.runtime.models.layers import Block

    dev = torch.device(device)
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    torch.manual_seed(0)
    block = Block(spec, pre_norm=True).to(device=dev, dtype=dtype)
    x = torch.randn(microbatch, spec.seq, spec.hidden, device=dev, dtype=dtype, requires_grad=True)
    grad = torch.randn_like(x)

    def fresh() -> None:
        # each pass starts without gradients, as a step's first micro-batch does: no accumulation adds
        block.zero_grad(set_to_none=True)
        x.grad = None

    def step() -> None:
        fresh()
        block(x).backward(grad)

    for _ in range(3):
        step()
    fwd, bwd = [], []
    for _ in range(repeats):
        fresh()
        if dev.type == "cuda":
            e = [torch.cuda.Event(enable_timing=True) for _ in range(3)]
            e[0].record()
            y = block(x)
            e[1].record()
            y.backward(grad)
            e[2].record()
            e[2].synchronize()
            fwd.append(e[0].elapsed_time(e[1]) / 1e3)
            bwd.append(e[1].elapsed_time(e[2]) / 1e3)
        else:
            t0 = time.perf_counter()
            y = block(x)
            t1 = time.perf_counter()
            y.backward(grad)
            fwd.append(t1 - t0)
            bwd.append(time.perf_counter() - t1)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.type == "cuda" else [])
    with profile(activities=activities) as prof:
        step()
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
    groups = dict.fromkeys(GROUPS, 0.0)
    for ev in prof.key_averages():
        t = ev.self_device_time_total if dev.type == "cuda" else ev.self_cpu_time_total
        if t > 0 and ev.key.startswith("aten::"):
            groups[_group(ev.key)] += t / 1e6
    return {"forward_s": sum(fwd) / len(fwd), "backward_s": sum(bwd) / len(bwd), "groups_s": groups,
            "torch_device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
            "dtype": "bf16" if dtype == torch.bfloat16 else "fp32"}


def devices(preset: str, measured: Path | None) -> dict[str, Any]:
    """The preset's device raw, fitted and (with ``measured``) measured."""
    from paratrain.plan.calibrated import FITTED_BY_DEVICE
    from paratrain.plan.validate import with_calibration
    from paratrain.runtime.gpu_calibrate import read_measured
    from paratrain.spec.cluster import resolve_cluster

    # with_calibration takes a cluster; its links do not enter a one-GPU layer.
    cluster = resolve_cluster("dgx-h100", "--cluster", gpus=8, device=preset)
    out = {"raw": cluster.device}
    fitted = FITTED_BY_DEVICE.get(cluster.device.name)
    if fitted is not None:
        out["fitted"] = with_calibration(cluster, fitted).device
    if measured is not None:
        rates = read_measured(measured, "--measured", "give the file `paratrain calibrate --gpu` wrote")
        out["measured"] = dataclasses.replace(out.get("fitted", cluster.device), **rates)
    return out


def predict(spec: Any, microbatch: int, device: Any, dtype: str) -> dict[str, Any]:
    from paratrain.cost.compute import layer_ops, op_time_split
    from paratrain.cost.stage import layer_cost
    from paratrain.parallel.config import Recompute

    part = layer_cost(spec, device, dtype, 1, False, microbatch, Recompute.NONE, False, "flash")
    groups = dict.fromkeys(GROUPS, 0.0)
    for op in layer_ops(spec, microbatch=microbatch, dtype=dtype, attention="flash"):
        key = ("gemm" if op.gemm is not None else "attention" if op.attention_shape is not None
               else "norm" if op.kind == "norm" else "elementwise")
        groups[key] += sum(op_time_split(op, device, dtype))
    return {"forward_s": part.forward_s, "backward_s": part.backward_input_s + part.backward_weight_s,
            "groups_s": groups}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default=None, help="torch device (default cuda when visible, else cpu)")
    p.add_argument("--preset", default="h100", help="device preset the prediction uses")
    p.add_argument("--measured", type=Path, default=None, help="`paratrain calibrate --gpu` output")
    p.add_argument("--shapes", default=None, help="hidden,heads,seq,microbatch;... (default: GPT shapes)")
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--json", type=Path, default=None, help="write the rows as JSON here")
    a = p.parse_args(argv)
    import torch

    device = a.device or ("cuda" if torch.cuda.is_available() else "cpu")
    shapes = GPU_SHAPES if a.shapes is None else tuple(
        tuple(int(v) for v in s.split(",")) for s in a.shapes.split(";"))
    devs = devices(a.preset, a.measured)
    rows = []
    print(f"{'hidden':>6} {'heads':>5} {'seq':>5} {'mb':>3} {'meas ms':>9} " +
          " ".join(f"{k + ' ms':>12} {'err':>7}" for k in devs))
    from paratrain.spec.model import gpt_layer

    for hidden, heads, seq, mb in shapes:
        spec = gpt_layer(hidden, heads, seq)
        m = measure(spec, mb, device, a.repeats)
        total = m["forward_s"] + m["backward_s"]
        row: dict[str, Any] = {"hidden": hidden, "heads": heads, "seq": seq, "microbatch": mb, "measured": m,
                               "predicted": {}}
        cells = []
        for name, d in devs.items():
            pr = predict(spec, mb, d, m["dtype"])
            t = pr["forward_s"] + pr["backward_s"]
            row["predicted"][name] = {**pr, "error": t / total - 1.0}
            cells.append(f"{t * 1e3:12.3f} {100 * (t / total - 1):+6.1f}%")
        rows.append(row)
        print(f"{hidden:6d} {heads:5d} {seq:5d} {mb:3d} {total * 1e3:9.3f} " + " ".join(cells), flush=True)
    print("device ms per operator group (measured / " + " / ".join(devs) + "):")
    for r in rows:
        parts = []
        for g in GROUPS:
            if g == "other":
                continue
            pred = " / ".join(f"{r['predicted'][k]['groups_s'][g] * 1e3:.3f}" for k in devs)
            parts.append(f"{g} {r['measured']['groups_s'][g] * 1e3:.3f} / {pred}")
        print(f"  h{r['hidden']} s{r['seq']} mb{r['microbatch']}: " + "; ".join(parts)
              + f"; other {r['measured']['groups_s']['other'] * 1e3:.3f}")
    if a.json is not None:
        a.json.write_text(json.dumps({"device": device, "preset": a.preset, "rows": rows}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

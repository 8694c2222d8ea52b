"""A layer's GEMMs on one GPU, measured vs the cost model, at the shapes a plan depends on.

For ``--model`` on ``--tp`` tensor-parallel ranks (default GPT-3 175B at tp 8, the 1024-GPU plan's
and the published records' layers) and each micro-batch size of ``--microbatches``, the cost
model's GEMM operators of one layer (``cost.compute.layer_ops``: QKV, attention output, MLP) are
run with ``torch.matmul`` in bf16 as the model prices them: the forward ``(m, n, k)``, the input
gradient ``(m, k, n)`` and the weight gradient ``(k, n, m)``. Each is timed with CUDA events (best
of ``--repeats`` after a warm-up) and set beside ``op_time_split`` with the ``--preset`` device raw,
fitted and (``--measured FILE``) with the measured GEMM efficiency. The per-micro-batch totals show
whether the model's shape efficiency tracks the GPU's as the micro-batch grows (the 175B plan's
winner runs micro-batch 2-3 where the records ran 1). ``--head`` adds the output head's GEMMs,
whose width is the vocabulary (GPT-2's 50,257 is odd; Megatron pads it to a multiple of 128).

    python bench/bench_gpu_gemm.py --measured ~/.cache/paratrain/measured-h100.json
    python bench/bench_gpu_gemm.py --model gpt2 --tp 1 --microbatches 8 --head
    python bench/bench_gpu_gemm.py --device cpu --model gpt-tiny --tp 1 --microbatches 1 --repeats 2
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from bench_gpu_layer import devices


def gemm_cases(model: Any, tp: int, microbatch: int, dtype: str,
               head: bool = False) -> list[tuple[str, tuple[int, int, int], int, Any]]:
    """(name, (m, n, k), batch, op) of every GEMM the model prices for one layer (and with ``head``
    the output head), both backward ones included (the weight gradient only where the operator has
    a weight)."""
    from paratrain.cost.compute import head_ops, layer_ops

    ops = layer_ops(model, tp=tp, microbatch=microbatch, dtype=dtype, attention="flash")
    if head:
        ops += head_ops(model, tp=tp, microbatch=microbatch, dtype=dtype)
    cases = []
    for op in ops:
        if op.gemm is None or op.attention_shape is not None:
            continue
        m, n, k = op.gemm
        cases.append((f"{op.name} fwd", (m, n, k), op.batch, op))
        cases.append((f"{op.name} dA", (m, k, n), op.batch, op))
        if op.has_weight:
            cases.append((f"{op.name} dB", (k, n, m), op.batch, op))
    return cases


def measure(shape: tuple[int, int, int], batch: int, device: str, repeats: int) -> float:
    import torch

    from paratrain.runtime.gpu_calibrate import _timer

    dev = torch.device(device)
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    m, n, k = shape
    a = torch.randn(batch, m, k, device=dev, dtype=dtype).squeeze(0)
    b = torch.randn(batch, k, n, device=dev, dtype=dtype).squeeze(0)
    return _timer(dev)(lambda: torch.matmul(a, b), repeats)


def predicted(op: Any, part: str, device: Any, dtype: str) -> float:
    from paratrain.cost.compute import op_time_split

    fwd, bwd_in, bwd_w = op_time_split(op, device, dtype)
    if part == "fwd":
        return fwd
    if part == "dA":
        return bwd_in if op.has_weight else bwd_in / 2  # without a weight both backward GEMMs are input's
    return bwd_w


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default=None, help="torch device (default cuda when visible, else cpu)")
    p.add_argument("--preset", default="h100")
    p.add_argument("--measured", type=Path, default=None, help="`paratrain calibrate --gpu` output")
    p.add_argument("--model", default="gpt3-175b")
    p.add_argument("--tp", type=int, default=8)
    p.add_argument("--microbatches", default="1,2,3")
    p.add_argument("--head", action="store_true", help="the output head's GEMMs too (its width is the vocabulary)")
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--json", type=Path, default=None)
    a = p.parse_args(argv)
    import torch

    from paratrain.spec.model import resolve_model

    device = a.device or ("cuda" if torch.cuda.is_available() else "cpu")
    dtype = "bf16" if torch.device(device).type == "cuda" else "fp32"
    model = resolve_model(a.model, "--model")
    devs = devices(a.preset, a.measured)
    rows = []
    for mb in (int(x) for x in a.microbatches.split(",")):
        total_meas, total_pred = 0.0, dict.fromkeys(devs, 0.0)
        print(f"{model.name} tp {a.tp} micro-batch {mb} ({dtype}):")
        print(f"  {'GEMM':<18} {'m x n x k (batch)':<26} {'meas ms':>8} {'TFLOP/s':>8} "
              + " ".join(f"{k + ' ms':>12}" for k in devs))
        for name, (m, n, k), batch, op in gemm_cases(model, a.tp, mb, dtype, a.head):
            t = measure((m, n, k), batch, device, a.repeats)
            pred = {key: predicted(op, name.split()[-1], d, dtype) for key, d in devs.items()}
            total_meas += t
            for key in devs:
                total_pred[key] += pred[key]
            rows.append({"microbatch": mb, "gemm": name, "m": m, "n": n, "k": k, "batch": batch, "seconds": t,
                         "predicted_s": pred})
            print(f"  {name:<18} {f'{m}x{n}x{k} ({batch})':<26} {t * 1e3:8.3f} {2 * m * n * k * batch / t / 1e12:8.1f} "
                  + " ".join(f"{pred[key] * 1e3:12.3f}" for key in devs))
        print(f"  total {total_meas * 1e3:.3f} ms measured; "
              + ", ".join(f"{key} {total_pred[key] * 1e3:.3f} ms ({100 * (total_pred[key] / total_meas - 1):+.1f} %)"
                          for key in devs), flush=True)
    if a.json is not None:
        doc = {"device": device, "model": model.name, "tp": a.tp, "rows": rows}
        a.json.write_text(json.dumps(doc, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Measure a GPU: what ``paratrain calibrate --gpu PRESET`` stores as that preset's measured
calibration.

Three measurements, each of the kernels the cost model prices (:mod:`paratrain.cost.compute`):

- **GEMMs** of transformer shapes in the training dtype (``torch.matmul``): the efficiency is the
  measured FLOP/s over the preset's peak and the shape efficiency the model gives the same shape
  (:func:`paratrain.cost.gemm.gemm_tile_choice`), so it is the model's ``gemm_efficiency``; the
  median over the shapes is kept;
- **memory bandwidth**: a device-to-device copy (reads and writes every byte) over the preset's
  nominal bandwidth (``copy_efficiency``);
- **a layer's element-wise kernels** at a layer's activation size (``ELEMENTWISE_SHAPE``): layer
  norm forward + backward and the residual add with its bias-gradient read give the model's
  ``memory_efficiency`` (they run below the copy's rate: row reductions, the norm's parameter
  gradients), the GeLU forward + backward + bias gradient its ``activation_efficiency``; each
  over the bytes and kernels the cost model counts for those operators (``layer_ops``, eager
  path), so the model reproduces the measured times;
- **fused attention**: ``scaled_dot_product_attention`` forward and backward, causal, over the FLOPs
  the fused kernels execute (the causal half; the backward 2.5× the forward: FlashAttention-2,
  Dao 2023, sec. 3.2) and the preset's peak × the tile shape efficiency of the ``s×s×d`` blocks,
  at sequences 2,048, 4,096 and 8,192 over the same tokens (``ATTENTION_SHAPES``; one H100 ran
  a layer's attention at 2,048 at most 0.75× as efficiently as at 4,096); the median is the
  model's ``attention_efficiency``;
- **the host's issue time**: the runtime's GPT block at a size where the GPU's work is negligible
  (``calibrate.OVERHEAD_BLOCK``), forward and backward back to back, over the kernels the cost
  model counts for it: the device's ``host_issue_s`` (an eager step of a small model was host-bound
  on an H100: 46 ms of kernels in a ~70 ms step).

:func:`measure_gpu` runs on any torch device (the unit tests run it on the CPU, which exercises
the code path without any GPU figure); :func:`efficiencies` turns its figures into the calibration.
GPU times are taken with CUDA events after a warm-up, the best of ``repeats``.
"""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from paratrain.cost.compute import op_kernels
from paratrain.cost.gemm import gemm_tile_choice
from paratrain.cost.op import Op
from paratrain.errors import ConfigError
from paratrain.spec.device import DeviceSpec, cpu_calibration_path

__all__ = [
    "GEMM_SHAPES", "ATTENTION_SHAPE", "ATTENTION_SHAPES", "COPY_BYTES", "ELEMENTWISE_SHAPE", "MEASURED_FIELDS",
    "OPTIONAL_FIELDS",
    "measure_gpu", "efficiencies", "elementwise_ops",
    "cuda_available", "measured_calibration_path", "shipped_calibration_path", "load_measured", "read_measured",
]

# (m, n, k): a Llama-8B-like layer at 8,192 tokens (QKV with GQA, attention output, MLP up and down)
# and two square ones.
GEMM_SHAPES: tuple[tuple[int, int, int], ...] = (
    (8192, 6144, 4096), (8192, 4096, 4096), (8192, 28672, 4096), (8192, 4096, 14336),
    (4096, 4096, 4096), (8192, 8192, 8192),
)
ATTENTION_SHAPE = (4, 32, 4096, 128)  # batch, heads, sequence, head size
# 16,384 tokens each (batch x sequence), 32 heads of 128, at the sequences plans use most
ATTENTION_SHAPES: tuple[tuple[int, int, int, int], ...] = ((8, 32, 2048, 128), ATTENTION_SHAPE, (2, 32, 8192, 128))
ELEMENTWISE_SHAPE = (8192, 4096)  # tokens, hidden: a Llama-8B-like layer's activation at 8,192 tokens
COPY_BYTES = 1 << 30
_FLASH_BWD_RATIO = 2.5
_DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}
MEASURED_FIELDS = ("gemm_efficiency", "memory_efficiency", "attention_efficiency")
# Measured since the element-wise kernels are: absent from older files (their memory_efficiency is the copy's).
OPTIONAL_FIELDS = ("activation_efficiency", "host_issue_s")


def cuda_available() -> bool:
    import torch

    return bool(torch.cuda.is_available())


def _timer(device: Any) -> Callable[[Callable[[], Any], int], float]:
    """Best-of-``repeats`` time of ``fn`` after one warm-up run, on ``device``'s clock."""
    import torch

    def cuda(fn: Callable[[], Any], repeats: int) -> float:
        fn()
        torch.cuda.synchronize(device)
        best = float("inf")
        for _ in range(repeats):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            best = min(best, start.elapsed_time(end) / 1e3)
        return best

    def host(fn: Callable[[], Any], repeats: int) -> float:
        fn()
        best = float("inf")
        for _ in range(repeats):
            t0 = time.perf_counter()
            fn()
            best = min(best, time.perf_counter() - t0)
        return best

    return cuda if torch.device(device).type == "cuda" else host


def measure_gpu(
    device: str = "cuda", *, dtype: str = "bf16", shapes: Sequence[tuple[int, int, int]] = GEMM_SHAPES,
    attention_shapes: Sequence[tuple[int, int, int, int]] = ATTENTION_SHAPES, copy_bytes: int = COPY_BYTES,
    repeats: int = 10,
    elementwise_shape: tuple[int, int] = ELEMENTWISE_SHAPE,
) -> dict[str, Any]:
    """Times of the GEMMs, the copy, a layer's element-wise kernels and the fused attention on
    ``device`` (a torch device name)."""
    import torch

    if dtype not in _DTYPES:
        raise ConfigError("dtype", f"unknown dtype {dtype!r}", f"use one of: {', '.join(_DTYPES)}")
    tdtype = getattr(torch, _DTYPES[dtype])
    dev = torch.device(device)
    timed = _timer(dev)
    gemms = []
    for m, n, k in shapes:
        a = torch.randn(m, k, device=dev, dtype=tdtype)
        b = torch.randn(k, n, device=dev, dtype=tdtype)
        gemms.append({"m": m, "n": n, "k": k, "seconds": timed(lambda a=a, b=b: torch.matmul(a, b), repeats)})
        del a, b
    src = torch.empty(copy_bytes, device=dev, dtype=torch.uint8)
    dst = torch.empty_like(src)
    copy_s = timed(lambda: dst.copy_(src), repeats)
    src = dst = torch.empty(0)  # free the buffers before the attention's
    elementwise = _time_elementwise(timed, dev, tdtype, elementwise_shape, repeats)
    attention = [_time_attention(timed, dev, tdtype, shape, repeats) for shape in attention_shapes]
    host_block_s = _time_host_block(dev, tdtype, repeats)
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else str(dev)
    return {
        "torch_device": name, "dtype": dtype, "gemm": gemms, "copy_bytes": copy_bytes, "copy_s": copy_s,
        "elementwise": elementwise,
        "attention": attention,
        "host_block_s": host_block_s,
    }


def _time_attention(timed: Callable[[Callable[[], Any], int], float], dev: Any, tdtype: Any,
                    shape: tuple[int, int, int, int], repeats: int) -> dict[str, Any]:
    import torch
    import torch.nn.functional as F

    bsz, heads, seq, head_dim = shape
    q, k, v = (torch.randn(bsz, heads, seq, head_dim, device=dev, dtype=tdtype, requires_grad=True) for _ in range(3))
    grad = torch.randn(bsz, heads, seq, head_dim, device=dev, dtype=tdtype)

    def attention() -> None:  # the gradients returned, not accumulated into .grad (no extra adds)
        torch.autograd.grad(F.scaled_dot_product_attention(q, k, v, is_causal=True), (q, k, v), grad)

    return {"batch": bsz, "heads": heads, "seq": seq, "head_dim": head_dim, "causal": True,
            "seconds": timed(attention, repeats)}


def _time_host_block(dev: Any, tdtype: Any, repeats: int) -> float:
    """Mean wall time of the overhead block's forward + backward issued back to back (the GPU's
    work at that size is far below the host's, so the wall is the host's issue time)."""
    import torch

    from paratrain.runtime.calibrate import overhead_block

    block, x = overhead_block()
    block, x = block.to(device=dev, dtype=tdtype), x.detach().to(device=dev, dtype=tdtype).requires_grad_(True)
    leaves = [x, *block.parameters()]

    def step() -> None:
        torch.autograd.grad([block(x).sum()], leaves)

    def sync() -> None:
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)

    calls = max(20, 5 * repeats)
    for _ in range(3):
        step()
    sync()
    t0 = time.perf_counter()
    for _ in range(calls):
        step()
    sync()
    return (time.perf_counter() - t0) / calls


def _attention_efficiency(a: dict[str, Any], peak: float, preset: DeviceSpec) -> float:
    b, h, s, d = int(a["batch"]), int(a["heads"]), int(a["seq"]), int(a["head_dim"])
    executed = 4.0 * b * h * s * s * d * (0.5 if a.get("causal", True) else 1.0) * (1.0 + _FLASH_BWD_RATIO)
    return executed / float(a["seconds"]) / (peak * gemm_tile_choice(s, s, d, preset, b * h)[0])


def _time_elementwise(timed: Callable[[Callable[[], Any], int], float], dev: Any, tdtype: Any,
                      shape: tuple[int, int], repeats: int) -> dict[str, Any]:
    """The kernels torch runs for the eager layer's norm, residual and activation operators."""
    import torch
    import torch.nn.functional as F

    tokens, hidden = shape
    x = torch.randn(tokens, hidden, device=dev, dtype=tdtype, requires_grad=True)
    y, g = torch.randn_like(x), torch.randn_like(x)
    w = torch.ones(hidden, device=dev, dtype=tdtype, requires_grad=True)
    b = torch.zeros(hidden, device=dev, dtype=tdtype, requires_grad=True)

    def norm() -> None:  # forward, then the backward (input and parameter gradients, not accumulated)
        torch.autograd.grad(F.layer_norm(x, (hidden,), w, b), (x, w, b), g)

    def residual() -> None:  # the add, and the backward's bias-gradient read of the incoming gradient
        torch.add(x.detach(), y)
        g.sum(0)

    norm_s, residual_s = timed(norm, repeats), timed(residual, repeats)
    x = y = g = torch.empty(0)
    u = torch.randn(tokens, 4 * hidden, device=dev, dtype=tdtype)
    gu = torch.randn_like(u)

    def activation() -> None:  # the runtime's GPT: tanh GeLU, its backward, the fc1 bias gradient
        F.gelu(u, approximate="tanh")
        torch.ops.aten.gelu_backward(gu, u, approximate="tanh").sum(0)

    return {"tokens": tokens, "hidden": hidden, "norm_s": norm_s, "residual_s": residual_s,
            "activation_s": timed(activation, repeats)}


def elementwise_ops(tokens: int, hidden: int, dtype: str) -> dict[str, Op]:
    """The cost model's norm, residual and activation operators of an eager GPT layer with
    ``tokens`` tokens of width ``hidden`` (what :func:`measure_gpu` times)."""
    from paratrain.cost.compute import layer_ops
    from paratrain.spec.model import gpt_layer

    ops = layer_ops(gpt_layer(hidden, max(1, hidden // 128), tokens), microbatch=1, dtype=dtype, attention="flash")
    return {"norm": next(o for o in ops if o.kind == "norm"),
            "residual": next(o for o in ops if o.name == "attn_residual"),
            "activation": next(o for o in ops if o.kind == "activation")}


def _memory_rate(ops: Sequence[Op], seconds: float, preset: DeviceSpec) -> float:
    """The fraction of ``preset``'s bandwidth at which ``ops``' bytes take ``seconds`` once the
    model's per-kernel overheads are taken off: the efficiency under which the model reproduces them."""
    nbytes = sum(o.fwd_bytes + o.bwd_bytes for o in ops)
    kernels = sum(sum(op_kernels(o)) for o in ops)
    busy = seconds - kernels * preset.kernel_overhead_s
    if busy <= 0:
        raise ConfigError("--gpu", f"the element-wise kernels took {seconds * 1e6:.1f} us, no more than the "
                                   f"{kernels} kernel overheads of the {preset.name} preset",
                          "measure at a larger ELEMENTWISE_SHAPE")
    return nbytes / busy / preset.memory_bandwidth_Bps


def efficiencies(measured: dict[str, Any], preset: DeviceSpec) -> dict[str, Any]:
    """The model's ``gemm_efficiency``, ``memory_efficiency`` and ``attention_efficiency`` of
    ``preset`` that reproduce ``measured`` (:func:`measure_gpu`), each capped at 1, with the
    per-shape GEMM efficiencies."""
    dtype = measured["dtype"]
    peak = preset.peak_flops(dtype)
    per_shape = []
    for g in measured["gemm"]:
        m, n, k, t = int(g["m"]), int(g["n"]), int(g["k"]), float(g["seconds"])
        shape = gemm_tile_choice(m, n, k, preset)[0]
        per_shape.append({"m": m, "n": n, "k": k, "flops_per_s": 2.0 * m * n * k / t,
                          "efficiency": 2.0 * m * n * k / t / (peak * shape)})
    # one shape in files measured before the sweep over sequences
    shapes = measured["attention"] if isinstance(measured["attention"], list) else [measured["attention"]]
    by_seq = [{"seq": int(a["seq"]), "efficiency": _attention_efficiency(a, peak, preset)} for a in shapes]
    attention = statistics.median(x["efficiency"] for x in by_seq)
    copy = min(1.0, 2.0 * float(measured["copy_bytes"]) / float(measured["copy_s"]) / preset.memory_bandwidth_Bps)
    out = {
        "preset": preset.name,
        "gemm_efficiency": min(1.0, statistics.median(p["efficiency"] for p in per_shape)),
        "memory_efficiency": copy,
        "attention_efficiency": min(1.0, attention),
        "copy_efficiency": copy,
        "gemm_by_shape": per_shape,
        "attention_by_seq": by_seq,
    }
    ew = measured.get("elementwise")
    if ew is not None:  # older measurements have none: the copy's rate stands for every memory-bound kernel
        ops = elementwise_ops(int(ew["tokens"]), int(ew["hidden"]), dtype)
        out["memory_efficiency"] = min(1.0, _memory_rate(
            [ops["norm"], ops["residual"]], float(ew["norm_s"]) + float(ew["residual_s"]), preset))
        out["activation_efficiency"] = min(1.0, _memory_rate([ops["activation"]], float(ew["activation_s"]), preset))
    if measured.get("host_block_s") is not None:
        from paratrain.runtime.calibrate import overhead_block_kernels

        out["host_issue_s"] = float(measured["host_block_s"]) / overhead_block_kernels()
    return out


def shipped_calibration_path(preset: str) -> Path:
    """A measured calibration shipped with paratrain (``paratrain/data/measured/PRESET.json``:
    measured on such a GPU by the project; see its README)."""
    from paratrain.data import DATA_DIR

    return DATA_DIR / "measured" / f"{preset}.json"


def measured_calibration_path(preset: str) -> Path:
    """Where ``paratrain calibrate --gpu PRESET`` stores the preset's measured calibration, beside
    the ``cpu`` one (``$PARATRAIN_CACHE``, ``~/.cache/paratrain`` by default); ``--calibration
    measured`` applies it to that device."""
    return cpu_calibration_path().parent / f"measured-{preset}.json"


def load_measured(preset: str, field: str = "--calibration") -> dict[str, float]:
    """The stored efficiencies of ``preset``: this machine's (:func:`measured_calibration_path`),
    else the one shipped for it (:func:`shipped_calibration_path`)."""
    path = measured_calibration_path(preset)
    fix = f"run `paratrain calibrate --gpu {preset}` on that GPU first"
    if not path.is_file():
        if not shipped_calibration_path(preset).is_file():
            raise ConfigError(field, f"there is no measured calibration of {preset} at {str(path)!r}", fix)
        path = shipped_calibration_path(preset)
    return read_measured(path, field, fix)


def read_measured(path: Path, field: str, fix: str) -> dict[str, float]:
    """The efficiencies (and, when measured, the optional fields) of a ``calibrate --gpu`` file."""
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
        out = {f: float(doc[f]) for f in MEASURED_FIELDS}
        out.update({f: float(doc[f]) for f in OPTIONAL_FIELDS if doc.get(f) is not None})
    except (OSError, ValueError, TypeError, KeyError) as e:
        raise ConfigError(field, f"the measured calibration at {str(path)!r} cannot be read ({e})", fix) from None
    for f, v in out.items():
        if not 0 < v <= 1:
            raise ConfigError(field, f"{f} in {str(path)!r} is {v}, not in (0, 1]", fix)
    return out

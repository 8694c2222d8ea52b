"""Measure a GPU: what ``paratrain calibrate --gpu PRESET`` stores as that preset's measured
calibration.

Three measurements, each of the kernels the cost model prices (:mod:`paratrain.cost.compute`):

- **GEMMs** of transformer shapes in the training dtype (``torch.matmul``): the efficiency is the
  measured FLOP/s over the preset's peak and the shape efficiency the model gives the same shape
  (:func:`paratrain.cost.gemm.gemm_tile_choice`), so it is the model's ``gemm_efficiency``; the
  median over the shapes is kept;
- **memory bandwidth**: a device-to-device copy (reads and writes every byte) over the preset's
  nominal bandwidth, the model's ``memory_efficiency``;
- **fused attention**: ``scaled_dot_product_attention`` forward and backward, causal, over the FLOPs
  the fused kernels execute (the causal half; the backward 2.5× the forward: FlashAttention-2,
  Dao 2023, sec. 3.2) and the preset's peak × the tile shape efficiency of the ``s×s×d`` blocks,
  the model's ``attention_efficiency``.

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

from paratrain.cost.gemm import gemm_tile_choice
from paratrain.errors import ConfigError
from paratrain.spec.device import DeviceSpec, cpu_calibration_path

__all__ = [
    "GEMM_SHAPES", "ATTENTION_SHAPE", "COPY_BYTES", "MEASURED_FIELDS", "measure_gpu", "efficiencies",
    "cuda_available", "measured_calibration_path", "shipped_calibration_path", "load_measured",
]

# (m, n, k): a Llama-8B-like layer at 8,192 tokens (QKV with GQA, attention output, MLP up and down)
# and two square ones.
GEMM_SHAPES: tuple[tuple[int, int, int], ...] = (
    (8192, 6144, 4096), (8192, 4096, 4096), (8192, 28672, 4096), (8192, 4096, 14336),
    (4096, 4096, 4096), (8192, 8192, 8192),
)
ATTENTION_SHAPE = (4, 32, 4096, 128)  # batch, heads, sequence, head size
COPY_BYTES = 1 << 30
_FLASH_BWD_RATIO = 2.5
_DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}
MEASURED_FIELDS = ("gemm_efficiency", "memory_efficiency", "attention_efficiency")


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
    attention_shape: tuple[int, int, int, int] = ATTENTION_SHAPE, copy_bytes: int = COPY_BYTES, repeats: int = 10,
) -> dict[str, Any]:
    """Times of the GEMMs, the copy and the fused attention on ``device`` (a torch device name)."""
    import torch
    import torch.nn.functional as F

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
    bsz, heads, seq, head_dim = attention_shape
    q, k_, v = (torch.randn(bsz, heads, seq, head_dim, device=dev, dtype=tdtype, requires_grad=True) for _ in range(3))
    grad = torch.randn(bsz, heads, seq, head_dim, device=dev, dtype=tdtype)

    def attention() -> None:
        out = F.scaled_dot_product_attention(q, k_, v, is_causal=True)
        out.backward(grad)

    attention_s = timed(attention, repeats)
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else str(dev)
    return {
        "torch_device": name, "dtype": dtype, "gemm": gemms, "copy_bytes": copy_bytes, "copy_s": copy_s,
        "attention": {"batch": bsz, "heads": heads, "seq": seq, "head_dim": head_dim, "causal": True,
                      "seconds": attention_s},
    }


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
    a = measured["attention"]
    b, h, s, d = int(a["batch"]), int(a["heads"]), int(a["seq"]), int(a["head_dim"])
    executed = 4.0 * b * h * s * s * d * (0.5 if a.get("causal", True) else 1.0) * (1.0 + _FLASH_BWD_RATIO)
    attention = executed / float(a["seconds"]) / (peak * gemm_tile_choice(s, s, d, preset, b * h)[0])
    memory = 2.0 * float(measured["copy_bytes"]) / float(measured["copy_s"]) / preset.memory_bandwidth_Bps
    return {
        "preset": preset.name,
        "gemm_efficiency": min(1.0, statistics.median(p["efficiency"] for p in per_shape)),
        "memory_efficiency": min(1.0, memory),
        "attention_efficiency": min(1.0, attention),
        "gemm_by_shape": per_shape,
    }


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
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
        out = {f: float(doc[f]) for f in MEASURED_FIELDS}
    except (OSError, ValueError, TypeError, KeyError) as e:
        raise ConfigError(field, f"the measured calibration at {str(path)!r} cannot be read ({e})", fix) from None
    for f, v in out.items():
        if not 0 < v <= 1:
            raise ConfigError(field, f"{f} in {str(path)!r} is {v}, not in (0, 1]", fix)
    return out

"""``paratrain calibrate``: measure this machine's CPU and store it as the ``cpu`` device.

Measures fp32 GEMM throughput with ``torch.matmul`` on a few square sizes (best of several runs),
memory bandwidth with a large tensor copy (read + write bytes over time), and the fixed cost of a
tiny kernel (framework dispatch), then writes a :class:`~paratrain.spec.device.DeviceSpec` JSON to
``cpu_calibration_path()`` (``$PARATRAIN_CACHE/cpu.json``; ``~/.cache/paratrain/cpu.json`` by
default), where ``resolve_device("cpu")`` picks it up. Takes a few seconds.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from pathlib import Path
from typing import Annotated, Any

import typer

from paratrain.cli.options import JsonOpt, print_json
from paratrain.errors import ConfigError
from paratrain.spec.device import DeviceSpec, cpu_calibration_path
from paratrain.spec.device_presets import DEVICE_PRESETS

__all__ = ["register", "calibrate", "measure_cpu"]

_GEMM_SIZES = (256, 512, 1024)
_COPY_BYTES = 128 * 2**20  # past the last-level cache of common CPUs
_BUDGET_S = 2.5  # keeps the whole command, torch import included, under 10 s on a loaded machine


def register(app: typer.Typer) -> None:
    app.command("calibrate", help="Measure this machine's CPU and store it as the `cpu` device.")(calibrate)


def _best_time(fn: Any, *, repeats: int, deadline: float) -> float:
    """Fastest of up to ``repeats`` timed calls (after one warm-up), stopping at ``deadline``
    (a ``time.perf_counter()`` value) once at least one call was timed."""
    fn()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        t1 = time.perf_counter()
        best = min(best, t1 - t0)
        if t1 > deadline:
            break
    return best


def measure_cpu(budget_s: float = _BUDGET_S) -> dict[str, Any]:
    """Measured figures of this machine: GEMM FLOP/s per size, copy bandwidth, kernel overhead.

    Each of the five measurements gets a cumulative share of ``budget_s``, so a loaded machine
    takes fewer repeats rather than longer.
    """
    import torch

    torch.manual_seed(0)
    start = time.perf_counter()
    steps = len(_GEMM_SIZES) + 2

    def deadline(i: int) -> float:
        return start + budget_s * (i + 1) / steps

    per_size = {}
    for i, n in enumerate(_GEMM_SIZES):
        a = torch.randn(n, n, dtype=torch.float32)
        b = torch.randn(n, n, dtype=torch.float32)
        t = _best_time(lambda a=a, b=b: torch.matmul(a, b), repeats=8, deadline=deadline(i))
        per_size[n] = 2 * n**3 / t
    elems = _COPY_BYTES // 4
    src = torch.ones(elems, dtype=torch.float32)
    dst = torch.empty_like(src)
    t_copy = _best_time(lambda: dst.copy_(src), repeats=6, deadline=deadline(steps - 2))
    bandwidth = 2 * _COPY_BYTES / t_copy  # the copy reads and writes every byte
    x = torch.ones(8)
    t_small = _best_time(lambda: torch.add(x, x), repeats=500, deadline=deadline(steps - 1))
    return {
        "gemm_flops_by_size": per_size,
        "peak_fp32_flops": max(per_size.values()),
        "memory_bandwidth_Bps": bandwidth,
        "kernel_overhead_s": t_small,
        "threads": torch.get_num_threads(),
    }


def _memory_bytes() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return DEVICE_PRESETS["cpu"].memory_bytes


def device_from_measurement(m: dict[str, Any]) -> DeviceSpec:
    """A ``cpu`` DeviceSpec whose peaks are the measured best, so efficiencies are 1."""
    return dataclasses.replace(
        DEVICE_PRESETS["cpu"],
        peak_fp32_flops=float(m["peak_fp32_flops"]),
        memory_bytes=int(_memory_bytes()),
        memory_bandwidth_Bps=float(m["memory_bandwidth_Bps"]),
        sm_count=int(m["threads"]),
        gemm_efficiency=1.0,
        memory_efficiency=1.0,
        kernel_overhead_s=float(m["kernel_overhead_s"]),
    )


def calibrate(
    out: Annotated[Path | None, typer.Option("--out", help="Write the device JSON here instead.")] = None,
    json_out: JsonOpt = False,
) -> None:
    target = out if out is not None else cpu_calibration_path()
    t0 = time.perf_counter()
    m = measure_cpu()
    device = device_from_measurement(m)
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(json.dumps(device.to_dict(), indent=2) + "\n")
    except OSError as e:
        raise ConfigError("--out", f"cannot write {str(target)!r}: {e.strerror or e}", "give a writable path") from None
    elapsed = time.perf_counter() - t0
    if json_out:
        print_json({
            "path": str(target),
            "device": device.to_dict(),
            "gemm_flops_by_size": {str(k): v for k, v in m["gemm_flops_by_size"].items()},
            "seconds": elapsed,
        })
        return
    for n, f in m["gemm_flops_by_size"].items():
        print(f"fp32 GEMM {n}x{n}x{n}: {f / 1e9:.1f} GFLOP/s")
    print(f"memory bandwidth (copy of {_COPY_BYTES // 2**20} MiB): {device.memory_bandwidth_Bps / 1e9:.2f} GB/s")
    print(f"kernel overhead (tiny add): {device.kernel_overhead_s * 1e6:.1f} us")
    print(f"threads: {device.sm_count}; memory: {device.memory_bytes / 2**30:.1f} GiB")
    print(f"wrote {target} in {elapsed:.1f} s")

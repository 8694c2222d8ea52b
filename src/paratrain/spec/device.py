"""Accelerator specification and presets.

A :class:`DeviceSpec` holds the datasheet numbers (peak FLOP/s per dtype, memory capacity and
bandwidth, SM count) plus the few efficiency parameters the roofline and GEMM shape-efficiency
model use. Presets live in :mod:`paratrain.spec.device_presets`, each number with its source.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from paratrain.errors import ConfigError, require_bool, require_positive, require_positive_int

__all__ = ["DeviceSpec", "resolve_device", "cpu_calibration_path"]

_PEAK_FIELDS = {
    "fp32": "peak_fp32_flops",
    "tf32": "peak_tf32_flops",
    "bf16": "peak_bf16_flops",
    "fp16": "peak_fp16_flops",
    "fp8": "peak_fp8_flops",
    "int8": "peak_int8_flops",
}


@dataclass(frozen=True)
class DeviceSpec:
    """One accelerator.

    Peak FLOP/s are dense (no structured sparsity). A dtype the device lacks has peak 0.
    ``gemm_tile_m``/``gemm_tile_n`` are the output tile of the typical tensor-core GEMM kernel,
    ``gemm_tile_k`` its K step; with ``sm_count`` they drive tile and wave quantization.
    ``gemm_efficiency`` is the fraction of peak a large, well-shaped GEMM sustains and
    ``memory_efficiency`` the fraction of peak bandwidth a streaming kernel sustains.
    ``kernel_overhead_s`` is the device-side cost of one kernel (start-up and tail), added to its
    roofline time. ``host_issue_s`` is the host (CPU) time to issue one kernel from the framework:
    kernels run asynchronously on a stream, so the host runs ahead of the device while kernels are
    long and the device waits on the host only when they are short. A sequence of ``n`` kernels
    therefore takes ``max(sum of device times, n·host_issue_s)`` (0: never host-bound).
    ``fused_attention``: the frameworks run fused (FlashAttention) kernels on this device by default;
    ``attention_efficiency`` is the fraction of the tensor-core peak such a kernel sustains on long
    sequences (before the tile shape efficiency of its ``s×s×d`` blocks).
    ``activation_efficiency``: the fraction of peak bandwidth the MLP's activation (GeLU, SwiGLU)
    sustains, when it differs from other element-wise kernels' (None: ``memory_efficiency``). On a
    CPU the vector units evaluate GeLU's tanh slower than memory streams it; ``paratrain
    calibrate`` measures both.
    """

    name: str
    peak_fp32_flops: float
    peak_bf16_flops: float
    memory_bytes: int
    memory_bandwidth_Bps: float
    sm_count: int
    peak_tf32_flops: float = 0.0
    peak_fp16_flops: float = 0.0
    peak_fp8_flops: float = 0.0
    peak_int8_flops: float = 0.0
    gemm_tile_m: int = 128
    gemm_tile_n: int = 128
    gemm_tile_k: int = 32
    gemm_efficiency: float = 0.85
    memory_efficiency: float = 0.85
    kernel_overhead_s: float = 4e-6  # device-side start-up + tail of one kernel
    host_issue_s: float = 0.0  # host time to issue one kernel (eager framework + CUDA launch)
    # Run-to-run variability of one compute action's duration (standard deviation / mean). 0: every
    # action takes its modelled time; > 0: the simulator draws durations around it (sim.variability).
    duration_cv: float = 0.0
    # Host time DTensor adds per tensor-parallel module (its input/output redistribution, sharding
    # propagation, autograd of the wrappers), forward and backward; `paratrain calibrate` measures
    # it on a CPU. 0: not modelled (GPU presets: the host runs ahead of the kernels).
    tp_dispatch_forward_s: float = 0.0
    tp_dispatch_backward_s: float = 0.0
    # Memory a training process cannot give to its tensors (see usable_memory_bytes): a fixed part
    # (CUDA context, library workspaces, communication buffers) and the fraction of the rest the
    # caching allocator loses to fragmentation. Presets: GPU_MEMORY_RESERVE in device_presets.
    memory_reserved_bytes: int = 0
    memory_fragmentation: float = 0.0
    fused_attention: bool = False
    attention_efficiency: float = 0.5
    activation_efficiency: float | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.name, str):
            raise ConfigError("name", f"must be a string, got {self.name!r}", "give the device a name")
        require_positive("peak_fp32_flops", self.peak_fp32_flops)
        require_positive("memory_bandwidth_Bps", self.memory_bandwidth_Bps)
        require_positive_int("memory_bytes", self.memory_bytes)
        require_positive_int("sm_count", self.sm_count)
        for f in ("peak_bf16_flops", "peak_tf32_flops", "peak_fp16_flops", "peak_fp8_flops", "peak_int8_flops"):
            require_positive(f, getattr(self, f), allow_zero=True)
        for f in ("gemm_tile_m", "gemm_tile_n", "gemm_tile_k"):
            require_positive_int(f, getattr(self, f))
        require_bool("fused_attention", self.fused_attention)
        for f in ("gemm_efficiency", "memory_efficiency", "attention_efficiency", "activation_efficiency"):
            v = getattr(self, f)
            if v is None and f == "activation_efficiency":
                continue
            require_positive(f, v)
            if v > 1:
                raise ConfigError(f, f"must be at most 1, got {v}", "give a fraction of peak in (0, 1]")
        require_positive("kernel_overhead_s", self.kernel_overhead_s, allow_zero=True)
        require_positive("host_issue_s", self.host_issue_s, allow_zero=True)
        require_positive("duration_cv", self.duration_cv, allow_zero=True)
        require_positive("tp_dispatch_forward_s", self.tp_dispatch_forward_s, allow_zero=True)
        require_positive("tp_dispatch_backward_s", self.tp_dispatch_backward_s, allow_zero=True)
        if not isinstance(self.memory_reserved_bytes, int) or isinstance(self.memory_reserved_bytes, bool):
            raise ConfigError(
                "memory_reserved_bytes", f"must be an integer, got {self.memory_reserved_bytes!r}", "give bytes"
            )
        if not 0 <= self.memory_reserved_bytes < self.memory_bytes:
            raise ConfigError(
                "memory_reserved_bytes",
                f"must be in [0, memory_bytes = {self.memory_bytes}), got {self.memory_reserved_bytes}",
                "give the bytes the CUDA context and communication buffers take, e.g. 1073741824",
            )
        require_positive("memory_fragmentation", self.memory_fragmentation, allow_zero=True)
        if self.memory_fragmentation >= 0.9:
            raise ConfigError(
                "memory_fragmentation",
                f"must be below 0.9, got {self.memory_fragmentation}",
                "give the fraction of memory lost to fragmentation, e.g. 0.1",
            )
        if self.duration_cv > 1:
            raise ConfigError("duration_cv", f"must be at most 1, got {self.duration_cv}",
                              "give the standard deviation of an action's duration over its mean, e.g. 0.1")

    @property
    def activation_memory_efficiency(self) -> float:
        """``activation_efficiency`` resolved (``memory_efficiency`` when unset)."""
        return self.activation_efficiency if self.activation_efficiency is not None else self.memory_efficiency

    @property
    def usable_memory_bytes(self) -> int:
        """Bytes the planner may fill with weights, gradients, optimizer state and activations:
        ``(memory_bytes - memory_reserved_bytes) · (1 - memory_fragmentation)``."""
        return int((self.memory_bytes - self.memory_reserved_bytes) * (1.0 - self.memory_fragmentation))

    def peak_flops(self, dtype: str) -> float:
        """Peak FLOP/s for ``dtype``; a dtype the device lacks falls back to the next wider one
        it has (fp8→bf16/fp16→fp32), as frameworks do."""
        if dtype not in _PEAK_FIELDS:
            raise ConfigError("dtype", f"unknown dtype {dtype!r}", f"use one of: {', '.join(_PEAK_FIELDS)}")
        chain = {
            "fp8": ("fp8", "bf16", "fp16", "fp32"),
            "int8": ("int8", "fp16", "fp32"),
            "bf16": ("bf16", "fp16", "fp32"),
            "fp16": ("fp16", "bf16", "fp32"),
            "tf32": ("tf32", "fp32"),
            "fp32": ("fp32",),
        }[dtype]
        for d in chain:
            v = getattr(self, _PEAK_FIELDS[d])
            if v > 0:
                return v
        return self.peak_fp32_flops

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def cpu_calibration_path() -> Path:
    """Where ``paratrain calibrate`` stores this machine's measured ``cpu`` device."""
    base = os.environ.get("PARATRAIN_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "paratrain")
    return Path(base) / "cpu.json"


def from_document(doc: dict[str, Any], field: str = "--device") -> DeviceSpec:
    if not isinstance(doc, dict):
        raise ConfigError(field, f"must be a mapping of device fields, got {doc!r}", "give a preset name or a mapping")
    doc = dict(doc)
    base = None
    if "preset" in doc:
        base = resolve_device(str(doc.pop("preset")), field)
    from paratrain.spec._files import check_keys

    check_keys(doc, DeviceSpec, field, "device", expected_kind="a device spec", required=base is None)
    if base is not None:
        return dataclasses.replace(base, **doc)
    try:
        return DeviceSpec(**doc)
    except TypeError as e:
        raise ConfigError(field, str(e), "check the device file's keys") from None


def resolve_device(name_or_path: str, field: str = "--device") -> DeviceSpec:
    """A preset name (``a100-80gb``, ``h100``, ``cpu`` …) or a JSON/YAML/TOML file."""
    from paratrain.spec._files import load_document
    from paratrain.spec.device_presets import DEVICE_ALIASES, DEVICE_PRESETS

    key = name_or_path.lower()
    key = DEVICE_ALIASES.get(key, key)
    if key == "cpu":
        path = cpu_calibration_path()
        if path.is_file():
            try:
                doc = json.loads(path.read_text(encoding="utf-8"))
                if isinstance(doc, dict) and "preset" not in doc:
                    return from_document(doc, f"{field} (calibration {path})")
            except (OSError, ValueError, TypeError, ConfigError):
                pass
            # A stale, damaged or foreign calibration file falls back to the default estimate.
        return DEVICE_PRESETS["cpu"]
    if key in DEVICE_PRESETS:
        return DEVICE_PRESETS[key]
    p = Path(name_or_path)
    if p.suffix.lower() in (".json", ".yaml", ".yml", ".toml") or p.exists():
        from paratrain.spec._files import loading_preset_file

        with loading_preset_file(p, field):
            return from_document(load_document(p, field), field)
    raise ConfigError(
        field, f"unknown device preset {name_or_path!r}", "run `paratrain presets` to list them, or give a file path"
    )

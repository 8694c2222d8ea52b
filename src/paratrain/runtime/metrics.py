"""Measurements of a real run: per-step metrics (JSON lines), MFU, and a Chrome trace.

Trace format: :mod:`paratrain.trace`, the simulator's own (each event carries its step).
Without a pipeline ``pid`` = global rank and events are named like the schedule IR's actions —
``F{mb}@c0`` / ``B{mb}@c0`` forward and backward of micro-batch ``mb`` on chunk 0 (the whole model),
``R@c0`` one data-parallel gradient bucket's all-reduce (from launch to completion as this rank sees
it), ``U`` the optimizer step, ``X:clip`` gradient clipping; with a pipeline ``pid`` = pipeline rank
(:mod:`paratrain.runtime.pipeline`). Thread 0 = compute, thread 1 = communication. Times are
wall-clock offsets from an origin rank 0 broadcasts at start-up, so ranks line up; every event's
``args.step`` is its step, and ``metadata`` says what ran (model, layout, schedule).
"""

from __future__ import annotations

import json
import time
from typing import IO, Any

import torch

from paratrain.cost.flops import model_flops_per_iteration
from paratrain.fileio import check_output_path
from paratrain.spec.model import ModelSpec
from paratrain.trace import TraceEvent, category_of

__all__ = ["Tracer", "step_mfu", "peak_flops_per_device", "MetricsWriter", "max_memory_bytes"]


def max_memory_bytes(device: torch.device) -> int:
    """Peak memory so far: the CUDA caching allocator's peak on a GPU, the process's peak resident
    set (ru_maxrss: KiB on Linux, bytes on macOS) on CPU."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    import resource
    import sys

    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(rss if sys.platform == "darwin" else rss * 1024)


def step_mfu(spec: ModelSpec, global_batch: int, step_s: float, peak_flops: float, devices: int) -> float:
    """Model FLOPs utilization of one step: the cost model's useful matmul FLOPs of the global batch
    (:func:`paratrain.cost.flops.model_flops_per_iteration`, the simulator's and planner's numerator
    too) over ``step_s`` × ``devices`` × ``peak_flops`` (per device)."""
    return model_flops_per_iteration(spec, global_batch) / (step_s * devices * peak_flops)


_CUDA_NAMES = (("h200", "h200"), ("h100", "h100"), ("a100", "a100-80gb"), ("v100", "v100"), ("p100", "p100"))


def peak_flops_per_device(device: torch.device, bf16: bool) -> tuple[float, str]:
    """(peak FLOP/s, what it is: ``"h100 preset"``, ``"cpu preset x 2 threads"``) used as MFU's
    denominator.

    CUDA: the preset matching the device name. CPU: the ``cpu`` preset, which is this machine's
    measured figures once ``paratrain calibrate`` has run, an uncalibrated estimate before; both
    are one core's, so a process computing on several threads is measured against that many
    (``paratrain train --nproc 1`` on 2 cores had reported an MFU of 284 %).
    """
    from paratrain.spec.device import resolve_device

    dtype = "bf16" if bf16 else "fp32"
    name = "cpu"
    if device.type == "cuda":
        gpu = torch.cuda.get_device_name(device).lower()
        name = next((preset for key, preset in _CUDA_NAMES if key in gpu), "h100")
        # fp32 matmuls run on the tensor cores (TF32) only when torch is told to; by default it is not
        tf32 = torch.get_float32_matmul_precision() != "highest"
        dtype = "bf16" if bf16 else "tf32" if tf32 else "fp32"
    spec = resolve_device(name)
    peak = spec.peak_flops(dtype) or spec.peak_fp32_flops
    threads = torch.get_num_threads()
    if device.type == "cpu" and threads > 1:
        return peak * threads, f"{name} preset x {threads} threads"
    return peak, f"{name} preset"


class Tracer:
    """Collects the spans of one rank with their steps. ``enabled=False`` makes every call a no-op."""

    def __init__(self, rank: int, origin_s: float, enabled: bool) -> None:
        self.rank, self.origin_s, self.enabled = rank, origin_s, enabled
        self.events: list[TraceEvent] = []
        self.step = 0
        # perf_counter is precise but has an arbitrary zero: map it to wall-clock time once.
        self._perf_to_wall = time.time() - time.perf_counter()

    def trace_time(self, perf_s: float) -> float:
        """A ``time.perf_counter()`` reading as seconds from the run's origin (the trace's clock)."""
        return perf_s + self._perf_to_wall - self.origin_s

    def record(self, name: str, stream: str, start_s: float, end_s: float, microbatch: int | None = None) -> None:
        """A span measured with ``time.perf_counter()``; ``stream`` is "compute" or "comm"."""
        if not self.enabled:
            return
        category = category_of(name)
        self.events.append(TraceEvent(self.rank, stream, name, self.trace_time(start_s), end_s - start_s, category,
                                      microbatch, self.step))

    def span(self, name: str, stream: str = "compute", microbatch: int | None = None) -> _Span:
        return _Span(self, name, stream, microbatch)


class _Span:
    def __init__(self, tracer: Tracer, name: str, stream: str, microbatch: int | None) -> None:
        self.tracer, self.name, self.stream, self.microbatch = tracer, name, stream, microbatch

    def __enter__(self) -> None:
        self.start_s = time.perf_counter()

    def __exit__(self, *exc: object) -> None:
        self.tracer.record(self.name, self.stream, self.start_s, time.perf_counter(), self.microbatch)


class MetricsWriter:
    """One JSON object per line and step, flushed at once (a live stream, so not written atomically;
    the path is checked before the run starts). A path containing ``{rank}`` gets one file per rank."""

    def __init__(self, path: str | None, rank: int, sinks: list[Any] | None = None) -> None:
        self._file: IO[str] | None = None
        self.sinks = list(sinks or [])  # TensorBoard, wandb (runtime/sinks.py): each gets every row too
        if path is not None and ("{rank}" in path or rank == 0):
            target = check_output_path(path.replace("{rank}", str(rank)), "--metrics", make_parents=True)
            self._file = open(target, "w", encoding="utf-8", buffering=1)  # noqa: SIM115

    def write(self, row: dict[str, Any]) -> None:
        if self._file is not None:
            self._file.write(json.dumps(row) + "\n")
        for sink in self.sinks:
            sink.write(row)

    def close(self) -> None:
        for sink in self.sinks:
            sink.close()
        self.sinks = []
        if self._file is not None:
            self._file.close()
            self._file = None

    def __enter__(self) -> MetricsWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

"""Measurements of a real run: per-step metrics (JSON lines), MFU, and a Chrome trace.

Trace format (shared with the simulator): Chrome trace events, ``ph: "X"`` spans with ``ts``/``dur``
in microseconds, ``pid`` = global rank, ``tid`` = ``"compute"`` or ``"comm"``. Event names:
``F{mb}`` forward and ``B{mb}`` backward of micro-batch ``mb``, ``allreduce`` (one per gradient
bucket, from launch to completion as this rank sees it), ``clip`` and ``optimizer``. Each span
carries ``args.step``. Times are wall-clock offsets from an origin rank 0 broadcasts at start-up.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import torch

from paratrain.spec.model import Arch, ModelSpec

__all__ = ["Tracer", "model_flops_per_token", "peak_flops_per_device", "MetricsWriter"]


def model_flops_per_token(spec: ModelSpec) -> float:
    """Training FLOPs per token: ``6N + 12·l·h·s`` (PaLM, Chowdhery et al. 2022, appendix B).

    ``N`` excludes the embedding tables (lookups do no matmul) but counts the output projection,
    which is a matmul even when tied. The attention term is PaLM's, without a causal discount.
    """
    n = spec.param_count() - spec.vocab * spec.hidden - spec.num_positions * spec.hidden
    if spec.arch is Arch.BERT:
        n -= 2 * spec.hidden  # token-type table
    n += spec.vocab * spec.hidden  # output projection matmul (tied or not)
    return 6.0 * n + 12.0 * spec.layers * spec.hidden * spec.seq


_CUDA_NAMES = (("h200", "h200"), ("h100", "h100"), ("a100", "a100-80gb"), ("v100", "v100"), ("p100", "p100"))


def peak_flops_per_device(device: torch.device, bf16: bool) -> tuple[float, str]:
    """(peak FLOP/s, device preset name) used as MFU's denominator.

    CUDA: the preset matching the device name. CPU: the ``cpu`` preset, which is this machine's
    measured figures once ``paratrain calibrate`` has run, an uncalibrated estimate before.
    """
    from paratrain.spec.device import resolve_device

    dtype = "bf16" if bf16 else "fp32"
    name = "cpu"
    if device.type == "cuda":
        gpu = torch.cuda.get_device_name(device).lower()
        name = next((preset for key, preset in _CUDA_NAMES if key in gpu), "h100")
        dtype = "bf16" if bf16 else "tf32"
    spec = resolve_device(name)
    peak = spec.peak_flops(dtype) or spec.peak_fp32_flops
    return peak, name


class Tracer:
    """Collects spans of one rank. ``enabled=False`` makes every call a no-op."""

    def __init__(self, rank: int, origin_s: float, enabled: bool) -> None:
        self.rank, self.origin_s, self.enabled = rank, origin_s, enabled
        self.events: list[dict[str, Any]] = []
        self.step = 0
        # perf_counter is precise but has an arbitrary zero: map it to wall-clock time once.
        self._perf_to_wall = time.time() - time.perf_counter()

    def record(self, name: str, tid: str, start_s: float, end_s: float) -> None:
        """A span measured with ``time.perf_counter()``."""
        if not self.enabled:
            return
        ts_us = (start_s + self._perf_to_wall - self.origin_s) * 1e6
        self.events.append({"name": name, "ph": "X", "ts": round(ts_us, 3), "dur": round((end_s - start_s) * 1e6, 3),
                            "pid": self.rank, "tid": tid, "args": {"step": self.step}})

    def span(self, name: str, tid: str = "compute") -> _Span:
        return _Span(self, name, tid)


class _Span:
    def __init__(self, tracer: Tracer, name: str, tid: str) -> None:
        self.tracer, self.name, self.tid = tracer, name, tid

    def __enter__(self) -> None:
        self.start_s = time.perf_counter()

    def __exit__(self, *exc: object) -> None:
        self.tracer.record(self.name, self.tid, self.start_s, time.perf_counter())


def write_chrome_trace(path: str | Path, events_by_rank: list[list[dict[str, Any]]], metadata: dict[str, Any]) -> None:
    events: list[dict[str, Any]] = []
    for rank, evs in enumerate(events_by_rank):
        events.append({"name": "process_name", "ph": "M", "pid": rank, "args": {"name": f"rank {rank}"}})
        for tid in ("compute", "comm"):
            events.append({"name": "thread_name", "ph": "M", "pid": rank, "tid": tid, "args": {"name": tid}})
        events.extend(evs)
    Path(path).write_text(json.dumps({"traceEvents": events, "displayTimeUnit": "ms", "metadata": metadata}))


class MetricsWriter:
    """One JSON object per line and step. A path containing ``{rank}`` gets one file per rank."""

    def __init__(self, path: str | None, rank: int) -> None:
        self._file = None
        if path is not None and ("{rank}" in path or rank == 0):
            self._file = open(path.replace("{rank}", str(rank)), "w", encoding="utf-8")  # noqa: SIM115

    def write(self, row: dict[str, Any]) -> None:
        if self._file is not None:
            self._file.write(json.dumps(row) + "\n")
            self._file.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()

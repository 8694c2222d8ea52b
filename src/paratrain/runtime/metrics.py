"""Measurements of a real run: per-step metrics (JSON lines), MFU, and a Chrome trace.

Trace format: the simulator's own (:class:`paratrain.sim.engine.TraceEvent` written by
:func:`paratrain.sim.trace.chrome_trace`): ``pid`` = global rank, thread 0 = compute, thread 1 =
communication, events named like the schedule IR's actions — ``F{mb}@c0`` / ``B{mb}@c0`` forward
and backward of micro-batch ``mb`` on chunk 0 (the whole model without a pipeline), ``R@c0`` one
data-parallel gradient bucket's all-reduce (from launch to completion as this rank sees it),
``U`` the optimizer step, ``X:clip`` gradient clipping. Times are wall-clock offsets from an origin
rank 0 broadcasts at start-up, so ranks line up; several steps follow one another in one file.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import torch

from paratrain.spec.model import Arch, ModelSpec
from paratrain.trace import TraceEvent, chrome_trace

__all__ = ["Tracer", "model_flops_per_token", "peak_flops_per_device", "MetricsWriter"]


def model_flops_per_token(spec: ModelSpec) -> float:
    """Training FLOPs per token: ``6N + 12·l·h·s`` (PaLM, Chowdhery et al. 2022, appendix B).

    ``N`` excludes the embedding tables (lookups do no matmul) but counts the output projection,
    which is a matmul even when tied. The attention term is PaLM's, without a causal discount.
    """
    n = spec.param_count() - spec.vocab * spec.hidden - spec.num_positions * spec.hidden
    if spec.arch is Arch.BERT:
        n -= 2 * spec.hidden  # token-type table
    if spec.tied_embeddings:
        n += spec.vocab * spec.hidden  # the tied output projection is a matmul over the shared table
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


_CATEGORY = {"F": "forward", "B": "backward", "I": "input", "W": "weight", "R": "reduce", "U": "optimizer"}


class Tracer:
    """Collects the spans of one rank. ``enabled=False`` makes every call a no-op."""

    def __init__(self, rank: int, origin_s: float, enabled: bool) -> None:
        self.rank, self.origin_s, self.enabled = rank, origin_s, enabled
        self.events: list[TraceEvent] = []
        self.step = 0
        # perf_counter is precise but has an arbitrary zero: map it to wall-clock time once.
        self._perf_to_wall = time.time() - time.perf_counter()

    def record(self, name: str, stream: str, start_s: float, end_s: float, microbatch: int | None = None) -> None:
        """A span measured with ``time.perf_counter()``; ``stream`` is "compute" or "comm"."""
        if not self.enabled:
            return
        category = "filler" if name.startswith("X:") else _CATEGORY.get(name[:1], "filler")
        self.events.append(TraceEvent(self.rank, stream, name, start_s + self._perf_to_wall - self.origin_s,
                                      end_s - start_s, category, microbatch))

    def span(self, name: str, stream: str = "compute", microbatch: int | None = None) -> _Span:
        return _Span(self, name, stream, microbatch)


class _Span:
    def __init__(self, tracer: Tracer, name: str, stream: str, microbatch: int | None) -> None:
        self.tracer, self.name, self.stream, self.microbatch = tracer, name, stream, microbatch

    def __enter__(self) -> None:
        self.start_s = time.perf_counter()

    def __exit__(self, *exc: object) -> None:
        self.tracer.record(self.name, self.stream, self.start_s, time.perf_counter(), self.microbatch)


def write_chrome_trace(path: str | Path, events_by_rank: list[list[TraceEvent]], title: str) -> None:
    """All ranks' events in one Chrome trace (the simulator's writer)."""
    doc = chrome_trace([e for evs in events_by_rank for e in evs], title=title)
    Path(path).write_text(json.dumps(doc))


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

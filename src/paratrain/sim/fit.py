"""Fit the simulator's device to measured pipeline runs (``paratrain calibrate --from-trace``).

Two figures come out of a measured trace (``paratrain train --trace``):

* ``duration_cv`` — how much repeated actions' durations vary
  (:func:`paratrain.trace.run_variation`): the input of :mod:`paratrain.sim.variability`.
* ``speed_factor`` — the run's compute time (every compute span: forwards, backwards, optimizer
  steps with their ``U.*`` parts; per step, summed over pipeline ranks) over what the cost model
  predicts for the same model and layout on the calibrated device (the simulator's busy time at
  mean durations). :func:`scaled_device` makes the cost model's compute take that factor longer
  by lowering the GEMM efficiency (the fraction of peak a GEMM sustains) and the sustained memory
  bandwidth, and raising the per-kernel overheads; the peak FLOP/s stay as ``paratrain
  calibrate`` measured them, so MFU keeps its meaning. Communication is left as calibrated.

Both describe this machine and runtime under pipeline load, which a loop of identical kernels
misses: measured on a shared 2-core machine, pipeline runs varied 0.06–0.21 against the loop's
0.03–0.18 (mostly below 0.10), and the calibration alone predicted their compute 6–23 % slow.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from paratrain.errors import ConfigError
from paratrain.spec.device import DeviceSpec
from paratrain.trace import COMPUTE_CATEGORIES, read_trace, run_variation, trace_origin

__all__ = ["TraceFit", "fit_trace", "scaled_device", "pooled_speed_factor"]

_PEAKS = ("peak_fp32_flops", "peak_bf16_flops", "peak_tf32_flops", "peak_fp16_flops", "peak_fp8_flops",
          "peak_int8_flops")
_OVERHEADS = ("kernel_overhead_s", "host_issue_s")


@dataclass(frozen=True)
class TraceFit:
    path: str
    duration_cv: float
    measured_busy_s: float  # per step, summed over pipeline ranks
    simulated_busy_s: float  # the same from the cost model at mean durations

    @property
    def speed_factor(self) -> float:
        return self.measured_busy_s / self.simulated_busy_s


def fit_trace(path: str | Path, device: DeviceSpec, field: str = "--from-trace") -> TraceFit:
    """Variation and compute time of one measured trace against ``device`` (cluster ``cpu``).

    Any layout is accepted, ``pp = 1`` included. The trace may hold the spans of one replica of
    the pipeline (``paratrain train --pp N`` writes those of data/tensor-parallel rank 0) or of
    every rank; the measured compute is the mean over the replicas it holds, so it compares with
    the simulator's busy time summed over the ``pp`` pipeline ranks. Steps come from the spans'
    ``args.step`` (the first, warm-up step is left out) or, without them, from the metadata's
    ``steps``."""
    from paratrain.parallel.config import ParallelConfig
    from paratrain.sim.report import simulate_config
    from paratrain.spec.cluster import resolve_cluster
    from paratrain.spec.model import from_document

    events, meta = read_trace(path, field)
    if trace_origin(meta) == "predicted":  # fitting the model to its own output would teach it nothing
        raise ConfigError(field, f"{path} is a simulated trace ({meta['source']}), not a measured run",
                          "give a trace written by paratrain train --trace")
    if not isinstance(meta.get("model_spec"), dict) or not isinstance(meta.get("parallel"), dict):
        raise ConfigError(field, f"{path} does not say which model and layout it measured (no model_spec/parallel "
                          "in its metadata)", "record it again with paratrain train --trace")
    spec = from_document(meta["model_spec"], field)
    cfg = ParallelConfig.from_dict(meta["parallel"], field)
    iterations = _meta_count(meta, "iterations", path, field)
    is_async = iterations > 1
    cv = run_variation(events, is_async)
    if cv is None:
        raise ConfigError(field, f"{path} has no action repeated three times on a rank",
                          "give the trace of a run with several micro-batches or steps")
    steps = sorted({e.step for e in events if e.step is not None})
    if not is_async and len(steps) > 1:  # the first step warms up
        events = [e for e in events if e.step != steps[0]]
        steps = steps[1:]
    n_steps = _meta_count(meta, "steps", path, field) if is_async or not steps else len(steps)
    ranks = {e.rank for e in events if e.stream == "compute"}
    replicas = max(1.0, len(ranks) / cfg.pp)
    compute = sum(e.duration_s for e in events if e.stream == "compute" and e.category in COMPUTE_CATEGORIES)
    measured = compute / n_steps / replicas
    cluster = dataclasses.replace(resolve_cluster("cpu", "--cluster", gpus=cfg.world_size), device=device)
    sim = simulate_config(spec, cluster, cfg, optimizer="torch", duration_cv=0.0)
    return TraceFit(str(path), cv, measured, sum(sim.busy_s_by_rank))


def _meta_count(meta: dict[str, Any], key: str, path: str | Path, field: str) -> int:
    """A positive integer of the trace's metadata (1 when absent)."""
    v = meta.get(key, 1)
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not float(v).is_integer() or v < 1:
        raise ConfigError(field, f"{path}: metadata {key!r} = {v!r} is not a positive integer",
                          "record the trace again with paratrain train --trace")
    return int(v)


def pooled_speed_factor(fits: list[TraceFit]) -> float:
    """All traces' measured compute over all their simulated compute."""
    return sum(f.measured_busy_s for f in fits) / sum(f.simulated_busy_s for f in fits)


def scaled_device(device: DeviceSpec, speed_factor: float, duration_cv: float | None = None) -> DeviceSpec:
    """``device`` whose compute takes ``speed_factor`` times as long in the cost model.

    Each operator's time is a roofline, max(FLOPs / (peak · GEMM efficiency), bytes / bandwidth-
    term) plus per-kernel overheads (:func:`paratrain.cost.compute.op_time_split`; the optimizer
    step is bytes / bandwidth), so dividing the GEMM efficiency and the memory bandwidth by the
    factor and multiplying the overheads by it scales every GEMM, memory-bound kernel and optimizer
    step exactly, while the peak FLOP/s, the MFU denominator, stay as measured. Only a run faster
    than the efficiency allows (``speed_factor`` below ``gemm_efficiency``) raises the peaks, by
    the part of the factor that an efficiency of 1 cannot absorb. An element-wise term bound by its
    FLOPs rather than its bytes is timed at the fp32 peak and not scaled: in the presets only the
    backward of the Llama models' residual adds, which the cost model gives FLOPs and no bytes."""
    if not speed_factor > 0:
        raise ConfigError("speed_factor", f"must be positive, got {speed_factor}", "fit it from a measured trace")
    eff = device.gemm_efficiency / speed_factor
    changes: dict[str, float] = {"gemm_efficiency": min(1.0, eff),
                                 "memory_bandwidth_Bps": device.memory_bandwidth_Bps / speed_factor}
    # Fused attention runs at attention_efficiency × peak: scaled like the GEMMs (divided by eff
    # again when the peaks absorb the excess).
    changes["attention_efficiency"] = min(1.0, device.attention_efficiency / speed_factor / max(1.0, eff))
    if eff > 1.0:
        changes.update({f: getattr(device, f) * eff for f in _PEAKS})
    changes.update({f: getattr(device, f) * speed_factor for f in _OVERHEADS})
    if duration_cv is not None:
        changes["duration_cv"] = duration_cv
    return dataclasses.replace(device, **changes)

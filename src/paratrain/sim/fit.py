"""Fit the simulator's device to measured pipeline runs (``paratrain calibrate --from-trace``).

Two figures come out of a measured trace (``paratrain train --trace``):

* ``duration_cv`` — how much repeated actions' durations vary
  (:func:`paratrain.cli.compare.run_variation`): the input of :mod:`paratrain.sim.variability`.
* ``speed_factor`` — the run's compute time (every compute span: forwards, backwards, optimizer
  steps with their ``U.*`` parts; per step, summed over pipeline ranks) over what the cost model
  predicts for the same model and layout on the calibrated device (the simulator's busy time at
  mean durations). :func:`scaled_device` divides every compute rate by it, so the cost model's
  compute takes that factor longer; communication is left as calibrated.

Both describe this machine and runtime under pipeline load, which a loop of identical kernels
misses: measured on a shared 2-core machine, pipeline runs varied 0.06–0.21 against the loop's
0.03–0.18 (mostly below 0.10), and the calibration alone predicted their compute 6–23 % slow.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

from paratrain.errors import ConfigError
from paratrain.spec.device import DeviceSpec

__all__ = ["TraceFit", "fit_trace", "scaled_device", "pooled_speed_factor"]

_RATES = ("peak_fp32_flops", "peak_bf16_flops", "peak_tf32_flops", "peak_fp16_flops", "peak_fp8_flops",
          "peak_int8_flops", "memory_bandwidth_Bps")
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
    """Variation and compute time of one measured trace against ``device`` (cluster ``cpu``)."""
    from paratrain.cli.compare import load_trace, run_variation
    from paratrain.parallel.config import ParallelConfig
    from paratrain.sim.report import simulate_config
    from paratrain.spec.cluster import resolve_cluster
    from paratrain.spec.model import from_document

    spans, meta = load_trace(str(path), field)
    if not isinstance(meta.get("model_spec"), dict) or not isinstance(meta.get("parallel"), dict):
        raise ConfigError(field, f"{path} does not say which model and layout it measured (no model_spec/parallel "
                          "in its metadata)", "record it again with paratrain train --trace")
    spec = from_document(meta["model_spec"], field)
    cfg = ParallelConfig.from_dict(meta["parallel"], field)
    is_async = int(meta.get("iterations", 1)) > 1
    cv = run_variation(spans, is_async)
    if cv is None:
        raise ConfigError(field, f"{path} has no action repeated three times on a rank",
                          "give the trace of a run with several micro-batches or steps")
    steps = sorted({s.step for s in spans if s.step is not None})
    if not is_async and len(steps) > 1:  # the first step warms up
        spans = [s for s in spans if s.step != steps[0]]
        steps = steps[1:]
    n_steps = int(meta.get("steps", 1)) if is_async else max(1, len(steps))
    compute = ("forward", "backward", "input", "weight", "optimizer", "filler")
    measured = sum(s.duration_s for s in spans if s.stream == "compute" and s.category in compute) / n_steps
    cluster = dataclasses.replace(resolve_cluster("cpu", "--cluster", gpus=cfg.world_size), device=device)
    sim = simulate_config(spec, cluster, cfg, optimizer="torch", duration_cv=0.0)
    return TraceFit(str(path), cv, measured, sum(sim.busy_s_by_rank))


def pooled_speed_factor(fits: list[TraceFit]) -> float:
    """All traces' measured compute over all their simulated compute."""
    return sum(f.measured_busy_s for f in fits) / sum(f.simulated_busy_s for f in fits)


def scaled_device(device: DeviceSpec, speed_factor: float, duration_cv: float | None = None) -> DeviceSpec:
    """``device`` whose compute takes ``speed_factor`` times as long in the cost model: every peak
    rate and the memory bandwidth divided by it, per-kernel overheads multiplied (each operator's
    time is a roofline of rates plus overheads, so it scales exactly)."""
    if not speed_factor > 0:
        raise ConfigError("speed_factor", f"must be positive, got {speed_factor}", "fit it from a measured trace")
    changes: dict[str, float] = {f: getattr(device, f) / speed_factor for f in _RATES}
    changes.update({f: getattr(device, f) * speed_factor for f in _OVERHEADS})
    if duration_cv is not None:
        changes["duration_cv"] = duration_cv
    return dataclasses.replace(device, **changes)

"""Throughput of one iteration: samples/s, tokens/s, TFLOP/s per GPU, MFU and HFU.

The one place these are computed: the planner's closed forms and the simulator's report both
call :func:`throughput`. MFU follows PaLM (Chowdhery et al. 2022, appendix B): model matmul
FLOPs per iteration (:func:`paratrain.cost.flops.model_flops_per_iteration`, no
recomputation) / (iteration time × GPUs × the device's peak dense FLOP/s for the training
dtype); HFU puts the recomputed matmuls in the numerator too.
"""

from __future__ import annotations

from dataclasses import dataclass

from paratrain.parallel.config import ParallelConfig
from paratrain.spec.device import DeviceSpec
from paratrain.spec.model import ModelSpec

__all__ = ["Throughput", "throughput"]


@dataclass(frozen=True)
class Throughput:
    """Rates of one iteration of ``iteration_time_s`` seconds."""

    samples_per_s: float
    tokens_per_s: float
    tflops_per_gpu: float  # model FLOPs (no recomputation) per second per GPU, in 10^12
    mfu: float
    hfu: float | None = None  # only when the recomputed FLOPs were given


def throughput(
    model: ModelSpec,
    device: DeviceSpec,
    config: ParallelConfig,
    iteration_time_s: float,
    model_flops: float,
    hardware_flops: float | None = None,
) -> Throughput:
    """Rates of ``config`` (all its GPUs, global batch ``config.global_batch``, 1 if unset) when
    one iteration takes ``iteration_time_s`` and does ``model_flops`` useful matmul FLOPs
    (``hardware_flops`` with the recomputed ones, for HFU)."""
    gb = config.global_batch or 1
    world = config.world_size
    peak = device.peak_flops(config.dtype)
    t = iteration_time_s
    return Throughput(
        samples_per_s=gb / t,
        tokens_per_s=gb * model.seq / t,
        tflops_per_gpu=model_flops / (t * world) / 1e12,
        mfu=model_flops / (t * world * peak),
        hfu=None if hardware_flops is None else hardware_flops / (t * world * peak),
    )

"""Throughputs of transformer job types predicted by paratrain's own cost model, so a trace can mix
Gavel's measured jobs with jobs nobody has run yet (say a GPT-3 350M on A100s next to ResNets on
K80s).

A job type ``"<model preset> (batch size B)"`` at scale factor ``sf`` is data-parallel training of
that model with global batch B over ``sf`` GPUs of one type (micro-batch ``min(B/sf, 4)``, in the
fastest dtype the device has: bf16, else fp16, else fp32); its throughput is 1 / the simulated
iteration time, in steps (iterations) per second, the unit of Gavel's table. GPUs of a type share
the node-local interconnect of the ``dgx-a100`` preset (NVLink); memory limits are not checked.
"""

from __future__ import annotations

from paratrain.cluster.throughputs import ThroughputTable
from paratrain.errors import ConfigError

__all__ = ["predicted_table", "parse_predict", "predicted_job_type"]


def predicted_job_type(model: str, batch: int) -> str:
    return f"{model} (batch size {batch})"


def parse_predict(text: str, field: str = "--predict") -> list[tuple[str, int]]:
    """``"gpt3-350m:32,gpt2-small:16"`` → [(model preset, global batch), …]."""
    out = []
    for part in text.split(","):
        model, colon, batch = part.strip().partition(":")
        try:
            b = int(batch)
        except ValueError:
            b = 0
        if not colon or not model or b < 1:
            raise ConfigError(field, f"cannot read {part.strip()!r}", "write MODEL:GLOBAL_BATCH, e.g. gpt3-350m:32")
        out.append((model, b))
    return out


def _dtype(device: object) -> str:
    if getattr(device, "peak_bf16_flops", 0) > 0:
        return "bf16"
    if getattr(device, "peak_fp16_flops", 0) > 0:
        return "fp16"
    return "fp32"


def predicted_table(jobs: list[tuple[str, int]], devices: dict[str, str],
                    scale_factors: tuple[int, ...] = (1, 2, 4, 8), field: str = "--predict") -> ThroughputTable:
    """Predicted steps/s of each (model, global batch) at each scale factor on each accelerator type
    (``devices``: type name → device preset)."""
    from paratrain.parallel.config import ParallelConfig
    from paratrain.sim.report import simulate_config
    from paratrain.spec.cluster import resolve_cluster
    from paratrain.spec.device import resolve_device
    from paratrain.spec.model import resolve_model

    table = ThroughputTable()
    for model_name, batch in jobs:
        try:
            model = resolve_model(model_name, field)
        except ConfigError as e:
            raise ConfigError(field, e.problem, e.fix) from None
        for sf in scale_factors:
            if batch % sf:
                continue
            key = (predicted_job_type(model_name, batch), sf)
            for wtype, dev_name in devices.items():
                try:
                    device = resolve_device(dev_name, "--accelerators")
                except ConfigError:
                    raise ConfigError("--accelerators", f"type {wtype!r} has no device preset {dev_name!r} to "
                                      "predict with", f"name one: {wtype}=N@a100") from None
                cluster = resolve_cluster("dgx-a100", gpus=sf, device=dev_name)
                cfg = ParallelConfig(dp=sf, microbatch=min(batch // sf, 4), global_batch=batch,
                                     dtype=_dtype(device))
                res = simulate_config(model, cluster, cfg)
                table.isolated.setdefault(key, {})[wtype] = 1.0 / res.iteration_time_s
    return table

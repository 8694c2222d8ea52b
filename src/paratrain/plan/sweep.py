"""Scaling sweeps: plan at each value of one variable (GPU count, global batch, sequence length)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from paratrain.errors import ConfigError
from paratrain.plan.search import PlanResult
from paratrain.spec.cluster import ClusterSpec
from paratrain.spec.model import ModelSpec

__all__ = ["SweepPoint", "parse_sweep", "sweep", "SWEEP_VARIABLES"]

SWEEP_VARIABLES = ("gpus", "batch", "seq")


@dataclass(frozen=True)
class SweepPoint:
    variable: str
    value: int
    result: PlanResult | None  # None when nothing fits
    error: ConfigError | None = None  # why nothing fits


def parse_sweep(text: str) -> tuple[str, list[int]]:
    """``gpus=64,128,256`` → ("gpus", [64, 128, 256])."""
    if "=" not in text:
        raise ConfigError("sweep", f"{text!r} is not VARIABLE=V1,V2,...", "e.g. gpus=64,128,256")
    var, _, vals = text.partition("=")
    var = var.strip().lower()
    if var not in SWEEP_VARIABLES:
        raise ConfigError("sweep", f"cannot sweep {var!r}", f"sweep one of: {', '.join(SWEEP_VARIABLES)}")
    try:
        values = [int(v) for v in vals.split(",") if v.strip()]
    except ValueError:
        raise ConfigError("sweep", f"{vals!r} is not a list of integers", "e.g. gpus=64,128,256") from None
    if not values or any(v <= 0 for v in values):
        raise ConfigError("sweep", f"{vals!r} must list positive integers", "e.g. gpus=64,128,256")
    return var, values


def sweep(
    model: ModelSpec,
    cluster: ClusterSpec,
    global_batch: int,
    variable: str,
    values: list[int],
    planner: Callable[..., PlanResult],
    **kwargs: object,
) -> list[SweepPoint]:
    """Run ``planner(model, cluster, global_batch, **kwargs)`` at each value; a value where no
    configuration fits is recorded with its reason instead of ending the sweep."""
    out = []
    for v in values:
        m, c, b = model, cluster, global_batch
        try:
            if variable == "gpus":
                c = cluster.resized(gpus=v)
            elif variable == "batch":
                b = v
            else:
                m = model.with_overrides(seq=v)
            out.append(SweepPoint(variable, v, planner(m, c, b, **kwargs)))
        except ConfigError as e:
            out.append(SweepPoint(variable, v, None, e))
    return out

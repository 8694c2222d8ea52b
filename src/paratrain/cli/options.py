"""Options shared by every command that takes a model, a cluster or a parallel layout, and the
functions that turn them into specs. Every command spells these flags the same way."""

from __future__ import annotations

import json
import sys
from typing import Annotated, Any

import typer

from paratrain.parallel.config import ParallelConfig
from paratrain.spec.cluster import ClusterSpec, resolve_cluster
from paratrain.spec.device import DeviceSpec, resolve_device
from paratrain.spec.model import ModelSpec, resolve_model

__all__ = [
    "ModelOpt",
    "LayersOpt",
    "HiddenOpt",
    "HeadsOpt",
    "KvHeadsOpt",
    "FfnOpt",
    "SeqOpt",
    "VocabOpt",
    "ClusterOpt",
    "DeviceOpt",
    "NodesOpt",
    "GpusOpt",
    "JsonOpt",
    "resolve_model_opts",
    "resolve_cluster_opts",
    "print_json",
]

_M = "Model"
_C = "Cluster"

ModelOpt = Annotated[
    str,
    typer.Option("--model", "-m", help="Model preset name or JSON/YAML/TOML/HF config.json file.", rich_help_panel=_M),
]
LayersOpt = Annotated[int | None, typer.Option("--layers", help="Override: transformer layers.", rich_help_panel=_M)]
HiddenOpt = Annotated[int | None, typer.Option("--hidden", help="Override: hidden size.", rich_help_panel=_M)]
HeadsOpt = Annotated[int | None, typer.Option("--heads", help="Override: attention heads.", rich_help_panel=_M)]
KvHeadsOpt = Annotated[
    int | None, typer.Option("--kv-heads", help="Override: key/value heads (GQA).", rich_help_panel=_M)
]
FfnOpt = Annotated[int | None, typer.Option("--ffn", help="Override: FFN size.", rich_help_panel=_M)]
SeqOpt = Annotated[int | None, typer.Option("--seq", help="Override: sequence length.", rich_help_panel=_M)]
VocabOpt = Annotated[int | None, typer.Option("--vocab", help="Override: vocabulary size.", rich_help_panel=_M)]

ClusterOpt = Annotated[str, typer.Option("--cluster", "-c", help="Cluster preset or file.", rich_help_panel=_C)]
DeviceOpt = Annotated[
    str | None,
    typer.Option("--device", "-d", help="Device preset or file (overrides the cluster's).", rich_help_panel=_C),
]
NodesOpt = Annotated[
    int | None, typer.Option("--nodes", help="Size the cluster to this many nodes.", rich_help_panel=_C)
]
GpusOpt = Annotated[
    int | None, typer.Option("--gpus", help="Size the cluster to this many devices.", rich_help_panel=_C)
]

CalibrationOpt = Annotated[
    str | None,
    typer.Option(
        "--calibration",
        help="Apply fitted efficiencies to the cluster: vtrain-a100 (fitted on measured Megatron-DeepSpeed runs).",
        rich_help_panel=_C,
    ),
]

JsonOpt = Annotated[bool, typer.Option("--json", help="Print one JSON object instead of tables.")]


def resolve_model_opts(
    model: str,
    layers: int | None = None,
    hidden: int | None = None,
    heads: int | None = None,
    kv_heads: int | None = None,
    ffn: int | None = None,
    seq: int | None = None,
    vocab: int | None = None,
) -> ModelSpec:
    return resolve_model(
        model, "--model", layers=layers, hidden=hidden, heads=heads, kv_heads=kv_heads, ffn=ffn, seq=seq, vocab=vocab
    )


def resolve_cluster_opts(
    cluster: str, device: str | None = None, nodes: int | None = None, gpus: int | None = None
) -> ClusterSpec:
    return resolve_cluster(cluster, "--cluster", nodes=nodes, gpus=gpus, device=device)


def apply_calibration(cluster: ClusterSpec, name: str | None) -> ClusterSpec:
    """``cluster`` with a named calibration's device efficiencies and link figures (``None``: as is)."""
    if name is None:
        return cluster
    from paratrain.errors import ConfigError
    from paratrain.plan.calibrated import CALIBRATIONS
    from paratrain.plan.validate import with_calibration

    if name not in CALIBRATIONS:
        raise ConfigError("--calibration", f"unknown calibration {name!r}", f"use one of: {', '.join(CALIBRATIONS)}")
    return with_calibration(cluster, CALIBRATIONS[name])


def resolve_device_opt(device: str) -> DeviceSpec:
    return resolve_device(device, "--device")


def parallel_from_opts(base: ParallelConfig | None = None, **kw: Any) -> ParallelConfig:
    """A ParallelConfig from CLI flags (``None`` = not given), on top of ``base`` if any."""
    given = {k: v for k, v in kw.items() if v is not None}
    if base is not None:
        return base.with_overrides(**given)
    if str(given.get("schedule", "")).lower() == "interleaved":
        given.setdefault("virtual_stages", 2)  # interleaving needs at least two chunks per rank
    return ParallelConfig(**given)


def print_json(obj: Any) -> None:
    json.dump(obj, sys.stdout, indent=2, default=_default)
    sys.stdout.write("\n")


def _default(o: Any) -> Any:
    if hasattr(o, "to_dict"):
        return o.to_dict()
    if hasattr(o, "value"):
        return o.value
    if isinstance(o, (set, frozenset, tuple)):
        return list(o)
    raise TypeError(f"not JSON-serializable: {type(o).__name__}")

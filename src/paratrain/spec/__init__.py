"""Specifications: what is trained (:class:`ModelSpec`) and on what (:class:`DeviceSpec`,
:class:`ClusterSpec`). Frozen dataclasses, validated on construction."""

from paratrain.spec.cluster import ClusterSpec, LinkSpec, Topology, TopologyKind, resolve_cluster
from paratrain.spec.device import DeviceSpec, resolve_device
from paratrain.spec.model import Activation, Arch, ModelSpec, Norm, Position, resolve_model

__all__ = [
    "Activation",
    "Arch",
    "ClusterSpec",
    "DeviceSpec",
    "LinkSpec",
    "ModelSpec",
    "Norm",
    "Position",
    "Topology",
    "TopologyKind",
    "resolve_cluster",
    "resolve_device",
    "resolve_model",
]

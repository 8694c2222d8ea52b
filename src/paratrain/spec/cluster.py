"""Cluster specification: nodes of identical devices, the links between them, and the topology.

Ranks are numbered node-major: rank ``r`` lives on node ``r // devices_per_node``. Which links a
communication group crosses therefore follows from the ranks in the group (see
:meth:`ClusterSpec.nodes_spanned`) and from the topology's kind.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Any

from paratrain.errors import ConfigError, require_at_most, require_bool, require_positive, require_positive_int
from paratrain.spec.device import DeviceSpec, resolve_device

__all__ = ["ClusterSpec", "LinkSpec", "Topology", "TopologyKind", "resolve_cluster", "MAX_DEVICES"]

# A million devices: ten times the largest published training clusters (~10^5 GPUs). Past it a
# typo (``--gpus 1e9``) would make the planner and the simulator run for hours.
MAX_DEVICES = 2**20


class TopologyKind(str, Enum):
    SINGLE_SWITCH = "single-switch"  # every node one hop from every other, full bisection
    FAT_TREE = "fat-tree"  # leaf switches of `nodes_per_leaf` nodes, uplinks oversubscribed
    TORUS_2D = "torus-2d"  # nodes on a 2-D wrap-around grid (`dims`)
    TORUS_3D = "torus-3d"  # nodes on a 3-D wrap-around grid (`dims`)
    HAMMINGMESH = "hammingmesh"  # boards (`board` = a×b devices, 2-D mesh) joined by row/column switches
    DRAGONFLY = "dragonfly"  # groups of `nodes_per_leaf` nodes, all-to-all global links

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True)
class LinkSpec:
    """A link's one-direction bandwidth and its per-message latency (the alpha of alpha–beta)."""

    bandwidth_Bps: float
    latency_s: float

    def __post_init__(self) -> None:
        require_positive("bandwidth_Bps", self.bandwidth_Bps)
        require_positive("latency_s", self.latency_s, allow_zero=True)


@dataclass(frozen=True)
class Topology:
    kind: TopologyKind = TopologyKind.SINGLE_SWITCH
    oversubscription: float = 1.0  # fat tree / dragonfly: downlink:uplink bandwidth ratio (≥ 1)
    nodes_per_leaf: int = 16  # fat tree: nodes under one leaf switch; dragonfly: nodes per group
    dims: tuple[int, ...] = ()  # torus: nodes per dimension; hammingmesh: boards per row/column
    board: tuple[int, ...] = ()  # hammingmesh: devices per board along each dimension
    in_network_reduction: bool = False  # switches can reduce (NVIDIA SHARP, a PsPIN switch)

    def __post_init__(self) -> None:
        try:
            object.__setattr__(self, "kind", TopologyKind(str(self.kind).lower()))
        except ValueError:
            choices = ", ".join(k.value for k in TopologyKind)
            raise ConfigError("topology.kind", f"unknown topology {self.kind!r}", f"use one of: {choices}") from None
        require_positive("topology.oversubscription", self.oversubscription)
        if self.oversubscription < 1:
            raise ConfigError(
                "topology.oversubscription",
                f"must be at least 1, got {self.oversubscription}",
                "use 1 for full bisection",
            )
        require_positive_int("topology.nodes_per_leaf", self.nodes_per_leaf)
        require_bool("topology.in_network_reduction", self.in_network_reduction)
        for f in ("dims", "board"):
            v = getattr(self, f)
            if not isinstance(v, (list, tuple)):
                raise ConfigError(f"topology.{f}", f"must be a list of sizes, got {v!r}", f"give {f} as [a, b, ...]")
            object.__setattr__(self, f, tuple(v))
        for i, d in enumerate(self.dims):
            require_positive_int(f"topology.dims[{i}]", d)
            require_at_most(f"topology.dims[{i}]", d, MAX_DEVICES, "nodes")
        for i, d in enumerate(self.board):
            require_positive_int(f"topology.board[{i}]", d)
        want = {TopologyKind.TORUS_2D: 2, TopologyKind.TORUS_3D: 3}.get(self.kind)
        if want is not None and self.dims and len(self.dims) != want:
            raise ConfigError(
                "topology.dims", f"{self.kind} needs {want} dimensions, got {len(self.dims)}", f"give {want} sizes"
            )
        if self.kind is TopologyKind.HAMMINGMESH and self.board and len(self.board) != 2:
            raise ConfigError("topology.board", "a HammingMesh board is 2-D", "give board as [a, b]")


@dataclass(frozen=True)
class ClusterSpec:
    """``nodes`` × ``devices_per_node`` identical devices.

    ``intra_link`` joins devices inside a node (NVLink/NVSwitch: every pair, full bandwidth);
    ``inter_link`` is each device's own network interface (one NIC per device, as in DGX nodes).
    """

    name: str
    device: DeviceSpec
    nodes: int
    devices_per_node: int
    intra_link: LinkSpec
    inter_link: LinkSpec
    topology: Topology = field(default_factory=Topology)
    # Collectives timed as the tensor-parallel runtime issues them, each right after compute on
    # every group at once (``paratrain calibrate``): (kind, group size, bytes, seconds). The
    # tensor-parallel cost reads it where it holds the kind and group size
    # (paratrain.cost.tensor_parallel); empty: the alpha-beta model of the links.
    measured_collectives: tuple[tuple[str, int, int, float], ...] = ()
    # What runs tensor parallelism here, and so which collectives it issues: "megatron" (fused
    # layers, the published GPU runs) or "dtensor" (paratrain's runtime: one DTensor style per Linear).
    tensor_parallel: str = "megatron"
    # CPU hosts: the cores a node's processes share, each process running ``threads_per_process``
    # threads; the simulator then runs compute under processor sharing (paratrain.sim.sharing)
    # and the device's rates are those of one process alone on a core. 0: every device has its
    # own processor (GPUs).
    cores_per_node: int = 0
    threads_per_process: int = 1
    # CPU seconds a tensor-parallel collective costs each process of its group, as ``paratrain
    # calibrate`` measured it (gloo's threads included): (kind, group size, bytes, seconds). Part
    # of a measured collective's time is this work, which competes for the cores; the rest is
    # waiting (paratrain.cost.tensor_parallel). Empty: all of it waiting.
    collective_cpu_s: tuple[tuple[str, int, int, float], ...] = ()
    # Collectives timed alone, no compute around them, every group of that size at once
    # (``paratrain calibrate``: all-reduces of 4 B to 32 MiB): (kind, group size, bytes, seconds).
    # Where it holds the kind and group size, a collective outside a tensor-parallel layer (the
    # data-parallel reduction, the gradient norm) takes its time from these rows
    # (paratrain.cost.collectives.measured_reduction_time); empty: the alpha-beta model.
    measured_reductions: tuple[tuple[str, int, int, float], ...] = ()
    # One-way point-to-point times measured while every other process computes (``paratrain
    # calibrate``'s loaded ping-pong): ("p2p", 2, bytes, seconds). A host whose cores are all busy
    # wakes the receiver late; pipeline transfers on such a node take these times
    # (paratrain.cost.collectives). Empty: the link's alpha-beta.
    measured_p2p: tuple[tuple[str, int, int, float], ...] = ()
    # The node's NVSwitch reduces in the switch (NVLink SHARP: third-generation NVSwitch, DGX/HGX
    # H100 and later), so NCCL runs an all-reduce inside a node as NVLS (paratrain.cost.collectives).
    nvlink_sharp: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.name, str):
            raise ConfigError("name", f"must be a string, got {self.name!r}", "give the cluster a name")
        object.__setattr__(self, "measured_collectives", measured_collective_rows(self.measured_collectives))
        cpu = measured_collective_rows(self.collective_cpu_s, "collective_cpu_s")
        object.__setattr__(self, "collective_cpu_s", cpu)
        object.__setattr__(self, "measured_reductions",
                           measured_collective_rows(self.measured_reductions, "measured_reductions"))
        object.__setattr__(self, "measured_p2p", measured_collective_rows(self.measured_p2p, "measured_p2p"))
        if self.tensor_parallel not in ("megatron", "dtensor"):
            raise ConfigError("tensor_parallel", f"unknown tensor-parallel runtime {self.tensor_parallel!r}",
                              "use megatron or dtensor")
        for f, cls, fix in (
            ("device", DeviceSpec, "give a device preset name or a mapping of device fields"),
            ("intra_link", LinkSpec, "give {bandwidth_Bps: ..., latency_s: ...}"),
            ("inter_link", LinkSpec, "give {bandwidth_Bps: ..., latency_s: ...}"),
            ("topology", Topology, "give a topology kind or a mapping with a 'kind' key"),
        ):
            if not isinstance(getattr(self, f), cls):
                raise ConfigError(f, f"must be a {cls.__name__}, got {getattr(self, f)!r}", fix)
        require_positive_int("nodes", self.nodes)
        require_positive_int("devices_per_node", self.devices_per_node)
        require_bool("nvlink_sharp", self.nvlink_sharp)
        if isinstance(self.cores_per_node, bool) or not isinstance(self.cores_per_node, int) or self.cores_per_node < 0:
            raise ConfigError("cores_per_node", f"must be a whole number ≥ 0, got {self.cores_per_node!r}",
                              "give the cores a node's processes share, or 0 for devices with their own processor")
        require_positive_int("threads_per_process", self.threads_per_process)
        require_at_most("devices_per_node", self.devices_per_node, MAX_DEVICES, "devices")
        if self.nodes * self.devices_per_node > MAX_DEVICES:
            raise ConfigError(
                "nodes",
                f"{self.nodes:,} nodes × {self.devices_per_node} devices = {self.nodes * self.devices_per_node:,}"
                f" devices exceed the limit of {MAX_DEVICES:,}",
                "use fewer nodes (--nodes/--gpus)",
            )
        t = self.topology
        if t.kind in (TopologyKind.TORUS_2D, TopologyKind.TORUS_3D) and t.dims:
            n = 1
            for d in t.dims:
                n *= d
            if n != self.nodes:
                raise ConfigError(
                    "topology.dims",
                    f"torus {'x'.join(map(str, t.dims))} holds {n} nodes, cluster has {self.nodes}",
                    "make the product of dims equal the node count",
                )

    @property
    def trains_with_gloo(self) -> bool:
        """Whether ``paratrain train`` runs this cluster's devices on gloo (the ``cpu`` device) rather
        than NCCL: the backend whose runtime defaults (e.g. receives posted ahead) apply."""
        return self.device.name == "cpu"

    @property
    def num_devices(self) -> int:
        return self.nodes * self.devices_per_node

    def node_of(self, rank: int) -> int:
        return rank // self.devices_per_node

    def nodes_spanned(self, ranks: tuple[int, ...] | list[int]) -> int:
        """How many distinct nodes the given ranks occupy."""
        return len({r // self.devices_per_node for r in ranks})

    def resized(self, *, nodes: int | None = None, gpus: int | None = None) -> ClusterSpec:
        """The same cluster with ``nodes`` nodes, or just enough nodes for ``gpus`` devices.

        ``gpus`` smaller than one node gives a single partial node.
        """
        both = nodes is not None and gpus is not None
        if both and gpus != nodes * self.devices_per_node and not (nodes == 1 and gpus < self.devices_per_node):
            raise ConfigError(
                "--gpus",
                f"{gpus} GPUs do not fill {nodes} nodes of {self.devices_per_node}",
                "give only one of --nodes/--gpus",
            )
        if gpus is not None:
            require_positive_int("--gpus", gpus)
            require_at_most("--gpus", gpus, MAX_DEVICES, "devices")
            if gpus < self.devices_per_node:
                return dataclasses.replace(self, nodes=1, devices_per_node=gpus, topology=_refit(self.topology, 1))
            if gpus % self.devices_per_node:
                raise ConfigError(
                    "--gpus",
                    f"{gpus} GPUs is not a whole number of {self.devices_per_node}-GPU nodes of {self.name}",
                    f"use a multiple of {self.devices_per_node}, or --nodes",
                )
            nodes = gpus // self.devices_per_node
        if nodes is not None:
            require_positive_int("--nodes", nodes)
            require_at_most("--nodes", nodes * self.devices_per_node, MAX_DEVICES, "devices: nodes × devices per node")
            return dataclasses.replace(self, nodes=nodes, topology=_refit(self.topology, nodes))
        return self

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["topology"]["kind"] = self.topology.kind.value
        return d


def measured_collective_rows(rows: Any, field: str = "measured_collectives") -> tuple[tuple[str, int, int, float], ...]:
    """``rows`` as hashable (kind, group size, bytes, seconds) tuples (a JSON file gives lists);
    ``field`` names them in errors."""
    fix = "give [[kind, group size, bytes, seconds], ...], e.g. [[\"all_reduce\", 4, 524288, 0.01]]"
    if not isinstance(rows, (list, tuple)):
        raise ConfigError(field, f"must be a list of rows, got {rows!r}", fix)
    out = []
    for i, row in enumerate(rows):
        if not isinstance(row, (list, tuple)) or len(row) != 4 or not isinstance(row[0], str):
            raise ConfigError(f"{field}[{i}]", f"must be [kind, group size, bytes, seconds], got {row!r}", fix)
        kind, size, nbytes, seconds = row
        require_positive_int(f"{field}[{i}] group size", size)
        require_positive_int(f"{field}[{i}] bytes", nbytes)
        require_positive(f"{field}[{i}] seconds", seconds, allow_zero=True)
        out.append((kind, int(size), int(nbytes), float(seconds)))
    return tuple(out)


def _refit(t: Topology, nodes: int) -> Topology:
    """Resize a torus to ``nodes`` (as square/cubic as the count allows); other kinds are unchanged."""
    if t.kind not in (TopologyKind.TORUS_2D, TopologyKind.TORUS_3D) or not t.dims:
        return t
    ndim = len(t.dims)
    dims = [1] * ndim
    rest = nodes
    for i in range(ndim):
        target = round(rest ** (1 / (ndim - i)))
        d = max(x for x in range(1, rest + 1) if rest % x == 0 and x <= max(1, target))
        dims[i] = d
        rest //= d
    dims[-1] *= rest
    return dataclasses.replace(t, dims=tuple(sorted(dims, reverse=True)))


def from_document(doc: dict[str, Any], field_name: str = "--cluster") -> ClusterSpec:
    if not isinstance(doc, dict):
        raise ConfigError(field_name, f"must be a mapping of cluster fields, got {doc!r}", "give a preset or a mapping")
    doc = dict(doc)
    base: ClusterSpec | None = None
    if "preset" in doc:
        base = resolve_cluster(str(doc.pop("preset")), field_name)
    if "device" in doc:
        from paratrain.spec.device import from_document as device_from_document

        dev = doc["device"]
        if isinstance(dev, str):
            doc["device"] = resolve_device(dev, f"{field_name} device")
        elif isinstance(dev, dict):
            doc["device"] = device_from_document(dev, f"{field_name} device")
    for k in ("intra_link", "inter_link"):
        if k in doc and isinstance(doc[k], dict):
            try:
                doc[k] = LinkSpec(**doc[k])
            except TypeError as e:
                raise ConfigError(f"{field_name} {k}", str(e), "give bandwidth_Bps and latency_s") from None
    if "topology" in doc and isinstance(doc["topology"], str):
        doc["topology"] = {"kind": doc["topology"]}
    if "topology" in doc and isinstance(doc["topology"], dict):
        try:
            doc["topology"] = Topology(**doc["topology"])
        except TypeError as e:
            raise ConfigError(f"{field_name} topology", str(e), "check the topology keys") from None
    from paratrain.spec._files import check_keys

    check_keys(doc, ClusterSpec, field_name, "cluster", expected_kind="a cluster spec", required=base is None)
    try:
        if base is not None:
            return dataclasses.replace(base, **doc)
        return ClusterSpec(**doc)
    except TypeError as e:
        raise ConfigError(field_name, str(e), "check the cluster file's keys") from None


def resolve_cluster(
    name_or_path: str,
    field_name: str = "--cluster",
    *,
    nodes: int | None = None,
    gpus: int | None = None,
    device: str | None = None,
) -> ClusterSpec:
    """A preset (``dgx-a100``, ``dgx-h100``, ``piz-daint``, ``cpu``) or a file, then sizing."""
    from paratrain.spec._files import load_document
    from paratrain.spec.cluster_presets import CLUSTER_PRESETS, cluster_preset

    key = name_or_path.lower()
    if key in CLUSTER_PRESETS:
        spec = cluster_preset(key)
    else:
        p = Path(name_or_path)
        if p.suffix.lower() in (".json", ".yaml", ".yml", ".toml") or p.exists():
            from paratrain.spec._files import loading_preset_file

            with loading_preset_file(p, field_name):
                spec = from_document(load_document(p, field_name), field_name)
        else:
            raise ConfigError(
                field_name,
                f"unknown cluster preset {name_or_path!r}",
                "run `paratrain presets` to list them, or give a file path",
            )
    if device is not None:
        spec = dataclasses.replace(spec, device=resolve_device(device))
    return spec.resized(nodes=nodes, gpus=gpus)

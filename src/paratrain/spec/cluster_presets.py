"""Cluster presets, each number with its public source.

Bandwidths are per direction. Latencies are the per-message software+wire alpha that NCCL-style
collectives see, not the raw link latency.
"""

from __future__ import annotations

import json
from pathlib import Path

from paratrain.errors import ConfigError
from paratrain.spec.cluster import (
    ClusterSpec,
    LinkSpec,
    Topology,
    TopologyKind,
    measured_collective_rows,
)
from paratrain.spec.device import cpu_calibration_path, resolve_device

__all__ = ["CLUSTER_PRESETS", "cluster_preset", "cpu_cluster_calibration_path", "cpu_links"]

GB = 1e9
Gbit = 1e9 / 8


def _dgx_a100() -> ClusterSpec:
    # NVIDIA DGX A100 datasheet: 8× A100 80GB, NVLink 3 at 600 GB/s bidirectional per GPU
    # (300 GB/s each way) through NVSwitch, 8× 200 Gb/s HDR InfiniBand ConnectX-6 for compute
    # (one per GPU). DGX SuperPOD reference architecture: non-blocking fat tree, 20 nodes per
    # scalable unit leaf group (rounded to 16 here), SHARP-capable Quantum switches.
    return ClusterSpec(
        name="dgx-a100",
        device=resolve_device("a100-80gb"),
        nodes=1,
        devices_per_node=8,
        intra_link=LinkSpec(bandwidth_Bps=300 * GB, latency_s=3e-6),
        inter_link=LinkSpec(bandwidth_Bps=200 * Gbit, latency_s=6e-6),
        topology=Topology(kind=TopologyKind.FAT_TREE, oversubscription=1.0, nodes_per_leaf=16),
    )


def _dgx_h100() -> ClusterSpec:
    # NVIDIA DGX H100 datasheet: 8× H100 SXM5, NVLink 4 at 900 GB/s bidirectional per GPU
    # (450 GB/s each way), 8× 400 Gb/s ConnectX-7 (NDR InfiniBand), non-blocking fat tree in the
    # DGX SuperPOD H100 reference architecture (32 nodes per scalable unit, rounded to 16 per leaf).
    # Its four third-generation NVSwitches reduce in the switch (NVLink SHARP; NCCL's NVLS
    # all-reduce, the default since NCCL 2.17 where the driver supports multicast).
    return ClusterSpec(
        name="dgx-h100",
        device=resolve_device("h100"),
        nodes=1,
        devices_per_node=8,
        intra_link=LinkSpec(bandwidth_Bps=450 * GB, latency_s=3e-6),
        inter_link=LinkSpec(bandwidth_Bps=400 * Gbit, latency_s=6e-6),
        topology=Topology(kind=TopologyKind.FAT_TREE, oversubscription=1.0, nodes_per_leaf=16),
        nvlink_sharp=True,
    )


def _piz_daint() -> ClusterSpec:
    # CSCS Piz Daint (Cray XC50): one P100 16GB per node, Cray Aries dragonfly interconnect.
    # Aries injection bandwidth about 10 GB/s per node and ~1.3 µs MPI latency (Alverson et al.,
    # "Cray XC Series Network", 2012); groups of 384 nodes (two cabinets) joined by global links,
    # whose tapering is approximated by an oversubscription of 2. Intra-node "link" is PCIe 3 x16
    # (~12 GB/s) but unused with one device per node.
    return ClusterSpec(
        name="piz-daint",
        device=resolve_device("p100"),
        nodes=1,
        devices_per_node=1,
        intra_link=LinkSpec(bandwidth_Bps=12 * GB, latency_s=5e-6),
        inter_link=LinkSpec(bandwidth_Bps=10 * GB, latency_s=1.5e-6),
        topology=Topology(kind=TopologyKind.DRAGONFLY, oversubscription=2.0, nodes_per_leaf=384),
    )


def cpu_cluster_calibration_path() -> Path:
    """Where ``paratrain calibrate`` stores the measured gloo links of this machine."""
    return cpu_calibration_path().parent / "cpu-cluster.json"


def cpu_links() -> LinkSpec | None:
    """The link between two processes of this machine: the alpha-beta fit of a gloo send/recv
    ping-pong over loopback measured by ``paratrain calibrate`` (``cpu-cluster.json``); None when
    nothing (or nothing readable) was measured."""
    path = cpu_cluster_calibration_path()
    if path.is_file():
        try:
            doc = json.loads(path.read_text(encoding="utf-8"))
            return LinkSpec(bandwidth_Bps=float(doc["p2p_bandwidth_Bps"]), latency_s=float(doc["p2p_latency_s"]))
        except (OSError, ValueError, KeyError, TypeError, ConfigError):
            pass  # a stale or damaged file falls back to the default, as the device's does
    return None


def _calibrated_rows(key: str) -> tuple[tuple[str, int, int, float], ...]:
    """Rows ``(kind, group size, bytes, seconds)`` under ``key`` in ``cpu-cluster.json``; empty
    when the file or the key is missing, or the rows cannot be read."""
    path = cpu_cluster_calibration_path()
    if path.is_file():
        try:
            doc = json.loads(path.read_text(encoding="utf-8"))
            return measured_collective_rows(doc.get(key, []), key)
        except (OSError, ValueError, AttributeError, TypeError, ConfigError):
            pass
    return ()


def cpu_measured_collectives() -> tuple[tuple[str, int, int, float], ...]:
    """The tensor-parallel collectives ``paratrain calibrate`` timed on this machine
    (``measured_collectives`` in ``cpu-cluster.json``); empty when none (or nothing readable)."""
    return _calibrated_rows("measured_collectives")


def cpu_collective_cpu() -> tuple[tuple[str, int, int, float], ...]:
    """The CPU per tensor-parallel collective that ``paratrain calibrate`` measured on this machine
    (``collective_cpu`` in ``cpu-cluster.json``); empty when none (or nothing readable)."""
    return _calibrated_rows("collective_cpu")


def cpu_measured_reductions() -> tuple[tuple[str, int, int, float], ...]:
    """The all-reduces ``paratrain calibrate`` timed alone on this machine, every group of a size
    at once (``measured_reductions`` in ``cpu-cluster.json``); empty when none."""
    return _calibrated_rows("measured_reductions")


def cpu_measured_p2p() -> tuple[tuple[str, int, int, float], ...]:
    """The one-way times of ``paratrain calibrate``'s ping-pong while the other processes compute
    (``measured_p2p`` in ``cpu-cluster.json``); empty when none."""
    return _calibrated_rows("measured_p2p")


def cpu_cores() -> tuple[int, int]:
    """``(cores, threads per process)`` that ``paratrain calibrate`` recorded (``cores`` and
    ``threads`` in ``cpu-cluster.json``); ``(0, 1)`` (no sharing modelled) when it recorded no
    core count: a calibration from before it did holds rates measured under its own sharing."""
    path = cpu_cluster_calibration_path()
    if path.is_file():
        try:
            doc = json.loads(path.read_text(encoding="utf-8"))
            cores, threads = doc.get("cores", 0), doc.get("threads", 1)
            ints = all(isinstance(v, int) and not isinstance(v, bool) for v in (cores, threads))
            if ints and cores >= 0 and threads >= 1:
                return cores, threads
        except (OSError, ValueError, AttributeError, TypeError):
            pass
    return 0, 1


def _cpu() -> ClusterSpec:
    # This machine: processes talk through gloo over loopback TCP. Calibrated: the one link
    # `paratrain calibrate` measures (every "node" is this machine, so inter-node is the same);
    # otherwise conservative defaults (loopback TCP: tens of microseconds, a few GB/s).
    link = cpu_links()
    cores, threads = cpu_cores()
    return ClusterSpec(
        name="cpu",
        device=resolve_device("cpu"),
        nodes=1,
        devices_per_node=8,
        intra_link=link or LinkSpec(bandwidth_Bps=2 * GB, latency_s=50e-6),
        inter_link=link or LinkSpec(bandwidth_Bps=1 * GB, latency_s=100e-6),
        topology=Topology(kind=TopologyKind.SINGLE_SWITCH),
        measured_collectives=cpu_measured_collectives(),
        tensor_parallel="dtensor",  # what `paratrain train` runs here
        cores_per_node=cores,
        threads_per_process=threads,
        collective_cpu_s=cpu_collective_cpu(),
        measured_reductions=cpu_measured_reductions(),
        measured_p2p=cpu_measured_p2p(),
    )


CLUSTER_PRESETS = {
    "dgx-a100": _dgx_a100,
    "dgx-h100": _dgx_h100,
    "piz-daint": _piz_daint,
    "cpu": _cpu,
}


def cluster_preset(name: str) -> ClusterSpec:
    return CLUSTER_PRESETS[name]()

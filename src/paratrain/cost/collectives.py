"""Alpha–beta time of collectives on a cluster, per algorithm, with the fastest chosen by default.

A message of ``n`` bytes over a link costs ``alpha + n / bandwidth`` (Hockney 1994). Algorithm
costs follow Thakur, Rabenseifner & Gropp 2005 ("Optimization of Collective Communication
Operations in MPICH") for ring and recursive halving/doubling, Sanders, Speck & Träff 2009 ("Two-tree
algorithms for full bandwidth broadcast, reduction and scan") for the double binary tree NCCL
uses, and NCCL's hierarchical and SHARP (in-network) all-reduce, and its NVLink SHARP (NVLS)
all-reduce inside a node whose NVSwitch reduces (``ClusterSpec.nvlink_sharp``).

``nbytes`` is the buffer size on each rank: the input of all-reduce, reduce-scatter, broadcast and
all-to-all, the *output* of all-gather (as nccl-tests report "size"), so that a reduce-scatter
plus an all-gather of ``n`` moves what an all-reduce of ``n`` moves.

Which links a group uses: ranks are node-major (``cluster.node_of``). A group inside one node uses
the intra-node link (NVLink/NVSwitch). A group spanning nodes is bound by the per-device NIC
(``inter_link``; NCCL runs one ring/tree channel per NIC), scaled by what the topology leaves of it:

- single switch: full bandwidth;
- fat tree: traffic between leaves shares uplinks oversubscribed ``oversubscription``:1, so a
  group spanning several leaves gets ``1/oversubscription`` of its NIC bandwidth. This assumes
  every rank of the leaf communicates at once (data-parallel groups of all pipeline stages and
  tensor ranks reduce together); a lone ring would cross each leaf boundary only twice;
- dragonfly: ``1/oversubscription`` once the group spans several groups (tapered global links);
- torus: neighbour traffic shares links with the groups interleaved with it, ``1/hops`` for a
  mean hop distance between consecutive nodes; distant-partner traffic is bound by the
  bisection: about ``min(1, 4/extent)`` of injection for a group ``extent`` nodes wide along its
  widest dimension (a wrap-around ring of ``k`` nodes has 2 links across any cut, ``k/2`` senders);
- HammingMesh (Hoefler et al. 2022): boards of ``board`` devices on a 2-D mesh, joined along rows
  and columns by switches: full bandwidth within a row or column of boards, half of it for
  distant-partner traffic across both dimensions (two switch hops share the board's ports).

Per-hop switch latency (~100 ns) is ignored against the µs software alpha of the presets.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache

from paratrain.cost.types import CollectiveCost
from paratrain.errors import ConfigError
from paratrain.spec.cluster import ClusterSpec, TopologyKind

__all__ = ["KINDS", "ALGORITHMS", "collective_time", "algorithms_for", "GroupLayout", "group_layout",
           "measured_reduction_time"]

KINDS = ("all_reduce", "reduce_scatter", "all_gather", "all_to_all", "broadcast", "p2p")
ALGORITHMS = ("ring", "dbtree", "rhd", "hierarchical", "in_network", "nvls", "pairwise")

_ALGOS_BY_KIND = {
    "all_reduce": ("ring", "dbtree", "rhd", "hierarchical", "in_network", "nvls"),
    "reduce_scatter": ("ring", "rhd", "hierarchical"),
    "all_gather": ("ring", "rhd", "hierarchical"),
    "broadcast": ("ring", "dbtree", "rhd", "hierarchical"),
    "all_to_all": ("pairwise",),
    "p2p": ("direct",),
}


def algorithms_for(kind: str) -> tuple[str, ...]:
    """Algorithms modelled for ``kind``."""
    if kind not in _ALGOS_BY_KIND:
        raise ConfigError("collective kind", f"unknown collective {kind!r}", f"use one of: {', '.join(KINDS)}")
    return _ALGOS_BY_KIND[kind]


@dataclass(frozen=True)
class GroupLayout:
    """How a group of ranks sits on the cluster, and the links it uses."""

    ranks: int
    nodes: int
    min_per_node: int
    max_per_node: int
    intra_latency_s: float
    intra_bandwidth_Bps: float
    inter_latency_s: float
    neighbor_bandwidth_Bps: float  # one NIC's share left by the topology to neighbour traffic
    global_bandwidth_Bps: float  # one NIC's share left by the topology to distant-partner traffic
    nic_bandwidth_Bps: float  # the NIC's own rate

    def flat(self, pattern: str) -> tuple[float, float]:
        """(alpha, bandwidth) of the slowest link a flat algorithm over the whole group uses.

        A ring over node-ordered ranks crosses each node boundary once per channel; NCCL runs one
        channel per NIC, so the ``g`` ranks of a node drive ``g`` NICs in parallel and the ring
        gets ``g × NIC`` across nodes (capped by NVLink); NCCL's trees likewise (a chain inside
        the node, one tree per channel across nodes), but between distant nodes. Recursive
        halving/doubling has every rank talking off-node at once, each through its own NIC.
        """
        if self.nodes == 1:
            return self.intra_latency_s, self.intra_bandwidth_Bps
        alpha = max(self.inter_latency_s, self.intra_latency_s)
        if pattern == "neighbor":
            return alpha, min(self.intra_bandwidth_Bps, self.min_per_node * self.neighbor_bandwidth_Bps)
        if pattern == "tree":  # NCCL trees: a chain inside the node, a tree across nodes, per channel
            return alpha, min(self.intra_bandwidth_Bps, self.min_per_node * self.global_bandwidth_Bps)
        return alpha, self.global_bandwidth_Bps


def _torus_coords(node: int, dims: tuple[int, ...]) -> tuple[int, ...]:
    out = []
    for d in reversed(dims):
        out.append(node % d)
        node //= d
    return tuple(reversed(out))


def _torus_hops(a: tuple[int, ...], b: tuple[int, ...], dims: tuple[int, ...]) -> int:
    return sum(min(abs(x - y), d - abs(x - y)) for x, y, d in zip(a, b, dims, strict=True))


def _topology_factors(cluster: ClusterSpec, nodes: list[int], ranks: Sequence[int]) -> tuple[float, float]:
    """(neighbour, global) fraction of the NIC bandwidth left by the topology to this group."""
    topo = cluster.topology
    kind = topo.kind
    if len(nodes) <= 1 or kind is TopologyKind.SINGLE_SWITCH:
        return 1.0, 1.0
    if kind in (TopologyKind.FAT_TREE, TopologyKind.DRAGONFLY):
        leaves = Counter(n // topo.nodes_per_leaf for n in nodes)
        if len(leaves) <= 1:
            return 1.0, 1.0
        share = 1.0 / topo.oversubscription
        return share, share
    if kind in (TopologyKind.TORUS_2D, TopologyKind.TORUS_3D):
        dims = topo.dims or (cluster.nodes,)
        coords = [_torus_coords(n, dims) for n in nodes]
        hops = [_torus_hops(a, b, dims) for a, b in zip(coords, coords[1:], strict=False)]
        mean_hops = sum(hops) / len(hops)
        extent = max(len({c[i] for c in coords}) for i in range(len(dims)))
        return 1.0 / max(1.0, mean_hops), min(1.0, 4.0 / extent)
    if kind is TopologyKind.HAMMINGMESH:
        per_board = math.prod(topo.board) if topo.board else cluster.devices_per_node
        row = max(1, topo.dims[0]) if topo.dims else max(1, int(math.isqrt(cluster.num_devices // per_board)))
        boards = {r // per_board for r in ranks}
        xs = {bd % row for bd in boards}
        ys = {bd // row for bd in boards}
        return 1.0, (1.0 if len(xs) == 1 or len(ys) == 1 else 0.5)
    raise ConfigError("topology.kind", f"no collective model for {kind}", "use a supported topology")


@lru_cache(maxsize=16384)
def group_layout(ranks: tuple[int, ...], cluster: ClusterSpec) -> GroupLayout:
    """Where ``ranks`` sit on ``cluster`` and which bandwidths they get."""
    if not ranks:
        raise ConfigError("ranks", "the group is empty", "give at least one rank")
    if len(set(ranks)) != len(ranks):
        raise ConfigError("ranks", f"{list(ranks)} repeats a rank", "give distinct ranks")
    bad = [r for r in ranks if not 0 <= r < cluster.num_devices]
    if bad:
        raise ConfigError(
            "ranks", f"rank {bad[0]} is outside the cluster's {cluster.num_devices} devices",
            "use a larger cluster (more GPUs or nodes) or fewer ranks",
        )
    per_node = Counter(cluster.node_of(r) for r in ranks)
    nodes = sorted(per_node)
    neighbor, glob = _topology_factors(cluster, nodes, ranks)
    nic = cluster.inter_link.bandwidth_Bps
    return GroupLayout(
        ranks=len(ranks), nodes=len(nodes), min_per_node=min(per_node.values()), max_per_node=max(per_node.values()),
        intra_latency_s=cluster.intra_link.latency_s, intra_bandwidth_Bps=cluster.intra_link.bandwidth_Bps,
        inter_latency_s=cluster.inter_link.latency_s, neighbor_bandwidth_Bps=nic * neighbor,
        global_bandwidth_Bps=nic * glob, nic_bandwidth_Bps=nic,
    )


# ----- flat algorithms: p ranks, alpha a, bandwidth bw (n in bytes) -------------------------------

def _pow2_floor(p: int) -> int:
    return 1 << (p.bit_length() - 1)


def _ring(kind: str, n: float, p: int, a: float, bw: float) -> tuple[float, float]:
    """(time, bytes sent per rank) of the ring algorithm (Thakur et al. 2005, sec. 4)."""
    frac = (p - 1) / p
    if kind == "all_reduce":
        return 2 * (p - 1) * a + 2 * frac * n / bw, 2 * frac * n
    if kind in ("reduce_scatter", "all_gather"):
        return (p - 1) * a + frac * n / bw, frac * n
    # broadcast: pipelined chain, large-message limit: every rank forwards the whole buffer once.
    return (p - 1) * a + n / bw, n


def _dbtree(kind: str, n: float, p: int, a: float, bw: float) -> tuple[float, float]:
    """Double binary tree (Sanders et al. 2009): two trees, each rank interior in at most one, each
    carrying half the data pipelined; a reduction up and a broadcast down for all-reduce."""
    depth = math.ceil(math.log2(p))
    if kind == "all_reduce":
        return 2 * depth * a + 2 * n / bw, 2 * n
    return depth * a + n / bw, n  # broadcast


def _rhd(kind: str, n: float, p: int, a: float, bw: float) -> tuple[float, float]:
    """Recursive halving (reduce-scatter) / doubling (all-gather), Rabenseifner's all-reduce and
    van de Geijn's scatter + all-gather broadcast. A non-power-of-two group first folds its
    ``p - 2^k`` extra ranks onto partners and unfolds at the end (Thakur et al. 2005, sec. 4.3)."""
    q = _pow2_floor(p)
    steps = int(math.log2(q))
    frac = (q - 1) / q
    fold_t, fold_b = (0.0, 0.0) if q == p else (2 * a + 2 * n / bw, 2 * n)
    if kind in ("all_reduce", "broadcast"):
        return 2 * steps * a + 2 * frac * n / bw + fold_t, 2 * frac * n + fold_b
    half_fold_t, half_fold_b = fold_t / 2, fold_b / 2
    return steps * a + frac * n / bw + half_fold_t, frac * n + half_fold_b  # reduce_scatter / all_gather


def _flat(algorithm: str, kind: str, n: float, p: int, layout: GroupLayout) -> tuple[float, float]:
    if algorithm == "ring":
        a, bw = layout.flat("neighbor")
        return _ring(kind, n, p, a, bw)
    if algorithm == "dbtree":
        a, bw = layout.flat("tree")
        return _dbtree(kind, n, p, a, bw)
    a, bw = layout.flat("global")
    return _rhd(kind, n, p, a, bw)


def _inter_only(layout: GroupLayout) -> GroupLayout:
    """The layout of one rank per node across the same nodes (the inter-node stage)."""
    return GroupLayout(
        ranks=layout.nodes, nodes=layout.nodes, min_per_node=1, max_per_node=1,
        intra_latency_s=layout.intra_latency_s, intra_bandwidth_Bps=layout.intra_bandwidth_Bps,
        inter_latency_s=layout.inter_latency_s, neighbor_bandwidth_Bps=layout.neighbor_bandwidth_Bps,
        global_bandwidth_Bps=layout.global_bandwidth_Bps, nic_bandwidth_Bps=layout.nic_bandwidth_Bps,
    )


def _best_flat(kind: str, n: float, layout: GroupLayout) -> tuple[float, float]:
    options = [a for a in ("ring", "dbtree", "rhd") if a in _ALGOS_BY_KIND[kind]]
    return min(_flat(a, kind, n, layout.ranks, layout) for a in options)


def _hierarchical(kind: str, n: float, layout: GroupLayout) -> tuple[float, float]:
    """Intra-node reduce-scatter, inter-node collective on the node's shard (one NIC per local
    rank works on its own shard in parallel), intra-node all-gather (NCCL's hierarchical
    all-reduce; Jia et al. 2018 "Highly Scalable Deep Learning Training System with Mixed-Precision").
    The node with the fewest ranks sets the shard size its NICs carry."""
    if layout.nodes == 1:
        return _flat("ring", kind, n, layout.ranks, layout)
    g, g_max = layout.min_per_node, layout.max_per_node
    a_i, bw_i = layout.intra_latency_s, layout.intra_bandwidth_Bps
    inter = _inter_only(layout)
    if kind == "broadcast":
        t_x, b_x = _best_flat("broadcast", n, inter)
        t_i = 0.0 if g_max == 1 else _ring("broadcast", n, g_max, a_i, bw_i)[0]
        return t_x + t_i, b_x
    if kind == "all_reduce":
        intra_kind, inter_kind = "reduce_scatter", "all_reduce"
    else:
        intra_kind = inter_kind = kind
    t_i = 0.0 if g_max == 1 else _ring(intra_kind, n, g_max, a_i, bw_i)[0]
    t_x, b_x = _best_flat(inter_kind, n / g, inter)
    t_back = t_i if kind == "all_reduce" else 0.0  # all-reduce ends with the intra-node all-gather
    return t_i + t_x + t_back, b_x


def _in_network(n: float, layout: GroupLayout) -> tuple[float, float]:
    """Switch-side reduction (NVIDIA SHARP, Graham et al. 2016; a PsPIN switch, Di Girolamo et al.
    2020): each NIC sends its shard up once and receives the result once, full duplex; reduced
    streams do not multiply on uplinks, so oversubscription does not apply. Inside a node the
    NVSwitch does the same (NVLink SHARP)."""
    if layout.nodes == 1:
        a, bw = layout.intra_latency_s, layout.intra_bandwidth_Bps
        return 2 * a + n / bw, n
    g, g_max = layout.min_per_node, layout.max_per_node
    a_i, bw_i = layout.intra_latency_s, layout.intra_bandwidth_Bps
    t_i = 0.0 if g_max == 1 else _ring("reduce_scatter", n, g_max, a_i, bw_i)[0]
    shard = n / g
    return 2 * t_i + 2 * layout.inter_latency_s + shard / layout.nic_bandwidth_Bps, shard


# NVLink SHARP on 8 H100 through third-generation NVSwitch: NCCL's all-reduce peaks at an algorithm
# bandwidth of ~275 GB/s where the other collectives (and the ring all-reduce) reach a bus bandwidth
# of ~370 GB/s on the same 450 GB/s links (S. Jeaugey, NCCL maintainer, NVIDIA/nccl-tests#212,
# 2024-05-06). Relative to the ring's bus bandwidth, the one the links' alpha-beta model stands for,
# an NVLS all-reduce of n bytes takes n · 370/275 / bandwidth; a ring one 2(p-1)/p · n / bandwidth
# (8 GPUs: 1.75 against 1.345, NVLS 1.30x faster). Only all-reduce gains: the other collectives run
# at the ring's rate there.
NVLS_BYTES_PER_BYTE = 370 / 275


def _nvls(n: float, layout: GroupLayout) -> tuple[float, float]:
    """NVLink SHARP all-reduce inside one node (:data:`NVLS_BYTES_PER_BYTE`): each GPU sends its
    buffer to the switch and reads the reduced result back, two message latencies. The group's size
    does not enter: the measured figure is for 8 GPUs, and a GPU's NVLink ports bound it at any
    size (an assumption for groups of 2 to 7; at 2 the ring, 1 · n / bandwidth, is faster)."""
    if layout.nodes != 1:
        raise ConfigError("algorithm", "nvls reduces in one node's NVSwitch; this group spans "
                          f"{layout.nodes} nodes", "use hierarchical (or none: the fastest) across nodes")
    b = NVLS_BYTES_PER_BYTE * n
    return 2 * layout.intra_latency_s + b / layout.intra_bandwidth_Bps, b


def _all_to_all(n: float, layout: GroupLayout) -> tuple[float, float]:
    """Pairwise exchange: ``p-1`` steps, each rank sends ``n/p`` to every other rank; the bytes for
    ranks on other nodes go through the NIC (distant-partner bandwidth), the rest over NVLink,
    concurrently."""
    p = layout.ranks
    if layout.nodes == 1:
        return (p - 1) * layout.intra_latency_s + (p - 1) / p * n / layout.intra_bandwidth_Bps, (p - 1) / p * n
    local = layout.max_per_node
    remote_bytes = n * (p - local) / p
    t_intra = (local - 1) / p * n / layout.intra_bandwidth_Bps
    t_inter = remote_bytes / layout.global_bandwidth_Bps
    return (p - 1) * max(layout.inter_latency_s, layout.intra_latency_s) + max(t_intra, t_inter), remote_bytes


@lru_cache(maxsize=65536)
def _collective(
    kind: str, nbytes: float, ranks: tuple[int, ...], cluster: ClusterSpec, algorithm: str | None
) -> CollectiveCost:
    choices = algorithms_for(kind)
    if algorithm is not None and algorithm not in choices:
        raise ConfigError(
            "algorithm", f"{algorithm!r} is not modelled for {kind}", f"use one of: {', '.join(choices)} (or none)"
        )
    if kind == "p2p":
        if len(ranks) != 2:
            raise ConfigError("ranks", f"p2p takes (src, dst), got {len(ranks)} ranks", "give two ranks")
        src, dst = ranks
        if src == dst:
            return CollectiveCost(0.0, "local", 0.0)
        loaded = measured_reduction_time(cluster.measured_p2p, "p2p", 2, nbytes)
        if loaded is not None:
            return CollectiveCost(loaded, "measured", float(nbytes))
        layout = group_layout(ranks, cluster)
        a, bw = layout.flat("global")
        return CollectiveCost(a + nbytes / bw, "direct", float(nbytes))
    layout = group_layout(ranks, cluster)
    if layout.ranks == 1 or nbytes == 0:
        return CollectiveCost(0.0, algorithm or "none", 0.0)
    measured = measured_reduction_time(cluster.measured_reductions, kind, layout.ranks, nbytes)
    if measured is not None and algorithm is None:
        return CollectiveCost(measured, "measured", float(nbytes))
    if kind == "all_to_all":
        t, b = _all_to_all(nbytes, layout)
        return CollectiveCost(t, "pairwise", b)
    candidates = [algorithm] if algorithm is not None else [
        a for a in choices
        if (a != "in_network" or (cluster.topology.in_network_reduction and layout.nodes > 1))
        and (a != "nvls" or (cluster.nvlink_sharp and layout.nodes == 1))
    ]
    best: CollectiveCost | None = None
    for algo in candidates:
        if algo == "hierarchical":
            t, b = _hierarchical(kind, nbytes, layout)
        elif algo == "in_network":
            t, b = _in_network(nbytes, layout)
        elif algo == "nvls":
            t, b = _nvls(nbytes, layout)
        else:
            t, b = _flat(algo, kind, nbytes, layout.ranks, layout)
        if best is None or t < best.time_s:
            best = CollectiveCost(t, algo, b)
    assert best is not None
    return best


def measured_reduction_time(
    rows: tuple[tuple[str, int, int, float], ...], kind: str, group: int, nbytes: float
) -> float | None:
    """Seconds of a ``kind`` collective of ``nbytes`` over ``group`` ranks from a cluster's
    ``measured_reductions`` (None without rows of that kind and group size): linear between the
    measured sizes, the smallest size's time below them, the last two sizes' line beyond (a
    bandwidth-bound collective grows linearly with its message)."""
    pts = sorted((float(b), t) for k, g, b, t in rows if k == kind and g == group)
    if not pts:
        return None
    if nbytes <= pts[0][0] or len(pts) == 1:
        return pts[0][1] if nbytes <= pts[0][0] else pts[0][1] * nbytes / pts[0][0]
    for (b0, t0), (b1, t1) in zip(pts, pts[1:], strict=False):
        if nbytes <= b1:
            return t0 + (t1 - t0) * (nbytes - b0) / (b1 - b0)
    (b0, t0), (b1, t1) = pts[-2], pts[-1]
    return t1 + max(0.0, (t1 - t0) / (b1 - b0)) * (nbytes - b1)


def collective_time(
    kind: str, nbytes: float, ranks: Sequence[int], cluster: ClusterSpec, algorithm: str | None = None
) -> CollectiveCost:
    """Time of one collective of ``nbytes`` per rank over ``ranks`` on ``cluster``.

    ``algorithm=None`` picks the fastest modelled algorithm (in-network reduction only when the
    topology has it). For ``p2p``, ``ranks`` is ``(src, dst)``.
    """
    if isinstance(nbytes, bool) or not isinstance(nbytes, (int, float)) or nbytes < 0 or math.isnan(nbytes):
        raise ConfigError("nbytes", f"must be a non-negative number of bytes, got {nbytes!r}", "give a size in bytes")
    return _collective(kind, float(nbytes), tuple(int(r) for r in ranks), cluster, algorithm)

"""Alpha–beta collective model: closed forms, topology effects and monotonicity properties."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from paratrain.cost.collectives import algorithms_for, collective_time
from paratrain.errors import ConfigError
from paratrain.spec.cluster import ClusterSpec, LinkSpec, Topology, TopologyKind, resolve_cluster
from paratrain.spec.device import resolve_device

DGX = resolve_cluster("dgx-a100", nodes=64)


def _cluster(kind: TopologyKind, nodes: int = 64, per_node: int = 8, **topo) -> ClusterSpec:
    return ClusterSpec(
        name=f"test-{kind.value}", device=resolve_device("a100-80gb"), nodes=nodes, devices_per_node=per_node,
        intra_link=LinkSpec(300e9, 3e-6), inter_link=LinkSpec(25e9, 6e-6), topology=Topology(kind=kind, **topo),
    )


CLUSTERS = [
    DGX,
    _cluster(TopologyKind.SINGLE_SWITCH),
    _cluster(TopologyKind.FAT_TREE, oversubscription=4.0, nodes_per_leaf=8),
    _cluster(TopologyKind.DRAGONFLY, oversubscription=2.0, nodes_per_leaf=16),
    _cluster(TopologyKind.TORUS_2D, dims=(8, 8)),
    _cluster(TopologyKind.TORUS_3D, dims=(4, 4, 4)),
    _cluster(TopologyKind.HAMMINGMESH, per_node=4, board=(2, 2), dims=(8, 8)),
    _cluster(TopologyKind.FAT_TREE, oversubscription=2.0, nodes_per_leaf=4, in_network_reduction=True),
]


@pytest.mark.parametrize("p", [2, 3, 4, 5, 8])
def test_ring_all_reduce_moves_2_p_minus_1_over_p_n_per_rank(p: int) -> None:
    n = 1e8
    c = collective_time("all_reduce", n, range(p), DGX, "ring")
    assert c.bytes_per_rank == pytest.approx(2 * (p - 1) / p * n)
    link = DGX.intra_link
    assert c.time_s == pytest.approx(2 * (p - 1) * link.latency_s + 2 * (p - 1) / p * n / link.bandwidth_Bps)
    rs = collective_time("reduce_scatter", n, range(p), DGX, "ring")
    ag = collective_time("all_gather", n, range(p), DGX, "ring")
    assert rs.bytes_per_rank == pytest.approx((p - 1) / p * n)
    assert rs.time_s + ag.time_s == pytest.approx(c.time_s)


def test_ring_across_nodes_is_bound_by_the_nics() -> None:
    n, nic = 1e9, DGX.inter_link
    one_per_node = tuple(range(0, 128, 8))
    c = collective_time("all_reduce", n, one_per_node, DGX, "ring")
    assert c.time_s == pytest.approx(2 * 15 * nic.latency_s + 2 * 15 / 16 * n / nic.bandwidth_Bps)
    # Two full nodes: eight channels, one per NIC, share the ring's node crossings.
    c = collective_time("all_reduce", n, tuple(range(16)), DGX, "ring")
    assert c.time_s == pytest.approx(2 * 15 * nic.latency_s + 2 * 15 / 16 * n / (8 * nic.bandwidth_Bps))


def test_rhd_closed_form_power_of_two_and_fold() -> None:
    n = 1e6
    link = DGX.intra_link
    a, bw = link.latency_s, link.bandwidth_Bps
    assert collective_time("all_reduce", n, range(8), DGX, "rhd").time_s == pytest.approx(6 * a + 2 * 7 / 8 * n / bw)
    # 6 ranks: fold 2 onto partners, 4-rank Rabenseifner, unfold.
    assert collective_time("all_reduce", n, range(6), DGX, "rhd").time_s == pytest.approx(
        4 * a + 2 * 3 / 4 * n / bw + 2 * a + 2 * n / bw
    )


def test_hierarchical_against_flat_ring_across_nodes() -> None:
    ranks = tuple(range(64))
    # Mid-size: the flat ring pays 2(p-1) = 126 latencies, the hierarchical one 2·7 + 2·log2(8).
    flat = collective_time("all_reduce", 1e6, ranks, DGX, "ring")
    hier = collective_time("all_reduce", 1e6, ranks, DGX, "hierarchical")
    assert hier.time_s < flat.time_s
    # Large: the multi-channel ring and tree use all 8 NICs for the whole buffer and skip the
    # intra-node reduce-scatter/all-gather, so they win.
    flat = collective_time("all_reduce", 1e9, ranks, DGX, "ring")
    hier = collective_time("all_reduce", 1e9, ranks, DGX, "hierarchical")
    assert flat.time_s < hier.time_s
    assert hier.bytes_per_rank == pytest.approx(2 * 7 / 8 * 1e9 / 8)  # 8-node ring on a 1/8 shard
    best = collective_time("all_reduce", 1e9, ranks, DGX)
    assert best.algorithm in ("ring", "dbtree") and best.time_s <= flat.time_s


def test_in_network_reduction_only_where_the_switches_have_it() -> None:
    sharp = CLUSTERS[-1]
    ranks = tuple(range(64))
    assert collective_time("all_reduce", 1e9, ranks, DGX).algorithm != "in_network"
    best = collective_time("all_reduce", 1e9, ranks, sharp)
    assert best.algorithm == "in_network"
    # Each NIC sends its 1/8 shard once: about half the bytes of a ring all-reduce.
    assert best.bytes_per_rank == pytest.approx(1e9 / 8)
    explicit = collective_time("all_reduce", 1e9, ranks, DGX, "in_network")
    assert explicit.algorithm == "in_network"


def test_fat_tree_oversubscription_slows_cross_leaf_groups() -> None:
    ranks = tuple(range(0, 512, 8))  # one rank on each of 64 nodes
    full = _cluster(TopologyKind.FAT_TREE, oversubscription=1.0, nodes_per_leaf=8)
    over = _cluster(TopologyKind.FAT_TREE, oversubscription=4.0, nodes_per_leaf=8)
    for kind in ("all_to_all", "broadcast"):
        assert collective_time(kind, 1e8, ranks, over).time_s > collective_time(kind, 1e8, ranks, full).time_s
    in_leaf = tuple(range(0, 64, 8))  # 8 nodes: one leaf
    assert collective_time("all_to_all", 1e8, in_leaf, over).time_s == collective_time(
        "all_to_all", 1e8, in_leaf, full).time_s


def test_torus_strided_groups_share_links() -> None:
    torus = _cluster(TopologyKind.TORUS_2D, dims=(8, 8))
    near = tuple(range(0, 64, 8))  # nodes 0..7, one torus row, neighbours
    far = tuple(range(0, 512, 64))  # nodes 0, 8, ..., 56: a column, still neighbours
    strided = tuple(8 * n for n in (0, 2, 4, 6, 16, 18, 20, 22))  # every other node: 2 hops apart
    t = [collective_time("all_reduce", 1e9, r, torus, "ring").time_s for r in (near, far, strided)]
    assert t[0] == pytest.approx(t[1])
    assert t[2] > t[0]


def test_p2p() -> None:
    intra = collective_time("p2p", 1e8, (0, 1), DGX)
    inter = collective_time("p2p", 1e8, (0, 8), DGX)
    assert intra.time_s < inter.time_s
    assert inter.time_s == pytest.approx(DGX.inter_link.latency_s + 1e8 / DGX.inter_link.bandwidth_Bps)
    assert collective_time("p2p", 1e8, (3, 3), DGX).time_s == 0


@pytest.mark.parametrize(
    "args, field",
    [
        (("all_sum", 1e6, (0, 1), DGX, None), "collective kind"),
        (("reduce_scatter", 1e6, (0, 1), DGX, "dbtree"), "algorithm"),
        (("all_reduce", 1e6, (0, 1), DGX, "magic"), "algorithm"),
        (("all_reduce", 1e6, (0, 10_000), DGX, None), "ranks"),
        (("all_reduce", 1e6, (0, 0), DGX, None), "ranks"),
        (("all_reduce", 1e6, (), DGX, None), "ranks"),
        (("all_reduce", -1, (0, 1), DGX, None), "nbytes"),
        (("p2p", 1e6, (0, 1, 2), DGX, None), "ranks"),
    ],
)
def test_bad_input(args: tuple, field: str) -> None:
    with pytest.raises(ConfigError) as e:
        collective_time(*args)
    assert e.value.field == field


# ----- properties ----------------------------------------------------------------------------

_KIND_ALGO = [(k, a) for k in ("all_reduce", "reduce_scatter", "all_gather", "broadcast", "all_to_all")
              for a in (None, *algorithms_for(k))]


@settings(max_examples=300, deadline=None)
@given(
    ka=st.sampled_from(_KIND_ALGO), cluster=st.sampled_from(CLUSTERS),
    ranks=st.sets(st.integers(0, 255), min_size=1, max_size=40),
    n1=st.floats(0, 1e10), n2=st.floats(0, 1e10),
)
def test_monotone_in_size(ka: tuple, cluster: ClusterSpec, ranks: set, n1: float, n2: float) -> None:
    kind, algo = ka
    if algo == "nvls":  # an in-switch reduction inside one node: the group's ranks folded onto node 0
        ranks = {r % cluster.devices_per_node for r in ranks}
    ranks_t = tuple(sorted(ranks))
    lo, hi = sorted((n1, n2))
    t_lo = collective_time(kind, lo, ranks_t, cluster, algo).time_s
    t_hi = collective_time(kind, hi, ranks_t, cluster, algo).time_s
    assert 0 <= t_lo <= t_hi


_GROUP_CLUSTERS = [c for c in CLUSTERS if c.topology.kind in
                   (TopologyKind.FAT_TREE, TopologyKind.SINGLE_SWITCH, TopologyKind.DRAGONFLY)]


@settings(max_examples=300, deadline=None)
@given(
    kind=st.sampled_from(["all_reduce", "reduce_scatter", "all_gather", "broadcast", "all_to_all"]),
    algo=st.sampled_from(["ring", "dbtree", None]), cluster=st.sampled_from(_GROUP_CLUSTERS),
    per_node=st.sampled_from([1, 2, 4, 8]), nodes=st.integers(1, 32), more=st.integers(1, 32),
    n=st.floats(1, 1e10),
)
def test_monotone_in_group_across_nodes(
    kind: str, algo: str | None, cluster: ClusterSpec, per_node: int, nodes: int, more: int, n: float
) -> None:
    """Same ranks per node, more nodes: never faster. Holds for ring and tree at every size and for
    the fastest algorithm at power-of-two node counts (recursive halving/doubling pays a fold
    step off powers of two, so a 5-node group can be slower than an 8-node one — as in MPICH)."""
    if algo is not None and algo not in algorithms_for(kind):
        algo = "ring" if "ring" in algorithms_for(kind) else None
    small, big = nodes, nodes + more
    if algo is None:
        small, big = 1 << (small.bit_length() - 1), 1 << (big.bit_length() - 1)
    big = min(big, cluster.nodes)
    small = min(small, big)

    def group(k: int) -> tuple[int, ...]:
        return tuple(node * cluster.devices_per_node + i for node in range(k) for i in range(per_node))

    t_small = collective_time(kind, n, group(small), cluster, algo).time_s
    t_big = collective_time(kind, n, group(big), cluster, algo).time_s
    assert t_small <= t_big * (1 + 1e-12)


@settings(max_examples=200, deadline=None)
@given(
    kind=st.sampled_from(["all_reduce", "reduce_scatter", "all_gather", "broadcast", "all_to_all"]),
    algo=st.sampled_from(["ring", "dbtree", None]), p=st.integers(1, 8), q=st.integers(1, 8), n=st.floats(1, 1e10),
)
def test_monotone_in_group_within_a_node(kind: str, algo: str | None, p: int, q: int, n: float) -> None:
    if algo is not None and algo not in algorithms_for(kind):
        algo = "ring" if "ring" in algorithms_for(kind) else None
    small, big = sorted((p, q))
    if algo is None:
        small, big = 1 << (small.bit_length() - 1), 1 << (big.bit_length() - 1)
    t_small = collective_time(kind, n, range(small), DGX, algo).time_s
    t_big = collective_time(kind, n, range(big), DGX, algo).time_s
    assert t_small <= t_big * (1 + 1e-12)


@settings(max_examples=100, deadline=None)
@given(o1=st.floats(1, 16), o2=st.floats(1, 16), kind=st.sampled_from(["all_reduce", "all_to_all", "broadcast"]),
       n=st.floats(1, 1e10))
def test_monotone_in_oversubscription(o1: float, o2: float, kind: str, n: float) -> None:
    lo, hi = sorted((o1, o2))
    ranks = tuple(range(0, 512, 4))
    base = _cluster(TopologyKind.FAT_TREE, nodes_per_leaf=4)
    t = [collective_time(kind, n, ranks, dataclasses.replace(base, topology=dataclasses.replace(
        base.topology, oversubscription=o)), None).time_s for o in (lo, hi)]
    assert t[0] <= t[1] * (1 + 1e-12)


def test_dragonfly_tapers_global_links() -> None:
    fly = _cluster(TopologyKind.DRAGONFLY, oversubscription=2.0, nodes_per_leaf=16, per_node=1)
    inside = tuple(range(16))  # one group
    across = tuple(range(8, 24))  # two groups
    t_in = collective_time("all_reduce", 1e9, inside, fly, "ring").time_s
    t_across = collective_time("all_reduce", 1e9, across, fly, "ring").time_s
    nic = fly.inter_link
    assert t_in == pytest.approx(2 * 15 * nic.latency_s + 2 * 15 / 16 * 1e9 / nic.bandwidth_Bps)
    assert t_across == pytest.approx(2 * 15 * nic.latency_s + 2 * 15 / 16 * 1e9 / (nic.bandwidth_Bps / 2))


def test_hammingmesh_full_bandwidth_along_a_row_half_across() -> None:
    hm = _cluster(TopologyKind.HAMMINGMESH, per_node=4, board=(2, 2), dims=(8, 8))
    row = tuple(4 * b for b in range(8))  # boards 0..7: one row of boards
    column = tuple(4 * 8 * y for y in range(8))  # boards 0, 8, ..., 56: one column
    diagonal = tuple(4 * (9 * i) for i in range(8))  # boards on different rows and columns
    t = [collective_time("all_to_all", 1e8, g, hm).time_s for g in (row, column, diagonal)]
    assert t[0] == pytest.approx(t[1])
    assert t[2] > t[0]


def test_measured_reductions_time_the_collectives_outside_tensor_parallel_layers() -> None:
    """A cluster whose calibration timed all-reduces alone (``measured_reductions``) takes their
    time from those rows, linear between the measured sizes and along the last two beyond; other
    kinds and group sizes keep the alpha-beta model."""
    from paratrain.cost.collectives import measured_reduction_time

    rows = (("all_reduce", 4, 4, 1e-3), ("all_reduce", 4, 1000, 2e-3), ("all_reduce", 4, 3000, 6e-3),
            ("all_reduce", 2, 1000, 5e-4))
    assert measured_reduction_time(rows, "all_reduce", 4, 1) == 1e-3  # below the smallest: its time
    assert measured_reduction_time(rows, "all_reduce", 4, 2000) == pytest.approx(4e-3)  # between
    assert measured_reduction_time(rows, "all_reduce", 4, 5000) == pytest.approx(10e-3)  # the last slope on
    assert measured_reduction_time(rows, "all_gather", 4, 2000) is None
    assert measured_reduction_time(rows, "all_reduce", 8, 2000) is None
    base = resolve_cluster("cpu", gpus=4)
    cpu = dataclasses.replace(base, measured_reductions=rows)
    four, two = (0, 1, 2, 3), (0, 1)
    measured = collective_time("all_reduce", 2000, four, cpu)
    assert (measured.time_s, measured.algorithm) == (pytest.approx(4e-3), "measured")
    assert collective_time("all_reduce", 500, two, cpu).time_s == pytest.approx(5e-4)
    assert collective_time("all_gather", 2000, four, cpu) == collective_time("all_gather", 2000, four, base)
    assert collective_time("all_reduce", 2000, four, cpu, "ring") == collective_time("all_reduce", 2000, four, base,
                                                                                      "ring")


def test_point_to_point_under_load_takes_the_loaded_ping_pong() -> None:
    """On a host whose ping-pong was also timed while the other processes computed
    (``measured_p2p``), a transfer takes that time, interpolated over the message size; without
    it, the link's alpha-beta."""
    base = resolve_cluster("cpu", gpus=4)
    rows = (("p2p", 2, 4096, 2e-3), ("p2p", 2, 1 << 20, 3e-3))
    loaded = dataclasses.replace(base, measured_p2p=rows)
    mid = 4096 + ((1 << 20) - 4096) // 2
    cost = collective_time("p2p", mid, (0, 1), loaded)
    assert (cost.time_s, cost.algorithm) == (pytest.approx(2.5e-3), "measured")
    assert collective_time("p2p", 100, (2, 3), loaded).time_s == 2e-3
    assert collective_time("p2p", 100, (1, 1), loaded).time_s == 0.0  # to itself: nothing moves
    link = base.intra_link
    assert collective_time("p2p", mid, (0, 1), base).time_s == pytest.approx(link.latency_s + mid / link.bandwidth_Bps)


H100_NODE = resolve_cluster("dgx-h100", nodes=2)


def test_nvls_all_reduce_on_one_h100_node_is_the_maintainers_ratio_to_the_ring() -> None:
    # NVIDIA/nccl-tests#212: NVLS reaches ~275 GB/s of algorithm bandwidth where the ring's bus
    # bandwidth is ~370 GB/s; on 450 GB/s links the model's n·370/275/bw against 2·7/8·n/bw.
    n, bw, a = 1e9, 450e9, 3e-6
    node = tuple(range(8))
    best = collective_time("all_reduce", n, node, H100_NODE)
    assert best.algorithm == "nvls"
    assert best.time_s == pytest.approx(2 * a + n * 370 / 275 / bw, rel=1e-12)
    assert best.bytes_per_rank == pytest.approx(n * 370 / 275)
    ring = collective_time("all_reduce", n, node, H100_NODE, "ring")
    assert ring.bytes_per_rank / best.bytes_per_rank == pytest.approx(1.75 * 275 / 370, rel=1e-12)  # 1.30x
    assert ring.time_s > best.time_s


def test_nvls_only_for_all_reduce_inside_a_node_whose_switch_reduces() -> None:
    node, two_nodes = tuple(range(8)), tuple(range(16))
    # two GPUs: the ring moves n once, NVLS 1.345 n: the ring is chosen
    assert collective_time("all_reduce", 1e9, (0, 1), H100_NODE).algorithm != "nvls"
    # reduce-scatter and all-gather run at the ring's rate on NVSwitch
    assert collective_time("reduce_scatter", 1e9, node, H100_NODE).algorithm != "nvls"
    # A100's second-generation NVSwitch does not reduce
    assert collective_time("all_reduce", 1e9, node, resolve_cluster("dgx-a100")).algorithm != "nvls"
    assert collective_time("all_reduce", 1e9, two_nodes, H100_NODE).algorithm != "nvls"
    with pytest.raises(ConfigError, match="one node's NVSwitch"):
        collective_time("all_reduce", 1e9, two_nodes, H100_NODE, "nvls")


def test_nvlink_sharp_must_be_a_bool() -> None:
    with pytest.raises(ConfigError, match="nvlink_sharp"):
        dataclasses.replace(H100_NODE, nvlink_sharp="yes")

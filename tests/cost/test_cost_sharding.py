"""Data-parallel reduction at scale: hierarchical reduce-scatter / all-gather over nodes at the
per-node NIC bandwidth, ring latency growing with the participants, and FSDP's prefetch overlap."""

from __future__ import annotations

import math

import pytest

from paratrain.cost.collectives import collective_time
from paratrain.cost.sharding import ShardedUnit, fsdp_microbatch_s
from paratrain.errors import ConfigError
from paratrain.spec.cluster import resolve_cluster

GiB = 2**30


@pytest.mark.parametrize("kind", ["reduce_scatter", "all_gather"])
@pytest.mark.parametrize("nodes", [2, 4, 16])
def test_hierarchical_reduction_closed_form(kind: str, nodes: int) -> None:
    """Ring inside the node over NVLink on the whole buffer, then each of the node's g ranks works on
    its 1/g shard across nodes through its own NIC (recursive halving/doubling over a power-of-two
    node count: log2(N) steps), so a node moves its data at g × the NIC's bandwidth."""
    cluster = resolve_cluster("dgx-a100", nodes=nodes)
    g, n = cluster.devices_per_node, 1 * GiB
    a_i, bw_i = cluster.intra_link.latency_s, cluster.intra_link.bandwidth_Bps
    a_x = max(cluster.inter_link.latency_s, a_i)
    nic = cluster.inter_link.bandwidth_Bps
    want = (g - 1) * a_i + (g - 1) / g * n / bw_i + math.log2(nodes) * a_x + (nodes - 1) / nodes * n / (g * nic)
    got = collective_time(kind, n, range(g * nodes), cluster, algorithm="hierarchical")
    assert got.time_s == pytest.approx(want, rel=1e-12)
    # The best algorithm is never slower than the hierarchical one.
    assert collective_time(kind, n, range(g * nodes), cluster).time_s <= got.time_s


def test_per_node_nic_bandwidth_bounds_the_reduction() -> None:
    """With many nodes the inter-node stage tends to n / (per-node NIC bandwidth): DGX A100 has
    8 × 200 Gb/s HDR per node (200 GB/s), DGX H100 8 × 400 Gb/s (400 GB/s)."""
    n = 4 * GiB
    for name, per_node in (("dgx-a100", 8 * 200e9 / 8), ("dgx-h100", 8 * 400e9 / 8)):
        cluster = resolve_cluster(name, nodes=64)
        t = collective_time("reduce_scatter", n, range(cluster.num_devices), cluster, algorithm="hierarchical")
        lower = 63 / 64 * n / per_node
        assert lower < t.time_s < lower + 7 / 8 * n / cluster.intra_link.bandwidth_Bps + 1e-3


def test_ring_latency_grows_with_the_participants() -> None:
    cluster = resolve_cluster("dgx-a100", nodes=256)
    alpha = max(cluster.inter_link.latency_s, cluster.intra_link.latency_s)
    for p in (16, 64, 256):
        ranks = range(0, 8 * p, 8)  # one rank per node: a flat ring across nodes
        tiny = collective_time("all_gather", 1.0, ranks, cluster, algorithm="ring").time_s
        assert tiny == pytest.approx((p - 1) * alpha + (p - 1) / p / cluster.inter_link.bandwidth_Bps, rel=1e-12)


def test_fsdp_prefetch_hides_gathers_shorter_than_compute() -> None:
    """Forward: first gather exposed, then max(compute, next gather) per unit; backward: first
    re-gather exposed, then max(compute, previous unit's re-gather + next unit's reduce-scatter),
    and the last reduce-scatter exposed."""
    u = ShardedUnit(forward_s=1.0, backward_s=2.0, gather_s=0.3, reduce_s=0.5)
    total, exposed = fsdp_microbatch_s([u] * 4)
    assert total == pytest.approx(0.3 + 4 * 1.0 + 0.3 + 4 * 2.0 + 0.5)
    assert exposed == pytest.approx(0.3 + 0.3 + 0.5)
    # Communication-bound units: each step costs the communication.
    slow = ShardedUnit(forward_s=0.1, backward_s=0.2, gather_s=1.0, reduce_s=1.0)
    total, _ = fsdp_microbatch_s([slow] * 3)
    assert total == pytest.approx((1.0 + 1.0 + 1.0 + 0.1) + (1.0 + 1.0 + 2.0 + 1.0 + 1.0))
    # ZeRO-2 (no reshard after the forward): no re-gather in the backward.
    total2, _ = fsdp_microbatch_s([slow] * 3, reshard_after_forward=False)
    assert total2 == pytest.approx((1.0 + 1.0 + 1.0 + 0.1) + (0.2 + 1.0 + 1.0 + 1.0))
    with pytest.raises(ConfigError):
        fsdp_microbatch_s([])

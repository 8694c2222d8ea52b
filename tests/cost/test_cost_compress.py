"""The cost of compressed gradient reductions (paratrain.cost.compress) against the papers' closed
forms and independent derivations, and its use by the simulator and the planner."""

from __future__ import annotations

import math

import pytest

from paratrain.cost.compress import (
    compressed_reduce_s,
    compression_cost,
    entries_kept,
    latency_terms,
    powersgd_elements,
    volume_elements,
)
from paratrain.parallel.config import ParallelConfig
from paratrain.spec.cluster import resolve_cluster
from paratrain.spec.model import resolve_model


def test_ok_topk_volume_is_the_papers_two_phases() -> None:
    """Li & Hoefler Eq. 1-3: split and reduce 2k(P-1)/P, balance and all-gatherv 4k(P-1)/P."""
    n, d = 1_000_000, 0.01
    k = 10_000
    assert entries_kept(n, d) == k
    for p in (2, 4, 8, 64):
        split_and_reduce = 2 * k * (p - 1) / p
        balance_and_allgatherv = 4 * k * (p - 1) / p
        assert volume_elements("oktopk", n, d, p) == pytest.approx(split_and_reduce + balance_and_allgatherv)
        assert latency_terms("oktopk", p) == 2 * p + 2 * math.log2(p)


def test_ok_topk_time_by_hand() -> None:
    # n = 1e6, density 1 % -> k = 1e4; P = 8: 6k*7/8 = 52,500 elements = 26,250 (value, index) pairs of
    # 8 bytes = 210,000 bytes; (2*8 + 2*3) = 22 alphas of 10 us; 1 GB/s -> 220 us + 210 us.
    c = compression_cost("oktopk", 1_000_000, 0.01, 8, alpha_s=1e-5, bandwidth_Bps=1e9, memory_bandwidth_Bps=1e12)
    assert c.elements_sent == pytest.approx(52_500)
    assert c.bytes_sent == pytest.approx(210_000)
    assert c.comm_time_s == pytest.approx(22e-5 + 210e-6)
    assert c.time_s == pytest.approx(c.comm_time_s + c.select_time_s)
    assert c.select_time_s > 0


def test_topka_grows_with_p_and_ok_topk_does_not() -> None:
    """TopkA all-gathers every rank's k entries: 2k(P-1); Ok-Topk stays below 6k, so their ratio is P/3."""
    n, d = 10**6, 0.001
    for p in (4, 16, 256):
        assert volume_elements("topka", n, d, p) / volume_elements("oktopk", n, d, p) == pytest.approx(p / 3)
    assert volume_elements("oktopk", n, d, 4096) < 6 * entries_kept(n, d)


def test_ok_topk_beats_dense_volume_below_a_third() -> None:
    """Dense ring all-reduce sends 2n(P-1)/P, Ok-Topk 6k(P-1)/P: smaller exactly when k < n/3."""
    n, p = 300_000, 8
    assert volume_elements("oktopk", n, 0.33, p) < volume_elements("none", n, 1, p)
    assert volume_elements("oktopk", n, 0.34, p) > volume_elements("none", n, 1, p)


def test_dense_volume_is_the_ring_all_reduce_of_the_collectives_model() -> None:
    from paratrain.cost.collectives import _ring

    n, p = 12_345, 6
    _, ring_bytes = _ring("all_reduce", 4 * n, p, 1e-6, 1e9)
    assert 4 * volume_elements("none", n, 1, p) == pytest.approx(ring_bytes)


def test_gtopk_sends_k_entries_per_round() -> None:
    assert volume_elements("gtopk", 10**6, 0.01, 16) == 2 * 10_000 * 4


def test_powersgd_volume_follows_torchs_own_rule() -> None:
    """The elements torch's hook all-reduces, counted with torch's own _should_compress."""
    from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import _should_compress

    shapes = [(768, 3072), (3072, 768), (768,), (50, 4), (256, 256)]
    want = 0
    for s in shapes:
        rows = s[0]
        cols = math.prod(s) // rows
        ok, before, after = _should_compress(rows, cols, min(rows, cols, 4), 2)
        want += after if ok and len(s) > 1 else before
    assert powersgd_elements(shapes, rank=4) == want


def test_powersgd_reduction_is_two_all_reduces_of_the_factors_and_its_passes() -> None:
    """Ten 768×3072 fp32 gradient matrices over 8 GPUs, rank 4 (torch's hook): each matrix sends
    P (768×4) and Q (3072×4), 15,360 elements, 153,600 in all, in two all-reduces (P, then Q; the
    model splits the factors' elements evenly between the two). The hook streams the gradient 7
    times: error feedback 2, M·Q and Mᵀ·P read M 2, P·Qᵀ writes it 1, the new error 2."""
    from paratrain.cost.collectives import collective_time

    cluster = resolve_cluster("dgx-a100", gpus=8)
    ranks = tuple(range(8))
    n = 10 * 768 * 3072
    each = 153_600 // 2 * 4  # bytes of one all-reduce
    all_reduce = collective_time("all_reduce", each, ranks, cluster).time_s
    passes = 7 * n * 4 / (cluster.device.memory_bandwidth_Bps * cluster.device.memory_efficiency)
    got = compressed_reduce_s("powersgd", 0.01, 4 * n, 4, ranks, cluster, matrix=(768, 3072))
    assert got == pytest.approx(2 * all_reduce + passes, rel=1e-12)
    assert compressed_reduce_s("powersgd", 0.01, 4 * n, 4, (0,), cluster, matrix=(768, 3072)) == 0.0


def test_one_rank_costs_nothing() -> None:
    for m in ("none", "oktopk", "topka", "gtopk", "gaussiank", "powersgd"):
        assert volume_elements(m, 1000, 0.1, 1) == 0


def test_simulate_shows_the_compressor_in_comm_time_by_kind() -> None:
    """One data-parallel reduction per iteration (pp = 1): the simulator's time of kind ``oktopk`` is
    the cost model's for the dp group."""
    from paratrain.cost.compute import dtype_bytes
    from paratrain.cost.stage import chunk_costs
    from paratrain.sim.report import simulate_config

    model, cluster = resolve_model("gpt2"), resolve_cluster("piz-daint", gpus=16)
    dense = simulate_config(model, cluster, ParallelConfig(dp=16, microbatch=4, global_batch=64))
    cfg = ParallelConfig(dp=16, microbatch=4, global_batch=64, compression="oktopk", compression_density=0.001)
    sparse = simulate_config(model, cluster, cfg)
    assert set(sparse.comm_time_by_kind) >= {"oktopk"} and "all_reduce" not in sparse.comm_time_by_kind
    grad_bytes = chunk_costs(model, cluster, cfg)[0].grad_reduce_bytes
    want = compressed_reduce_s("oktopk", 0.001, grad_bytes, dtype_bytes(cfg.dtype), tuple(range(16)), cluster)
    assert sparse.comm_time_by_kind["oktopk"] == pytest.approx(want)
    # 0.1 % of GPT-2's gradients on a 10 GB/s dragonfly: far less than the dense all-reduce
    assert sparse.comm_time_by_kind["oktopk"] < dense.comm_time_by_kind["all_reduce"] / 10


def test_planner_weighs_compression_against_dense() -> None:
    from paratrain.plan.space import Layout, Pins, variants

    model = resolve_model("gpt2")
    pins = Pins(pp=1, tp=1, recompute="none", sequence_parallel=False, compressions=("none", "oktopk", "gtopk"))
    got = {(c.optimizer_sharding, c.compression) for c in variants(model, 64, Layout(8, 1, 1), pins)}
    # compression never with optimizer sharding (FSDP2 reduces the gradients itself)
    assert got == {(False, "none"), (False, "oktopk"), (False, "gtopk"), (True, "none")}
    odd = {c.compression for c in variants(model, 60, Layout(6, 1, 1), pins)}
    assert odd == {"none", "oktopk"}  # gTop-k pairs ranks: power-of-two dp only


def test_compression_is_a_field_of_the_one_config() -> None:
    from paratrain.errors import ConfigError

    cfg = ParallelConfig(dp=4, compression="oktopk", compression_density=0.001)
    assert ParallelConfig.from_dict(cfg.to_dict()) == cfg
    assert ParallelConfig().compression == "none"
    for bad, field in ((dict(compression="dgc"), "compression"), (dict(compression_density=0.0), "compression_density"),
                       (dict(compression_density=float("nan")), "compression_density"),
                       (dict(compression="topka", optimizer_sharding=True, dp=2), "compression")):
        with pytest.raises(ConfigError) as err:
            ParallelConfig(**bad)
        assert err.value.field == field

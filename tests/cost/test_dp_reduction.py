"""Data-parallel reduction at scale: bucketed overlap, fp32 gradient bytes, the wait for the slowest
rank, and the hierarchical all-reduce against a hand derivation."""

from __future__ import annotations

import math
import random

import pytest

from paratrain.cost.collectives import collective_time
from paratrain.cost.dp_reduction import (
    OVERLAP_SLOWDOWN,
    RANK_CV,
    bucketed_exposed_s,
    grad_reduce_bytes,
    megatron_bucket_elements,
    num_buckets,
    overlapped_s,
    skew_s,
)
from paratrain.errors import ConfigError
from paratrain.parallel.config import ParallelConfig
from paratrain.spec.cluster import resolve_cluster


def _stream(compute_s: float, comm_s: float, k: int) -> float:
    """Event by event: bucket i is ready at i·compute/k, the stream reduces one at a time."""
    free = 0.0
    for i in range(1, k + 1):
        free = max(free, i * compute_s / k) + comm_s / k
    return free - compute_s


def test_bucketed_overlap_hand_example() -> None:
    # 100 ms of backward, 4 buckets. 40 ms of reduction: the buckets finish at 35, 60, 85 and 110 ms,
    # the stream keeps up and only the last bucket's 10 ms is exposed.
    assert bucketed_exposed_s(0.100, 0.040, 4) == pytest.approx(0.010)
    # 200 ms of reduction: 50 ms a bucket, the stream falls behind from the first bucket (ready at
    # 25 ms): done at 225 ms, 125 ms exposed = 200 − 100·3/4.
    assert bucketed_exposed_s(0.100, 0.200, 4) == pytest.approx(0.125)
    # One bucket (vTrain's unbucketed reduction) exposes all of it; no compute hides nothing.
    assert bucketed_exposed_s(0.100, 0.040, 1) == pytest.approx(0.040)
    assert bucketed_exposed_s(0.0, 0.040, 8) == pytest.approx(0.040)


def test_bucketed_overlap_matches_the_event_order() -> None:
    rng = random.Random(3)
    for _ in range(200):
        compute, comm, k = rng.uniform(0, 2), rng.uniform(0, 2), rng.randint(1, 64)
        assert bucketed_exposed_s(compute, comm, k) == pytest.approx(_stream(compute, comm, k), abs=1e-12)


def test_overlapped_compute_runs_slower_beside_a_collective() -> None:
    s = OVERLAP_SLOWDOWN
    # 10 ms of compute beside 4 ms of communication: during those 4 ms it does 4/(1+s) ms of work.
    assert overlapped_s(0.010, 0.004) == pytest.approx(0.004 + (0.010 - 0.004 / (1 + s)))
    # A collective longer than the slowed compute sets the time; no slowdown is the plain maximum.
    assert overlapped_s(0.010, 0.020) == 0.020
    assert overlapped_s(0.010, 0.004, slowdown=0.0) == pytest.approx(0.010)
    assert overlapped_s(0.010, 0.020, slowdown=0.0) == pytest.approx(0.020)
    # As long as the collective: during its 10 ms the compute does 10/(1+s) ms of work, the rest
    # runs alone after it (the collective alone would be the maximum, 10 ms).
    assert overlapped_s(0.010, 0.010) == pytest.approx(0.010 + (0.010 - 0.010 / (1 + s)))
    assert overlapped_s(0.010, 0.010) > 0.010
    # Continuous where the two meet: compute·(1+s) = comm.
    assert overlapped_s(0.010, 0.010 * (1 + s) * (1 - 1e-12)) == pytest.approx(0.010 * (1 + s))


def test_the_gpu_figures_apply_to_the_accelerator_presets_only() -> None:
    from paratrain.cost.dp_reduction import default_overlap_slowdown, default_skew_cv
    from paratrain.spec.device import resolve_device

    a100, cpu = resolve_device("a100-80gb"), resolve_device("cpu")
    assert default_skew_cv(a100) == RANK_CV and default_overlap_slowdown(a100) == OVERLAP_SLOWDOWN
    assert default_skew_cv(cpu) == 0.0 and default_overlap_slowdown(cpu) == 0.0


def test_megatron_bucket_size_and_count() -> None:
    assert megatron_bucket_elements(8) == 40_000_000
    assert megatron_bucket_elements(192) == 192_000_000
    # GPT-3 175B at tp 8, pp 8: 2.7 billion parameters a rank, 68 buckets at dp 16.
    assert num_buckets(2.7e9, megatron_bucket_elements(16)) == 68
    assert num_buckets(10, 40) == 1 and num_buckets(0, 40) == 1


def test_bf16_gradients_are_reduced_in_fp32() -> None:
    assert grad_reduce_bytes(2e9, "bf16") == 4e9
    assert grad_reduce_bytes(2e9, "fp16") == 2e9
    assert grad_reduce_bytes(4e9, "fp32") == 4e9


def test_skew_closed_form_and_the_expected_maximum_it_bounds() -> None:
    assert skew_s(10.0, 1) == 0.0
    assert skew_s(10.0, 1024) == pytest.approx(RANK_CV * 10.0 * math.sqrt(2 * math.log(1024)))
    assert skew_s(10.0, 1024, cv=0.02) == pytest.approx(2 * skew_s(10.0, 1024))
    # sqrt(2 ln N) bounds the mean maximum of N standard normals and approaches it: at N = 1024 the
    # sampled mean maximum is about 3.2 against the bound's 3.72.
    rng = random.Random(0)
    n, trials = 1024, 400
    mean_max = sum(max(rng.gauss(0, 1) for _ in range(n)) for _ in range(trials)) / trials
    bound = math.sqrt(2 * math.log(n))
    assert 0.8 * bound < mean_max < bound
    # It grows with the ranks, slowly.
    assert skew_s(1.0, 64) < skew_s(1.0, 1024) < skew_s(1.0, 12288) < 1.6 * skew_s(1.0, 64)


@pytest.mark.parametrize(("call", "field"), [
    (lambda: bucketed_exposed_s(-1.0, 1.0, 2), "compute_s"),
    (lambda: bucketed_exposed_s(1.0, float("nan"), 2), "comm_s"),
    (lambda: bucketed_exposed_s(1.0, 1.0, 0), "buckets"),
    (lambda: skew_s(1.0, 0), "ranks"),
    (lambda: megatron_bucket_elements(0), "dp"),
    (lambda: grad_reduce_bytes(1.0, "int4"), "dtype"),
])
def test_bad_input(call, field: str) -> None:
    with pytest.raises(ConfigError) as e:
        call()
    assert e.value.field == field


def test_hierarchical_all_reduce_by_hand() -> None:
    """Intra-node ring reduce-scatter over 8 GPUs, all-reduce of each GPU's 1/8 shard across the
    nodes (one NIC per GPU, the DGX A100's 200 Gb/s), intra-node ring all-gather."""
    n = 1e9
    dgx = resolve_cluster("dgx-a100", nodes=16)
    a_i, bw_i = dgx.intra_link.latency_s, dgx.intra_link.bandwidth_Bps
    a_x, nic = max(dgx.inter_link.latency_s, a_i), dgx.inter_link.bandwidth_Bps
    assert nic == pytest.approx(200e9 / 8)
    intra = 7 * a_i + 7 / 8 * n / bw_i  # ring reduce-scatter (and all-gather) over the node's 8 GPUs
    shard = n / 8
    # 2 nodes: ring and recursive halving/doubling tie (one step each way); the tree pays the full shard twice.
    two = intra + (2 * a_x + 2 * (1 / 2) * shard / nic) + intra
    assert collective_time("all_reduce", n, range(16), dgx, "hierarchical").time_s == pytest.approx(two)
    # 16 nodes: Rabenseifner (log2 16 = 4 steps each way) beats the 15-step ring on latency.
    sixteen = intra + (2 * 4 * a_x + 2 * 15 / 16 * shard / nic) + intra
    assert collective_time("all_reduce", n, range(128), dgx, "hierarchical").time_s == pytest.approx(sixteen)
    # The ring's latency grows with its participants: 2(p−1) steps.
    one_per_node = tuple(range(0, 128, 8))
    ring = collective_time("all_reduce", 8.0, one_per_node, dgx, "ring").time_s
    assert ring == pytest.approx(2 * 15 * a_x + 2 * 15 / 16 * 8.0 / nic)


def test_simulator_charges_the_bucketed_tail_and_the_skew() -> None:
    from paratrain.cost.stage import chunk_costs
    from paratrain.schedule.registry import generate
    from paratrain.sim.report import timing_for_config
    from paratrain.spec.model import preset

    model = preset("gpt3-1.3b")
    cluster = resolve_cluster("dgx-a100", nodes=2)
    config = ParallelConfig(dp=16, microbatch=2, global_batch=64, dtype="bf16")
    schedule = generate("1f1b", stages=1, microbatches=config.num_microbatches)
    (cost,) = costs = chunk_costs(model, cluster, config)
    ranks = tuple(config.group_ranks("dp")[0])
    full = collective_time("all_reduce", 2 * cost.grad_reduce_bytes, ranks, cluster).time_s  # fp32 = 2 × bf16
    plain = timing_for_config(schedule, costs, cluster, config, skew_cv=0.0)
    assert plain.reduce_s == (pytest.approx(full),)
    k = num_buckets(cost.grad_reduce_bytes / 2, megatron_bucket_elements(16))
    bucketed = timing_for_config(schedule, costs, cluster, config, grad_buckets=True, skew_cv=0.0)
    assert bucketed.reduce_s == (pytest.approx(bucketed_exposed_s(cost.backward_s, full, k)),)
    assert bucketed.reduce_s[0] < full
    # What the buckets hide slows the backward beside them: the rank's step carries the lost compute.
    lost = overlapped_s(cost.backward_s, full - bucketed.reduce_s[0]) - cost.backward_s
    assert lost > 0 and bucketed.optimizer_s[0] - plain.optimizer_s[0] == pytest.approx(lost)
    # The step's all-reduce over every rank waits for the slowest: the A100 preset's 1 % spread.
    skewed = timing_for_config(schedule, costs, cluster, config)
    busy = config.num_microbatches * (cost.forward_s + cost.backward_s)
    assert skewed.optimizer_s == plain.optimizer_s
    assert skewed.step_allreduce_s - plain.step_allreduce_s == pytest.approx(skew_s(busy, 16))

"""simulate_config: the cost-model path the planner calls."""

from __future__ import annotations

import pytest

from paratrain.cost.collectives import collective_time
from paratrain.cost.stage import chunk_costs
from paratrain.parallel.config import ParallelConfig
from paratrain.schedule import generate
from paratrain.sim import simulate, simulate_config, timing_for_config
from paratrain.spec.cluster import resolve_cluster
from paratrain.spec.model import resolve_model

MODEL = resolve_model("gpt3-1.3b")
CLUSTER = resolve_cluster("dgx-a100", gpus=16)


def _cfg(**kw) -> ParallelConfig:
    base = dict(dp=2, tp=2, pp=4, microbatch=2, global_batch=64, schedule="1f1b")
    return ParallelConfig(**{**base, **kw})


def test_overlapped_reduction_is_never_slower() -> None:
    for sched, v in (("1f1b", 1), ("interleaved", 2), ("zb-h1", 1)):
        cfg = _cfg(schedule=sched, virtual_stages=v)
        on = simulate_config(MODEL, CLUSTER, cfg, overlap_grad_reduce=True).iteration_time_s
        off = simulate_config(MODEL, CLUSTER, cfg, overlap_grad_reduce=False).iteration_time_s
        assert on <= off


def test_chimera_holds_two_replicas() -> None:
    one = simulate_config(MODEL, CLUSTER, _cfg()).memory
    two = simulate_config(MODEL, CLUSTER, _cfg(schedule="chimera")).memory
    assert one is not None and two is not None
    for r in range(4):
        assert two[r].weight_bytes == one[r].weight_bytes + one[3 - r].weight_bytes
    cfg = _cfg(schedule="chimera")
    s = generate("chimera", stages=4, microbatches=cfg.num_microbatches)
    t = timing_for_config(s, chunk_costs(MODEL, CLUSTER, cfg), CLUSTER, cfg)
    # chunk 0's replicas live on pipeline ranks 0 and 3, each with its data-parallel pair
    assert t.reduce_groups[0] == (0, 2, 12, 14)


def test_transfer_time_follows_placement() -> None:
    cfg = _cfg()
    s = generate("1f1b", stages=4, microbatches=cfg.num_microbatches)
    costs = chunk_costs(MODEL, CLUSTER, cfg)
    t = timing_for_config(s, costs, CLUSTER, cfg)
    # mesh (pp, dp, tp): pipeline rank r is global rank 4r, so ranks 0-1 share node 0 and 1-2 cross nodes
    assert [cfg.rank_of(pp=r) for r in range(4)] == [0, 4, 8, 12]
    # each transfer also re-assembles the tensor-parallel slices on arrival (Megatron's
    # scatter/gather: an all-gather over the receiver's tp group, the same on every node)
    gather = costs[0].p2p_gather_s
    assert gather > 0 and costs[1].p2p_gather_s == gather
    intra = collective_time("p2p", costs[0].p2p_bytes, (0, 4), CLUSTER).time_s + gather
    inter = collective_time("p2p", costs[1].p2p_bytes, (4, 8), CLUSTER).time_s + gather
    assert t.p2p_s(0, 1, 0) == intra and t.p2p_s(1, 2, 1) == inter
    assert inter > intra
    # the reduction of chunk c spans its data-parallel group
    assert t.reduce_groups[0] == (0, 2)


def test_compute_times_come_from_the_cost_model() -> None:
    cfg = _cfg(pp=1, dp=1, tp=1, global_batch=4, microbatch=1)
    cl = resolve_cluster("dgx-a100", gpus=1)
    (c,) = chunk_costs(MODEL, cl, cfg)
    r = simulate_config(MODEL, cl, cfg)
    # one rank, four micro-batches, no communication: busy = 4 (F + B) + optimizer step
    s = generate("1f1b", stages=1, microbatches=4)
    t = timing_for_config(s, [c], cl, cfg)
    assert r.iteration_time_s == pytest.approx(4 * (c.forward_s + c.backward_s) + t.optimizer_s[0], rel=1e-12)
    assert r.bubble_fraction == pytest.approx(0.0, abs=1e-12)
    assert simulate(s, t).iteration_time_s == pytest.approx(r.iteration_time_s, rel=1e-12)

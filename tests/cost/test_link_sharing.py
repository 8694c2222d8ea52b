"""Transfers sharing a link (cost.link_sharing), the simulator's use of it for the interleaved
schedule's batched exchanges, and the fp32 gradient buffer of bf16 training (cost.memory)."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest

from paratrain.cost.link_sharing import share_by_link, shared_completion_s
from paratrain.cost.stage import chunk_costs
from paratrain.errors import ConfigError
from paratrain.parallel.config import ParallelConfig
from paratrain.schedule import generate
from paratrain.sim import simulate, uniform_timing
from paratrain.sim.program import _P2P, _program
from paratrain.sim.report import _generate_cached, simulate_config, timing_for_config
from paratrain.spec.cluster import resolve_cluster
from paratrain.spec.model import ModelSpec


def _processor_sharing(sizes: list[float]) -> list[float]:
    """Event-by-event fair sharing of one link: at every instant the unfinished transfers split
    it equally; returns each one's completion time (an independent derivation of the closed form)."""
    left = list(sizes)
    done = [0.0] * len(sizes)
    t = 0.0
    active = [i for i, x in enumerate(left) if x > 0]
    while active:
        # advance to the next completion at the current rate 1/len(active)
        step = min(left[i] for i in active) * len(active)
        t += step
        for i in active:
            left[i] -= step / len(active)
        for i in active:
            if left[i] <= 1e-12:
                done[i] = t
        active = [i for i in active if left[i] > 1e-12]
    return done


def test_closed_form_equals_fair_sharing_of_one_link() -> None:
    rng = random.Random(3)
    for n in (1, 2, 3, 5):
        sizes = [rng.uniform(0.1, 2.0) for _ in range(n)]
        assert shared_completion_s(sizes) == pytest.approx(_processor_sharing(sizes), rel=1e-9)
    # equal transfers all end at n·x, one alone is unchanged, a free one stays free
    assert shared_completion_s([0.5, 0.5]) == (1.0, 1.0)
    assert shared_completion_s([0.5]) == (0.5,)
    assert shared_completion_s([0.0, 1.0]) == (0.0, 1.0)
    # the short of two (1 and 3) ends at 2 (half rate), the long at 4 (all bytes through one link)
    assert shared_completion_s([1.0, 3.0]) == (2.0, 4.0)


def test_only_transfers_on_the_same_link_share() -> None:
    assert share_by_link([1.0, 1.0, 2.0], ["nic", ("node", 3), "nic"]) == (2.0, 1.0, 3.0)
    with pytest.raises(ConfigError):
        share_by_link([1.0], ["a", "b"])
    for bad in (-1.0, float("nan"), float("inf"), True):
        with pytest.raises(ConfigError):
            shared_completion_s([bad])


def _p2p_steps(schedule, timing) -> list[tuple]:  # noqa: ANN001
    return [step for row in _program(schedule, schedule.compiled, timing) for step in row if step[0] == _P2P]


def test_interleaved_batches_share_the_link_of_their_rank() -> None:
    # Steady state of the interleaved schedule: two receives (from both neighbours) and two sends
    # in one batch; through one link each takes twice its time alone.
    s = generate("interleaved", stages=4, microbatches=8, virtual_stages=2)
    t = replace(uniform_timing(s), p2p_s=lambda src, dst, c: 0.25)
    shared = replace(t, p2p_link=lambda r, peer: "nic")
    four = 0
    for alone, both in zip(_p2p_steps(s, t), _p2p_steps(s, shared), strict=True):
        sends = sum(op[3] for op in alone[1])
        recvs = len(alone[1]) - sends
        four += sends == recvs == 2
        for a, b in zip(alone[1], both[1], strict=True):
            assert a[2] == 0.25
            assert b[2] == 0.25 * (sends if a[3] else recvs)
    assert four > 0
    # links of their own (a transfer inside the node to another peer): nothing changes
    own = replace(t, p2p_link=lambda r, peer: ("node", peer))
    assert simulate(s, own).iteration_time_s == simulate(s, t).iteration_time_s
    assert simulate(s, shared).iteration_time_s > simulate(s, t).iteration_time_s


MODEL = ModelSpec(layers=16, hidden=2048, heads=16, seq=2048, vocab=51200, name="gpt-16x2048")


def test_simulator_shares_the_nic_only_across_nodes() -> None:
    # pp outermost over 4 nodes: every pipeline neighbour is on another node, so the interleaved
    # schedule's two receives share the GPU's NIC; 1F1B batches one receive at a time.
    cluster = resolve_cluster("dgx-a100", nodes=4)
    base = dict(dp=8, pp=4, microbatch=1, global_batch=64, mesh_order=("pp", "dp", "cp", "tp"))
    one = ParallelConfig(schedule="1f1b", **base)
    inter = ParallelConfig(schedule="interleaved", virtual_stages=2, **base)
    unshared = {}
    for cfg in (one, inter):
        res = simulate_config(MODEL, cluster, cfg)
        sch = _generate_cached(cfg.schedule.value, cfg.pp, cfg.num_microbatches, cfg.virtual_stages)
        timing = replace(timing_for_config(sch, chunk_costs(MODEL, cluster, cfg), cluster, cfg, grad_buckets=True),
                         p2p_link=None)
        unshared[cfg.schedule.value] = (res.iteration_time_s, simulate(sch, timing).iteration_time_s)
    shared_1f1b, alone_1f1b = unshared["1f1b"]
    shared_int, alone_int = unshared["interleaved"]
    assert shared_1f1b == pytest.approx(alone_1f1b, rel=1e-12)
    assert shared_int > alone_int


# bf16 training keeps fp32 main gradients: Megatron-Core's distributed-optimizer table counts
# "bf16 parameters, fp32 gradients" at 18 B per parameter, 6 + 12/d with the optimizer sharded.
GPT = ModelSpec(layers=4, hidden=1024, heads=16, seq=1024, vocab=32000, name="gpt-4x1024")


@pytest.mark.parametrize("dp", [1, 4, 64])
def test_bf16_bytes_per_parameter_follow_megatron_table(dp: int) -> None:
    cluster = resolve_cluster("dgx-a100", nodes=8)
    p = GPT.param_count()
    (none,) = chunk_costs(GPT, cluster, ParallelConfig(dp=dp, sharding="none", global_batch=dp))
    (z1,) = chunk_costs(GPT, cluster, ParallelConfig(dp=dp, sharding="zero1", global_batch=dp))
    assert none.weight_bytes + none.grad_bytes + none.optimizer_bytes == 18 * p
    assert z1.weight_bytes + z1.grad_bytes == 6 * p and z1.optimizer_bytes == -(-12 * p // dp)
    # the reduction's bytes stay the bf16 gradient's; the simulator moves them in fp32
    assert z1.grad_reduce_bytes == 2 * p
    fp16 = ParallelConfig(dp=dp, sharding="none", global_batch=dp, dtype="fp16")
    (c16,) = chunk_costs(GPT, cluster, fp16)
    assert c16.grad_bytes == 2 * p  # fp16 gradients stay 16-bit

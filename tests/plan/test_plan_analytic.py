"""Closed forms of the planner: textbook bubbles with uniform stages, and agreement with the
discrete-event simulator within 3 % on the standard schedules with real costs."""

from __future__ import annotations

import dataclasses

import pytest

from paratrain.cost.flops import model_flops_per_iteration
from paratrain.cost.types import ChunkCost
from paratrain.parallel.config import ParallelConfig
from paratrain.plan.analytic import PipelineInputs, RankStats, estimate, inflight_per_chunk
from paratrain.plan.backend import default_backend
from paratrain.plan.search import evaluate
from paratrain.spec.cluster import resolve_cluster
from paratrain.spec.model import preset


def _uniform(n: int, f: float = 1.0, b: float = 2.0, w_frac: float = 0.0) -> tuple[ChunkCost, ...]:
    ck = ChunkCost(
        forward_s=f,
        backward_input_s=b * (1 - w_frac),
        backward_weight_s=b * w_frac,
        recompute_s=0.0,
        tp_comm_s=0.0,
        activation_bytes=10,
        weight_bytes=100,
        grad_bytes=100,
        optimizer_bytes=600,
        grad_reduce_bytes=100,
        p2p_bytes=1,
        model_flops=1.0,
    )
    return (ck,) * n


def _free(config: ParallelConfig, chunks) -> PipelineInputs:
    n = len(chunks)
    return PipelineInputs(
        stats=RankStats.of(chunks, config.pp),
        p2p_s=0.0,
        grad_reduce_s=(0.0,) * n,
        param_gather_s=(0.0,) * n,
        optimizer_s=(0.0,) * config.pp,
    )


@pytest.mark.parametrize("p,m", [(2, 2), (4, 8), (8, 8), (8, 32), (3, 7)])
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_gpipe_and_1f1b_bubble_closed_form(schedule, p, m):
    cfg = ParallelConfig(pp=p, microbatch=1, global_batch=m, schedule=schedule)
    est = estimate(cfg, _free(cfg, _uniform(p)))
    assert est.iteration_time_s == pytest.approx((m + p - 1) * 3.0)
    assert est.bubble_fraction == pytest.approx((p - 1) / (m + p - 1))


@pytest.mark.parametrize("p,v,m", [(2, 2, 4), (4, 2, 8), (4, 4, 16), (8, 3, 16)])
def test_interleaved_bubble_closed_form(p, v, m):
    cfg = ParallelConfig(pp=p, microbatch=1, global_batch=m, schedule="interleaved", virtual_stages=v)
    # Chunks of 1/v of a stage: forward 1/v, backward 2/v.
    est = estimate(cfg, _free(cfg, _uniform(p * v, 1.0 / v, 2.0 / v)))
    assert est.bubble_fraction == pytest.approx((p - 1) / (v * m + p - 1))


def test_zero_bubble_h1_with_equal_thirds():
    # F = B_input = W = 1: ZB-H1's bubble (p-1)(F + B - W) = (p-1)·1 (Qi et al. 2024, sec. 3.1).
    p, m = 4, 8
    cfg = ParallelConfig(pp=p, microbatch=1, global_batch=m, schedule="zb-h1")
    est = estimate(cfg, _free(cfg, _uniform(p, 1.0, 2.0, w_frac=0.5)))
    assert est.iteration_time_s == pytest.approx(m * 3.0 + (p - 1) * 1.0)


def test_chimera_bubble_matches_the_paper_for_one_unit():
    # N = D micro-batches, F = B: (D-2) idle slots of one forward (Li & Hoefler 2021, Table 1).
    p = 4
    cfg = ParallelConfig(pp=p, microbatch=1, global_batch=p, schedule="chimera")
    est = estimate(cfg, _free(cfg, _uniform(p, 1.0, 1.0)))
    assert est.iteration_time_s == pytest.approx(p * 2.0 + (p - 2) * 1.0)


def test_inflight_counts():
    cfg = ParallelConfig(pp=4, microbatch=1, global_batch=8, schedule="1f1b")
    assert inflight_per_chunk(cfg) == [4, 3, 2, 1]
    assert inflight_per_chunk(ParallelConfig(pp=4, global_batch=8, schedule="gpipe")) == [8.0] * 4
    inter = ParallelConfig(pp=4, global_batch=8, schedule="interleaved", virtual_stages=2)
    # Megatron's warm-up on rank 0: (v-1)·p + 2(p-1) + 1 = 11 chunk-micro-batches over 2 chunks.
    assert inflight_per_chunk(inter)[0] == pytest.approx(11 / 2)


_GPT175 = preset("gpt3-175b")
_GPT13 = preset("gpt3-13b")
CASES = [
    (_GPT175, 1024, 1536, dict(dp=16, tp=8, pp=8, microbatch=1, recompute="selective", sequence_parallel=True)),
    (_GPT175, 1024, 1536, dict(dp=32, tp=8, pp=4, microbatch=2, recompute="full", optimizer_sharding=True)),
    (_GPT13, 64, 512, dict(dp=2, tp=8, pp=4, microbatch=1, recompute="selective")),
    (_GPT13, 64, 512, dict(dp=8, tp=2, pp=4, microbatch=4, recompute="none")),
]


@pytest.mark.slow
@pytest.mark.parametrize("schedule,v", [("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("zb-h1", 1)])
@pytest.mark.parametrize("case", range(len(CASES)))
@pytest.mark.parametrize("overlap", [True, False])
def test_analytic_agrees_with_the_simulator_within_3_percent(schedule, v, case, overlap):
    from paratrain.sim import simulate_config

    model, gpus, batch, kw = CASES[case]
    cluster = resolve_cluster("dgx-a100", gpus=gpus)
    cfg = ParallelConfig(global_batch=batch, schedule=schedule, virtual_stages=v, **kw)
    if model.layers % cfg.num_chunks:  # uneven: give the near-even split explicitly
        cfg = dataclasses.replace(cfg, partition=cfg.layers_per_chunk(model.layers))
    sim = simulate_config(model, cluster, cfg, overlap_grad_reduce=overlap)
    est = evaluate(
        model, cluster, cfg, default_backend(), model_flops_per_iteration(model, batch), overlap_grad_reduce=overlap
    )
    assert est.analytic.iteration_time_s == pytest.approx(sim.iteration_time_s, rel=0.03)
    assert est.estimate.peak_memory_bytes == pytest.approx(sim.peak_memory_bytes, rel=0.03)
    assert est.analytic.mfu == pytest.approx(sim.mfu, rel=0.03)

"""The search with injected fake costs: the pruned search finds the exhaustive optimum, pins hold,
and impossible requests fail with the right message."""

from __future__ import annotations

import dataclasses

import pytest

from paratrain.errors import ConfigError
from paratrain.parallel.config import ParallelConfig, ScheduleName
from paratrain.plan.backend import PlanCache
from paratrain.plan.search import evaluate, plan, simulated_actions
from paratrain.plan.space import Pins, Rejections, layouts, microbatches, schedule_rule_ok, variants
from paratrain.spec.cluster import resolve_cluster
from paratrain.spec.model import preset

MODEL = preset("gpt3-1.3b")
CLUSTER = resolve_cluster("dgx-a100", gpus=32)


def _exhaustive(backend, model, cluster, batch, pins=Pins()):
    """Every candidate evaluated, no pruning: the best memory-feasible analytic time."""
    cap = cluster.device.memory_bytes
    best = None
    for lay in layouts(model, cluster, batch, pins, Rejections()):
        for variant in variants(model, batch, lay, pins):
            for mb in microbatches(batch, lay, pins, Rejections()):
                m = batch // (lay.dp * mb)
                if not schedule_rule_ok(variant.schedule, lay.pp, variant.virtual_stages, m):
                    continue
                cfg = dataclasses.replace(variant, microbatch=mb)
                if model.layers % cfg.num_chunks:
                    cfg = dataclasses.replace(cfg, partition=cfg.layers_per_chunk(model.layers))
                cand = evaluate(model, cluster, cfg, backend, 1.0)
                if cand.estimate.peak_memory_bytes <= cap and (
                    best is None or cand.analytic.iteration_time_s < best.analytic.iteration_time_s
                ):
                    best = cand
    return best


def test_pruned_search_finds_the_exhaustive_optimum(fake_backend):
    no_sim = dataclasses.replace(fake_backend, simulate=None)
    res = plan(MODEL, CLUSTER, 256, backend=no_sim, refine=1, confirm=1, top=1)
    want = _exhaustive(dataclasses.replace(no_sim, cache=PlanCache()), MODEL, CLUSTER, 256)
    assert res.winner.analytic.iteration_time_s <= want.analytic.iteration_time_s * (1 + 1e-12)
    assert res.rejected.get("slower_than_top", 0) > 0  # the bound did prune


def test_winner_is_confirmed_by_the_simulator_and_ranked_by_it(fake_backend):
    res = plan(MODEL, CLUSTER, 256, backend=fake_backend, confirm=3, top=5)
    sims = [c for c in res.ranked if c.simulated is not None]
    assert len(sims) == 3 and res.winner.simulated is not None
    times = [c.metrics.iteration_time_s for c in sims]
    assert times == sorted(times)
    assert res.winner.metrics.peak_memory_bytes <= CLUSTER.device.memory_bytes
    assert res.considered >= res.evaluated > 0


def test_simulated_actions_count_every_chunk_pass_of_every_microbatch():
    # 4 stages x 2 chunks, 64 / (2 x 4) = 8 micro-batches: forward and backward of each, 128 actions;
    # ZB-H1 splits the backward into input and weight gradients (3 per chunk and micro-batch).
    inter = ParallelConfig(dp=2, pp=4, microbatch=4, global_batch=64, schedule=ScheduleName.INTERLEAVED,
                           virtual_stages=2)
    assert simulated_actions(inter) == 2 * 8 * 8
    zb = ParallelConfig(dp=2, pp=4, microbatch=4, global_batch=64, schedule=ScheduleName.ZB_H1)
    assert simulated_actions(zb) == 3 * 4 * 8


def test_confirmation_budget_counts_actions_not_seconds(fake_backend):
    # The order the simulator confirms in: the closed forms' ranking.
    order = [c.config for c in plan(MODEL, CLUSTER, 256, backend=dataclasses.replace(fake_backend, simulate=None),
                                    confirm=3, top=5).ranked]
    # No budget beyond the first: the first candidate alone is simulated, whatever the machine's speed.
    one = plan(MODEL, CLUSTER, 256, backend=fake_backend, confirm=3, top=5, confirm_budget_actions=0)
    assert [c.config for c in one.ranked if c.simulated is not None] == order[:1]
    # A budget of exactly the first two candidates' actions confirms those two and stops.
    budget = simulated_actions(order[0]) + simulated_actions(order[1])
    two = plan(MODEL, CLUSTER, 256, backend=fake_backend, confirm=3, top=5, confirm_budget_actions=budget)
    assert {c.config for c in two.ranked if c.simulated is not None} == set(order[:2])
    # The default budget confirms all three.
    full = plan(MODEL, CLUSTER, 256, backend=fake_backend, confirm=3, top=5)
    assert sum(c.simulated is not None for c in full.ranked) == 3


def test_pins_are_respected(fake_backend):
    pins = Pins(
        tp=2,
        pp=4,
        microbatch=2,
        schedule=ScheduleName.INTERLEAVED,
        recompute="full",
        sequence_parallel=True,
        optimizer_sharding=False,
    )
    res = plan(MODEL, CLUSTER, 256, pins=pins, backend=fake_backend)
    for c in res.ranked:
        cfg = c.config
        assert (cfg.tp, cfg.pp, cfg.dp, cfg.microbatch) == (2, 4, 4, 2)
        assert cfg.schedule is ScheduleName.INTERLEAVED and cfg.virtual_stages > 1
        assert cfg.recompute.value == "full" and cfg.sequence_parallel and not cfg.optimizer_sharding


def test_balanced_partition_lightens_the_end_stages(fake_backend):
    # A head worth three layers (think of a large vocabulary): with 24 layers on 4 stages the
    # even split (6 each) makes the last stage take 9 layer-times; the balanced one moves layers off it.
    from tests.plan.conftest import LAYER_FWD_S, fake_chunk_costs

    def heavy_head(model, cluster, config):
        chunks = fake_chunk_costs(model, cluster, config)
        extra = 2 * config.microbatch * LAYER_FWD_S / config.tp
        last = dataclasses.replace(
            chunks[-1],
            forward_s=chunks[-1].forward_s + extra,
            backward_input_s=chunks[-1].backward_input_s + extra,
            backward_weight_s=chunks[-1].backward_weight_s + extra,
        )
        return [*chunks[:-1], last]

    pins = Pins(
        tp=1,
        pp=4,
        microbatch=1,
        schedule=ScheduleName.ONE_F_ONE_B,
        recompute="none",
        sequence_parallel=False,
        optimizer_sharding=False,
        mesh_order=("pp", "dp", "tp"),
    )
    backend = dataclasses.replace(fake_backend, chunk_costs=heavy_head, simulate=None)
    res = plan(MODEL, CLUSTER, 256, pins=pins, backend=backend, top=1)
    part = res.winner.config.layers_per_chunk(MODEL.layers)
    assert sum(part) == MODEL.layers and part[-1] < 6 and res.winner.config.partition == part
    even = evaluate(
        MODEL,
        CLUSTER,
        dataclasses.replace(res.winner.config, partition=None),
        dataclasses.replace(backend, cache=PlanCache()),
        1.0,
    )
    assert res.winner.analytic.iteration_time_s < even.analytic.iteration_time_s


def test_batch_no_layout_divides(fake_backend):
    with pytest.raises(ConfigError) as err:
        plan(MODEL, CLUSTER, 7, pins=Pins(dp=32), backend=fake_backend)
    assert err.value.field == "global_batch"


def test_model_fits_nowhere_names_the_memory_and_gpu_count():
    # Real costs: 175B parameters need ~2.8 TB of weights, gradients and Adam state; 8 GPUs hold 640 GB.
    big = preset("gpt3-175b")
    with pytest.raises(ConfigError) as err:
        plan(big, resolve_cluster("dgx-a100", gpus=8), 64)
    msg = str(err.value)
    assert "GiB per GPU" in msg and "use at least" in msg
    gpus = int(msg.split("use at least ")[1].split()[0])
    assert gpus > 8
    plan(big, resolve_cluster("dgx-a100", gpus=gpus), 64, confirm=1)  # the advice is right: it fits there


def test_pin_not_dividing_the_gpus(fake_backend):
    with pytest.raises(ConfigError) as err:
        plan(MODEL, CLUSTER, 256, pins=Pins(tp=3), backend=fake_backend)
    assert err.value.field == "tp" and "tp(3) does not divide" in err.value.problem


def test_pinned_partition_is_used_where_it_fits(fake_backend):
    res = plan(MODEL, CLUSTER, 256, pins=Pins(pp=2, partition=(13, 11)), backend=fake_backend)
    assert all(c.config.partition == (13, 11) and c.config.num_chunks == 2 for c in res.ranked)
    assert res.rejected.get("partition_mismatch", 0) > 0
    with pytest.raises(ConfigError, match="^partition: sums to 25"):
        plan(MODEL, CLUSTER, 256, pins=Pins(partition=(13, 12)), backend=fake_backend)
    with pytest.raises(ConfigError, match="^partition: no candidate"):
        plan(
            MODEL,
            CLUSTER,
            256,
            pins=Pins(pp=2, schedule=ScheduleName.ONE_F_ONE_B, partition=(5, 5, 5, 9)),
            backend=fake_backend,
        )


def test_sweep_records_points_that_fail(fake_backend):
    from paratrain.plan.sweep import parse_sweep, sweep

    var, values = parse_sweep("batch=256,7")
    assert (var, values) == ("batch", [256, 7])
    points = sweep(MODEL, CLUSTER, 256, var, values, plan, pins=Pins(dp=32), backend=fake_backend)
    assert points[0].result is not None and points[0].result.winner.config.global_batch == 256
    assert points[1].result is None and points[1].error is not None and points[1].error.field == "global_batch"
    with pytest.raises(ConfigError, match="^sweep:"):
        parse_sweep("gpus=")


def test_pinned_virtual_stages_select_interleaving(fake_backend):
    res = plan(MODEL, CLUSTER, 256, pins=Pins(virtual_stages=3), backend=fake_backend)
    assert all(c.config.schedule is ScheduleName.INTERLEAVED and c.config.virtual_stages == 3 for c in res.ranked)
    res = plan(MODEL, CLUSTER, 256, pins=Pins(virtual_stages=1), backend=fake_backend)
    assert all(c.config.virtual_stages == 1 for c in res.ranked)


def test_one_backend_reused_for_another_model_or_cluster_prices_each_anew():
    """The plan caches key costs by layout alone; a backend asked for another model (or cluster)
    empties them instead of returning the first problem's costs."""
    from paratrain.plan.backend import default_backend

    config = ParallelConfig(dp=4, tp=4, pp=2, microbatch=1, global_batch=64, schedule=ScheduleName.ONE_F_ONE_B)
    wide = dataclasses.replace(MODEL, name="gpt-wide", hidden=2 * MODEL.hidden, heads=2 * MODEL.heads)
    slow = dataclasses.replace(CLUSTER, inter_link=dataclasses.replace(
        CLUSTER.inter_link, bandwidth_Bps=CLUSTER.inter_link.bandwidth_Bps / 10))

    def fresh(model, cluster) -> float:  # noqa: ANN001
        return evaluate(model, cluster, config, default_backend(simulate=False), 1.0).analytic.iteration_time_s

    shared = default_backend(simulate=False)
    times = [evaluate(m, c, config, shared, 1.0).analytic.iteration_time_s
             for m, c in ((MODEL, CLUSTER), (wide, CLUSTER), (wide, slow), (MODEL, CLUSTER))]
    assert times == [fresh(MODEL, CLUSTER), fresh(wide, CLUSTER), fresh(wide, slow), fresh(MODEL, CLUSTER)]
    assert times[1] > 2 * times[0] and times[2] > times[1]  # each problem really costs differently

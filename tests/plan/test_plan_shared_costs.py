"""The planner and the simulator share one throughput function and one optimizer-step time: their
figures for the same iteration are the same numbers, and each function matches its formula worked
by hand."""

from __future__ import annotations

import pytest

from paratrain.cost.optimizer import optimizer_step_bytes, optimizer_step_s
from paratrain.cost.stage import chunk_costs
from paratrain.cost.throughput import throughput
from paratrain.errors import ConfigError
from paratrain.parallel.config import ParallelConfig
from paratrain.plan.backend import default_backend, pipeline_inputs
from paratrain.plan.search import plan
from paratrain.plan.space import Pins, Rejections, layouts, variants
from paratrain.sim.report import _generate_cached, simulate_config, timing_for_config
from paratrain.spec.cluster import resolve_cluster
from paratrain.spec.device_presets import DEVICE_PRESETS
from paratrain.spec.model import preset

MODEL = preset("gpt3-1.3b")


def test_throughput_by_hand() -> None:
    dev = DEVICE_PRESETS["a100-80gb"]
    cfg = ParallelConfig(dp=2, tp=2, microbatch=2, global_batch=8)  # 4 GPUs, 8 samples
    r = throughput(MODEL, dev, cfg, 2.0, model_flops=1e15, hardware_flops=1.5e15)
    peak = dev.peak_flops("bf16")
    assert r.samples_per_s == 4.0
    assert r.tokens_per_s == 4.0 * MODEL.seq
    assert r.tflops_per_gpu == pytest.approx(1e15 / 2.0 / 4 / 1e12, rel=1e-15)
    assert r.mfu == pytest.approx(1e15 / (2.0 * 4 * peak), rel=1e-15)
    assert r.hfu == pytest.approx(1.5 * r.mfu, rel=1e-15)
    assert throughput(MODEL, dev, cfg, 2.0, model_flops=1e15).hfu is None


def test_optimizer_step_by_hand() -> None:
    dev = DEVICE_PRESETS["a100-80gb"]
    # fused: read gradients, read + write the state, write the weights
    assert optimizer_step_bytes(100, 100, 600) == 1400
    assert optimizer_step_s(100, 100, 600, dev) == 1400 / dev.memory_bandwidth_Bps
    # torch: 25 fp32 element accesses per parameter; 100 bf16 weight bytes are 50 parameters
    assert optimizer_step_bytes(100, 100, 600, optimizer="torch", dtype="bf16") == 25 * 4 * 50
    with pytest.raises(ConfigError, match="optimizer"):
        optimizer_step_bytes(1, 1, 1, optimizer="sgd")


@pytest.mark.parametrize(
    "kw",
    [
        dict(dp=2, tp=2, pp=2, microbatch=1, global_batch=16),
        dict(dp=2, tp=1, pp=4, microbatch=2, global_batch=32, optimizer_sharding=True),
        dict(dp=1, tp=2, pp=4, microbatch=1, global_batch=16, schedule="interleaved", virtual_stages=2),
    ],
)
def test_planner_and_simulator_time_the_optimizer_step_alike(kw) -> None:
    """For synchronous schedules the closed forms' optimizer step of every pipeline rank is the
    simulator's (which adds the gradient-norm all-reduce as a separate wait)."""
    cluster = resolve_cluster("dgx-a100", gpus=8)
    cfg = ParallelConfig(**kw)
    costs = chunk_costs(MODEL, cluster, cfg)
    schedule = _generate_cached(cfg.schedule.value, cfg.pp, cfg.num_microbatches, cfg.virtual_stages)
    sim = timing_for_config(schedule, costs, cluster, cfg)
    ana = pipeline_inputs(MODEL, cluster, cfg, costs, default_backend(simulate=False))
    assert ana.optimizer_s == sim.optimizer_s
    assert all(t > 0 for t in ana.optimizer_s)


def test_planner_reports_the_simulators_throughput() -> None:
    """A confirmed candidate's figures are the simulator's, bit for bit."""
    cluster = resolve_cluster("dgx-a100", gpus=8)
    res = plan(MODEL, cluster, 64, confirm=2, top=3)
    for cand in res.ranked:
        if cand.simulated is None:
            continue
        sim, m = cand.simulated, cand.metrics
        assert (m.iteration_time_s, m.tokens_per_s, m.samples_per_s, m.tflops_per_gpu, m.mfu) == (
            sim.iteration_time_s,
            sim.tokens_per_s,
            sim.samples_per_s,
            sim.tflops_per_gpu,
            sim.mfu,
        )
        again = simulate_config(MODEL, cluster, cand.config)
        assert again.mfu == m.mfu


def test_variants_are_configs_of_one_layout() -> None:
    cluster = resolve_cluster("dgx-a100", gpus=8)
    pins = Pins()
    (lay, *_) = [x for x in layouts(MODEL, cluster, 64, pins, Rejections()) if x.pp == 2 and x.tp == 2]
    cfgs = list(variants(MODEL, 64, lay, pins, 4))
    assert cfgs and all(isinstance(c, ParallelConfig) for c in cfgs)
    assert {(c.dp, c.tp, c.pp, c.microbatch, c.global_batch) for c in cfgs} == {(2, 2, 2, 4, 64)}
    assert len(set(cfgs)) == len(cfgs)  # no configuration twice
    assert {c.schedule.value for c in cfgs} >= {"1f1b", "gpipe", "chimera"}


def test_library_errors_name_fields_not_flags() -> None:
    cluster = resolve_cluster("dgx-a100", gpus=8)
    with pytest.raises(ConfigError) as err:
        plan(preset("gpt3-175b"), cluster, 64, backend=default_backend(simulate=False))
    assert err.value.field == "cluster.gpus" and "--" not in str(err.value)
    with pytest.raises(ConfigError) as err:
        plan(MODEL, cluster, 64, pins=Pins(partition=(1, 2)))
    assert err.value.field == "partition" and "--" not in str(err.value)


def test_the_planner_prices_cached_fp8_weights_per_global_batch() -> None:
    # With the FP8 weight cache a chunk's cost depends on the micro-batches per step (one cast per
    # step), so two global batches of the same layout must not share a cached chunk cost.
    from paratrain.plan.search import _cost_key

    cluster = resolve_cluster("dgx-h100").resized(gpus=8)
    model = preset("llama3-8b")
    small, large = (ParallelConfig(dp=8, microbatch=1, global_batch=b, gemm_dtype="fp8", fp8_weight_cache=True)
                    for b in (8, 64))
    assert _cost_key(small, cluster) != _cost_key(large, cluster)
    uncached = [ParallelConfig(dp=8, microbatch=1, global_batch=b, gemm_dtype="fp8") for b in (8, 64)]
    assert _cost_key(uncached[0], cluster) == _cost_key(uncached[1], cluster)
    # ... as their costs differ: 8 micro-batches share one cast, against one micro-batch
    assert chunk_costs(model, cluster, large)[0].forward_s < chunk_costs(model, cluster, small)[0].forward_s

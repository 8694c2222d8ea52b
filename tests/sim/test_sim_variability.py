"""Variable action durations (paratrain.sim.variability): the engine with scaled durations
against an independent recurrence, and the Monte-Carlo statistics against closed forms."""

from __future__ import annotations

import dataclasses
import random

import numpy as np
import pytest

from paratrain.errors import ConfigError
from paratrain.schedule.ir import ActionKind
from paratrain.schedule.registry import generate
from paratrain.sim import scaled_timing, simulate, simulate_variable, uniform_timing
from paratrain.sim.variability import gamma_factors


def test_gamma_factors_have_mean_one_and_the_requested_variation() -> None:
    rng = np.random.default_rng(1)
    for cv in (0.05, 0.15, 0.5):
        f = gamma_factors(rng, cv, 400_000)
        assert f.min() > 0
        assert f.mean() == pytest.approx(1.0, abs=4 * cv / 400_000**0.5)
        assert f.std() / f.mean() == pytest.approx(cv, rel=0.01)
    assert (gamma_factors(rng, 0.0, 5) == 1).all()


@pytest.mark.parametrize("stages,microbatches", [(2, 3), (3, 5), (4, 4)])
def test_scaled_gpipe_matches_a_tandem_recurrence(stages: int, microbatches: int) -> None:
    """GPipe with free communication: micro-batch m's forward on stage r ends at
    max(its end on stage r-1, stage r's previous forward) + its duration; the backwards run in
    order 0..M-1 from the last stage back, the first starting after the stage's last forward."""
    sched = generate("gpipe", stages=stages, microbatches=microbatches)
    rnd = random.Random(7)
    factor = {(r, str(a)): rnd.uniform(0.5, 2.0) for r, row in enumerate(sched.actions) for a in row}
    timing = uniform_timing(sched, forward=1.0, backward=2.0)
    scaled = scaled_timing(sched, timing, lambda r, i: factor[(r, str(sched.actions[r][i]))])
    res = simulate(sched, scaled)

    p, m = stages, microbatches
    f = [[0.0] * m for _ in range(p)]
    for r in range(p):
        for k in range(m):
            ready = max(f[r - 1][k] if r else 0.0, f[r][k - 1] if k else 0.0)
            f[r][k] = ready + 1.0 * factor[(r, f"F{k}@c{r}")]
    b = [[0.0] * m for _ in range(p)]
    for r in reversed(range(p)):
        for k in range(m):
            ready = max(b[r + 1][k] if r < p - 1 else 0.0, b[r][k - 1] if k else f[r][m - 1])
            b[r][k] = ready + 2.0 * factor[(r, f"B{k}@c{r}")]
    assert res.iteration_time_s == pytest.approx(max(b[r][m - 1] for r in range(p)), rel=1e-12)
    busy = [sum(factor[(r, f"F{k}@c{r}")] + 2 * factor[(r, f"B{k}@c{r}")] for k in range(m)) for r in range(p)]
    assert list(res.busy_s_by_rank) == pytest.approx(busy, rel=1e-12)


def test_no_variation_is_the_plain_simulation() -> None:
    sched = generate("1f1b", stages=4, microbatches=8)
    timing = uniform_timing(sched)
    plain = simulate(sched, timing)
    for cv, samples in ((0.0, 32), (0.2, 0)):
        res = simulate_variable(sched, timing, cv, samples=samples)
        assert res.iteration_time_s == plain.iteration_time_s and res.bubble_fraction == plain.bubble_fraction
        assert res.samples == 0


def test_one_stage_expected_iteration_is_the_sum_of_means() -> None:
    """One stage never waits: the iteration is the sum of its actions, whose mean is the sum of
    the mean durations (within the sampling error of the mean)."""
    sched = generate("gpipe", stages=1, microbatches=16)
    timing = uniform_timing(sched, forward=1.0, backward=2.0)
    cv, n = 0.2, 400
    res = simulate_variable(sched, timing, cv, samples=n, seed=3)
    nominal = 16 * 3.0
    assert res.nominal_iteration_time_s == nominal
    # sum of 16 forwards (std cv) and 16 backwards (std 2cv): std of the iteration
    std = cv * (16 * 1.0**2 + 16 * 2.0**2) ** 0.5
    assert res.iteration_time_std_s == pytest.approx(std, rel=0.15)
    assert abs(res.iteration_time_s - nominal) < 4 * std / n**0.5
    assert res.bubble_fraction == 0.0


@pytest.mark.parametrize("name", ["gpipe", "1f1b", "interleaved", "chimera", "zb-h1"])
def test_variation_lengthens_a_pipeline(name: str) -> None:
    """E[max] > max E: with several stages, waiting for the later of two random times makes the
    expected iteration longer and the bubble larger, more so the larger the variation."""
    sched = generate(name, stages=4, microbatches=8, virtual_stages=2 if name == "interleaved" else 1)
    timing = uniform_timing(sched)
    plain = simulate(sched, timing)
    prev = plain
    for cv in (0.1, 0.3):
        res = simulate_variable(sched, timing, cv, samples=64, seed=0)
        assert res.iteration_time_s > prev.iteration_time_s
        assert res.bubble_fraction > prev.bubble_fraction
        assert res.nominal_iteration_time_s == plain.iteration_time_s and res.samples == 64
        prev = res


def test_same_seed_same_answer_and_bad_arguments() -> None:
    sched = generate("1f1b", stages=2, microbatches=4)
    timing = uniform_timing(sched)
    a = simulate_variable(sched, timing, 0.1, samples=8, seed=5)
    b = simulate_variable(sched, timing, 0.1, samples=8, seed=5)
    assert a.iteration_time_s == b.iteration_time_s
    with pytest.raises(ConfigError, match="duration_cv"):
        simulate_variable(sched, timing, -0.1)
    with pytest.raises(ConfigError, match="samples"):
        simulate_variable(sched, timing, 0.1, samples=-1)


def test_optimizer_steps_vary_too() -> None:
    sched = generate("gpipe", stages=1, microbatches=1)
    timing = dataclasses.replace(uniform_timing(sched), optimizer_s=(5.0,))
    u = next(i for i, a in enumerate(sched.actions[0]) if a.kind is ActionKind.OPTIMIZER_STEP)
    scaled = scaled_timing(sched, timing, lambda r, i: 3.0 if i == u else 1.0)
    assert simulate(sched, scaled).iteration_time_s == pytest.approx(1.0 + 2.0 + 15.0)


def test_simulate_config_takes_the_devices_variation() -> None:
    from paratrain.parallel.config import ParallelConfig
    from paratrain.sim import simulate_config
    from paratrain.spec.cluster import resolve_cluster
    from paratrain.spec.model import preset

    cluster = resolve_cluster("cpu", "--cluster", gpus=2)
    noisy = dataclasses.replace(cluster, device=dataclasses.replace(cluster.device, duration_cv=0.15))
    cfg = ParallelConfig(pp=2, microbatch=1, global_batch=8)
    spec = preset("gpt-tiny")
    plain = simulate_config(spec, cluster, cfg)
    res = simulate_config(spec, noisy, cfg)
    assert plain.samples == 0 and res.samples == 32 and res.duration_cv == 0.15
    assert res.nominal_iteration_time_s == plain.iteration_time_s
    assert res.bubble_fraction > plain.bubble_fraction
    assert res.mfu == pytest.approx(plain.mfu * plain.iteration_time_s / res.iteration_time_s)
    off = simulate_config(spec, noisy, cfg, duration_cv=0.0)
    assert off.iteration_time_s == plain.iteration_time_s

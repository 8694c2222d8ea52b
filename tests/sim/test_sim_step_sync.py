"""The optimizer step as paratrain's runtime runs it: global-norm clipping all-reduces one scalar
over every rank (so each rank's step waits for the slowest), and PyTorch's single-tensor AdamW."""

from __future__ import annotations

from dataclasses import replace

import pytest

from paratrain.cost.collectives import collective_time
from paratrain.cost.stage import chunk_costs
from paratrain.errors import ConfigError
from paratrain.parallel.config import ParallelConfig
from paratrain.schedule import generate
from paratrain.sim import run_schedule, simulate, timing_for_config, uniform_timing
from paratrain.spec.cluster import resolve_cluster
from paratrain.spec.model import resolve_model


def _u_starts(run) -> dict[int, float]:
    return {e.rank: e.start_s for e in run.events if e.category == "optimizer"}


@pytest.mark.parametrize("name", ["gpipe", "1f1b", "zb-h1", "chimera"])
def test_step_waits_for_every_rank_then_the_allreduce(name: str) -> None:
    """Derived from the run without the all-reduce: there each rank starts its step when it is
    ready; with it, every rank starts at the latest of those times plus the all-reduce."""
    s = generate(name, stages=4, microbatches=8)
    # unequal optimizer steps, and the last compute action of rank 2 longer (per-action override),
    # so that the ranks are ready at different times
    last = max(i for i, a in enumerate(s.actions[2]) if a.kind.value in ("F", "B", "I", "W"))
    base = replace(uniform_timing(s, 1.0, 2.0), optimizer_s=(0.5, 0.25, 0.75, 0.125),
                   action_s=lambda r, i: 2.7 if (r, i) == (2, last) else None)
    free = run_schedule(s, base)
    ready = _u_starts(free)
    assert len(set(ready.values())) > 1  # the check below is not trivially met
    x = 0.3
    synced = run_schedule(s, replace(base, step_allreduce_s=x))
    starts = _u_starts(synced)
    assert starts == {r: pytest.approx(max(ready.values()) + x) for r in ready}
    assert max(synced.finish_s) == pytest.approx(max(ready.values()) + x + max(base.optimizer_s))
    assert synced.busy_s == pytest.approx(free.busy_s)  # the wait is idle time, not work
    waits = [e for e in synced.events if e.name == "allreduce(grad norm)"]
    assert {e.rank for e in waits} == set(range(4))
    assert [c for c in synced.comm_log if c.bytes == 4 and c.kind == "all_reduce"][0].time_s == x


def test_zero_allreduce_only_aligns_the_steps() -> None:
    s = generate("1f1b", stages=3, microbatches=6)
    base = replace(uniform_timing(s), optimizer_s=(1.0, 1.0, 1.0))
    free = simulate(s, base)
    synced = simulate(s, replace(base, step_allreduce_s=0.0))
    assert synced.iteration_time_s == pytest.approx(free.iteration_time_s)


MODEL = resolve_model("gpt-tiny")
CLUSTER = resolve_cluster("dgx-a100", gpus=8)


def _timing(schedule: str, **kw):
    cfg = ParallelConfig(pp=2, dp=2, microbatch=2, global_batch=16, schedule=schedule, **kw)
    s = generate(schedule, stages=2, microbatches=cfg.num_microbatches, iterations=3 if cfg.schedule.is_async else None)
    costs = chunk_costs(MODEL, CLUSTER, cfg)
    return cfg, s, costs


def test_timing_for_config_synchronous_schedules_allreduce_the_norm_over_all_ranks() -> None:
    cfg, s, costs = _timing("1f1b")
    t = timing_for_config(s, costs, CLUSTER, cfg, skew_cv=0.0)  # without the wait for the slowest rank
    assert t.step_allreduce_s == collective_time("all_reduce", 4, tuple(range(4)), CLUSTER).time_s > 0
    cfg, s, costs = _timing("pipedream")
    t = timing_for_config(s, costs, CLUSTER, cfg)
    assert t.step_allreduce_s is None  # asynchronous: each stage clips by its own norm


def test_torch_adamw_step_counts_every_kernel_pass() -> None:
    """PyTorch's single-tensor AdamW plus clipping touches each fp32 parameter element 25 times
    (counted kernel by kernel in timing_for_config); the fused step reads and writes weights,
    gradients and state once."""
    cfg, s, costs = _timing("1f1b")
    bw = CLUSTER.device.memory_bandwidth_Bps
    fused = timing_for_config(s, costs, CLUSTER, cfg)
    torch_ = timing_for_config(s, costs, CLUSTER, cfg, optimizer="torch")
    for r in range(2):
        w = sum(costs[c].weight_bytes for c, _ in s.chunks_of(r))
        params = w / 2  # ParallelConfig's default dtype is bf16: 2 bytes per weight
        assert torch_.optimizer_s[r] == pytest.approx(25 * 4 * params / bw)
        full = sum(costs[c].weight_bytes + costs[c].grad_bytes + 2 * costs[c].optimizer_bytes
                   for c, _ in s.chunks_of(r))
        assert fused.optimizer_s[r] == pytest.approx(full / bw)
    with pytest.raises(ConfigError, match="optimizer"):
        timing_for_config(s, costs, CLUSTER, cfg, optimizer="sgd")

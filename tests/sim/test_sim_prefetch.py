"""Receives posted ahead of their batch (``Timing.prefetch_receives``, the runtime engine's
``prefetch_receives`` and ``ParallelConfig.prefetch_receives``): hand-timed cases, the property that
posting earlier never delays anything, and how a configuration picks its figure."""

from __future__ import annotations

from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from paratrain.errors import ConfigError
from paratrain.parallel.config import GLOO_PREFETCH_RECEIVES, ParallelConfig, prefetch_receives_on
from paratrain.schedule import generate
from paratrain.sim import run_schedule, simulate, simulate_config, uniform_timing
from paratrain.spec.cluster import resolve_cluster
from paratrain.spec.model import preset


def _p2p(s, k: int, x: float = 0.5):
    return replace(uniform_timing(s), p2p_s=lambda src, dst, c: x, prefetch_receives=k)


def test_a_prefetched_receive_takes_the_transfer_off_the_critical_path() -> None:
    # 1F1B, 2 stages, 2 micro-batches, F = 1, B = 2, every transfer 0.5.
    # Rank 0: F0@c0 [0,1], F1@c0 [1,2]; rank 1: RF0 [1,1.5], F0@c1 [1.5,2.5], B0@c1 [2.5,4.5].
    # Posted at its batch (k = 0), rank 1's RF1 starts when it gets there at 4.5: [4.5,5], F1 [5,6],
    # B1 [6,8], SB1 -> rank 0's RB1 [8,8.5], B1@c0 [8.5,10.5].
    # Posted when RF0's batch completes (k = 1, at 1.5), it runs as soon as rank 0 sends at 2:
    # [2,2.5], F1 [4.5,5.5], B1 [5.5,7.5], RB1 [7.5,8], B1@c0 [8,10].
    s = generate("1f1b", stages=2, microbatches=2)
    assert simulate(s, _p2p(s, 0)).iteration_time_s == 10.5
    r = simulate(s, _p2p(s, 1))
    assert r.iteration_time_s == 10.0
    rf1 = next(e for e in r.events if e.rank == 1 and e.name.startswith("RF1"))
    assert (rf1.start_s, rf1.duration_s) == (2.0, 0.5)  # logged when it travels, beside B0's compute
    assert r.comm_time_by_kind["p2p"] == 2.0  # the transfers still take their time, hidden or not


def test_nothing_to_hide_without_transfers_or_with_the_receiver_waiting() -> None:
    # Free transfers: prefetching changes nothing. One micro-batch: every receive waits for a
    # send that is still being computed, so posting it earlier gains nothing either.
    s = generate("interleaved", stages=4, microbatches=8, virtual_stages=2)
    assert simulate(s, replace(uniform_timing(s), prefetch_receives=2)).iteration_time_s == \
        simulate(s).iteration_time_s
    one = generate("1f1b", stages=2, microbatches=1)
    assert simulate(one, _p2p(one, 1)).iteration_time_s == simulate(one, _p2p(one, 0)).iteration_time_s == 7.0


_SCHEDULES = [("1f1b", 1), ("gpipe", 1), ("interleaved", 2), ("interleaved", 3), ("chimera", 1), ("zb-h1", 1),
              ("pipedream", 1), ("2bw", 1)]


@settings(max_examples=40, deadline=None)
@given(
    which=st.sampled_from(_SCHEDULES),
    stages=st.sampled_from([2, 4]),
    per_stage=st.integers(1, 3),
    fwd=st.floats(0.1, 3.0), bwd=st.floats(0.1, 6.0), x=st.floats(0.0, 4.0),
    blocking=st.booleans(),
)
def test_posting_earlier_never_delays_anything(which, stages, per_stage, fwd, bwd, x, blocking) -> None:
    # Every time in the run is a max of sums of earlier times and durations; a receive posted
    # earlier lowers one of its terms, so no rank can finish later with more receives ahead.
    name, v = which
    s = generate(name, stages=stages, microbatches=stages * per_stage, virtual_stages=v)
    base = replace(uniform_timing(s, fwd, bwd), p2p_s=lambda src, dst, c: x * (1 + (src + dst + c) % 3) / 3)
    finish = [max(run_schedule(s, replace(base, prefetch_receives=k), record=False,
                               blocking_sends=blocking).finish_s) for k in range(4)]
    for a, b in zip(finish, finish[1:], strict=False):
        assert b <= a + 1e-9 * max(1.0, a)


def test_the_backend_default_is_what_the_runtime_runs() -> None:
    cfg = ParallelConfig(pp=2, global_batch=8)
    assert prefetch_receives_on(cfg, gloo=True) == GLOO_PREFETCH_RECEIVES == 2  # gloo
    assert prefetch_receives_on(cfg, gloo=False) == 0  # NCCL
    assert prefetch_receives_on(replace(cfg, prefetch_receives=1), gloo=False) == 1
    assert prefetch_receives_on(replace(cfg, prefetch_receives=0), gloo=True) == 0


def test_simulate_config_runs_with_the_configured_receives_ahead() -> None:
    model = replace(preset("gpt2"), layers=8)
    cluster = resolve_cluster("dgx-a100", gpus=8)
    base = ParallelConfig(pp=4, dp=2, microbatch=1, global_batch=32, schedule="interleaved", virtual_stages=2)
    times = [simulate_config(model, cluster, replace(base, prefetch_receives=k)).iteration_time_s
             for k in (None, 0, 1)]
    assert times[0] == times[1]  # NCCL's default: none ahead
    assert times[2] <= times[1]


@pytest.mark.parametrize(("value", "pp", "problem"), [
    (-1, 2, "at least 0"), (True, 2, "at least 0"), (1.5, 2, "at least 0"), (65, 2, "64"),
    (1, 1, "pp is 1"),
])
def test_bad_values_name_the_field(value, pp, problem) -> None:
    with pytest.raises(ConfigError) as e:
        ParallelConfig(pp=pp, global_batch=8, prefetch_receives=value)
    assert e.value.field == "prefetch_receives" and problem in str(e.value)


def test_zero_ahead_is_fine_without_a_pipeline() -> None:
    assert ParallelConfig(pp=1, prefetch_receives=0).prefetch_receives == 0


def test_the_planner_pins_the_figure_on_pipelined_candidates_only() -> None:
    from paratrain.plan.space import Pins, Rejections, layouts, variants

    model = replace(preset("gpt2"), layers=8)
    cluster = resolve_cluster("dgx-a100", gpus=8)
    pins = Pins(prefetch_receives=1)
    seen = set()
    for layout in layouts(model, cluster, 64, pins, Rejections()):
        for cfg in variants(model, 64, layout, pins):
            seen.add((cfg.pp > 1, cfg.prefetch_receives))
    assert seen == {(False, None), (True, 1)}
    with pytest.raises(ConfigError, match="prefetch_receives"):
        Pins(prefetch_receives=-1)

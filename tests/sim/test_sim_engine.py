"""Engine mechanics with hand-computable timings: transfers, reductions, deadlock, memory, traces."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from paratrain.cost.types import ChunkCost
from paratrain.errors import ConfigError
from paratrain.schedule import Schedule, generate
from paratrain.sim import memory_by_rank, run_schedule, simulate, uniform_timing
from paratrain.sim.trace import ascii_timeline, chrome_trace, events_from_chrome_trace, plot_timeline


def test_p2p_time_on_the_critical_path() -> None:
    s = generate("1f1b", stages=2, microbatches=1)
    t = replace(uniform_timing(s), p2p_s=lambda src, dst, c: 0.5)
    r = simulate(s, t)
    # F0 [0,1] -> +0.5 -> F1 [1.5,2.5] B1 [2.5,4.5] -> +0.5 -> B0 [5,7]
    assert r.iteration_time_s == 7.0
    assert r.comm_time_by_kind["p2p"] == 1.0
    assert len([c for c in r.comm_log if c.kind == "p2p"]) == 2


def test_reduction_overlaps_backward_or_waits_for_it() -> None:
    s = generate("1f1b", stages=2, microbatches=1)
    t = replace(uniform_timing(s), reduce_s=(3.0, 3.0))
    # rank 1 reduces in [4, 7] after its backward, rank 0 in [6, 9] after B0 [4, 6]
    assert simulate(s, t).iteration_time_s == 9.0
    s = generate("interleaved", stages=2, microbatches=2, virtual_stages=2)
    t = replace(uniform_timing(s), reduce_s=(4.0,) * 4)
    over = simulate(s, t, overlap_grad_reduce=True).iteration_time_s
    after = simulate(s, t, overlap_grad_reduce=False).iteration_time_s
    base = simulate(s).iteration_time_s
    # the reductions of one rank share its comm stream: two of 4 after the last backward = +8,
    # overlapping the first with the remaining backward saves part of it
    assert after == base + 8
    assert base + 4 <= over < after


def test_chimera_reduction_waits_for_both_replicas() -> None:
    s = generate("chimera", stages=2, microbatches=2)
    t = replace(uniform_timing(s, 1, 1), reduce_s=(5.0, 5.0))
    r = simulate(s, t)
    # both ranks finish compute at 4 (no bubble for D = 2), then two reductions of 5 each
    assert r.iteration_time_s == 4 + 5 + 5
    assert r.comm_time_by_kind["all_reduce"] == 10


def test_blocking_sends_never_faster_than_eager() -> None:
    for name in ("zb-h1", "1f1b", "chimera", "interleaved"):
        s = generate(name, stages=4, microbatches=8, virtual_stages=2 if name == "interleaved" else 1)
        eager = run_schedule(s, uniform_timing(s), record=False)
        blocking = run_schedule(s, uniform_timing(s), record=False, blocking_sends=True)
        assert max(blocking.finish_s) >= max(eager.finish_s)


def test_engine_reports_a_deadlock() -> None:
    r0 = ["F0@c0", "F1@c0", "RB0@c0<1", "X:gap", "SF0@c0>1", "SF1@c0>1", "B0@c0", "RB1@c0<1", "B1@c0", "R@c0", "U"]
    r1 = ["RF0@c1<0", "F0@c1", "B0@c1", "SB0@c1>0", "RF1@c1<0", "F1@c1", "B1@c1", "SB1@c1>0", "R@c1", "U"]
    s = Schedule.from_dict({"stages": 2, "microbatches": 2, "actions": [r0, r1]})
    with pytest.raises(ConfigError, match="deadlock"):
        run_schedule(s, uniform_timing(s), blocking_sends=True)


def _cost(act: int, weight: int = 100) -> ChunkCost:
    return ChunkCost(
        forward_s=1,
        backward_input_s=1,
        backward_weight_s=1,
        recompute_s=0,
        tp_comm_s=0,
        activation_bytes=act,
        weight_bytes=weight,
        grad_bytes=weight,
        optimizer_bytes=4 * weight,
        grad_reduce_bytes=weight,
        p2p_bytes=8,
        model_flops=1.0,
    )


def test_memory_by_rank() -> None:
    costs = [_cost(10)] * 4
    gp = memory_by_rank(generate("gpipe", stages=4, microbatches=8), costs)
    assert [m.activation_bytes for m in gp] == [80] * 4
    assert gp[0].total_bytes == 80 + 100 + 100 + 400
    ofob = memory_by_rank(generate("1f1b", stages=4, microbatches=8), costs)
    assert [m.activation_bytes for m in ofob] == [40, 30, 20, 10]
    ch = memory_by_rank(generate("chimera", stages=4, microbatches=8), costs)
    assert all(m.weight_bytes == 200 and m.optimizer_bytes == 800 for m in ch)  # two replicas
    pd = memory_by_rank(generate("pipedream", stages=4, microbatches=8), costs)
    assert [m.stashed_weight_bytes for m in pd] == [300, 200, 100, 0]  # p - r versions
    bw = memory_by_rank(generate("2bw", stages=4, microbatches=8), costs)
    assert [m.stashed_weight_bytes for m in bw] == [100] * 4
    # a recomputed layer's activations add once, during a backward, on top of what is in flight
    rc = memory_by_rank(generate("1f1b", stages=4, microbatches=8), [replace(_cost(10), transient_bytes=7)] * 4)
    assert [m.activation_bytes for m in rc] == [40 + 7, 30 + 7, 20 + 7, 10 + 7]


def test_traces(tmp_path) -> None:
    s = generate("1f1b", stages=4, microbatches=8)
    r = simulate(s)
    doc = chrome_trace(r.events, time_unit_s=1.0)
    text = json.dumps(doc)
    back = events_from_chrome_trace(json.loads(text), time_unit_s=1.0)
    assert len(back) == len(r.events) == 4 * 16 + 0  # F and B per micro-batch per rank
    assert {e["pid"] for e in doc["traceEvents"]} == {0, 1, 2, 3}
    art = ascii_timeline(r.events, 4)
    lines = art.splitlines()
    assert len(lines) == 8  # kinds and micro-batches per rank
    assert all(len(line) == len(lines[0]) for line in lines)
    fig = plot_timeline(r.events, 4, title="1F1B")
    out = tmp_path / "t.png"
    fig.savefig(out)
    assert out.stat().st_size > 1000

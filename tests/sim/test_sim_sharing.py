"""Processes sharing a host's cores (paratrain.sim.sharing): the engine under processor sharing
against hand-derived timelines, and the calibration's per-core rates that make it consistent."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import replace

import pytest

from paratrain.errors import ConfigError
from paratrain.parallel.config import ParallelConfig
from paratrain.runtime.calibrate import core_share, device_from_measurement
from paratrain.schedule import Schedule, generate
from paratrain.schedule.ir import Action, ActionKind
from paratrain.sim import run_schedule, simulate, simulate_config, uniform_timing
from paratrain.sim.sharing import CoreSharing, core_sharing, layout_sharing
from paratrain.spec.cluster import resolve_cluster
from paratrain.spec.model import preset


def _two_ranks(work0: float, work1: float) -> Schedule:
    """Two ranks, each one piece of compute and nothing else: they run at the same time."""
    return Schedule(name="two", stages=2, microbatches=1, placement=((0, 1),),
                    actions=((Action(ActionKind.FILLER, tag="work", duration_s=work0),),
                             (Action(ActionKind.FILLER, tag="work", duration_s=work1),)))


ONE_CORE_TWO_PROCS = CoreSharing(cores=1, threads=1, placement=(((0, 1),), ((0, 1),)))


def test_two_ranks_on_one_core_computing_at_once_take_twice_as_long() -> None:
    s = _two_ranks(1.0, 1.0)
    alone = run_schedule(s, uniform_timing(s))
    shared = run_schedule(s, replace(uniform_timing(s), core_sharing=ONE_CORE_TWO_PROCS))
    assert alone.finish_s == (1.0, 1.0)
    assert shared.finish_s == (2.0, 2.0)
    assert shared.busy_s == (2.0, 2.0)
    # unequal work: both at half speed until the short one ends at 2 (1 done each), then the
    # long one alone at full speed for its remaining 2: the core never idles, 4 in all
    s = _two_ranks(1.0, 3.0)
    assert run_schedule(s, replace(uniform_timing(s), core_sharing=ONE_CORE_TWO_PROCS)).finish_s == (2.0, 4.0)


def test_a_rank_alone_runs_at_full_speed() -> None:
    # GPipe, 2 stages, 1 micro-batch: F0 on rank 0, F0 on rank 1, B0 on rank 1, B0 on rank 0,
    # never two at once, so one core for both changes nothing: 1 + 1 + 2 + 2
    s = generate("gpipe", stages=2, microbatches=1)
    r = simulate(s, replace(uniform_timing(s), core_sharing=ONE_CORE_TWO_PROCS))
    assert r.iteration_time_s == 6.0
    assert r.busy_s_by_rank == (3.0, 3.0)


@pytest.mark.parametrize("m", [2, 4, 8])
@pytest.mark.parametrize(("cores", "rate"), [(2, 0.5), (3, 0.75), (4, 1.0)])
def test_gpipe_two_stages_two_processes_each_closed_form(m: int, cores: int, rate: float) -> None:
    """dp 2 × pp 2 on one node of ``cores`` cores, one thread each, F = 1, B = 2, free transfers.
    A stage alone has its 2 processes on 2 cores (full speed); both stages computing put 4
    threads on the cores (speed ``rate = min(1, cores / 4)``). By hand: F0 of stage 0 alone (1);
    then m - 1 steps where stage 0 runs F(i+1) while stage 1 runs F(i), both 1 at ``rate``; F(m-1)
    of stage 1 alone (1); its B(m-1) alone (2); m - 1 steps of B pairs (2 at ``rate``); B0 of
    stage 0 alone (2): 6 + 3(m - 1) / rate. At rate 1 that is GPipe's 3(m + p - 1)."""
    s = generate("gpipe", stages=2, microbatches=m)
    share = CoreSharing(cores=cores, threads=1, placement=(((0, 2),), ((0, 2),)))
    r = simulate(s, replace(uniform_timing(s), core_sharing=share))
    assert r.iteration_time_s == pytest.approx(6 + 3 * (m - 1) / rate, rel=1e-12)
    if rate == 1:
        assert r.iteration_time_s == pytest.approx(3 * (m + 2 - 1), rel=1e-12)


@pytest.mark.parametrize(("name", "p", "m", "v"), [("1f1b", 4, 8, 1), ("interleaved", 2, 4, 2), ("zb-h1", 4, 6, 1),
                                                   ("gpipe", 3, 5, 1)])
def test_sharing_that_never_binds_matches_the_unshared_engine(name: str, p: int, m: int, v: int) -> None:
    """The global-time executor against the per-rank one, with transfers, reductions and steps."""
    s = generate(name, stages=p, microbatches=m, virtual_stages=v)
    t = replace(uniform_timing(s, 1.0, 2.5), p2p_s=lambda src, dst, c: 0.125 + 0.01 * src,
                reduce_s=tuple(0.5 + 0.1 * c for c in range(s.num_chunks)), optimizer_s=(0.25,) * p,
                step_allreduce_s=0.05)
    plenty = CoreSharing(cores=64, threads=1, placement=tuple(((0, 1),) for _ in range(p)))
    a, b = run_schedule(s, t), run_schedule(s, replace(t, core_sharing=plenty))
    assert b.finish_s == pytest.approx(a.finish_s, rel=1e-12)
    assert b.busy_s == pytest.approx(a.busy_s, rel=1e-12)
    assert b.comm_time_by_kind == pytest.approx(a.comm_time_by_kind, rel=1e-12)
    assert sorted((e.rank, e.name, round(e.start_s, 9)) for e in b.events) == sorted(
        (e.rank, e.name, round(e.start_s, 9)) for e in a.events)


def test_a_wait_in_a_collective_takes_no_core() -> None:
    # one stage of 2 tensor-parallel processes on 1 core: F = 1 of which 0.4 is a wait in a
    # collective, B = 2 of which 0.5: F takes 0.6 / 0.5 + 0.4 = 1.6, B 1.5 / 0.5 + 0.5 = 3.5
    s = generate("gpipe", stages=1, microbatches=1)
    t = replace(uniform_timing(s), forward_wait_s=(0.4,), backward_wait_s=(0.5,),
                core_sharing=CoreSharing(cores=1, threads=1, placement=(((0, 2),),)))
    assert simulate(s, t).iteration_time_s == pytest.approx(1.6 + 3.5, rel=1e-12)


@pytest.mark.parametrize(("wait", "expected"), [(0.2, 2 * 0.8), (1.5, 0.8 + 1.5)])
def test_independent_groups_fill_each_others_waits(wait: float, expected: float) -> None:
    """dp 2 × tp 2 on 2 cores as one stage: a forward of W = 0.8 of work and ``wait`` = L of
    waits in collectives, a backward of 1 of work. Two independent pairs: the forward takes the
    fluid bound max(W / r_all, W / r_one + L), with r_all = 2 / 4 and r_one = 2 / 2 (the cores
    bind at 1.6 when L is short, one pair's own path 0.8 + L when it is long); the backward
    1 / r_all = 2. In lockstep (one group) the forward is W / r_all + L."""
    s = generate("gpipe", stages=1, microbatches=1)
    t = replace(uniform_timing(s, 0.8 + wait, 1.0), forward_wait_s=(wait,), backward_wait_s=(0.0,))
    pairs = CoreSharing(cores=2, threads=1, placement=(((0, 4),),), groups=(2,))
    lockstep = CoreSharing(cores=2, threads=1, placement=(((0, 4),),))
    assert simulate(s, replace(t, core_sharing=pairs)).iteration_time_s == pytest.approx(expected + 2, rel=1e-12)
    assert simulate(s, replace(t, core_sharing=lockstep)).iteration_time_s == pytest.approx(1.6 + wait + 2,
                                                                                            rel=1e-12)


def test_one_group_rate_counts_the_other_computing_ranks() -> None:
    share = CoreSharing(cores=2, threads=1, placement=(((0, 4),), ((0, 2),)), groups=(2, 1))
    assert share.one_group_rate(0, [0]) == 1.0  # 2 of its processes on 2 cores
    assert share.one_group_rate(0, [0, 1]) == 0.5  # and rank 1's 2 beside them
    assert share.one_group_rate(1, [1]) == 1.0
    # a rank over two nodes runs at its slowest node's rate: one of its 2 groups has 1 process on
    # node 0 (free) and 1 on node 1 beside rank 1's 4: 2 cores for 5 processes there
    spread = CoreSharing(cores=2, threads=1, placement=(((0, 2), (1, 2)), ((1, 4),)), groups=(2, 1))
    assert spread.one_group_rate(0, [0, 1]) == pytest.approx(2 / 5)
    assert spread.one_group_rate(0, [0]) == 1.0
    with pytest.raises(ConfigError, match="groups"):
        CoreSharing(cores=2, threads=1, placement=(((0, 4),),), groups=(0,))


def test_rates_count_threads_and_take_the_slowest_node() -> None:
    share = CoreSharing(cores=4, threads=2, placement=(((0, 1), (1, 1)), ((0, 2),), ((1, 1),)))
    # ranks 0 and 1 computing: node 0 has 1 + 2 processes x 2 threads = 6 on 4 cores, node 1 2
    assert share.rates([0, 1]) == {0: pytest.approx(4 / 6), 1: pytest.approx(4 / 6)}
    # ranks 0 and 2: node 0 has 2 threads, node 1 4: nobody waits for a core
    assert share.rates([0, 2]) == {0: 1.0, 2: 1.0}


def test_sharing_is_off_without_cores_or_with_enough_of_them() -> None:
    assert core_sharing(0, 1, [(0, 0), (1, 0)]) is None  # devices with their own processor
    assert core_sharing(4, 1, [(0, 0), (1, 0), (0, 0), (1, 0)]) is None  # one core per process
    assert core_sharing(2, 2, [(0, 0), (1, 0)]) is not None  # 4 threads on 2 cores
    config = ParallelConfig(dp=2, pp=2, microbatch=1, global_batch=8)
    assert layout_sharing(resolve_cluster("dgx-a100", gpus=4), config) is None
    cpu = dataclasses.replace(resolve_cluster("cpu", gpus=4), cores_per_node=2, threads_per_process=1)
    assert layout_sharing(cpu, config) == CoreSharing(2, 1, (((0, 2),), ((0, 2),)))
    # dp tensor-parallel pairs wait apart unless sharded parameters tie them together
    tp_pairs = ParallelConfig(dp=2, tp=2, microbatch=1, global_batch=8)
    assert layout_sharing(cpu, tp_pairs).groups == (2,)
    assert layout_sharing(cpu, replace(tp_pairs, sharding="zero3")).groups == ()
    with pytest.raises(ConfigError, match="cores_per_node"):
        dataclasses.replace(cpu, cores_per_node=-1)
    with pytest.raises(ConfigError, match="threads_per_process"):
        dataclasses.replace(cpu, threads_per_process=0)


MEASURED = {"peak_fp32_flops": 40e9, "gemm_flops_by_size": {512: 40e9}, "memory_bandwidth_Bps": 6e9,
            "elementwise_Bps": 2e9, "kernel_overhead_s": 30e-6, "small_add_s": 1e-6, "small_matmul_s": 2e-6,
            "duration_cv": 0.05, "threads": 1, "tp_dispatch_forward_s": 8e-4, "tp_dispatch_backward_s": 1.6e-3}


def test_calibration_stores_per_core_rates() -> None:
    assert core_share(4, 1, 2) == 0.5
    assert core_share(2, 1, 4) == 1.0
    old = device_from_measurement(MEASURED)  # no core count recorded: the rates as measured
    new = device_from_measurement({**MEASURED, "procs": 4, "cores": 2})
    assert (old.peak_fp32_flops, old.kernel_overhead_s) == (40e9, 30e-6)
    assert new.peak_fp32_flops == 80e9 and new.memory_bandwidth_Bps == 12e9
    assert new.kernel_overhead_s == pytest.approx(15e-6) and new.tp_dispatch_backward_s == pytest.approx(8e-4)
    assert new.memory_efficiency == pytest.approx(old.memory_efficiency)
    # DTensor's dispatch timed on the CPU clock is per core already: not scaled again
    cpu_clock = device_from_measurement({**MEASURED, "procs": 4, "cores": 2, "tp_dispatch_per_core": True})
    assert (cpu_clock.tp_dispatch_forward_s, cpu_clock.tp_dispatch_backward_s) == (8e-4, 1.6e-3)
    assert cpu_clock.kernel_overhead_s == pytest.approx(15e-6)


@pytest.mark.parametrize(("dp", "tp", "pipelined"), [(4, 1, (2, 1)), (1, 4, (1, 2))])
def test_layouts_always_all_computing_are_predicted_as_before(
    tmp_path, monkeypatch, dp: int, tp: int, pipelined: tuple[int, int]
) -> None:
    """No double count: a layout whose 4 processes always compute at once (no pipeline, one
    lockstep group) gets the same prediction from per-core rates shared 2 ways as from the rates
    measured under that sharing; only pipelines, whose idle stages lend their cores, change (and
    independent tensor-parallel groups, which lend theirs while they wait: dp 2 × tp 2, above)."""
    old, new = tmp_path / "old", tmp_path / "new"
    for d in (old, new):
        d.mkdir()
    m = {**MEASURED, "procs": 4}
    (old / "cpu.json").write_text(json.dumps(device_from_measurement(m).to_dict()))
    (new / "cpu.json").write_text(json.dumps(device_from_measurement({**m, "cores": 2}).to_dict()))
    links = {"p2p_latency_s": 5e-4, "p2p_bandwidth_Bps": 2e9, "procs": 4, "threads": 1,
             "measured_collectives": [["all_reduce", 2, 4096, 3e-3], ["all_reduce", 4, 4096, 6e-3]]}
    (old / "cpu-cluster.json").write_text(json.dumps(links))
    (new / "cpu-cluster.json").write_text(json.dumps({**links, "cores": 2}))
    model = dataclasses.replace(preset("gpt-tiny"), layers=4, hidden=128, heads=4, seq=64, vocab=256)
    times = {}
    for name, d in (("old", old), ("new", new)):
        monkeypatch.setenv("PARATRAIN_CACHE", str(d))
        cluster = resolve_cluster("cpu", gpus=4)
        assert cluster.cores_per_node == (2 if name == "new" else 0)
        out = []
        for d, t, pp in ((dp, tp, 1), (*pipelined, 2)):
            cfg = ParallelConfig(dp=d, tp=t, pp=pp, microbatch=1, global_batch=8, dtype="fp32")
            out.append(simulate_config(model, cluster, cfg, optimizer="torch", duration_cv=0).iteration_time_s)
        times[name] = out
    assert times["new"][0] == pytest.approx(times["old"][0], rel=1e-9)
    # the same processes as a 2-stage pipeline: a stage idle in the bubble lends its cores
    assert times["new"][1] < times["old"][1]


@pytest.mark.parametrize(("doc", "expected"), [
    ({"cores": 2, "threads": 1}, (2, 1)),
    ({"threads": 1}, (0, 1)),  # a calibration from before the core count: no sharing
    ({"cores": True, "threads": 1}, (0, 1)),
    ({"cores": -1, "threads": 1}, (0, 1)),
    ({"cores": "2", "threads": 1}, (0, 1)),
    ([2, 1], (0, 1)),
])
def test_the_cpu_cluster_reads_the_recorded_cores(tmp_path, monkeypatch, doc, expected) -> None:
    from paratrain.spec.cluster_presets import cpu_cores

    monkeypatch.setenv("PARATRAIN_CACHE", str(tmp_path))
    (tmp_path / "cpu-cluster.json").write_text(json.dumps(doc))
    assert cpu_cores() == expected
    cluster = resolve_cluster("cpu")
    assert (cluster.cores_per_node, cluster.threads_per_process) == expected


def test_the_waits_are_the_tensor_parallel_time_less_the_dispatch() -> None:
    """``forward_wait_s + backward_wait_s`` is ``tp_comm_s`` without DTensor's host dispatch: zero
    dispatch leaves all of it a wait; a dispatch adds to ``tp_comm_s`` and not to the waits."""
    from paratrain.cost.stage import chunk_costs

    model = dataclasses.replace(preset("gpt-tiny"), layers=4, hidden=128, heads=4, seq=64, vocab=256)
    config = ParallelConfig(tp=2, pp=2, microbatch=1, global_batch=4, dtype="fp32")
    base = resolve_cluster("cpu", gpus=4)
    plain = dataclasses.replace(base, device=dataclasses.replace(base.device, tp_dispatch_forward_s=0.0,
                                                                 tp_dispatch_backward_s=0.0))
    slow = dataclasses.replace(base, device=dataclasses.replace(base.device, tp_dispatch_forward_s=1e-3,
                                                                tp_dispatch_backward_s=2e-3))
    for a, b in zip(chunk_costs(model, plain, config), chunk_costs(model, slow, config), strict=True):
        assert a.tp_comm_s > 0
        assert a.forward_wait_s + a.backward_wait_s == pytest.approx(a.tp_comm_s, rel=1e-12)
        assert (b.forward_wait_s, b.backward_wait_s) == pytest.approx((a.forward_wait_s, a.backward_wait_s))
        assert b.tp_comm_s > a.tp_comm_s
        assert b.forward_s - a.forward_s == pytest.approx(b.tp_comm_s - a.tp_comm_s - (b.backward_input_s
                                                                                         - a.backward_input_s))

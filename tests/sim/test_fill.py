"""The K-FAC fill pass (``paratrain.sim.fill``): placement, dependencies, deadlock checks, spill.

Durations are uniform (forward 1, backward 2, free communication) so that the gaps are known in
closed form; the pieces come from :func:`uniform_kfac_work` or are written out.
"""

from __future__ import annotations

import dataclasses
from collections import Counter

import pytest

from paratrain.errors import ConfigError
from paratrain.schedule.filled import FilledSchedule, kfac_piece
from paratrain.schedule.ir import ActionKind, Schedule
from paratrain.schedule.registry import generate
from paratrain.schedule.validate import validate
from paratrain.sim.engine import run_schedule
from paratrain.sim.fill import KfacWork, fill_kfac, kfac_work, uniform_kfac_work
from paratrain.sim.timing import uniform_timing

K = ActionKind
SYNC = [("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("chimera", 1), ("zb-h1", 1)]


def _fill(name: str, v: int, p: int = 4, m: int = 8, work: KfacWork | None = None):
    s = generate(name, stages=p, microbatches=m, virtual_stages=v)
    return s, fill_kfac(s, uniform_timing(s), work or uniform_kfac_work(s))


def test_two_stage_gpipe_by_hand() -> None:
    # rank 0: F0 [0,1], idle [1,4] waiting for the gradient, B0 [4,6]; rank 1: idle [0,1], F0, B0 [1,4],
    # idle [4,6]. Rank 1's pieces fit its tail in step 0 (its backward is done at 4); rank 0's
    # curvature may start only after its backward, which ends the step: they spill into step 1's gap.
    s = generate("gpipe", stages=2, microbatches=1)
    work = KfacWork(({0: 0.5}, {0: 0.5}), (0.25, 0.25), ((1.0,), (1.0,)))
    res = fill_kfac(s, uniform_timing(s), work)
    assert res.refresh_steps == 2 and res.serial_pieces == 0
    step0, step1 = (it.to_text().splitlines() for it in res.filled.iterations)
    assert step0[0] == "rank 0: F0@c0 SF0@c0>1 RB0@c0<1 B0@c0 R@c0 U"
    assert step0[1] == ("rank 1: RF0@c1<0 F0@c1 B0@c1 SB0@c1>0 R@c1 X:kfac.curv.0/0.5 X:kfac.reduce/0.25 "
                        "X:kfac.inv.0/1 U")
    assert step1[0] == ("rank 0: F0@c0 SF0@c0>1 X:kfac.curv.0/0.5 X:kfac.reduce/0.25 X:kfac.inv.0/1 "
                        "RB0@c0<1 B0@c0 R@c0 U")
    assert step1[1] == "rank 1: RF0@c1<0 F0@c1 B0@c1 SB0@c1>0 R@c1 U"
    # the pieces sit inside the bubbles: the step time stays 6; busy 3 + 1.75 of work over two steps
    assert res.iteration_time_s == res.iteration_time_with_fillers_s == 6
    assert res.utilization_without_fillers == 0.5
    assert res.utilization_with_fillers == pytest.approx((2 * 3 + 1.75) / (2 * 6))
    # preconditioning at every U (no filler): rank 0 ends both steps at 6 + 0.5
    pre = fill_kfac(s, uniform_timing(s), work, precondition_s=(0.5, 0.25))
    assert pre.iteration_time_with_kfac_s == 6.5 and pre.filled == res.filled
    assert pre.utilization_with_fillers == res.utilization_with_fillers


@pytest.mark.parametrize("name, v", SYNC)
def test_every_synchronous_schedule_is_filled_validly(name: str, v: int) -> None:
    base, res = _fill(name, v)
    filled = res.filled
    assert filled.refresh_steps == len(filled.iterations) >= 1
    tags: Counter[str] = Counter()
    for it in filled.iterations:
        validate(it)  # deadlock freedom with the split batches and the collective fillers
        for r in range(base.stages):
            row = it.actions[r]
            # the base actions, in the same order, plus fillers
            assert [a for a in row if a.kind is not K.FILLER and not a.is_p2p] == [
                a for a in base.actions[r] if not a.is_p2p]
            assert Counter(a for a in row if a.is_p2p) == Counter(a for a in base.actions[r] if a.is_p2p)
            tags.update(f"{r}:{a.tag}" for a in row if a.kind is K.FILLER)
    # each piece exactly once per cycle on every rank
    work = uniform_kfac_work(base)
    want = Counter(f"{r}:kfac.curv.{m}" for r in range(base.stages) for m in work.curv_s[r])
    want.update(f"{r}:kfac.reduce" for r in range(base.stages))
    want.update(f"{r}:kfac.inv.{k}" for r in range(base.stages) for k in range(2))
    assert tags == want
    _check_dependencies(base, filled)
    # the fillers sit in the bubbles: utilization goes up, the step does not get longer here
    assert res.utilization_with_fillers > res.utilization_without_fillers
    assert res.iteration_time_with_fillers_s == pytest.approx(res.iteration_time_s)
    assert res.utilization_without_fillers == pytest.approx(1 - _bubble(base))


def _bubble(s: Schedule) -> float:
    from paratrain.sim import simulate

    return simulate(s).bubble_fraction


def _check_dependencies(base: Schedule, filled: FilledSchedule) -> None:
    """curv.m after the rank's last B/W of m in step 0; reduce after every curv of its group;
    inv after the reduce; a group's reduce in the same step on every member."""
    where: dict[tuple[int, str], tuple[int, int]] = {}
    for step, it in enumerate(filled.iterations):
        for r, row in enumerate(it.actions):
            last_bwd: dict[int, int] = {}
            for i, a in enumerate(row):
                if a.kind in (K.BACKWARD, K.BACKWARD_WEIGHT):
                    last_bwd[a.microbatch] = i
            for i, a in enumerate(row):
                if a.kind is K.FILLER:
                    where[(r, a.tag)] = (step, i)
                    piece = kfac_piece(a.tag)
                    if piece and piece[0] == "curv" and step == 0:
                        assert i > last_bwd[piece[1]], (r, a.tag)
    for r in range(base.stages):
        red = where[(r, "kfac.reduce")]
        for q in base.filler_group(r):
            # one collective: the same step on every member, each member's curvature before it
            assert where[(q, "kfac.reduce")][0] == red[0]
            assert all(pos < where[(q, "kfac.reduce")] for (qq, tag), pos in where.items()
                       if qq == q and tag.startswith("kfac.curv"))
        assert all(pos > red for (rr, tag), pos in where.items() if rr == r and tag.startswith("kfac.inv"))


def test_chimera_reduce_is_one_collective_per_mirror_pair() -> None:
    base, res = _fill("chimera", 1)
    assert base.filler_group(0) == (0, 3) and base.filler_group(1) == (1, 2)
    it = next(i for i in res.filled.iterations if any(a.tag == "kfac.reduce" for a in i.actions[0]))
    comp = it.compiled
    g0 = comp.offsets[0] + next(i for i, a in enumerate(it.actions[0]) if a.tag == "kfac.reduce")
    g3 = comp.offsets[3] + next(i for i, a in enumerate(it.actions[3]) if a.tag == "kfac.reduce")
    assert comp.collective_members[g0] == comp.collective_members[g3] == (g0, g3)
    # in the simulation both members run it at the same time
    run = run_schedule(it, uniform_timing(it))
    starts = {e.rank: e.start_s for e in run.events if e.name.startswith("X:kfac.reduce")}
    assert starts[0] == starts[3]


def test_collective_filler_waits_for_the_last_member() -> None:
    s = generate("chimera", stages=2, microbatches=2)
    rows = [list(r) for r in s.to_dict()["actions"]]
    rows[0][:0] = ["X:late/3", "X:kfac.reduce/1"]
    rows[1][:0] = ["X:kfac.reduce/1"]
    filled = Schedule.from_dict({**s.to_dict(), "actions": rows})
    validate(filled)
    run = run_schedule(filled, uniform_timing(filled))
    starts = sorted(e.start_s for e in run.events if e.name == "X:kfac.reduce/1")
    assert starts == [3, 3]  # rank 1 reaches it at 0 and waits for rank 0, there at 3
    assert run.busy_s[1] == run_schedule(s, uniform_timing(s)).busy_s[1] + 1  # waiting is not work


def test_a_deadlocking_collective_placement_is_refused() -> None:
    # Chimera pair 0/3: rank 0 enters the all-reduce before sending its first activation, rank 3
    # only after receiving activations that come (through ranks 1, 2) from rank 0
    s = generate("chimera", stages=4, microbatches=4)
    rows = [list(r) for r in s.to_dict()["actions"]]
    rows[0].insert(0, "X:kfac.reduce/1")
    rows[3].insert(len(rows[3]) - 1, "X:kfac.reduce/1")
    bad = Schedule.from_dict({**s.to_dict(), "actions": rows})
    with pytest.raises(ConfigError, match="deadlock"):
        validate(bad)
    # a collective on one member only has no partner
    rows[3].pop(len(rows[3]) - 2)
    with pytest.raises(ConfigError, match="collective filler #1"):
        validate(Schedule.from_dict({**s.to_dict(), "actions": rows}))


def test_a_piece_larger_than_every_bubble_runs_at_the_end() -> None:
    s = generate("1f1b", stages=2, microbatches=2)
    work = KfacWork(({0: 0.1, 1: 0.1}, {0: 0.1, 1: 0.1}), (0.1, 0.1), ((50.0,), (0.1,)))
    res = fill_kfac(s, uniform_timing(s), work)
    assert res.serial_pieces == 1
    last = res.filled.iterations[-1].actions[0]
    assert [str(a) for a in last[-2:]] == ["X:kfac.inv.0/50", "U"]
    assert res.iteration_time_with_fillers_s > res.iteration_time_s


def test_asynchronous_schedules_are_refused() -> None:
    s = generate("pipedream", stages=2, microbatches=2)
    with pytest.raises(ConfigError, match="asynchronous"):
        fill_kfac(s, uniform_timing(s), uniform_kfac_work(s))


def test_filled_schedule_round_trips_through_json() -> None:
    _, res = _fill("zb-h1", 1)
    doc = res.filled.to_dict()
    back = FilledSchedule.from_dict(doc)
    assert back == res.filled and back.inv_groups(0) == 2
    assert back.schedule_for_step(res.refresh_steps + 1) == res.filled.iterations[1 % res.refresh_steps]
    with pytest.raises(ConfigError, match="refresh_steps"):
        FilledSchedule.from_dict({**doc, "refresh_steps": doc["refresh_steps"] + 1})


def test_zero_bubble_curvature_follows_the_weight_gradient() -> None:
    # ZB-H1 over 2 stages, 2 micro-batches; stage 0 is slow: F = 3, I = 1, W = 3; stage 1: F = I = W = 1.
    # rank 0: F0 [0,3] F1 [3,6] I0 [6,7] W0 [7,10] I1 [10,11] W1 [11,14]: no gap at all.
    # rank 1: idle [0,3] F0 [3,4] I0 [4,5] idle [5,6] F1 [6,7] I1 [7,8] W0 [8,9] W1 [9,10] idle [10,14].
    # The gap [5,6] comes after I0 but before W0: curvature of micro-batch 0 (it needs the weight
    # gradient) may not go there, only into the tail [10,14] with the rest of rank 1's pieces
    # (1.75 in all). Rank 0 appends its 1.75 before its optimizer step: the step takes 15.75.
    s = generate("zb-h1", stages=2, microbatches=2)
    timing = dataclasses.replace(uniform_timing(s), forward_s=(3.0, 1.0), weight_s=(3.0, 1.0))
    assert timing.input_s == (1.0, 1.0)
    work = KfacWork(({0: 0.5, 1: 0.5}, {0: 0.5, 1: 0.5}), (0.25, 0.25), ((0.5,), (0.5,)))
    res = fill_kfac(s, timing, work)
    assert res.refresh_steps == 1 and res.serial_pieces == 4
    rank0, rank1 = res.filled.iterations[0].to_text().splitlines()
    pieces = "X:kfac.curv.0/0.5 X:kfac.curv.1/0.5 X:kfac.reduce/0.25 X:kfac.inv.0/0.5 U"
    assert rank0 == "rank 0: F0@c0 SF0@c0>1 F1@c0 SF1@c0>1 RB0@c0<1 I0@c0 W0@c0 RB1@c0<1 I1@c0 W1@c0 R@c0 " + pieces
    assert rank1 == ("rank 1: RF0@c1<0 F0@c1 I0@c1 SB0@c1>0 RF1@c1<0 F1@c1 I1@c1 SB1@c1>0 W0@c1 W1@c1 R@c1 "
                     + pieces)
    assert res.iteration_time_s == 14 and res.iteration_time_with_fillers_s == 15.75
    _check_dependencies(s, res.filled)


def test_split_curvature_pieces_add_up_to_the_whole() -> None:
    from paratrain.cost.kfac import KfacLayerCost
    from paratrain.schedule.filled import curv_group

    # interleaved: rank r holds chunks r and r+2, two layers each; layer j of chunk c has curvature c+1+j/10
    s = generate("interleaved", stages=2, microbatches=4, virtual_stages=2)
    layers = [tuple(KfacLayerCost(1, 1, c + 1 + j / 10, 8, 0.5, 0.0) for j in range(2)) for c in range(4)]
    work = kfac_work(s, layers, (0.0, 0.0), inv_groups=2)
    # rank 0 holds chunks 0 and 2: group 0 = chunk 0's layers, group 1 = chunk 2's
    assert work.curv_parts_s[0][1] == pytest.approx((1 + 1.1, 3 + 3.1))
    assert work.curv_s[0][1] == pytest.approx(sum(work.curv_parts_s[0][1]))
    assert work.inv_s[0] == (1.0, 1.0)
    res = fill_kfac(s, uniform_timing(s, 10, 20), work, split_curvature=True)
    tags = [a.tag for it in res.filled.iterations for a in it.actions[0] if a.kind is K.FILLER]
    assert sorted(t for t in tags if curv_group(t) is not None) == sorted(
        f"kfac.curv.{m}.{k}" for m in range(4) for k in range(2))
    assert kfac_piece("kfac.curv.3.1") == ("curv", 3) and curv_group("kfac.curv.3") is None
    assert kfac_piece("kfac.inv.1.2") is None


@pytest.mark.parametrize("name, v", SYNC)
def test_random_piece_sizes_still_give_valid_steps(name: str, v: int) -> None:
    import random

    rng = random.Random(7)
    s = generate(name, stages=4, microbatches=8, virtual_stages=v)
    for split in (False, True):
        curv = tuple({m: rng.uniform(0.05, 1.5) for m in range(8)} for _ in range(4))
        parts = tuple({m: (d / 3, d / 3, d / 3) for m, d in c.items()} for c in curv)
        work = KfacWork(curv, tuple(rng.uniform(0, 2) for _ in range(4)),
                        tuple(tuple(rng.uniform(0.1, 4) for _ in range(3)) for _ in range(4)), parts)
        res = fill_kfac(s, uniform_timing(s, 1.0, rng.uniform(1, 3)), work, split_curvature=split)
        for it in res.filled.iterations:
            validate(it)
        _check_dependencies(s, res.filled)
        work_total = sum(work.total_s(r) for r in range(4))
        placed = sum(a.duration_s for it in res.filled.iterations for row in it.actions for a in row
                     if a.kind is K.FILLER)
        # every piece once; a reduce counts on each member
        assert placed == pytest.approx(work_total + sum(
            max(work.reduce_s[q] for q in s.filler_group(r)) - work.reduce_s[r] for r in range(4)))

"""The planner keeps exactly the (schedule, stages, micro-batches, chunks) the generators build,
so a search over every schedule never hands the simulator one it rejects."""

from __future__ import annotations

import dataclasses

from hypothesis import given, settings
from hypothesis import strategies as st

from paratrain.errors import ConfigError
from paratrain.parallel.config import ScheduleName
from paratrain.plan.backend import default_backend
from paratrain.plan.search import plan
from paratrain.plan.space import Pins, schedule_rule_ok
from paratrain.schedule import generate
from paratrain.spec.cluster import resolve_cluster
from paratrain.spec.model import preset

ALL = tuple(ScheduleName)


def _generator_accepts(name: ScheduleName, stages: int, microbatches: int, virtual_stages: int) -> bool:
    # One iteration is enough: no rule depends on how many an asynchronous schedule covers.
    its = 1 if name.is_async else None
    try:
        generate(name, stages=stages, microbatches=microbatches, virtual_stages=virtual_stages, iterations=its)
    except ConfigError:
        return False
    return True


@settings(max_examples=300, deadline=None)
@given(
    name=st.sampled_from(ALL),
    stages=st.integers(1, 8),
    microbatches=st.integers(1, 24),
    virtual_stages=st.integers(1, 3),
)
def test_planner_rule_accepts_exactly_what_the_generator_builds(
    name: ScheduleName, stages: int, microbatches: int, virtual_stages: int
) -> None:
    assert schedule_rule_ok(name, stages, virtual_stages, microbatches) == _generator_accepts(
        name, stages, microbatches, virtual_stages
    )


def test_rule_cases_each_schedule_rejects() -> None:
    # the cases that broke or could break the planner: each side of every rule
    cases = [
        (ScheduleName.PIPEDREAM_2BW, 2, 1, 1, False),
        (ScheduleName.PIPEDREAM_2BW, 2, 2, 1, True),
        (ScheduleName.CHIMERA, 3, 6, 1, False),
        (ScheduleName.CHIMERA, 4, 6, 1, False),
        (ScheduleName.CHIMERA, 4, 8, 1, True),
        (ScheduleName.INTERLEAVED, 1, 4, 2, False),
        (ScheduleName.INTERLEAVED, 2, 3, 2, False),
        (ScheduleName.INTERLEAVED, 2, 4, 1, False),
        (ScheduleName.INTERLEAVED, 2, 4, 2, True),
        (ScheduleName.GPIPE, 4, 8, 2, False),
        (ScheduleName.PIPEDREAM, 8, 1, 1, True),
        (ScheduleName.ZB_H1, 8, 1, 1, True),
    ]
    for name, p, m, v, ok in cases:
        assert schedule_rule_ok(name, p, v, m) is ok, (name, p, m, v)
        assert _generator_accepts(name, p, m, v) is ok, (name, p, m, v)


def test_plan_over_every_schedule_completes() -> None:
    # 16 GPUs, global batch 64: some layouts leave 2BW fewer micro-batches than stages, which the
    # simulator's generator rejects; the search counts them and goes on.
    model = preset("gpt3-1.3b")
    cluster = resolve_cluster("dgx-a100", gpus=16)
    res = plan(model, cluster, 64, pins=Pins(schedules=ALL), backend=default_backend(), top=5, confirm=8)
    assert res.ranked
    assert res.rejected.get("schedule_rule", 0) > 0
    for cand in res.ranked:
        cfg = cand.config
        assert _generator_accepts(cfg.schedule, cfg.pp, cfg.num_microbatches, cfg.virtual_stages)
    assert any(c.simulated is not None for c in res.ranked)


def test_rule_breakers_never_reach_the_simulator(fake_backend) -> None:
    # The simulator builds the schedule first, as the real one does: a rule breaker would raise.
    built = []

    def simulate(model, cluster, config, *, overlap_grad_reduce=True):
        generate(
            config.schedule,
            stages=config.pp,
            microbatches=config.num_microbatches,
            virtual_stages=config.virtual_stages,
            iterations=1 if config.schedule.is_async else None,
        )
        built.append(config)
        return fake_backend.simulate(model, cluster, config, overlap_grad_reduce=overlap_grad_reduce)

    backend = dataclasses.replace(fake_backend, simulate=simulate)
    model = preset("gpt3-1.3b")
    cluster = resolve_cluster("dgx-a100", gpus=32)
    for name in ALL:
        pins = Pins(schedule=name, pp=4, microbatch=4)
        res = plan(model, cluster, 64, pins=pins, backend=backend, top=40, confirm=40, refine=40,
                   confirm_budget_actions=10**9)
        assert res.ranked, name
    assert built
    assert {c.schedule for c in built} == set(ALL)


def test_plan_cli_with_every_schedule_listed(capsys) -> None:
    import json

    from paratrain.cli import main

    names = ",".join(s.value for s in ALL)
    try:
        main(["plan", "--model", "gpt3-1.3b", "--gpus", "16", "--global-batch", "64", "--schedules", names, "--json"])
        code = 0
    except SystemExit as e:
        code = int(e.code or 0)
    out = capsys.readouterr()
    assert code == 0, out.err
    doc = json.loads(out.out)
    assert doc["rejected"]["schedule_rule"] > 0
    assert doc["candidates"]

"""The compiled form (paratrain.schedule.compiled): hosts, matched sends and receives, reduction and
optimizer-step groups, built once per schedule object and shared by the validator and the engine."""

from __future__ import annotations

import pytest

from paratrain.errors import ConfigError
from paratrain.schedule import Schedule, generate, validate
from paratrain.schedule.compiled import STEP_P2P, compile_schedule, hosts_of
from paratrain.schedule.ir import ActionKind as K
from paratrain.sim import run_schedule, uniform_timing


def test_hosts_of_a_chunk() -> None:
    assert [hosts_of(generate("1f1b", stages=4, microbatches=4), c) for c in range(4)] == [(0,), (1,), (2,), (3,)]
    il = generate("interleaved", stages=2, microbatches=4, virtual_stages=2)
    assert [hosts_of(il, c) for c in range(4)] == [(0,), (1,), (0,), (1,)]
    ch = generate("chimera", stages=4, microbatches=4)  # replica 1 runs the chunks in reverse rank order
    assert [hosts_of(ch, c) for c in range(4)] == [(0, 3), (1, 2), (1, 2), (0, 3)]
    assert ch.compiled.hosts == tuple(hosts_of(ch, c) for c in range(4))


@pytest.mark.parametrize("name", ["1f1b", "interleaved", "chimera", "zb-h1", "2bw"])
def test_partners_are_the_matching_fifo_actions(name: str) -> None:
    s = generate(name, stages=4, microbatches=8, virtual_stages=2 if name == "interleaved" else 1)
    c = s.compiled
    assert c is s.compiled  # built once per object
    flat = [(r, a) for r, row in enumerate(s.actions) for a in row]
    assert c.total == len(flat) and c.offsets[1] == len(s.actions[0])
    for g, (r, a) in enumerate(flat):
        p = c.partner[g]
        if not a.is_p2p:
            assert p == -1
            continue
        q, b = flat[p]
        assert c.partner[p] == g and c.rank_of[p] == q == a.peer and b.peer == r
        assert b.microbatch == a.microbatch and b.is_send != a.is_send
    for g, ms in c.reduce_members.items():
        assert g in ms and [c.rank_of[m] for m in ms] == list(hosts_of(s, flat[g][1].chunk))
    for g, ms in c.step_members.items():
        assert [flat[m][1].kind for m in ms] == [K.OPTIMIZER_STEP] * s.stages and g in ms
    assert validate(s).p2p_batches_by_rank == tuple(sum(st[0] == STEP_P2P for st in row) for row in c.steps)


def test_a_send_without_its_receive_is_named_by_the_simulator_too() -> None:
    r0 = ["F0@c0", "SF0@c0>1", "RB0@c0<1", "B0@c0", "R@c0", "U"]
    r1 = ["F0@c1", "B0@c1", "SB0@c1>0", "R@c1", "U"]  # RF0@c1<0 is missing
    s = Schedule.from_dict({"stages": 2, "microbatches": 1, "actions": [r0, r1]})
    with pytest.raises(ConfigError, match=r"rank 0 action 1 \(SF0@c0>1\): no matching receive"):
        compile_schedule(s)
    with pytest.raises(ConfigError, match="no matching receive"):
        run_schedule(s, uniform_timing(s))

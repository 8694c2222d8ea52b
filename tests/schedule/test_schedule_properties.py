"""Property tests: random per-rank orders of forwards and backwards, lowered with insert_p2p.

The validator's deadlock analysis and the simulator's execution under blocking sends are two
separate implementations of the IR's semantics; they must agree on every schedule. Schedules the
validator accepts must also keep every rank busy exactly 3m (F = 1, B = 2) in the simulator.
"""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from paratrain.errors import ConfigError
from paratrain.schedule import Action, ActionKind, Schedule, insert_p2p, validate
from paratrain.sim import run_schedule, simulate, uniform_timing

K = ActionKind


@st.composite
def random_orders(draw) -> Schedule:
    p = draw(st.integers(2, 4))
    m = draw(st.integers(1, 4))
    rows = []
    for r in range(p):
        # a random interleaving of F0..F(m-1) and B0..B(m-1) with each B after its F
        f = b = 0
        row: list[Action] = []
        while b < m:
            if f < m and (f == b or draw(st.booleans())):
                row.append(Action(K.FORWARD, f, r))
                f += 1
            else:
                row.append(Action(K.BACKWARD, b, r))
                b += 1
        row += [Action(K.REDUCE_GRAD, None, r), Action(K.OPTIMIZER_STEP)]
        rows.append(row)
    placement = (tuple(range(p)),)
    return Schedule("random", p, m, placement, insert_p2p(rows, placement))


def _deadlocks_in_validator(s: Schedule) -> bool:
    try:
        validate(s)
    except ConfigError as e:
        assert "deadlock" in str(e), str(e)  # the lowering never produces any other error
        return True
    return False


def _deadlocks_in_engine(s: Schedule) -> bool:
    try:
        run_schedule(s, uniform_timing(s), record=False, blocking_sends=True)
    except ConfigError as e:
        assert "deadlock" in str(e)
        return True
    return False


@settings(max_examples=300, deadline=None)
@given(random_orders())
def test_validator_and_engine_agree_on_deadlock(s: Schedule) -> None:
    dead = _deadlocks_in_validator(s)
    assert dead == _deadlocks_in_engine(s)
    if not dead:
        r = simulate(s)
        assert r.busy_s_by_rank == (3.0 * s.microbatches,) * s.stages
        # eager sends never lose to blocking ones
        blocking = run_schedule(s, uniform_timing(s), record=False, blocking_sends=True)
        assert r.iteration_time_s <= max(blocking.finish_s)


def test_some_random_orders_deadlock_and_some_do_not() -> None:
    # guard that the property above exercises both outcomes
    r0 = [Action(K.FORWARD, 0, 0), Action(K.FORWARD, 1, 0), Action(K.BACKWARD, 0, 0), Action(K.BACKWARD, 1, 0)]
    r1_ok = [Action(K.FORWARD, 0, 1), Action(K.BACKWARD, 0, 1), Action(K.FORWARD, 1, 1), Action(K.BACKWARD, 1, 1)]
    tail = [Action(K.OPTIMIZER_STEP)]
    pl = ((0, 1),)

    def mk(a: list[Action], b: list[Action]) -> Schedule:
        return Schedule(
            "x",
            2,
            2,
            pl,
            insert_p2p([a + [Action(K.REDUCE_GRAD, None, 0)] + tail, b + [Action(K.REDUCE_GRAD, None, 1)] + tail], pl),
        )

    assert not _deadlocks_in_validator(mk(r0, r1_ok))
    # rank 0 runs B0 before F1 but rank 1 wants F1 before B0: each waits for the other
    r0_bad = [Action(K.FORWARD, 0, 0), Action(K.BACKWARD, 0, 0), Action(K.FORWARD, 1, 0), Action(K.BACKWARD, 1, 0)]
    r1_bad = [Action(K.FORWARD, 0, 1), Action(K.FORWARD, 1, 1), Action(K.BACKWARD, 0, 1), Action(K.BACKWARD, 1, 1)]
    s = mk(r0_bad, r1_bad)
    assert _deadlocks_in_validator(s) and _deadlocks_in_engine(s)

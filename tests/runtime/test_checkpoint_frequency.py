"""What a checkpoint costs the training loop (:class:`frequency.CostLedger`), on synthetic step-time
series: every step after a checkpoint starts is counted against a reference taken far from any write,
so a slowdown that outlasts the write is part of the cost, and one-off noise is bounded."""

from __future__ import annotations

import pytest

from paratrain.runtime.checkpoint import frequency


def _run(ledger: frequency.CostLedger, steps: list[tuple[float, bool]]) -> None:
    for step_s, writing in steps:
        ledger.observe(step_s, writing=writing)


def _profiled(ref: float = 1.0, n: int = 3) -> frequency.CostLedger:
    ledger = frequency.CostLedger()
    _run(ledger, [(ref, False)] * n)
    return ledger


def _interval(write: list[float], after: list[float]) -> list[tuple[float, bool]]:
    """A checkpoint's interval: steps beside its write, then the steps after it."""
    return [(t, True) for t in write] + [(t, False) for t in after]


def test_a_slowdown_that_outlasts_the_write_is_counted() -> None:
    # 1 s steps; each checkpoint's write slows 20 steps by 0.3 s, and 15 more after it by 0.1 s
    ledger = _profiled()
    for _ in range(3):
        ledger.started()
        _run(ledger, _interval([1.3] * 20, [1.1] * 15))
    assert ledger.reference_s == pytest.approx(1.0)  # no step after a write was far enough to move it
    assert ledger.mean_cost_s() == pytest.approx(20 * 0.3 + 15 * 0.1)  # 7.5 s, of which 1.5 s after the write
    assert ledger.spent_s == pytest.approx(3 * 7.5)
    # the steps beside the write alone would have said 6 s; against the steps after the write as
    # the clean ones (the earlier baseline) only 20 * (1.3 - 1.1) = 4 s
    assert ledger.checkpoints == 3


def test_the_reference_comes_from_steps_far_from_any_write() -> None:
    # a long interval: the steps after FAR_STEPS (here longer than the write) refresh the
    # reference, the lingering ones do not
    far = frequency.FAR_STEPS
    ledger = _profiled(1.0)
    ledger.started()
    _run(ledger, _interval([1.5] * 4, [1.2] * far + [1.0] * 20))
    assert ledger.reference_s == pytest.approx(1.0)
    assert ledger.mean_cost_s() == pytest.approx(4 * 0.5 + far * 0.2)
    # a slowdown lingering beyond FAR_STEPS after a short write is taken for the machine's new speed
    ledger = _profiled(1.0)
    ledger.started()
    _run(ledger, _interval([1.5] * 4, [1.2] * (far + 64)))
    assert ledger.reference_s == pytest.approx(1.2)
    # a machine that got slower for good: the reference follows once far steps show it
    ledger = _profiled(1.0)
    ledger.started()
    _run(ledger, _interval([2.5] * 2, [2.0] * (far + frequency.REF_WINDOW)))
    assert ledger.reference_s == pytest.approx(2.0)


def test_waiting_for_the_snapshot_and_the_loop_are_counted_apart() -> None:
    ledger = _profiled(1.0)
    ledger.started()
    ledger.add_thread_time(0.05)  # starting the snapshot after the step
    ledger.observe(1.4, writing=True, waited_s=0.3)  # 0.3 s of the step waited at the optimizer step
    ledger.observe(1.0, writing=False, thread_s=0.02)
    assert ledger.spent_s == pytest.approx(0.05 + 0.3 + 0.1 + 0.02)


def test_a_spike_counts_as_one_step_at_most() -> None:
    # another job's burst makes one step 30x slower: it costs at most one reference step
    ledger = _profiled(1.0)
    ledger.started()
    _run(ledger, _interval([1.2] * 2, [30.0] + [1.0] * 10))
    assert ledger.mean_cost_s() == pytest.approx(2 * 0.2 + 1.0)
    # and among the far steps it does not raise the reference
    assert frequency.reference_step([1.0, 1.1, 0.9, 30.0, 1.0]) == pytest.approx(1.0)
    assert frequency.reference_step([]) == 0.0


def test_a_faster_machine_is_not_a_cost_taken_back() -> None:
    # steps faster than the reference after a write: the checkpoint costs its training-thread time
    ledger = _profiled(1.0)
    ledger.started()
    ledger.add_thread_time(0.01)
    _run(ledger, _interval([1.0], [0.7] * 10))
    assert ledger.spent_s == pytest.approx(0.01)


def test_one_disturbed_interval_does_not_spend_the_whole_budget() -> None:
    # four intervals cost 1 s; one that a burst of load filled cost 40 s: it counts as 3 x the median
    ledger = _profiled(1.0)
    for extra in (0.1, 0.1, 0.1, 0.5, 0.1):
        ledger.started()
        _run(ledger, _interval([1.0 + extra] * 10, [1.0] * 10) if extra < 0.5 else [(2.0, True)] * 40)
    ledger.started()
    assert ledger.spent_s == pytest.approx(4 * 1.0 + frequency.OUTLIER * 1.0)
    assert ledger.mean_cost_s() == pytest.approx((4 + frequency.OUTLIER) / 5)


def _simulate(write_steps: int, beside: float, linger_steps: int, linger: float, steps: int = 4000,
              bound: float = frequency.DEFAULT_OVERHEAD, first_s: float = 1.0) -> tuple[float, int]:
    """A run of 1 s steps driven by the ledger and :func:`frequency.budget_interval` as the
    Checkpointer drives them (a profiling checkpoint after PROFILE_STEPS timed steps, ``k`` decided
    when its write ends, re-decided as each later checkpoint starts): each checkpoint slows
    ``write_steps`` steps by ``beside`` and the next ``linger_steps`` by ``linger``. Returns the
    run's true overhead and the checkpoints taken. ``first_s``: the profiling steps' time (a loaded
    start), the true overhead being against 1 s."""
    ledger = frequency.CostLedger()
    total, taken, writing_left, slow = 0.0, 0, 0, []
    next_at: int | None = frequency.PROFILE_STEPS + 1
    profiling = False

    def decide(done: int, starting: bool) -> int:
        cost = ledger.mean_cost_s()
        spent = ledger.spent_s + starting * cost
        k = frequency.budget_interval(ledger.reference_s, cost, write_steps, spent_s=spent,
                                      steps_total=steps - 1, steps_left=steps - done, bound=bound * frequency.AIM)
        return max(k, ledger.min_interval)

    for step in range(1, steps):  # step 0, the warm-up, is not counted
        t = (first_s if step <= frequency.PROFILE_STEPS else 1.0) + (slow.pop(0) if slow else 0.0)
        total += t
        ledger.observe(t, writing=writing_left > 0)
        writing_left = max(0, writing_left - 1)
        done = step + 1
        if profiling and writing_left == 0:
            profiling = False
            next_at = done + decide(done, starting=False)
        if done == next_at:
            ledger.started()
            if taken:
                next_at = done + decide(done, starting=True)
            else:
                profiling, next_at = True, None
            taken += 1
            writing_left, slow = write_steps, [beside] * write_steps + [linger] * linger_steps
    return total / (steps - 1) - 1.0, taken


@pytest.mark.parametrize("write_steps,beside,linger_steps,linger", [
    (5, 0.3, 0, 0.0),  # the whole cost beside the write
    (5, 0.3, 8, 0.1),  # lingering after the write, for FAR_STEPS
    (30, 0.1, 29, 0.1),  # lingering after the write, as long as the write
    (60, 0.17, 40, 0.1),  # a write spread over most of the interval (the 96M GPT's case)
])
def test_the_tuner_keeps_a_run_within_the_bound_whatever_the_slowdown_s_shape(write_steps, beside, linger_steps,
                                                                              linger) -> None:
    overhead, taken = _simulate(write_steps, beside, linger_steps, linger)
    assert overhead <= frequency.DEFAULT_OVERHEAD
    assert taken >= 3  # and it does checkpoint


def test_slow_first_steps_do_not_make_checkpoints_look_free() -> None:
    # the profiling steps ran on a loaded machine (3x slower): against that reference every later
    # checkpoint would look free; the interval keeps far steps (min_interval), so the reference
    # comes down and the run stays within the bound
    overhead, taken = _simulate(3, 0.5, 0, 0.0, first_s=3.0)
    assert overhead <= frequency.DEFAULT_OVERHEAD + 6 / 4000  # the slow profiling steps themselves
    assert taken >= 3


def test_every_interval_keeps_steps_far_from_the_write() -> None:
    ledger = _profiled()
    ledger.started()
    _run(ledger, _interval([1.2] * 20, []))
    assert ledger.min_interval == 20 + 20 + 1  # the write, as long again, then one far step
    ledger.started()
    assert ledger.min_interval == 41  # the last finished write's, until the new one's is longer
    _run(ledger, _interval([1.2] * 3, [1.0] * 10))
    assert ledger.min_interval == 3 + frequency.FAR_STEPS + 1

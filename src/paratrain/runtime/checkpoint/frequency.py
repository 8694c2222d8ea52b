"""How often to checkpoint: ``--checkpoint-every auto|N|Ns`` and the CheckFreq tuner (no torch).

CheckFreq (Mohan et al., FAST'21; msr-fiddle/CheckFreq ``cf_iterator.py``) measures the iteration
time ``t_i``, the cost ``c`` one checkpoint adds to training and the time ``t_p`` of a whole
checkpoint (snapshot + persist, in the background), then checkpoints every

    k = max(1, ceil(c / (p * t_i)), ceil(t_p / t_i))

steps: the cost amortized over ``k`` steps stays within the bound ``p`` of the step time, and the
background persist of checkpoint n ends before checkpoint n+1 starts (at most one in flight).

The cost ``c`` is measured, not assumed (:class:`CostLedger`): the time the training thread spends
on the checkpoint (taking references, waiting for the snapshot before the optimizer step, joining
the writer) *plus* how much slower than a reference step *every* step of its interval was, the
steps after its write included. The writer is a process of its own (no GIL shared with training)
but shares the cores; on a machine with no core to spare the second term is most of ``c``, and
part of it lands after the write (the README's figures).

A run also pays for its first, profiling checkpoint and the measurement is noisy, so
:func:`budget_interval` spends the bound as a budget over the run's steps: the cost measured so far
(the profiling checkpoint included) is subtracted from ``p`` times the run's clean time, and the
remaining checkpoints are spread so that the rest fits. Over a long run this is CheckFreq's ``k``;
over a short one it is larger. Each checkpoint re-tunes from the costs measured so far.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from paratrain.errors import ConfigError

__all__ = ["DEFAULT_OVERHEAD", "PROFILE_STEPS", "AIM", "Every", "parse_every", "interval_for", "budget_interval",
           "steps_for_seconds", "reference_step", "CostLedger", "FAR_STEPS", "REF_WINDOW", "SPIKE",
           "OUTLIER"]

DEFAULT_OVERHEAD = 0.035  # the bound on checkpointing's share of step time (issue 13)
PROFILE_STEPS = 3  # steps timed before the first decision; step 0 (allocation, warm-up) is not counted
# The tuner plans for this share of the bound: the first decisions rest on one or two checkpoints'
# costs, and a cost above the mean is only paid back by the budget afterwards.
AIM = 0.8
FAR_STEPS = 8  # a step this many steps after a write ended is far from it: the reference's steps
REF_WINDOW = 64  # far steps the reference averages: recent enough to follow a drifting machine
SPIKE = 2.0  # a far step over this many times their median is another job's burst, not the reference
OUTLIER = 3.0  # a checkpoint's cost counts at most this many times the median cost (three or more)


@dataclass(frozen=True)
class Every:
    """``kind``: ``auto`` (tuned), ``steps`` (every ``value`` steps) or ``seconds`` (every ``value``
    seconds of training, converted to steps from the measured step time)."""

    kind: str
    value: float = 0.0

    def __str__(self) -> str:
        return {"auto": "auto", "steps": f"{self.value:g}", "seconds": f"{self.value:g}s"}[self.kind]


def parse_every(text: str) -> Every:
    t = str(text).strip().lower()
    if t == "auto":
        return Every("auto")
    m = re.fullmatch(r"(\d+)", t)
    if m and int(m.group(1)) >= 1:
        return Every("steps", int(m.group(1)))
    m = re.fullmatch(r"(\d+(?:\.\d*)?|\.\d+)s", t)
    if m and math.isfinite(float(m.group(1))) and float(m.group(1)) > 0:
        return Every("seconds", float(m.group(1)))
    raise ConfigError("--checkpoint-every", f"{text!r} is not 'auto', a step count or a number of seconds",
                      "use e.g. --checkpoint-every auto, 100 (steps) or 600s (seconds)")


def interval_for(step_s: float, cost_s: float, persist_s: float, bound: float = DEFAULT_OVERHEAD) -> int:
    """CheckFreq's ``k``: the fewest steps between checkpoints that keep one checkpoint's cost
    within ``bound`` of the step time and one checkpoint in flight (module docstring)."""
    if step_s <= 0 or not math.isfinite(step_s):
        return 1
    k_cost = math.ceil(max(cost_s, 0.0) / (bound * step_s) - 1e-9)
    k_persist = math.ceil(max(persist_s, 0.0) / step_s - 1e-9)
    return max(1, k_cost, k_persist)


def reference_step(times: list[float]) -> float:
    """A step's time with no checkpoint near: the mean of ``times`` without the spikes (a step over
    :data:`SPIKE` times the median: another job's burst, a page-cache flush), which would raise the
    reference and hide what checkpoints cost. The mean, not the median: the excess summed against a
    median of a right-skewed spread would be biased upward. 0.0 when there is nothing to go on."""
    if not times:
        return 0.0
    mid = sorted(times)[len(times) // 2]
    kept = [t for t in times if t <= SPIKE * mid]
    return sum(kept) / len(kept)


class CostLedger:
    """What checkpointing has cost the training loop: every step since the first checkpoint, not only
    the steps beside a write (no torch; :class:`~.persist.Checkpointer` feeds it each step).

    Why every step: a write's slowdown of training can outlast the write (dirty pages flushed, caches
    refilled), and a low-priority writer spread over most of an interval leaves few clean steps to
    compare with; counting only the steps beside the write, against the other steps, saw a fraction
    of the loss (the 96M GPT: ~15 s of training lost per checkpoint, ~3 s counted).

    * The *reference* step time (:attr:`reference_s`) comes from steps far from any write: the steps
      before the first checkpoint, then only steps after the last write ended by at least as many
      steps as it lasted, and at least :data:`FAR_STEPS` (the last :data:`REF_WINDOW` of them,
      :func:`reference_step`). So it follows a machine that gets faster or slower for good, but is
      not pulled up by a write's lingering slowdown, as long as that lasts no longer than the write
      (or FAR_STEPS): a slowdown that outlasts that is taken for the machine's new speed.
    * Each step after the first checkpoint started is charged to the newest checkpoint: its time
      over the reference (the wait for the snapshot inside it set apart), clamped to one reference
      step either way, so that one step of another job's burst counts as one step at most; plus the
      training thread's own time on checkpoints (waits, joins, starting the snapshot), not clamped.
    * A checkpoint's cost, once the next one starts, is the sum over its interval, never below its
      training-thread time (a machine that got faster is not a cost the write took back).
    * :attr:`spent_s` sums those costs, each capped at :data:`OUTLIER` times the median of the
      costs so far once there are three: an interval that another job's burst filled must not spend
      the budget of the whole run (and stop checkpointing until its end).
    * :attr:`min_interval`, the tuner's least ``k``, leaves far steps in every interval, so the
      reference is refreshed (a reference taken on slow first steps would make checkpoints free).
    """

    def __init__(self) -> None:
        self._far: list[float] = []  # step times far from any write: the reference's window
        self._since_write = FAR_STEPS  # steps since the last write ended (far before the first)
        self._write_steps = 0  # steps the newest checkpoint's write has lasted so far
        self._prev_write_steps = 0  # and the one before's
        self._costs: list[float] = []  # closed checkpoints: cost of each, over its whole interval
        self._open_excess: float | None = None  # the newest checkpoint's signed, clamped excess so far
        self._open_thread = 0.0  # and its training-thread time

    @property
    def reference_s(self) -> float:
        return reference_step(self._far)

    @property
    def checkpoints(self) -> int:
        """Checkpoints started (the newest, still accumulating, included)."""
        return len(self._costs) + (self._open_excess is not None)

    def observe(self, step_s: float, *, writing: bool, waited_s: float = 0.0, thread_s: float = 0.0) -> None:
        """One step: its wall time ``step_s`` (``waited_s`` of it waiting for the snapshot before
        the optimizer step), whether a checkpoint was being written while it ran, and ``thread_s``,
        the training thread's time on checkpoints outside the step."""
        ref = self.reference_s
        if self._open_excess is not None:
            if ref > 0:
                self._open_excess += max(-ref, min(ref, step_s - waited_s - ref))
            self._open_thread += waited_s + thread_s
        if writing:
            self._since_write = 0
            self._write_steps += 1
            return
        self._since_write += 1
        if self._since_write > max(FAR_STEPS, self._write_steps):
            self._far = (self._far + [step_s - waited_s])[-REF_WINDOW:]

    def add_thread_time(self, seconds: float) -> None:
        """Training-thread time on checkpoints outside any step (the newest checkpoint's)."""
        if self._open_excess is not None:
            self._open_thread += seconds

    def started(self) -> None:
        """A checkpoint starts: the previous one's interval, and so its cost, is closed."""
        if self._open_excess is not None:
            self._costs.append(self._open_cost())
        self._open_excess, self._open_thread = 0.0, 0.0
        self._prev_write_steps = self._write_steps or self._prev_write_steps
        self._since_write = self._write_steps = 0

    @property
    def min_interval(self) -> int:
        """The fewest steps between checkpoints that leave far steps in every interval: the last
        write's length, as many steps again, :data:`FAR_STEPS` at least, and one. Without far steps
        the reference could not be refreshed, and one taken on slow steps (a loaded start) would
        make every checkpoint look free: the tuner would then checkpoint as often as writes allow."""
        w = self._write_steps or self._prev_write_steps
        return w + max(FAR_STEPS, w) + 1

    def _open_cost(self) -> float:
        return self._open_thread + max(0.0, self._open_excess or 0.0)

    def _capped(self, costs: list[float]) -> list[float]:
        if len(costs) < 3:
            return costs
        cap = OUTLIER * sorted(costs)[len(costs) // 2]
        return [min(c, cap) for c in costs]

    @property
    def spent_s(self) -> float:
        """Cost of every checkpoint so far, the newest one's interval up to now included."""
        costs = self._costs + ([self._open_cost()] if self._open_excess is not None else [])
        return sum(self._capped(costs))

    def mean_cost_s(self) -> float:
        """The expected cost of one checkpoint: the mean of the closed ones (capped like
        :attr:`spent_s`); before one is closed, what the first has cost so far."""
        if self._costs:
            costs = self._capped(self._costs)
            return sum(costs) / len(costs)
        return self._open_cost() if self._open_excess is not None else 0.0


def budget_interval(step_s: float, cost_s: float, persist_s: float, *, spent_s: float, steps_total: int,
                    steps_left: int, bound: float = DEFAULT_OVERHEAD) -> int:
    """``k`` so that the whole run's checkpointing costs at most ``bound`` of its clean time.

    ``spent_s``: the cost measured so far (profiling checkpoint included); ``cost_s``: the
    expected cost of one more checkpoint; ``steps_total``: the run's steps (from its start or
    resume), ``steps_left``: those still to run. The budget left, ``bound * steps_total * step_s -
    spent_s``, pays for ``n`` more checkpoints, spread evenly over the steps left (the end of the
    run writes its own). Never below CheckFreq's :func:`interval_for`."""
    k = interval_for(step_s, cost_s, persist_s, bound)
    if step_s <= 0 or cost_s <= 0 or steps_left <= 0 or not math.isfinite(step_s + cost_s):
        return k
    n = math.floor((bound * steps_total * step_s - spent_s) / cost_s)
    if n < 1:
        return max(k, steps_left)  # the budget is spent: no more before the end of the run
    return max(k, math.ceil(steps_left / (n + 1) - 1e-9))


def steps_for_seconds(seconds: float, step_s: float) -> int:
    """``--checkpoint-every Ns`` as a step count at the measured step time."""
    if step_s <= 0 or not math.isfinite(step_s):
        return 1
    return max(1, round(seconds / step_s))

"""How often to checkpoint: ``--checkpoint-every auto|N|Ns`` and the CheckFreq tuner (no torch).

CheckFreq (Mohan et al., FAST'21; msr-fiddle/CheckFreq ``cf_iterator.py``) measures the iteration
time ``t_i``, the cost ``c`` one checkpoint adds to training and the time ``t_p`` of a whole
checkpoint (snapshot + persist, in the background), then checkpoints every

    k = max(1, ceil(c / (p * t_i)), ceil(t_p / t_i))

steps: the cost amortized over ``k`` steps stays within the bound ``p`` of the step time, and the
background persist of checkpoint n ends before checkpoint n+1 starts (at most one in flight).

The cost ``c`` is measured, not assumed: the time the training thread spends on the checkpoint
(taking references, waiting for the snapshot before the optimizer step, joining the writer)
*plus* how much the steps that overlap the background write are slower than clean steps. The
writer is a process of its own (no GIL shared with training) but shares the cores; on a machine
with no core to spare the second term is most of ``c`` (the README's figures).

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
           "interference", "steps_for_seconds"]

DEFAULT_OVERHEAD = 0.035  # the bound on checkpointing's share of step time (issue 13)
PROFILE_STEPS = 3  # steps timed before the first decision; step 0 (allocation, warm-up) is not counted
# The tuner plans for this share of the bound: the cost it measures (the training thread's time and
# the steps beside a write) misses what lands outside those steps (caches the write evicted, the
# allocator); in bench/bench_checkpoint.py runs the whole-loop overhead was 10-30 % above it.
AIM = 0.8


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


def interference(overlapped_s: list[float], clean_step_s: float) -> float:
    """Extra time of the steps that ran while a checkpoint was written in the background, over as
    many clean steps; never negative. A write does not make training faster: a negative sum means
    the machine got faster than the clean steps it is compared with, and counting it would make
    checkpoints look free (the tuner would then checkpoint as often as one write allows)."""
    return max(0.0, sum(overlapped_s) - len(overlapped_s) * clean_step_s)


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

"""How often to checkpoint: ``--checkpoint-every auto|N|Ns`` and the CheckFreq tuner (no torch).

CheckFreq (Mohan et al., FAST'21; msr-fiddle/CheckFreq ``cf_iterator.py``) measures the iteration
time ``t_i``, the snapshot stall ``t_s`` (the time training waits for a checkpoint) and the full
checkpoint time ``t_p`` (snapshot + persist, in the background), then checkpoints every

    k = max(1, ceil(t_s / (p * t_i)), ceil(t_p / t_i))

steps: the stall amortized over ``k`` steps stays within the bound ``p`` of the step time, and the
background persist of checkpoint n ends before checkpoint n+1 starts (at most one in flight).
Over each interval it measures the overhead actually paid,

    overhead = (sum of the interval's step times + its stalls - n * t_i) / (n * t_i),

which also counts a persist slowing down the steps it overlaps, and, when that leaves the bound,
stretches ``k`` in proportion, at most doubling it (CheckFreq adds 2); ``k`` never shrinks.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from paratrain.errors import ConfigError

__all__ = ["DEFAULT_OVERHEAD", "PROFILE_STEPS", "Every", "parse_every", "interval_for", "interval_overhead",
           "retune", "steps_for_seconds"]

DEFAULT_OVERHEAD = 0.035  # the bound on checkpointing's share of step time (issue 13)
PROFILE_STEPS = 3  # steps timed before the first decision; step 0 (allocation, warm-up) is not counted


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


def interval_for(step_s: float, stall_s: float, persist_s: float, bound: float = DEFAULT_OVERHEAD) -> int:
    """CheckFreq's ``k``: the fewest steps between checkpoints that keep the stall within
    ``bound`` of the step time and one checkpoint in flight (module docstring)."""
    if step_s <= 0 or not math.isfinite(step_s):
        return 1
    k_stall = math.ceil(max(stall_s, 0.0) / (bound * step_s) - 1e-9)
    k_persist = math.ceil(max(persist_s, 0.0) / step_s - 1e-9)
    return max(1, k_stall, k_persist)


def interval_overhead(step_times_s: list[float], stall_s: float, baseline_step_s: float) -> float:
    """The overhead one interval paid: extra time over ``len(step_times_s)`` clean steps, as a
    fraction of them."""
    n = len(step_times_s)
    if n == 0 or baseline_step_s <= 0:
        return 0.0
    clean = n * baseline_step_s
    return (sum(step_times_s) + stall_s - clean) / clean


def retune(k: int, overhead: float, bound: float = DEFAULT_OVERHEAD) -> int:
    """``k`` stretched so that the measured ``overhead`` (a cost per checkpoint, amortized over
    ``k`` steps) would fall within ``bound``, at most doubled per re-tune so that one noisy interval
    cannot stretch it tenfold; unchanged while it is within."""
    if overhead <= bound:
        return k
    return max(k + 1, min(2 * k, math.ceil(k * overhead / bound)))


def steps_for_seconds(seconds: float, step_s: float) -> int:
    """``--checkpoint-every Ns`` as a step count at the measured step time."""
    if step_s <= 0 or not math.isfinite(step_s):
        return 1
    return max(1, round(seconds / step_s))

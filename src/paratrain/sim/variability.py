"""Variable action durations: the expected iteration of a schedule whose actions do not all take
their mean time.

A pipeline waits for its slowest path. When every compute action takes exactly its modelled time,
the simulator gives the bubble of the schedule's shape; when durations vary from one execution to
the next (measured on a shared 2-core CPU: a coefficient of variation of 0.08–0.17 per forward or
backward of 20–45 ms, 0.1–0.4 per optimizer step), the expected iteration is longer and the bubble
larger, because a rank waiting for a partner waits for the later of two random times
(E[max] ≥ max E). The GPU presets leave this off (not measured here; a dedicated GPU's kernels
vary far less than a shared CPU's).

Model: each compute action (``F``, ``B``, ``I``, ``W``) and optimizer step takes its modelled
duration times an independent factor drawn from a gamma distribution with mean 1 and coefficient
of variation ``cv`` (positive and right-skewed, as measured durations are: on the CPU above, the
shortest of a chunk's forwards ran about 0.85 times their mean, the longest up to 1.7 times).
Communication keeps its modelled time. :func:`simulate_variable` averages ``samples`` independent
draws (a fixed seed: the same inputs give the same answer).
"""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Callable

import numpy as np

from paratrain.errors import ConfigError
from paratrain.schedule.ir import ActionKind, Schedule
from paratrain.sim.report import SimResult, simulate
from paratrain.sim.timing import Timing

__all__ = ["gamma_factors", "scaled_timing", "simulate_variable", "DEFAULT_SAMPLES"]

K = ActionKind
DEFAULT_SAMPLES = 32
_TIMED = (K.FORWARD, K.BACKWARD, K.BACKWARD_INPUT, K.BACKWARD_WEIGHT, K.OPTIMIZER_STEP)


def gamma_factors(rng: np.random.Generator, cv: float, n: int) -> np.ndarray:
    """``n`` independent factors with mean 1 and coefficient of variation ``cv`` (gamma with shape
    ``1/cv²`` and scale ``cv²``); all ones for ``cv = 0``."""
    if cv == 0:
        return np.ones(n)
    return rng.gamma(shape=1.0 / cv**2, scale=cv**2, size=n)


def scaled_timing(schedule: Schedule, timing: Timing, factor: Callable[[int, int], float]) -> Timing:
    """``timing`` with the compute action or optimizer step at ``index`` of rank ``rank``'s list
    taking ``factor(rank, index)`` times its duration (per-action overrides included)."""
    per_kind = {K.FORWARD: timing.forward_s, K.BACKWARD: timing.backward_s, K.BACKWARD_INPUT: timing.input_s,
                K.BACKWARD_WEIGHT: timing.weight_s}
    base: list[dict[int, float]] = []
    for r, row in enumerate(schedule.actions):
        mine = {}
        for i, a in enumerate(row):
            if a.kind not in _TIMED:
                continue
            v = timing.action_s(r, i) if timing.action_s is not None else None
            if v is None:
                v = timing.optimizer_s[r] if a.kind is K.OPTIMIZER_STEP else per_kind[a.kind][a.chunk]
            mine[i] = v
        base.append(mine)

    def action_s(rank: int, index: int) -> float | None:
        v = base[rank].get(index)
        return None if v is None else v * factor(rank, index)

    return dataclasses.replace(timing, action_s=action_s)


def simulate_variable(schedule: Schedule, timing: Timing, cv: float, *, samples: int = DEFAULT_SAMPLES,
                      seed: int = 0, overlap_grad_reduce: bool = True, record: bool = True) -> SimResult:
    """The schedule's expected behaviour when action durations vary with coefficient ``cv``.

    Returns the simulation at the modelled (mean) durations — its timeline, memory and
    communication log — with iteration time, busy and idle time per rank and bubble fraction
    replaced by their means over ``samples`` draws, and ``iteration_time_std_s`` their standard
    deviation across draws. ``cv = 0`` or ``samples = 0`` is the plain simulation."""
    if not 0 <= cv <= 1:
        raise ConfigError("duration_cv", f"must be in [0, 1], got {cv}", "give e.g. 0.1 (10 % variation), or 0")
    if samples < 0:
        raise ConfigError("samples", f"must be at least 0, got {samples}", "give e.g. 32, or 0 for no sampling")
    nominal = simulate(schedule, timing, overlap_grad_reduce=overlap_grad_reduce, record=record)
    if cv == 0 or samples == 0:
        return nominal
    rng = np.random.default_rng(seed)
    lengths = [len(row) for row in schedule.actions]
    runs = []
    for _ in range(samples):
        draws = [gamma_factors(rng, cv, n) for n in lengths]
        t = scaled_timing(schedule, timing, lambda r, i, draws=draws: float(draws[r][i]))
        runs.append(simulate(schedule, t, overlap_grad_reduce=overlap_grad_reduce, record=False))
    p = schedule.stages
    its = [r.iteration_time_s for r in runs]
    return dataclasses.replace(
        nominal,
        iteration_time_s=statistics.fmean(its),
        iteration_time_std_s=statistics.stdev(its) if samples > 1 else 0.0,
        busy_s_by_rank=tuple(statistics.fmean(r.busy_s_by_rank[k] for r in runs) for k in range(p)),
        idle_s_by_rank=tuple(statistics.fmean(r.idle_s_by_rank[k] for r in runs) for k in range(p)),
        bubble_fraction=statistics.fmean(r.bubble_fraction for r in runs),
        samples=samples,
        duration_cv=cv,
        nominal_iteration_time_s=nominal.iteration_time_s,
    )

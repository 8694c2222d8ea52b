"""Schedule generators by name (the names of :class:`paratrain.parallel.config.ScheduleName`)."""

from __future__ import annotations

from collections.abc import Callable

from paratrain.errors import ConfigError
from paratrain.parallel.config import ScheduleName
from paratrain.schedule.chimera import chimera, chimera_rules
from paratrain.schedule.gpipe import gpipe, gpipe_rules
from paratrain.schedule.interleaved import interleaved, interleaved_rules
from paratrain.schedule.ir import Schedule
from paratrain.schedule.one_f_one_b import one_f_one_b, one_f_one_b_rules
from paratrain.schedule.pipedream import (
    DEFAULT_ASYNC_ITERATIONS,
    pipedream,
    pipedream_2bw,
    pipedream_2bw_rules,
    pipedream_rules,
)
from paratrain.schedule.zero_bubble import zb_h1, zb_h1_rules

__all__ = ["generate", "check_rules", "rule_violation", "SCHEDULE_NAMES"]

SCHEDULE_NAMES = tuple(n.value for n in ScheduleName)

# Each generator checks its own rule first: what a rule accepts, the generator builds.
_RULES: dict[ScheduleName, Callable[[int, int, int], None]] = {
    ScheduleName.GPIPE: gpipe_rules,
    ScheduleName.ONE_F_ONE_B: one_f_one_b_rules,
    ScheduleName.INTERLEAVED: interleaved_rules,
    ScheduleName.CHIMERA: chimera_rules,
    ScheduleName.ZB_H1: zb_h1_rules,
    ScheduleName.PIPEDREAM: pipedream_rules,
    ScheduleName.PIPEDREAM_2BW: pipedream_2bw_rules,
}


def _name(name: str | ScheduleName) -> ScheduleName:
    try:
        return ScheduleName(str(name).lower())
    except ValueError:
        raise ConfigError(
            "schedule", f"unknown schedule {name!r}", f"use one of: {', '.join(SCHEDULE_NAMES)}"
        ) from None


def check_rules(name: str | ScheduleName, *, stages: int, microbatches: int, virtual_stages: int = 1) -> None:
    """Raise the :class:`ConfigError` :func:`generate` would raise for these counts (none: it builds)."""
    _RULES[_name(name)](stages, microbatches, virtual_stages)


def rule_violation(
    name: str | ScheduleName, *, stages: int, microbatches: int, virtual_stages: int = 1
) -> ConfigError | None:
    """The error :func:`check_rules` raises, or ``None`` when the schedule accepts the counts."""
    try:
        check_rules(name, stages=stages, microbatches=microbatches, virtual_stages=virtual_stages)
    except ConfigError as e:
        return e
    return None


def generate(
    name: str | ScheduleName, *, stages: int, microbatches: int, virtual_stages: int = 1, iterations: int | None = None
) -> Schedule:
    """Generate the named schedule for ``stages`` pipeline ranks and ``microbatches`` micro-batches
    per optimizer step. ``virtual_stages`` (chunks per rank) applies to ``interleaved`` (default 2
    there when left at 1 is an error: pass it explicitly); ``iterations`` (optimizer steps covered)
    to the asynchronous ``pipedream`` and ``2bw`` (default 4)."""
    sname = _name(name)
    if iterations is not None and not sname.is_async:
        raise ConfigError("iterations", f"{sname} is synchronous: one iteration per schedule", "drop iterations")
    its = DEFAULT_ASYNC_ITERATIONS if iterations is None else iterations
    _RULES[sname](stages, microbatches, virtual_stages)
    if sname is ScheduleName.INTERLEAVED:
        return interleaved(stages, microbatches, virtual_stages)
    if sname is ScheduleName.GPIPE:
        return gpipe(stages, microbatches)
    if sname is ScheduleName.ONE_F_ONE_B:
        return one_f_one_b(stages, microbatches)
    if sname is ScheduleName.CHIMERA:
        return chimera(stages, microbatches)
    if sname is ScheduleName.PIPEDREAM:
        return pipedream(stages, microbatches, its)
    if sname is ScheduleName.PIPEDREAM_2BW:
        return pipedream_2bw(stages, microbatches, its)
    return zb_h1(stages, microbatches)

"""Schedule generators by name (the names of :class:`paratrain.parallel.config.ScheduleName`)."""

from __future__ import annotations

from paratrain.errors import ConfigError
from paratrain.parallel.config import ScheduleName
from paratrain.schedule.chimera import chimera
from paratrain.schedule.gpipe import gpipe
from paratrain.schedule.interleaved import interleaved
from paratrain.schedule.ir import Schedule
from paratrain.schedule.one_f_one_b import one_f_one_b
from paratrain.schedule.pipedream import DEFAULT_ASYNC_ITERATIONS, pipedream, pipedream_2bw
from paratrain.schedule.zero_bubble import zb_h1

__all__ = ["generate", "SCHEDULE_NAMES"]

SCHEDULE_NAMES = tuple(n.value for n in ScheduleName)


def generate(
    name: str | ScheduleName, *, stages: int, microbatches: int, virtual_stages: int = 1, iterations: int | None = None
) -> Schedule:
    """Generate the named schedule for ``stages`` pipeline ranks and ``microbatches`` micro-batches
    per optimizer step. ``virtual_stages`` (chunks per rank) applies to ``interleaved`` (default 2
    there when left at 1 is an error: pass it explicitly); ``iterations`` (optimizer steps covered)
    to the asynchronous ``pipedream`` and ``2bw`` (default 4)."""
    try:
        sname = ScheduleName(str(name).lower())
    except ValueError:
        raise ConfigError(
            "schedule", f"unknown schedule {name!r}", f"use one of: {', '.join(SCHEDULE_NAMES)}"
        ) from None
    if iterations is not None and not sname.is_async:
        raise ConfigError("iterations", f"{sname} is synchronous: one iteration per schedule", "drop iterations")
    its = DEFAULT_ASYNC_ITERATIONS if iterations is None else iterations
    if sname is ScheduleName.INTERLEAVED:
        return interleaved(stages, microbatches, virtual_stages)
    if virtual_stages != 1:
        from paratrain.schedule._common import check_counts

        check_counts(sname.value, stages, microbatches, virtual_stages)
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

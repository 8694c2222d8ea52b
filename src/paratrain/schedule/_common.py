"""Helpers shared by the schedule generators."""

from __future__ import annotations

import dataclasses

from paratrain.errors import ConfigError
from paratrain.schedule.ir import Action, ActionKind, Schedule, insert_p2p

K = ActionKind
Item = Action | tuple[Action, ...]  # a compute group runs back to back (see insert_p2p)


def check_counts(name: str, stages: int, microbatches: int, virtual_stages: int = 1) -> None:
    for field, value in (("stages", stages), ("microbatches", microbatches), ("virtual_stages", virtual_stages)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ConfigError(field, f"{name} needs a positive integer, got {value!r}", f"set {field} to at least 1")
    if virtual_stages != 1 and name != "interleaved":
        raise ConfigError(
            "virtual_stages",
            f"{name} places one chunk per rank, got virtual_stages={virtual_stages}",
            "use the interleaved schedule for several chunks per rank, or virtual_stages 1",
        )


def plain_placement(stages: int) -> tuple[tuple[int, ...], ...]:
    return (tuple(range(stages)),)


def with_reduce_and_step(rows: list[list[Item]]) -> list[list[Item]]:
    """Reduce each chunk's gradients right after its last gradient-producing action on the rank
    (so the data-parallel all-reduce overlaps the remaining backward work, as in Megatron-LM's
    ``overlap_grad_reduce``), then one optimizer step at the end of the list."""
    out = []
    for row in rows:
        last: dict[tuple[int, int], int] = {}
        for i, item in enumerate(row):
            for a in item if isinstance(item, tuple) else (item,):
                if a.kind is K.BACKWARD or a.kind is K.BACKWARD_WEIGHT:
                    last[(a.chunk, a.replica)] = i
        after: dict[int, list[Action]] = {}
        for (c, rep), i in sorted(last.items(), key=lambda kv: kv[1]):
            after.setdefault(i, []).append(Action(K.REDUCE_GRAD, None, c, rep))
        new: list[Item] = []
        for i, a in enumerate(row):
            new.append(a)
            new.extend(after.get(i, ()))
        new.append(Action(K.OPTIMIZER_STEP))
        out.append(new)
    return out


def build(
    name: str,
    stages: int,
    microbatches: int,
    placement: tuple[tuple[int, ...], ...],
    rows: list[list[Item]],
    *,
    iterations: int = 1,
) -> Schedule:
    """The schedule with sends/receives inserted; ``weight_versions`` counted from the version
    annotations (asynchronous schedules), 1 otherwise."""
    s = Schedule(
        name=name,
        stages=stages,
        microbatches=microbatches,
        placement=placement,
        actions=insert_p2p(rows, placement),
        iterations=iterations,
    )
    if any(a.version is not None for row in s.actions for a in row):
        from paratrain.schedule.validate import inflight_and_versions

        s = dataclasses.replace(s, weight_versions=max(inflight_and_versions(s)[1]))
    return s

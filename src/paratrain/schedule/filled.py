"""A schedule whose bubbles hold K-FAC work: one complete action list per step of a refresh cycle.

PipeFisher (Osawa, Li & Hoefler, MLSys'23) puts the work of K-FAC into pipeline bubbles; what does
not fit into one step's bubbles spills into the next steps', so one K-FAC cycle (curvature,
factor all-reduce, inversion) spans ``refresh_steps`` training steps. :class:`FilledSchedule`
holds, for each step ``i`` of the cycle, the complete schedule to run (the base schedule's actions
plus filler actions ``X``); step ``t`` of training runs ``iterations[t % refresh_steps]``. The
simulator's fill pass (:func:`paratrain.sim.fill.fill_kfac`) builds it; the runtime receives it
through the CLI (runtime does not import the simulator).

Filler tags and what they mean on pipeline rank ``r`` (the chunks ``r`` holds: its "K-FAC layers",
the linear layers of those chunks in pipeline order, replica 0 first):

* ``kfac.curv.<m>`` — add micro-batch ``m``'s contribution to the Kronecker factors of every
  K-FAC layer the micro-batch passes on this rank: A from the layer's inputs, G from its output
  gradients, both captured during micro-batch ``m`` of the **first step of the cycle**. Placed
  after the rank's last backward action of ``m`` in that step (``B``, or ``W`` under ZB-H1: the
  weight-gradient step is where the inputs and output gradients meet; ``I`` already produced G).
  ``kfac.curv.<m>.<k>`` (the pass's ``split_curvature``, PipeFisher's finer pieces) does the same
  for the layers of layer group ``k`` only (the groups of ``kfac.inv``).
* ``kfac.reduce`` — all-reduce of the rank's factors over the data-parallel copies of its chunks
  and, under Chimera, the mirror rank holding the same chunks (a collective filler, see
  :mod:`paratrain.schedule.ir`). After every ``kfac.curv`` of the cycle on every member.
* ``kfac.inv.<k>`` — damped inversion of the factors of the rank's ``k``-th layer group, ``k`` in
  ``0..n-1`` where ``n`` is the number of distinct ``kfac.inv`` tags of the rank; the groups are
  :func:`layer_groups` of the rank's K-FAC layers. After ``kfac.reduce``.

Preconditioning is no filler: it runs at every optimizer step ``U`` with the newest active
inverses. **Inverses computed in cycle c become active from the first step of cycle c+1**, so the
result does not depend on where inside a cycle the pieces ran (a single-process reference with
the same refresh interval gives the same parameters).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from paratrain.errors import ConfigError
from paratrain.schedule.ir import ActionKind, Schedule

__all__ = ["FilledSchedule", "CURV", "REDUCE", "INV", "kfac_piece", "curv_group", "layer_groups"]

CURV = "kfac.curv"
REDUCE = "kfac.reduce"
INV = "kfac.inv"


def kfac_piece(tag: str | None) -> tuple[str, int | None] | None:
    """``("curv", m)`` (also for ``kfac.curv.<m>.<k>``), ``("reduce", None)``, ``("inv", k)`` for a
    K-FAC filler tag, else None."""
    if tag == REDUCE:
        return "reduce", None
    for prefix, name in ((CURV, "curv"), (INV, "inv")):
        if tag is not None and tag.startswith(prefix + "."):
            parts = tag[len(prefix) + 1:].split(".")
            if all(p.isdigit() for p in parts) and (len(parts) == 1 or (name == "curv" and len(parts) == 2)):
                return name, int(parts[0])
    return None


def curv_group(tag: str | None) -> int | None:
    """``k`` of a split curvature piece ``kfac.curv.<m>.<k>`` (only layer group ``k``), else None
    (``kfac.curv.<m>`` covers every layer of the rank that micro-batch ``m`` passes)."""
    p = kfac_piece(tag)
    if p is None or p[0] != "curv" or tag is None or tag.count(".") != 3:
        return None
    return int(tag.rsplit(".", 1)[1])


def layer_groups(n_layers: int, n_groups: int) -> tuple[range, ...]:
    """Split ``n_layers`` layers (in order) into ``n_groups`` contiguous groups whose sizes differ
    by at most one, the larger first; groups are empty when there are more groups than layers."""
    if n_layers < 0 or n_groups < 1:
        raise ConfigError("layer groups", f"cannot split {n_layers} layers into {n_groups} groups",
                          "give at least one group")
    base, extra = divmod(n_layers, n_groups)
    out, start = [], 0
    for k in range(n_groups):
        size = base + (1 if k < extra else 0)
        out.append(range(start, start + size))
        start += size
    return tuple(out)


@dataclass(frozen=True)
class FilledSchedule:
    """``iterations[i]``: the complete schedule of step ``i`` of a K-FAC cycle; step ``t`` of
    training runs ``iterations[t % refresh_steps]``. ``refresh_steps`` = ``len(iterations)``: the
    curvature and inverses are refreshed once per that many steps."""

    iterations: tuple[Schedule, ...]
    refresh_steps: int

    def __post_init__(self) -> None:
        if self.refresh_steps != len(self.iterations) or not self.iterations:
            raise ConfigError("filled schedule", f"refresh_steps {self.refresh_steps} for "
                              f"{len(self.iterations)} iteration schedules", "give one schedule per step of the cycle")

    def schedule_for_step(self, step: int) -> Schedule:
        return self.iterations[step % self.refresh_steps]

    def inv_groups(self, rank: int) -> int:
        """Number of inversion groups of ``rank`` (distinct ``kfac.inv`` tags over the cycle)."""
        return len({a.tag for s in self.iterations for a in s.actions[rank] if a.kind is ActionKind.FILLER
                    and (p := kfac_piece(a.tag)) is not None and p[0] == "inv"})

    def to_dict(self) -> dict[str, Any]:
        return {"refresh_steps": self.refresh_steps, "iterations": [s.to_dict() for s in self.iterations]}

    @classmethod
    def from_dict(cls, doc: dict[str, Any], field_name: str = "filled schedule") -> FilledSchedule:
        if not isinstance(doc, dict) or not isinstance(doc.get("iterations"), list) or not doc["iterations"]:
            raise ConfigError(field_name, "must be an object with a non-empty list \"iterations\"",
                              "write what FilledSchedule.to_dict writes")
        its = tuple(Schedule.from_dict(d, f"{field_name}.iterations[{i}]") for i, d in enumerate(doc["iterations"]))
        steps = doc.get("refresh_steps", len(its))
        if isinstance(steps, bool) or not isinstance(steps, int):
            raise ConfigError(f"{field_name}.refresh_steps", f"must be a whole number, got {steps!r}",
                              "write the number of iteration schedules")
        return cls(its, steps)

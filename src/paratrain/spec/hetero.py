"""A shared cluster with several accelerator types (Gavel's "cluster spec").

:class:`~paratrain.spec.cluster.ClusterSpec` describes one training job's machines: identical devices
and the links between them. A scheduler sharing a cluster among many jobs needs the other view: how
many accelerators of each *type* there are (``v100=12,p100=12,k80=12``), each type optionally tied to
a device preset so throughputs can be predicted by the cost model. Links do not matter at this level:
Gavel places a job's GPUs on one type and leaves the topology to the job.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from paratrain.errors import ConfigError, require_at_most, require_positive_int
from paratrain.spec.cluster import MAX_DEVICES

__all__ = ["AcceleratorPool", "HeteroClusterSpec", "parse_accelerators"]

# Accelerator type names are used as JSON keys, trace fields and Ray resource names.
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")


@dataclass(frozen=True)
class AcceleratorPool:
    """``count`` accelerators of type ``name``; ``device`` is the device preset it corresponds to
    (defaults to ``name``; unknown presets are allowed when throughputs come from measurements)."""

    name: str
    count: int
    device: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not _NAME.match(self.name):
            raise ConfigError("accelerators", f"bad accelerator type name {self.name!r}",
                              "use letters, digits, '-', '_' or '.', e.g. v100=12")
        require_positive_int(f"accelerators.{self.name}", self.count)


@dataclass(frozen=True)
class HeteroClusterSpec:
    """Accelerator pools, one per type, in the order given."""

    pools: tuple[AcceleratorPool, ...]

    def __post_init__(self) -> None:
        if not self.pools:
            raise ConfigError("accelerators", "no accelerator types given", "pass e.g. v100=12,p100=12,k80=12")
        names = [p.name for p in self.pools]
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise ConfigError("accelerators", f"type {dup[0]!r} given twice", "give each type once")
        # The scheduler keeps per-accelerator state: a count past any real cluster exhausts memory.
        require_at_most("accelerators", sum(p.count for p in self.pools), MAX_DEVICES, "accelerators in all")

    @property
    def types(self) -> tuple[str, ...]:
        return tuple(p.name for p in self.pools)

    @property
    def counts(self) -> dict[str, int]:
        return {p.name: p.count for p in self.pools}

    @property
    def total(self) -> int:
        return sum(p.count for p in self.pools)

    def to_dict(self) -> dict[str, int]:
        return self.counts


def parse_accelerators(text: str, field: str = "--accelerators") -> HeteroClusterSpec:
    """Parse ``"v100=12,p100=12,k80=12"`` (a type may name its device preset: ``fast=12@h100``)."""
    if not isinstance(text, str) or not text.strip():
        raise ConfigError(field, "empty", "pass e.g. v100=12,p100=12,k80=12")
    pools = []
    for part in text.split(","):
        part = part.strip()
        name, eq, rest = part.partition("=")
        count_text, at, device = rest.partition("@")
        try:
            count = int(count_text)
        except ValueError:
            count = None
        if not eq or count is None:
            raise ConfigError(field, f"cannot read {part!r}", "write TYPE=COUNT pairs, e.g. v100=12,p100=12,k80=12")
        try:
            pools.append(AcceleratorPool(name.strip(), count, device.strip() if at else None))
        except ConfigError as e:
            raise ConfigError(field, e.problem, e.fix) from None
    try:
        return HeteroClusterSpec(tuple(pools))
    except ConfigError as e:
        raise ConfigError(field, e.problem, e.fix) from None

"""Processes sharing a host's cores: the rate at which each pipeline rank computes.

On a CPU host a training process is one or more threads on cores that the other processes of
the node share. When more threads compute than there are cores, the operating system's scheduler
time-slices them: each computing process advances at ``cores / (computing processes × threads)``
of its single-core speed (processor sharing, the fluid limit of round-robin scheduling;
Kleinrock, *Queueing Systems* vol. 2, 1976, §4.4). A process waiting for a message takes no core:
gloo blocks in the kernel rather than spinning (measured here: a rank blocked 3 s in ``recv``,
in ``all_reduce`` and in a functional collective's ``wait_tensor`` used under 10 ms of CPU), so a
rank idle in a pipeline bubble or a communication wait lends its core to the others.

The engine (:mod:`paratrain.sim.engine`) simulates one pipeline of ranks; every pipeline rank
stands for the ``dp × tp (× cp)`` processes that run its actions in lockstep, placed on nodes as
the cluster numbers ranks. :class:`CoreSharing` holds, per pipeline rank, how many of its
processes sit on each node; :meth:`CoreSharing.rates` gives every computing rank's speed.
:func:`core_sharing` builds it from a cluster and a layout, or returns None when no node can be
oversubscribed (GPU devices; enough cores for every thread), and the engine then runs unchanged.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from paratrain.errors import ConfigError, require_positive_int

if TYPE_CHECKING:
    from paratrain.parallel.config import ParallelConfig
    from paratrain.spec.cluster import ClusterSpec

__all__ = ["CoreSharing", "core_sharing", "layout_sharing"]


@dataclass(frozen=True)
class CoreSharing:
    """``cores`` per node, ``threads`` per process; ``placement[r]``: ``(node, processes)`` pairs,
    the processes of pipeline rank ``r`` on each node it occupies."""

    cores: int
    threads: int
    placement: tuple[tuple[tuple[int, int], ...], ...]

    def __post_init__(self) -> None:
        require_positive_int("cores", self.cores)
        require_positive_int("threads", self.threads)
        if not self.placement or any(not p for p in self.placement):
            raise ConfigError("placement", "every pipeline rank needs at least one (node, processes) pair",
                              "give ((node, processes), ...) per pipeline rank")

    def rates(self, computing: Iterable[int]) -> dict[int, float]:
        """Speed of each computing pipeline rank, as a fraction of its speed alone on a core:
        ``min(1, cores / (threads × processes computing on the node))``, the slowest of the nodes
        its processes occupy (its processes run in lockstep, so the slowest sets the pace)."""
        ranks = list(computing)
        demand: Counter[int] = Counter()
        for r in ranks:
            for node, procs in self.placement[r]:
                demand[node] += procs * self.threads
        return {r: min(min(1.0, self.cores / demand[node]) for node, _ in self.placement[r]) for r in ranks}

    @property
    def binding(self) -> bool:
        """Whether sharing can slow any rank: the threads of all ranks exceed some node's cores."""
        return any(rate < 1.0 for rate in self.rates(range(len(self.placement))).values())


def core_sharing(cores: int, threads: int, node_of_process: Iterable[tuple[int, int]]) -> CoreSharing | None:
    """Sharing for processes given as ``(pipeline rank, node)`` pairs, or None when it never
    binds (``cores`` 0: each process has its own processor, as a GPU does)."""
    if cores == 0:
        return None
    counts: dict[int, Counter[int]] = {}
    for r, node in node_of_process:
        counts.setdefault(r, Counter())[node] += 1
    placement = tuple(tuple(sorted(counts[r].items())) for r in range(len(counts)))
    share = CoreSharing(cores, threads, placement)
    return share if share.binding else None


def layout_sharing(cluster: ClusterSpec, config: ParallelConfig) -> CoreSharing | None:
    """Sharing for ``config``'s processes placed on ``cluster`` (rank ``g`` on node
    ``g // devices_per_node``), grouped by pipeline rank; None when the cluster's devices have
    their own processors (``cores_per_node`` 0) or its cores never run short."""
    if cluster.cores_per_node == 0:
        return None
    pairs = ((config.coords_of(g)["pp"], cluster.node_of(g)) for g in range(config.world_size))
    return core_sharing(cluster.cores_per_node, cluster.threads_per_process, pairs)

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

A pipeline rank's processes need not move in lockstep: with data parallelism over tensor-parallel
groups (``dp`` groups of ``tp`` processes, no sharding collectives between them inside a step),
each group waits in its own collectives, and while one group waits the others compute on the
cores it left. ``CoreSharing.groups`` holds that count per pipeline rank. For a compute step of
``W`` single-core seconds of work and ``L`` of waits, processor sharing of ``G`` independent
groups gives the fluid bounds ``max(W / r_all, W / r_one + L)``, where ``r_all`` is the rate while
every group computes and ``r_one`` the rate of one group computing alone: the cores are the
bottleneck, or one group's own path (its work, then its waits) is. One group (``G = 1``) gives
``W / r + L``, the lockstep the engine runs otherwise. The engine applies it by letting the
waits overlap the time sharing added to the work (:meth:`CoreSharing.one_group_rate`).
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
    the processes of pipeline rank ``r`` on each node it occupies; ``groups[r]``: how many
    independent groups (each waiting in its own collectives) those processes form (empty: 1 each)."""

    cores: int
    threads: int
    placement: tuple[tuple[tuple[int, int], ...], ...]
    groups: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        require_positive_int("cores", self.cores)
        require_positive_int("threads", self.threads)
        if not self.placement or any(not p for p in self.placement):
            raise ConfigError("placement", "every pipeline rank needs at least one (node, processes) pair",
                              "give ((node, processes), ...) per pipeline rank")
        if self.groups and (len(self.groups) != len(self.placement) or any(g < 1 for g in self.groups)):
            raise ConfigError("groups", f"need one count >= 1 per pipeline rank, got {self.groups!r}",
                              "give the number of independent groups of each pipeline rank")

    def groups_of(self, rank: int) -> int:
        """Independent groups of pipeline rank ``rank`` (1: its processes move in lockstep)."""
        return self.groups[rank] if self.groups else 1

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

    def one_group_rate(self, rank: int, computing: Iterable[int]) -> float:
        """Speed of one of ``rank``'s groups computing while the rest of ``rank`` waits and the
        other ``computing`` ranks compute: :meth:`rates` with ``rank``'s processes on each node
        divided by its group count."""
        demand: Counter[int] = Counter()
        for r in computing:
            if r != rank:
                for node, procs in self.placement[r]:
                    demand[node] += procs * self.threads
        share = self.groups_of(rank)
        return min(min(1.0, self.cores / (demand[node] + procs * self.threads / share))
                   for node, procs in self.placement[rank])

    @property
    def binding(self) -> bool:
        """Whether sharing can slow any rank: the threads of all ranks exceed some node's cores."""
        return any(rate < 1.0 for rate in self.rates(range(len(self.placement))).values())


def core_sharing(
    cores: int, threads: int, node_of_process: Iterable[tuple[int, int]], groups: int = 1,
) -> CoreSharing | None:
    """Sharing for processes given as ``(pipeline rank, node)`` pairs, each pipeline rank's
    processes forming ``groups`` independent groups, or None when it never binds (``cores`` 0:
    each process has its own processor, as a GPU does)."""
    if cores == 0:
        return None
    counts: dict[int, Counter[int]] = {}
    for r, node in node_of_process:
        counts.setdefault(r, Counter())[node] += 1
    placement = tuple(tuple(sorted(counts[r].items())) for r in range(len(counts)))
    share = CoreSharing(cores, threads, placement, (groups,) * len(placement) if groups > 1 else ())
    return share if share.binding else None


def layout_sharing(cluster: ClusterSpec, config: ParallelConfig) -> CoreSharing | None:
    """Sharing for ``config``'s processes placed on ``cluster`` (rank ``g`` on node
    ``g // devices_per_node``), grouped by pipeline rank; None when the cluster's devices have
    their own processors (``cores_per_node`` 0) or its cores never run short. A pipeline rank's
    ``dp`` tensor-parallel groups are independent inside a step unless context parallelism or
    sharded parameters (zero2, zero3: per-layer collectives over dp) tie them together."""
    if cluster.cores_per_node == 0:
        return None
    pairs = ((config.coords_of(g)["pp"], cluster.node_of(g)) for g in range(config.world_size))
    independent = config.tp > 1 and config.cp == 1 and config.sharding in ("none", "zero1")
    return core_sharing(cluster.cores_per_node, cluster.threads_per_process, pairs,
                        groups=config.dp if independent else 1)

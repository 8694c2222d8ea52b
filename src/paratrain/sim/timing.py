"""Per-action durations for a simulated run: the :class:`Timing` record the engine reads.

A :class:`Timing` holds the time of every chunk's compute, every p2p transfer, every gradient
reduction and every optimizer step; it is built from the cost model by
:func:`paratrain.sim.report.timing_for_config` or uniform by :func:`uniform_timing`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from paratrain.errors import ConfigError
from paratrain.schedule.ir import Schedule
from paratrain.sim.sharing import CoreSharing

__all__ = ["Timing", "uniform_timing"]


@dataclass(frozen=True)
class Timing:
    """Durations in seconds (or any unit, consistently).

    Per chunk ``c``: ``forward_s[c]``, ``backward_s[c]`` (a full ``B``: recomputation, input and
    weight gradient), ``input_s[c]`` (an ``I``: recomputation and input gradient), ``weight_s[c]``
    (a ``W``). ``p2p_s(src_rank, dst_rank, chunk)`` is the transfer time of one activation or
    gradient between pipeline ranks; ``reduce_s[c]`` the gradient reduction of chunk ``c`` (all its
    replicas and data-parallel copies together); ``optimizer_s[r]`` the optimizer step of rank
    ``r``. ``tp_comm_s`` per chunk (tensor-parallel collectives of one forward + backward, already
    inside the compute times), ``p2p_bytes``/``reduce_bytes`` per chunk and the groups only feed the
    communication log and ``comm_time_by_kind``.
    """

    forward_s: tuple[float, ...]
    backward_s: tuple[float, ...]
    input_s: tuple[float, ...]
    weight_s: tuple[float, ...]
    p2p_s: Callable[[int, int, int], float]
    reduce_s: tuple[float, ...]
    optimizer_s: tuple[float, ...]
    p2p_bytes: tuple[int, ...] = ()
    reduce_bytes: tuple[int, ...] = ()
    tp_comm_s: tuple[float, ...] = ()
    # per chunk: context-parallel ring time not hidden by attention, forward + backward (in the compute times)
    cp_comm_s: tuple[float, ...] = ()
    # per chunk: FSDP's gathers and reduce-scatters not hidden by compute, forward + backward (in the compute times)
    fsdp_comm_s: tuple[float, ...] = ()
    reduce_kind: str = "all_reduce"
    global_rank: Callable[[int], int] = field(default=lambda r: r)
    reduce_groups: tuple[tuple[int, ...], ...] = ()
    tp_groups: tuple[tuple[int, ...], ...] = ()  # per pipeline rank: its tensor-parallel group
    # Global-norm gradient clipping across pipeline stages: the k-th optimizer step of every rank
    # first all-reduces the squared gradient norm (one scalar) over all ranks, so it starts when the
    # last rank is ready plus this all-reduce's time. None: the ranks' steps are independent.
    step_allreduce_s: float | None = None
    # Per-action override of compute durations: ``action_s(rank, index)`` for the action at
    # ``index`` of the rank's list, or None to keep the per-chunk time (replays of measured runs).
    action_s: Callable[[int, int], float | None] | None = None
    # Processes sharing a host's cores (paratrain.sim.sharing): compute durations are then the
    # time on a core of its own, stretched while more threads compute than the node has cores
    # (the waits in collectives inside them are not: per chunk, forward_wait_s of a forward and
    # backward_wait_s of a backward, B or I, ChunkCost's). None: every rank has its own processor.
    core_sharing: CoreSharing | None = None
    forward_wait_s: tuple[float, ...] = ()
    backward_wait_s: tuple[float, ...] = ()
    # ``p2p_link(rank, peer)``: the link of ``rank`` a transfer to or from pipeline rank ``peer``
    # uses; the receives (and the sends) of one p2p batch on the same link share its bandwidth
    # (paratrain.cost.link_sharing). None: every transfer has its link alone.
    p2p_link: Callable[[int, int], object] | None = None
    # Pipeline receives posted ahead of their batch, per peer (the runtime engine's
    # ``prefetch_receives``; Megatron-Core's ``overlap_p2p_comm`` is about 1): a transfer can then
    # run while the receiving rank still computes. 0: each receive is posted when its batch is reached.
    prefetch_receives: int = 0


_MIN_UNIFORM_S, _MAX_UNIFORM_S = 1e-12, 1e12  # uniform durations: relative units or seconds


def uniform_timing(schedule: Schedule, forward: float = 1.0, backward: float = 2.0) -> Timing:
    """Every chunk takes ``forward`` and ``backward`` (split in equal halves for ``I`` and ``W``);
    communication and optimizer steps are free: the setting of the schedule papers' figures."""
    if not 0 < forward < float("inf") or not 0 < backward < float("inf"):  # NaN fails too
        raise ConfigError(
            "--forward-time/--backward-time", f"must be positive and finite, got {forward} and {backward}",
            "use e.g. 1 and 2",
        )
    # Finite is not enough: thousands of durations near the float maximum sum to inf, and a
    # duration near the float minimum makes the timeline's scale (end / shortest) overflow.
    if not all(_MIN_UNIFORM_S <= t <= _MAX_UNIFORM_S for t in (forward, backward)):
        raise ConfigError(
            "--forward-time/--backward-time",
            f"must lie in [{_MIN_UNIFORM_S:g}, {_MAX_UNIFORM_S:g}], got {forward:g} and {backward:g}",
            "use e.g. 1 and 2",
        )
    n = schedule.num_chunks
    return Timing(
        forward_s=(forward,) * n,
        backward_s=(backward,) * n,
        input_s=(backward / 2,) * n,
        weight_s=(backward / 2,) * n,
        p2p_s=_free_p2p,
        reduce_s=(0.0,) * n,
        optimizer_s=(0.0,) * schedule.stages,
    )


def _free_p2p(src: int, dst: int, chunk: int) -> float:
    return 0.0


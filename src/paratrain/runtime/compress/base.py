"""What every gradient compressor offers, the statistics of one reduction, and the counting
communication layer they are written on.

A compressor reduces one flat gradient (all of a rank's gradient as one view) over a process group:
``reduce(flat)`` leaves in ``flat`` the **sum** over the group of what the compressor kept (the
caller divides, as the dense paths do) and keeps the rest in its own residual (error feedback).
Every message goes through :class:`Comm`, which counts what this rank sends: payload (values and
indices) apart from control messages (counts, cut points, threshold histograms), so the measured
volume can be compared with the papers' bounds, which count payload only.

Volume of a collective: an all-reduce of ``n`` elements counts ``2n(P-1)/P`` sent per rank and an
all-gather of ``n`` per rank ``n(P-1)`` (the ring algorithms' per-rank send volume, the
bandwidth-optimal figure); point-to-point messages count exactly what they carry.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
import torch.distributed as dist

from ..comm import layer as comm

__all__ = ["Comm", "Compressor", "ReductionStats", "index_dtype"]


@dataclass
class ReductionStats:
    """One reduction of one flat gradient on this rank.

    ``values_sent``/``indices_sent``: payload elements this rank sent; ``control_elements``: counts,
    cut points and histograms; ``*_bytes`` the same in bytes. ``density``: fraction of the gradient
    this rank selected (``None`` on dense reductions); ``threshold``: the magnitude threshold used
    (``None`` where there is none); ``residual_norm``: L2 norm of the residual after the reduction.
    """

    gradient_elements: int
    values_sent: int = 0
    indices_sent: int = 0
    control_elements: int = 0
    payload_bytes: int = 0
    control_bytes: int = 0
    density: float | None = None
    threshold: float | None = None
    residual_norm: float = 0.0

    @property
    def elements_sent(self) -> int:
        return self.values_sent + self.indices_sent


class Compressor(Protocol):
    """A gradient reduction with compression (module docstring)."""

    name: str

    def reduce(self, flat: torch.Tensor) -> ReductionStats:
        """Replace ``flat`` (this rank's whole gradient, 1-D) by the group's sum of the kept
        entries; the rest stays in the residual."""

    def residual_norm(self) -> float: ...


def index_dtype(n: int) -> torch.dtype:
    """int32 indices while they fit (half the bytes of int64, as in the Ok-Topk code)."""
    return torch.int32 if n < 2**31 else torch.int64


class Comm:
    """The group a compressor reduces over, with send counters (module docstring).

    ``group`` ``None`` is the default (world) group. Ranks are group ranks; point-to-point calls
    translate them to global ranks.
    """

    def __init__(self, group: dist.ProcessGroup | None) -> None:
        self.group = group
        self.size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.stats = ReductionStats(0)
        self.device = torch.device("cpu")

    def begin(self, gradient_elements: int, device: torch.device | None = None) -> ReductionStats:
        """Start counting one reduction whose tensors live on ``device`` (NCCL needs control
        messages there too)."""
        self.stats = ReductionStats(gradient_elements)
        if device is not None:
            self.device = device
        return self.stats

    def ints(self, values: list[int]) -> torch.Tensor:
        """A control message (int64) on the reduction's device."""
        return torch.tensor(values, dtype=torch.int64, device=self.device)

    def global_rank(self, group_rank: int) -> int:
        return group_rank if self.group is None else dist.get_global_rank(self.group, group_rank)

    def _count(self, t: torch.Tensor, elements: int, payload: str | None) -> None:
        nbytes = elements * t.element_size()
        if payload == "values":
            self.stats.values_sent += elements
            self.stats.payload_bytes += nbytes
        elif payload == "indices":
            self.stats.indices_sent += elements
            self.stats.payload_bytes += nbytes
        else:
            self.stats.control_elements += elements
            self.stats.control_bytes += nbytes

    def all_reduce(self, t: torch.Tensor, payload: str | None = None) -> torch.Tensor:
        """Sum ``t`` over the group in place (``payload`` "values": counted as values)."""
        if self.size > 1:
            self._count(t, round(2 * t.numel() * (self.size - 1) / self.size), payload)
            comm.all_reduce(t, self.group, axis="dp", purpose=f"compress_{payload or 'control'}")
        return t

    def all_gather(self, t: torch.Tensor, payload: str | None = None) -> list[torch.Tensor]:
        """Every rank's ``t`` (same shape on every rank), in group-rank order."""
        if self.size == 1:
            return [t]
        out = [torch.empty_like(t) for _ in range(self.size)]
        self._count(t, t.numel() * (self.size - 1), payload)
        comm.all_gather(out, t.contiguous(), self.group, axis="dp", purpose=f"compress_{payload or 'control'}")
        return out

    def exchange(self, sends: dict[int, list[tuple[torch.Tensor, str]]],
                 receives: dict[int, list[torch.Tensor]]) -> None:
        """Point-to-point: ``sends[peer]`` tensors (with their payload kind) to group rank ``peer``,
        ``receives[peer]`` buffers filled from ``peer``; returns when all are done. Empty
        tensors are skipped (both sides know the sizes)."""
        for work in self.start_exchange(sends, receives):
            work.wait()

    def start_exchange(self, sends: dict[int, list[tuple[torch.Tensor, str]]],
                       receives: dict[int, list[torch.Tensor]]) -> list[dist.Work]:
        """:meth:`exchange` without waiting: the works to wait for."""
        ops = []
        for peer, items in sends.items():
            for t, kind in items:
                if t.numel():
                    self._count(t, t.numel(), kind)
                    ops.append(comm.P2P(True, t.contiguous(), self.global_rank(peer), f"compress_{kind}"))
        for peer, bufs in receives.items():
            for b in bufs:
                if b.numel():
                    ops.append(comm.P2P(False, b, self.global_rank(peer), "compress"))
        return comm.batch_isend_irecv(ops, self.group, axis="dp")

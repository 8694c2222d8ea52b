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

__all__ = ["Comm", "Compressor", "ReductionStats", "Packed", "index_dtype", "pack", "packed_bytes", "unpack"]


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


def _segment(entries: int, itype: torch.dtype, vtype: torch.dtype) -> tuple[int, int]:
    """Bytes of one packed segment's indices and of the whole segment, each part padded to 8 bytes
    (the next part, of any dtype, starts aligned)."""
    ib = -(-entries * itype.itemsize // 8) * 8
    return ib, ib + -(-entries * vtype.itemsize // 8) * 8


@dataclass(frozen=True)
class Packed:
    """Sparse entries (indices and values) of one or more segments in one byte buffer: one message
    per peer instead of one for the indices and one for the values. Counted as ``entries`` values
    and ``entries`` indices (the padding, under 8 bytes a segment, is not payload), and a count
    in front (``head``) as one control element."""

    buf: torch.Tensor  # uint8
    entries: int
    index_dtype: torch.dtype
    value_dtype: torch.dtype
    head: bool = False


def packed_bytes(counts: list[int], itype: torch.dtype, vtype: torch.dtype, *, head: bool = False) -> int:
    """Size of the buffer :func:`pack` makes of segments of ``counts`` entries."""
    return 8 * head + sum(_segment(c, itype, vtype)[1] for c in counts)


def pack(segments: list[tuple[torch.Tensor, torch.Tensor]], itype: torch.dtype, *, head: int | None = None) -> Packed:
    """Segments of (indices, values) in one buffer, each its indices (as ``itype``) then its
    values; with ``head``, that number (int64) in front (a receiver that does not know the count)."""
    vtype = segments[0][1].dtype
    device = segments[0][1].device
    counts = [i.numel() for i, _ in segments]
    buf = torch.empty(packed_bytes(counts, itype, vtype, head=head is not None), dtype=torch.uint8, device=device)
    at = 0
    if head is not None:
        buf[:8].view(torch.int64).fill_(head)
        at = 8
    for idx, vals in segments:
        ib, size = _segment(idx.numel(), itype, vtype)
        buf[at: at + idx.numel() * itype.itemsize].view(itype).copy_(idx)
        buf[at + ib: at + ib + idx.numel() * vtype.itemsize].view(vtype).copy_(vals)
        at += size
    return Packed(buf, sum(counts), itype, vtype, head is not None)


def unpack(buf: torch.Tensor, counts: list[int], itype: torch.dtype, vtype: torch.dtype, *,
           head: bool = False) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The segments of a buffer :func:`pack` made (views into ``buf``; a longer buffer's tail is
    ignored)."""
    out, at = [], 8 * head
    for c in counts:
        ib, size = _segment(c, itype, vtype)
        out.append((buf[at: at + c * itype.itemsize].view(itype),
                    buf[at + ib: at + ib + c * vtype.itemsize].view(vtype)))
        at += size
    return out


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
        self._count_bytes(t.element_size(), elements, payload)

    def _count_bytes(self, itemsize: int, elements: int, payload: str | None) -> None:
        nbytes = elements * itemsize
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

    def exchange(self, sends: dict[int, list[tuple[torch.Tensor, str] | Packed]],
                 receives: dict[int, list[torch.Tensor]]) -> None:
        """Point-to-point: ``sends[peer]`` tensors (with their payload kind) to group rank ``peer``,
        ``receives[peer]`` buffers filled from ``peer``; returns when all are done. Empty
        tensors are skipped (both sides know the sizes)."""
        for work in self.start_exchange(sends, receives):
            work.wait()

    def start_exchange(self, sends: dict[int, list[tuple[torch.Tensor, str] | Packed]],
                       receives: dict[int, list[torch.Tensor]]) -> list[dist.Work]:
        """:meth:`exchange` without waiting: the works to wait for."""
        ops = []
        for peer, items in sends.items():
            for item in items:
                if isinstance(item, Packed):
                    if item.entries or item.head:
                        self._count_bytes(item.index_dtype.itemsize, item.entries, "indices")
                        self._count_bytes(item.value_dtype.itemsize, item.entries, "values")
                        self._count_bytes(8, int(item.head), None)
                        ops.append(comm.P2P(True, item.buf, self.global_rank(peer), "compress_packed"))
                    continue
                t, kind = item
                if t.numel():
                    self._count(t, t.numel(), kind)
                    ops.append(comm.P2P(True, t.contiguous(), self.global_rank(peer), f"compress_{kind}"))
        for peer, bufs in receives.items():
            for b in bufs:
                if b.numel():
                    ops.append(comm.P2P(False, b, self.global_rank(peer), "compress"))
        return comm.batch_isend_irecv(ops, self.group, axis="dp")

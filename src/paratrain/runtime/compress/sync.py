"""Compressed data-parallel reduction (a :class:`~paratrain.runtime.data_parallel.GradSync`) and the
per-step metrics of compressed reductions.

Overlap with backward: none by design. Ok-Topk and its baselines select over the whole gradient
of a rank (one flat view, not per 25 MiB bucket, so k and the thresholds are the whole model's),
and selection needs every gradient; the reduction therefore runs when ``finish()`` is called,
after the last backward. Dense warm-up steps all-reduce the same flat view.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from .base import Comm, ReductionStats
from .momentum import DgcSettings, MomentumCorrection, clip_local_, density_at, live_entries

__all__ = ["CompressedGradSync", "FlatReducer", "compression_metrics", "metrics_row"]


def _local(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


class FlatReducer:
    """One flat gradient (the local shards of ``params``) reduced over ``group``: dense for the
    first ``warmup`` calls, then with compressor ``name`` (its own residual). ``reduce()`` leaves
    the group's **sum** in the parameters' gradients and returns the call's statistics.

    Parameters replicated over tensor parallelism (DTensors placed ``Replicate()`` everywhere:
    norms, biases after a row-parallel layer) are all-reduced densely, apart from the flat view:
    each TP rank selects over its own shard, and a replicated gradient compressed inside two
    different shards could keep different entries on the two ranks and let the replicas drift."""

    def __init__(self, name: str, params: list[nn.Parameter], group: dist.ProcessGroup | None, density: float,
                 warmup: int, dgc: DgcSettings | None = None) -> None:
        from . import make_compressor

        self.params = [p for p in params if not _replicated(p)]
        self.replicated = [p for p in params if _replicated(p)]
        if not self.params:  # nothing sharded here: the replicated gradients are the flat view
            self.params, self.replicated = self.replicated, []
        self.group = group
        self.warmup = warmup
        self.calls = 0
        self.compressor = make_compressor(name, group, density, [_local(p).shape for p in self.params])
        self._dense = Comm(group)
        # DGC (momentum.py): this rank's momentum of the flat view and of the replicated rest
        self.dgc = dgc or DgcSettings()
        self.density = density
        self._momentum = MomentumCorrection(self.dgc.momentum)
        self._momentum_rest = MomentumCorrection(self.dgc.momentum)

    @staticmethod
    def _flat(params: list[nn.Parameter]) -> torch.Tensor:
        grads = []
        for p in params:
            if p.grad is None:  # unused in this step's graph: contributes zeros, as in DDP
                p.grad = torch.zeros_like(p)
            grads.append(_local(p.grad).reshape(-1))
        return torch.cat(grads)

    @staticmethod
    def _unflat(params: list[nn.Parameter], flat: torch.Tensor) -> None:
        offset = 0
        with torch.no_grad():
            for p in params:
                g = _local(p.grad)
                g.copy_(flat[offset: offset + g.numel()].view_as(g))
                offset += g.numel()

    def reduce(self) -> ReductionStats:
        flat = self._flat(self.params)
        rest = self._flat(self.replicated) if self.replicated else None
        if self.dgc.corrects:  # DGC: clip locally, then reduce this rank's momentum instead
            clip_local_([flat] if rest is None else [flat, rest], self.dgc.clip, self._dense.size)
            self._momentum.accumulate(flat)
            if rest is not None:
                self._momentum_rest.accumulate(rest)
        if self.calls < self.warmup:
            stats = self._dense.begin(flat.numel())
            self._dense.all_reduce(flat, "values")
            stats.payload_bytes = stats.values_sent * flat.element_size()
            stats.residual_norm = self.compressor.residual_norm()
        else:
            if self.dgc.density_warmup and hasattr(self.compressor, "density"):
                self.compressor.density = density_at(self.calls - self.warmup, self.density,
                                                     self.dgc.density_warmup)
            masking = self.dgc.corrects and self.dgc.masking
            live = live_entries(getattr(self.compressor, "residual", None), flat) if masking else None
            stats = self.compressor.reduce(flat)
            if live is not None:  # momentum factor masking: zero u where v left the residual
                self._momentum.mask(live & (self.compressor.residual == 0))  # type: ignore[attr-defined]
        self._unflat(self.params, flat)
        if rest is not None:
            dense = self._dense.begin(rest.numel())
            self._dense.all_reduce(rest, "values")
            self._unflat(self.replicated, rest)
            stats.gradient_elements += rest.numel()
            stats.values_sent += dense.values_sent
            stats.payload_bytes += dense.values_sent * rest.element_size()
            if stats.density is not None:  # the share of the whole gradient this rank sent
                stats.density = (stats.density * flat.numel() + rest.numel()) / stats.gradient_elements
        self.calls += 1
        return stats


def _replicated(p: torch.Tensor) -> bool:
    from torch.distributed.tensor import DTensor, Replicate

    return isinstance(p, DTensor) and all(isinstance(pl, Replicate) for pl in p.placements)


class CompressedGradSync:
    """Data parallelism with compression (module docstring): gradients accumulate locally over
    micro-batches; ``finish()`` reduces them as one flat view and averages over the group."""

    def __init__(self, modules: list[nn.Module], group: dist.ProcessGroup, name: str, density: float, *,
                 warmup: int, recorder: Any = None, dgc: DgcSettings | None = None) -> None:
        params = list({id(p): p for m in modules for p in m.parameters() if p.requires_grad}.values())
        self.world = dist.get_world_size(group)
        self.reducer = FlatReducer(name, params, group, density, warmup, dgc)
        self.recorder = recorder
        self.compression_stats: list[ReductionStats] = []

    @contextlib.contextmanager
    def accumulate(self) -> Iterator[None]:
        yield  # nothing is reduced before finish()

    def finish(self) -> None:
        start = time.perf_counter()
        stats = self.reducer.reduce()
        with torch.no_grad():
            for p in self.reducer.params + self.reducer.replicated:
                _local(p.grad).div_(self.world)
        if self.recorder is not None:
            self.recorder.record("R@c0", "comm", start, time.perf_counter())
        self.compression_stats = [stats]


def metrics_row(stats: list[ReductionStats]) -> dict[str, Any]:
    """The per-step metrics of this rank's reductions of one step (several flat gradients: a
    pipeline rank holding several chunks): volumes summed; density over all of them; the threshold
    of each (one number for one flat gradient)."""
    n = sum(s.gradient_elements for s in stats)
    sparse = [s for s in stats if s.density is not None]
    thresholds = [s.threshold for s in stats]
    return {
        "comm_elements_sent": sum(s.elements_sent for s in stats),
        "comm_bytes_sent": sum(s.payload_bytes for s in stats),
        "comm_control_elements": sum(s.control_elements for s in stats),
        "gradient_elements": n,
        "density": (sum(s.density * s.gradient_elements for s in sparse) / n  # type: ignore[operator]
                    if sparse and len(sparse) == len(stats) and n else None),
        "threshold": thresholds[0] if len(thresholds) == 1 else thresholds,
        "residual_norm": float(sum(s.residual_norm ** 2 for s in stats) ** 0.5),
    }


def compression_metrics(executor: Any) -> dict[str, Any]:
    """The metrics row keys of a step's compressed reductions, ``{}`` for a run without compression
    (the executor's, or its data-parallel reduction's, ``compression_stats``)."""
    source = getattr(executor, "grad_sync", executor)
    stats = getattr(source, "compression_stats", None)
    if not stats:
        return {}
    return metrics_row(stats)


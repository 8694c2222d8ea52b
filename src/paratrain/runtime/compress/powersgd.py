"""PowerSGD (Vogels et al., NeurIPS 2019) through torch's own DDP communication hook,
``torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook``, not re-implemented.

The hook reads a DDP ``GradBucket``: its flat ``buffer()``, the per-parameter ``gradients()``
(views of the buffer), ``index()`` and ``is_last()``. :class:`_FlatBucket` offers the same four
methods over paratrain's flat gradient, so the hook runs unchanged outside DDP (and so with tensor
parallelism and the pipeline's reductions). The hook returns the group's mean; the interface asks
for the sum.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from unittest import mock

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import PowerSGDState, powerSGD_hook

from .base import Comm, ReductionStats

__all__ = ["PowerSGD", "POWERSGD_RANK"]

POWERSGD_RANK = 4  # the rank of the comparison (Vogels et al. use 1-4)


class _FlatBucket:
    def __init__(self, flat: torch.Tensor, shapes: list[torch.Size]) -> None:
        self._flat = flat
        self._views = []
        offset = 0
        for s in shapes:
            n = math.prod(s)
            self._views.append(flat[offset: offset + n].view(s))
            offset += n

    def buffer(self) -> torch.Tensor:
        return self._flat

    def gradients(self) -> list[torch.Tensor]:
        return self._views

    def index(self) -> int:
        return 0

    def is_last(self) -> bool:
        return True


@contextlib.contextmanager
def _cpu_tensors_with_cuda_visible(flat: torch.Tensor) -> Iterator[None]:
    """torch's hook calls ``torch.cuda.synchronize(device)`` whenever CUDA is available, with the
    device of the tensors (powerSGD_hook.py, ``decompress``), which refuses a CPU device: a CPU
    run on a machine with a GPU would fail. While the hook runs on CPU tensors, CUDA is hidden
    from it (nothing on a GPU to wait for)."""
    if flat.device.type == "cuda" or not torch.cuda.is_available():
        yield
        return
    with mock.patch.object(torch.cuda, "is_available", lambda: False):
        yield


class PowerSGD:
    """Rank-``rank`` PowerSGD with error feedback and warm start on a flat gradient whose pieces
    have ``shapes`` (the parameters'; matrices are compressed, vectors all-reduced as they are)."""

    name = "powersgd"

    def __init__(self, group: dist.ProcessGroup | None, shapes: list[torch.Size], *, rank: int = POWERSGD_RANK,
                 seed: int = 0) -> None:
        self.comm = Comm(group)
        self.shapes = shapes
        self.rank = rank
        # start_powerSGD_iter must exceed 1 with error feedback; paratrain's own dense warm-up
        # comes before the first call, so the hook's is skipped by starting its counter there.
        self.state = PowerSGDState(process_group=group, matrix_approximation_rank=rank, start_powerSGD_iter=2,
                                   min_compression_rate=2, use_error_feedback=True, warm_start=True,
                                   random_seed=seed)
        self.state.iter = 2

    def residual_norm(self) -> float:
        err = self.state.error_dict.get(0)
        return 0.0 if err is None else float(err.norm())

    def _sent_elements(self) -> int:
        """What the hook all-reduces per call: r(n+m) per compressed matrix (P then Q), the rest whole,
        with the hook's own test of whether a matrix is worth compressing."""
        total = 0
        for s in self.shapes:
            rows = s[0] if len(s) else 1
            cols = math.prod(s) // max(rows, 1)
            r = min(rows, cols, self.rank)
            if len(s) > 1 and (rows + cols) * r * self.state.min_compression_rate < rows * cols:
                total += r * (rows + cols)
            else:
                total += rows * cols
        return total

    def reduce(self, flat: torch.Tensor) -> ReductionStats:
        stats = self.comm.begin(flat.numel(), flat.device)
        with _cpu_tensors_with_cuda_visible(flat):
            out = powerSGD_hook(self.state, _FlatBucket(flat, self.shapes)).wait()  # type: ignore[arg-type]
        if out.data_ptr() != flat.data_ptr():
            flat.copy_(out)
        flat.mul_(self.comm.size)
        p = self.comm.size
        stats.values_sent = round(2 * self._sent_elements() * (p - 1) / p)  # ring all-reduce volume
        stats.payload_bytes = stats.values_sent * flat.element_size()
        stats.density = self._sent_elements() / flat.numel()
        stats.residual_norm = self.residual_norm()
        return stats

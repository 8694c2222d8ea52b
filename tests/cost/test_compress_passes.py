"""The cost model's selection passes (paratrain.cost.compress.SELECTION_PASSES) against what the
compressors do: one call of each on a one-rank gloo group, every torch op observed, and the
streaming passes over the gradient-sized tensors counted with a small cache model.

The compiled loops of ``runtime.compress.kernels`` (every sparse method's pass over the gradient on
the CPU) are invisible to torch's dispatch: each reports the arrays it streams, read or written.

Cache model: a run of ops on views of at most :data:`~paratrain.runtime.compress.select.FUSED_BLOCK`
entries (one block of the one-pass selection) stays in cache until a view of another block comes:
reading a view again within the run is free, each view written is written back once. Any op on a
larger view streams it from memory. Index ops (gathers and scatters at selected entries) touch k
entries, not n, and are left out.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from paratrain.cost.compress import selection_passes
from paratrain.runtime.compress import Gaussiank, GTopk, OkTopk, TopkA, kernels
from paratrain.runtime.compress.select import FUSED_BLOCK

N = 4 * FUSED_BLOCK + 1000  # several blocks and a ragged tail
SPARSE_OPS = ("index", "gather", "scatter", "nonzero", "masked", "take", "put", "searchsorted", "topk", "sort")


class _PassCounter(TorchDispatchMode):
    """Bytes streamed to and from tensors whose storage holds at least ``big`` elements (module docstring)."""

    def __init__(self, big: int) -> None:
        super().__init__()
        self.big = big
        self.bytes = 0.0  # bytes
        self._block: tuple[int, int] | None = None  # (offset, length) of the block in cache
        self._cached: set[tuple[int, int]] = set()
        self._dirty: set[tuple[int, int]] = set()
        self._bytes: dict[tuple[int, int], int] = {}

    def _flush(self) -> None:
        self.bytes += sum(self._bytes[key] for key in self._dirty)
        self._block, self._cached, self._dirty = None, set(), set()

    def _big(self, t: object) -> bool:
        return (isinstance(t, torch.Tensor) and t.numel() > 0
                and t.untyped_storage().nbytes() >= self.big * t.element_size())

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if any(s in func.__name__ for s in SPARSE_OPS) or any(
                r.alias_info is not None and not r.alias_info.is_write for r in func._schema.returns):
            return out  # sparse, or a view (no memory touched)
        overwrites = func.__name__.split(".")[0] in ("zero_", "fill_", "copy_")  # self written, not read
        touched: dict[tuple[int, int], list[Any]] = {}  # key -> [tensor, read, write]
        for arg, value in zip(func._schema.arguments, [*args, *[kwargs.get(a.name) for a in
                                                              func._schema.arguments[len(args):]]], strict=False):
            mutated = arg.alias_info is not None and arg.alias_info.is_write
            for t in tree_leaves(value):
                if self._big(t):
                    entry = touched.setdefault((t.data_ptr(), t.numel()), [t, False, False])
                    entry[1] |= arg.name != "out" and not (overwrites and arg.name == "self")
                    entry[2] |= mutated
        for t in tree_leaves(out):
            if self._big(t):
                touched.setdefault((t.data_ptr(), t.numel()), [t, False, False])[2] = True
        for key, (t, read, write) in touched.items():
            if t.numel() > FUSED_BLOCK:  # streams from memory
                self._flush()
                self.bytes += t.numel() * t.element_size() * (read + write)
                continue
            block = (t.storage_offset(), t.numel())
            if block != self._block:
                self._flush()
                self._block = block
            if read and key not in self._cached:
                self.bytes += t.numel() * t.element_size()
            self._cached.add(key)
            self._bytes[key] = t.numel() * t.element_size()
            if write:
                self._dirty.add(key)
        return out

    def kernel(self, name: str, streams: list[tuple[torch.Tensor, bool, bool]]) -> None:
        """A compiled loop (runtime.compress.kernels) streams each of its arrays once: torch's
        dispatch does not see it, so it reports the arrays it reads and writes."""
        self._flush()
        for t, read, write in streams:
            if self._big(t):
                self.bytes += t.numel() * t.element_size() * (read + write)

    def passes(self, n: int) -> float:
        """In passes over ``n`` fp32 values (a bool mask of n counts 1/4)."""
        self._flush()
        return self.bytes / (4 * n)


@contextmanager
def _one_rank_group() -> Iterator[None]:
    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group("gloo", init_method=f"file://{os.path.join(tmp, 'rdzv')}", rank=0, world_size=1)
        try:
            yield
        finally:
            dist.destroy_process_group()


def _measure(make: Any, calls: int = 3) -> float:
    """Passes of the last of ``calls`` reductions (the first ones set thresholds and buffers)."""
    gen = torch.Generator().manual_seed(0)
    comp = make()
    for i in range(calls):
        g = torch.randn(N, generator=gen) * torch.exp(torch.randn(N, generator=gen))
        if i == calls - 1:
            with _PassCounter(big=N // 2) as counter:
                kernels.TRAFFIC_HOOKS.append(counter.kernel)
                try:
                    comp.reduce(g)
                finally:
                    kernels.TRAFFIC_HOOKS.remove(counter.kernel)
            return counter.passes(N)
        comp.reduce(g)
    raise AssertionError


@pytest.mark.slow
def test_selection_passes_are_what_the_compressors_do() -> None:
    with _one_rank_group():
        # Ok-Topk on one rank: its region is the whole gradient, summed sparsely (no pass over it)
        got = {"oktopk": _measure(lambda: OkTopk(None, 0.01)),
               "topka": _measure(lambda: TopkA(None, 0.01)),
               "gtopk": _measure(lambda: GTopk(None, 0.01)),
               "gaussiank": _measure(lambda: Gaussiank(None, 0.01))}
    want = {m: selection_passes(m, 1) for m in got}
    # tolerance: the sampled bound reads 2 x 65,536 strided entries, 1/8 of a pass at this size (0.5 % at 25M)
    assert got == pytest.approx(want, abs=0.15), got

"""Fused single-pass loops over a rank's gradient, compiled with numba, on zero-copy numpy views of
CPU tensors.

Every sparse compressor touches all n entries of its gradient in a few places: adding the
gradient into the residual and selecting on the sum, selecting on a reduced region, and writing
the received or gathered entries. Torch's eager ops need one pass (and often an n-sized
temporary) per operation; each loop here does its whole job in one read of each input, while the
entry is in a register. Measured on one thread, 25M fp32 at 1 %, idle machine: the add-and-select
loop 13 ms (a scalar loop with the compare's branch inside: 26 ms; the four streams alone: 10.5 ms),
against 50 ms, loaded, for the blocked torch version that other devices run
(:func:`~paratrain.runtime.compress.select.accumulate_above`).

Compilation: ``cache=True`` stores the machine code next to this file (``__pycache__``), or, when
that directory is read-only (an installed package), in the user's cache directory (numba's
``UserWideCacheLocator``; ``NUMBA_CACHE_DIR`` overrides both). Each signature compiles once per
machine and loads from the cache once per process, on its first call.

Memory streams, for the cost model (``paratrain.cost.compress``) and its pass counter
(``tests/cost/test_compress_passes.py``): every wrapper reports the n-sized arrays it streams,
read or written, to :data:`TRAFFIC_HOOKS` (empty outside that test).
"""

from __future__ import annotations

from collections.abc import Callable

import numba
import numpy as np
import torch
from numba.cpython.unsafe.numbers import trailing_zeros

__all__ = ["TRAFFIC_HOOKS", "supported", "accumulate_select", "select_above", "scatter_add", "scatter_copy",
           "clear_sent", "count_at_least", "keep_at_least", "merge_add", "IndexBuffer"]

# Called as hook(name, [(tensor, read, written), ...]) by every wrapper (module docstring)
TRAFFIC_HOOKS: list[Callable[[str, list[tuple[torch.Tensor, bool, bool]]], None]] = []


def _traffic(name: str, streams: list[tuple[torch.Tensor, bool, bool]]) -> None:
    for hook in TRAFFIC_HOOKS:
        hook(name, streams)


def supported(t: torch.Tensor) -> bool:
    """Whether the loops here take ``t``: a CPU tensor of fp32 or fp64 (what gradients are in;
    other devices keep the torch ops of :mod:`~paratrain.runtime.compress.select`)."""
    return t.device.type == "cpu" and t.dtype in (torch.float32, torch.float64)


def _np(t: torch.Tensor) -> np.ndarray:
    return t.detach().numpy()


def _thr(x: np.ndarray, threshold: float) -> np.floating:
    """The threshold in the array's dtype, as torch compares a tensor with a Python float (the
    scalar is rounded to the tensor's dtype); 0 becomes the smallest positive value, so that
    ``|a| >= thr`` selects the nonzeros (exact zeros are never sent)."""
    if threshold > 0:
        top = float(np.finfo(x.dtype).max)
        return x.dtype.type(threshold) if threshold <= top else x.dtype.type(np.inf)  # no overflow warning
    return np.nextafter(x.dtype.type(0), x.dtype.type(1))


# The dense loops run in chunks of _NSUB sub-blocks of _SUB entries. The first loop over a chunk
# has no branch (add, store, clear, sums, and one bit per entry at or above the threshold), so
# LLVM vectorises it; the second walks only the set bits of each sub-block's mask. A compare with a
# branch in the dense loop kept it scalar: 26 ms against 13 ms for 25M fp32 at 1 % on one core
# here, where the four streams alone take 10.5 ms. ``reassoc`` lets the sums run in vector lanes
# (each chunk's sums are in the data's dtype, then added in float64); the selection and the
# stored values do not depend on it.
_SUB, _NSUB = 32, 64
_BITS = np.left_shift(np.uint32(1), np.arange(_SUB, dtype=np.uint32))
_FAST = {"reassoc", "contract"}


@numba.njit(cache=True, nogil=True, fastmath=_FAST)
def _accumulate_select(r, g, thr, out, outv, select):  # pragma: no cover - compiled
    n = r.shape[0]
    chunk = _SUB * _NSUB
    whole = n - n % chunk
    masks = np.zeros(_NSUB, np.uint32)
    m = 0
    cap = out.shape[0]
    s = 0.0
    t = 0.0
    zero = g.dtype.type(0)
    none = np.uint32(0)
    for a in range(0, whole, chunk):
        cs = zero
        ct = zero
        for b in range(_NSUB):
            o = a + b * _SUB
            k = none
            for j in range(_SUB):
                x = r[o + j] + g[o + j]
                r[o + j] = x
                g[o + j] = zero
                cs += x * x
                ct += x
                k |= _BITS[j] if abs(x) >= thr else none
            masks[b] = k
        s += cs
        t += ct
        if select:
            for b in range(_NSUB):
                k = masks[b]
                o = a + b * _SUB
                while k:
                    i = o + trailing_zeros(k)
                    k &= k - np.uint32(1)
                    if m < cap:
                        out[m] = i
                        outv[m] = r[i]
                    m += 1
    for i in range(whole, n):
        x = r[i] + g[i]
        r[i] = x
        g[i] = zero
        s += np.float64(x) * x
        t += x
        if select and abs(x) >= thr:
            if m < cap:
                out[m] = i
                outv[m] = x
            m += 1
    return m, s, t


@numba.njit(cache=True, nogil=True, fastmath=_FAST)
def _select(x, thr, out):  # pragma: no cover - compiled
    n = x.shape[0]
    whole = n - n % _SUB
    m = 0
    cap = out.shape[0]
    none = np.uint32(0)
    for o in range(0, whole, _SUB):
        k = none
        for j in range(_SUB):
            k |= _BITS[j] if abs(x[o + j]) >= thr else none
        while k:
            i = o + trailing_zeros(k)
            k &= k - np.uint32(1)
            if m < cap:
                out[m] = i
            m += 1
    for i in range(whole, n):
        if abs(x[i]) >= thr:
            if m < cap:
                out[m] = i
            m += 1
    return m


@numba.njit(cache=True, nogil=True)
def _scatter_add(dst, idx, vals, offset):  # pragma: no cover - compiled
    for j in range(idx.shape[0]):
        dst[idx[j] - offset] += vals[j]


@numba.njit(cache=True, nogil=True)
def _scatter_copy(dst, idx, vals):  # pragma: no cover - compiled
    for j in range(idx.shape[0]):
        dst[idx[j]] = vals[j]


@numba.njit(cache=True, nogil=True)
def _clear_sent(acc, result, idx, sent):  # pragma: no cover - compiled
    z = 0.0
    m = 0
    zero = acc.dtype.type(0)
    for j in range(idx.shape[0]):
        i = idx[j]
        if result[i] != 0:
            z += np.float64(acc[i]) * acc[i]
            acc[i] = zero
            sent[m] = i
            m += 1
    return m, z


@numba.njit(cache=True, nogil=True)
def _count_at_least(vals, thr):  # pragma: no cover - compiled
    m = 0
    for j in range(vals.shape[0]):
        m += abs(vals[j]) >= thr
    return m


@numba.njit(cache=True, nogil=True)
def _keep_at_least(idx, vals, thr):  # pragma: no cover - compiled
    m = 0  # in place: the m-th kept entry moves to slot m <= j
    for j in range(vals.shape[0]):
        # written whether kept or not (a no-branch loop: about half the candidates are kept, a
        # branch on it mispredicts every other entry); a dropped one is overwritten next
        v = vals[j]
        idx[m] = idx[j]
        vals[m] = v
        m += abs(v) >= thr
    return m


def count_at_least(vals: torch.Tensor, threshold: float) -> int:
    """How many of ``vals`` have ``|v| >= threshold`` (threshold > 0)."""
    v = _np(vals)
    return int(_count_at_least(v, _thr(v, threshold)))


def keep_at_least(idx: torch.Tensor, vals: torch.Tensor, threshold: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The entries (indices and values, in order) with ``|v| >= threshold`` (threshold > 0),
    compacted in place: the results are the front of ``idx`` and ``vals``."""
    v = _np(vals)
    m = _keep_at_least(_np(idx), v, _thr(v, threshold))
    return idx[:m], vals[:m]


@numba.njit(cache=True, nogil=True)
def _merge_add(ia, va, ib, vb, oi, ov):  # pragma: no cover - compiled
    a = b = m = 0
    na, nb = ia.shape[0], ib.shape[0]
    while a < na and b < nb:
        x, y = ia[a], ib[b]
        if x < y:
            oi[m] = x
            ov[m] = va[a]
            a += 1
        elif y < x:
            oi[m] = y
            ov[m] = vb[b]
            b += 1
        else:
            oi[m] = x
            ov[m] = va[a] + vb[b]
            a += 1
            b += 1
        m += 1
    while a < na:
        oi[m] = ia[a]
        ov[m] = va[a]
        a += 1
        m += 1
    while b < nb:
        oi[m] = ib[b]
        ov[m] = vb[b]
        b += 1
        m += 1
    return m


def merge_add(ia: torch.Tensor, va: torch.Tensor, ib: torch.Tensor,
              vb: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Two sparse vectors (sorted unique int64 indices, values) summed: the sorted union of the
    indices, values added where both hold one."""
    oi = np.empty(ia.numel() + ib.numel(), dtype=np.int64)
    ov = np.empty(ia.numel() + ib.numel(), dtype=_np(va).dtype)
    m = _merge_add(_np(ia), _np(va), _np(ib), _np(vb), oi, ov)
    return torch.from_numpy(oi[:m]), torch.from_numpy(ov[:m])


class IndexBuffer:
    """Reused buffers the selections write their indices (int64) and values into (fresh ones would
    cost page faults); they grow to the largest selection seen."""

    def __init__(self) -> None:
        self.buf = np.empty(0, dtype=np.int64)
        self.vals: dict[np.dtype, np.ndarray] = {}

    def ensure(self, size: int) -> np.ndarray:
        if self.buf.shape[0] < size:
            self.buf = np.empty(max(size, self.buf.shape[0] * 5 // 4), dtype=np.int64)
        return self.buf

    def values(self, dtype: np.dtype) -> np.ndarray:
        """The value buffer of ``dtype``, as long as the index buffer."""
        v = self.vals.get(dtype)
        if v is None or v.shape[0] != self.buf.shape[0]:
            v = self.vals[dtype] = np.empty(self.buf.shape[0], dtype=dtype)
        return v


def _result(buf: np.ndarray, m: int) -> torch.Tensor:
    # a copy of the m entries (O(k)): the buffer is reused by the next selection
    return torch.from_numpy(buf[:m].copy())


def accumulate_select(residual: torch.Tensor, grad: torch.Tensor, threshold: float | None, buf: IndexBuffer, *,
                      limit: int | None = None,
                      expect: int = 0) -> tuple[torch.Tensor | None, torch.Tensor | None, float, float]:
    """``residual += grad``, ``grad`` zeroed and, when ``threshold`` is given, the sorted indices
    (int64) of the new residual's entries with ``|r| >= threshold`` (nonzeros for 0) and their
    values, in one pass: reads ``residual`` and ``grad``, writes both (4 streams). ``None``
    instead of indices and values when more than ``limit`` pass. Also returns the new residual's
    sum of squares and sum (float64 accumulation). ``expect``: a guess of the count, to size the
    buffers on first use (a short one costs a second, read-only pass)."""
    r, g = _np(residual), _np(grad)
    select = threshold is not None
    thr = _thr(r, threshold if select else 1.0)  # type: ignore[arg-type]
    out = buf.ensure(limit + 1 if limit is not None else max(expect, 1024) if select else 0)
    outv = buf.values(r.dtype)
    if not select:
        out, outv = out[:0], outv[:0]
    _traffic("accumulate_select", [(residual, True, True), (grad, True, True)])
    m, sumsq, total = _accumulate_select(r, g, thr, out, outv, select)
    if not select or (limit is not None and m > limit):
        return None, None, float(sumsq), float(total)
    if m > out.shape[0]:  # the buffers were short: select again on the sum, now complete
        idx = select_above(residual, threshold, buf)  # type: ignore[arg-type]
        assert idx is not None
        return idx, residual.index_select(0, idx), float(sumsq), float(total)
    return _result(out, m), _result(outv, m), float(sumsq), float(total)


def select_above(x: torch.Tensor, threshold: float, buf: IndexBuffer, limit: int | None = None) -> torch.Tensor | None:
    """Sorted indices (int64) of the entries of ``x`` with ``|x| >= threshold`` (nonzeros for 0),
    one read of ``x``; ``None`` when more than ``limit`` pass."""
    a = _np(x)
    thr = _thr(a, threshold)
    _traffic("select_above", [(x, True, False)])
    out = buf.ensure(limit + 1 if limit is not None else max(1024, buf.buf.shape[0]))
    m = _select(a, thr, out)
    if limit is not None and m > limit:
        return None
    if m > out.shape[0]:
        out = buf.ensure(m)
        m = _select(a, thr, out)
        _traffic("select_above", [(x, True, False)])
    return _result(buf.buf, m)


def scatter_add(dst: torch.Tensor, idx: torch.Tensor, vals: torch.Tensor, offset: int = 0) -> None:
    """``dst[idx - offset] += vals`` (entries of one index are added in their order)."""
    _scatter_add(_np(dst), _np(idx), _np(vals), offset)


def scatter_copy(dst: torch.Tensor, idx: torch.Tensor, vals: torch.Tensor) -> None:
    """``dst[idx] = vals``."""
    _scatter_copy(_np(dst), _np(idx), _np(vals))


def clear_sent(acc: torch.Tensor, result: torch.Tensor, idx: torch.Tensor) -> tuple[torch.Tensor, float]:
    """Zero ``acc`` at the entries of ``idx`` where ``result`` is nonzero (this rank sent them and
    the group kept them); returns those entries and the sum of squares ``acc`` held there."""
    sent = np.empty(idx.numel(), dtype=np.int64)
    m, z = _clear_sent(_np(acc), _np(result), _np(idx), sent)
    return torch.from_numpy(sent[:m]), float(z)

"""Magnitude thresholds: exact local top-k, exact top-k over a group without gathering values,
the Gaussian estimate, and the selection rule shared by every sparse compressor."""

from __future__ import annotations

import math

import torch

from .base import Comm

__all__ = ["exact_threshold", "sampled_threshold", "group_threshold", "gaussian_threshold", "select", "k_of"]


def k_of(n: int, density: float) -> int:
    """Entries to keep of ``n`` at ``density`` (at least one)."""
    return max(1, min(n, math.ceil(n * density)))


def select(magnitude: torch.Tensor, threshold: float) -> torch.Tensor:
    """Indices (sorted) of the entries at or above ``threshold``; exact zeros are never sent."""
    mask = magnitude >= threshold if threshold > 0 else magnitude > 0
    return mask.nonzero().squeeze(1)


def exact_threshold(magnitude: torch.Tensor, k: int) -> float:
    """The k-th largest magnitude (0 when ``k`` covers every entry: keep all)."""
    n = magnitude.numel()
    if k >= n:
        return 0.0
    return float(torch.topk(magnitude, k, sorted=False).values.min())


SAMPLE = 2**16  # magnitudes a sampled threshold looks at: ~k/n * 65,536 of them lie above it


def sampled_threshold(magnitude: torch.Tensor, k: int) -> float:
    """An estimate of the k-th largest magnitude from every s-th entry (s = n / 65,536): the same
    quantile of the sample. O(n / s) instead of a top-k over all n."""
    n = magnitude.numel()
    stride = max(1, n // SAMPLE)
    sample = magnitude[::stride]
    ks = max(1, round(k * sample.numel() / n))
    return exact_threshold(sample, ks)


def _bits(magnitude: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Non-negative floats as integers of the same order (IEEE 754: the bit pattern of a
    non-negative float grows with its value), and the pattern's width."""
    if magnitude.dtype == torch.float64:
        return magnitude.view(torch.int64), 64
    if magnitude.dtype == torch.float32:
        return magnitude.view(torch.int32).to(torch.int64), 32
    return magnitude.float().view(torch.int32).to(torch.int64), 32


def group_threshold(magnitude: torch.Tensor, k: int, comm: Comm) -> float:
    """The exact k-th largest of the magnitudes held by all ranks together (disjoint pieces).

    Radix selection on the bit patterns, 8 bits a round: each round all-reduces a 256-bin
    histogram of the next byte among the entries matching the prefix found so far (4 rounds for
    fp32, 8 for fp64). Control traffic of 256 counts a round instead of gathering every nonzero
    (what the public Ok-Topk code does every 32 calls), so the exact recompute keeps the volume
    bound. Returns 0 when the group holds at most ``k`` nonzeros (keep all of them).
    """
    nonzero = magnitude[magnitude > 0]
    total = comm.all_reduce(comm.ints([nonzero.numel()]))
    if int(total) <= k:
        return 0.0
    keys, width = _bits(nonzero)
    prefix = 0
    remaining = k  # rank, among entries matching the prefix, of the one we look for
    candidates = keys
    for shift in range(width - 8, -1, -8):
        digit = (candidates >> shift) & 0xFF
        hist = torch.bincount(digit, minlength=256).to(torch.int64)
        comm.all_reduce(hist)
        # largest digit first: walk down until the count above reaches ``remaining``
        above = torch.flip(torch.cumsum(torch.flip(hist, [0]), 0), [0])  # above[d] = count of digits >= d
        d = int((above >= remaining).nonzero().max())
        remaining -= int(above[d + 1]) if d < 255 else 0
        prefix |= d << shift
        candidates = candidates[digit == d]
    as_int = torch.tensor([prefix], dtype=torch.int64)
    if width == 64:
        return float(as_int.view(torch.float64))
    return float(as_int.to(torch.int32).view(torch.float32))


def gaussian_threshold(values: torch.Tensor, density: float) -> float:
    """Gaussiank's estimate: the magnitude a Gaussian fit of ``values`` exceeds with probability
    ``density`` (two-sided: |mean| + std * Phi^-1(1 - density/2))."""
    mean = float(values.mean())
    std = float(values.std()) if values.numel() > 1 else 0.0
    z = float(torch.special.ndtri(torch.tensor(1.0 - density / 2, dtype=torch.float64)))
    return abs(mean) + std * z

"""GEMM shape efficiency: how close to peak a matrix multiply of a given shape runs.

A tensor-core GEMM ``C[m×n] = A[m×k]·B[k×n]`` is cut into output tiles of ``tm×tn``; each tile is
computed by one SM (thread block) in steps of ``tk`` along K. Two effects make the shape matter
(NVIDIA, "Matrix Multiplication Background User's Guide", sections "Tile Quantization" and
"Wave Quantization"):

- **tile quantization**: a dimension that is not a multiple of the tile still pays for whole tiles,
  so a fraction of the work is padding (also along K, in steps of ``tk``);
- **wave quantization**: ``tiles = ceil(m/tm)·ceil(n/tn)`` run in waves of ``sm_count``; the last,
  partial wave leaves SMs idle.

Libraries pick smaller tiles when the large tile would leave most SMs idle. A smaller tile does
fewer FLOPs per byte it loads from L2/shared memory (intensity ``tm·tn/(tm+tn)``); large tiles
are chosen because smaller ones are bound by that traffic, so a tile's own efficiency is modelled
as its intensity relative to the device's default tile. The best candidate tile is used.

A short K also hurts: each tile pays a fixed prologue/epilogue (pipeline fill, writing C) worth
about two K-steps, so the K efficiency is ``k / (k + 2·tk)``.
"""

from __future__ import annotations

from functools import lru_cache

from paratrain.errors import require_positive_int
from paratrain.spec.device import DeviceSpec

__all__ = ["gemm_efficiency", "gemm_tile_choice"]

# Candidate tiles relative to the device's default (tm, tn): the default, then halvings, as
# cuBLAS/CUTLASS heuristics step down for small problems.
_TILE_DIVISORS = ((1, 1), (2, 1), (1, 2), (2, 2), (4, 2), (4, 4))
_EPILOGUE_K_STEPS = 2


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def _intensity(tm: int, tn: int) -> float:
    return tm * tn / (tm + tn)


@lru_cache(maxsize=65536)
def gemm_tile_choice(m: int, n: int, k: int, device: DeviceSpec, batch: int = 1) -> tuple[float, int, int]:
    """``(shape efficiency, tm, tn)`` of the best tile for this GEMM, without ``device.gemm_efficiency``.

    ``batch`` independent GEMMs of the same shape (a batched GEMM such as attention over heads)
    share the waves.
    """
    for name, v in (("m", m), ("n", n), ("k", k), ("batch", batch)):
        require_positive_int(f"gemm {name}", v)
    tk = device.gemm_tile_k
    k_eff = (k / (_ceil_div(k, tk) * tk)) * (k / (k + _EPILOGUE_K_STEPS * tk))
    base = _intensity(device.gemm_tile_m, device.gemm_tile_n)
    best = (0.0, device.gemm_tile_m, device.gemm_tile_n)
    for dm, dn in _TILE_DIVISORS:
        tm = max(1, device.gemm_tile_m // dm)
        tn = max(1, device.gemm_tile_n // dn)
        tiles_m, tiles_n = _ceil_div(m, tm), _ceil_div(n, tn)
        tile_eff = (m * n) / (tiles_m * tm * tiles_n * tn)
        tiles = tiles_m * tiles_n * batch
        waves = _ceil_div(tiles, device.sm_count)
        wave_eff = tiles / (waves * device.sm_count)
        eff = tile_eff * wave_eff * min(1.0, _intensity(tm, tn) / base) * k_eff
        if eff > best[0]:
            best = (eff, tm, tn)
    return best


def gemm_efficiency(m: int, n: int, k: int, device: DeviceSpec, batch: int = 1) -> float:
    """Fraction of ``device``'s peak FLOP/s that an ``m×k · k×n`` GEMM sustains, in (0, 1].

    The product of tile quantization (M, N and K padding), wave quantization over
    ``device.sm_count`` SMs, the chosen tile's relative intensity, the short-K penalty, and
    ``device.gemm_efficiency`` (what a large, well-shaped GEMM reaches).
    """
    return gemm_tile_choice(m, n, k, device, batch)[0] * device.gemm_efficiency

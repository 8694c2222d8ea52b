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

FP8 GEMMs (``dtype="fp8"``) run at the device's FP8 peak (H100 SXM: 1,979 TFLOP/s dense, twice
the 16-bit rate: NVIDIA H100 Tensor Core GPU datasheet, "FP8 Tensor Core 3,958 teraFLOPS" with
sparsity) at the same ``device.gemm_efficiency``. Their K step holds twice the elements of the
16-bit one (``2·gemm_tile_k``): a pipeline stage of the kernel loads the same bytes of one-byte
elements (CUTLASS's Hopper FP8 example uses a 128-deep K tile,
``examples/54_hopper_fp8_warp_specialized_gemm``, ``TileShape = Shape<_64,_128,_128>``, where the
h100 preset's 16-bit K step is 64). A device without an FP8 peak cannot run them
(:func:`gemm_peak_flops` raises a ConfigError).
"""

from __future__ import annotations

from functools import lru_cache

from paratrain.errors import ConfigError, require_positive_int
from paratrain.spec.device import DeviceSpec

__all__ = ["gemm_efficiency", "gemm_tile_choice", "gemm_k_step", "gemm_peak_flops", "FP8_K_STEP_FACTOR"]

# Candidate tiles relative to the device's default (tm, tn): the default, then halvings, as
# cuBLAS/CUTLASS heuristics step down for small problems.
_TILE_DIVISORS = ((1, 1), (2, 1), (1, 2), (2, 2), (4, 2), (4, 4))
_EPILOGUE_K_STEPS = 2
FP8_K_STEP_FACTOR = 2  # one-byte elements: twice the K per pipeline stage of the 16-bit kernels


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def _intensity(tm: int, tn: int) -> float:
    return tm * tn / (tm + tn)


def gemm_k_step(device: DeviceSpec, dtype: str = "bf16") -> int:
    """K elements per pipeline stage of the device's GEMM kernel for inputs of ``dtype``."""
    return device.gemm_tile_k * (FP8_K_STEP_FACTOR if dtype == "fp8" else 1)


def gemm_peak_flops(device: DeviceSpec, dtype: str) -> float:
    """Peak FLOP/s of a GEMM with inputs of ``dtype``. FP8 GEMMs need FP8 tensor cores: unlike the
    other dtypes (which fall back to a wider one, as frameworks do), a device without an FP8 peak
    is an error, since torchao's Float8 and Transformer Engine refuse to run there."""
    if dtype == "fp8" and device.peak_fp8_flops <= 0:
        raise ConfigError(
            "gemm_dtype", f"{device.name} has no FP8 tensor cores (no FP8 peak)",
            "use bf16 GEMMs on this device, or a device with FP8 (h100, h200)",
        )
    return device.peak_flops(dtype)


@lru_cache(maxsize=65536)
def gemm_tile_choice(
    m: int, n: int, k: int, device: DeviceSpec, batch: int = 1, dtype: str = "bf16"
) -> tuple[float, int, int]:
    """``(shape efficiency, tm, tn)`` of the best tile for this GEMM, without ``device.gemm_efficiency``.

    ``batch`` independent GEMMs of the same shape (a batched GEMM such as attention over heads)
    share the waves. ``dtype`` sets the K step (:func:`gemm_k_step`).
    """
    for name, v in (("m", m), ("n", n), ("k", k), ("batch", batch)):
        require_positive_int(f"gemm {name}", v)
    tk = gemm_k_step(device, dtype)
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


def gemm_efficiency(m: int, n: int, k: int, device: DeviceSpec, batch: int = 1, dtype: str = "bf16") -> float:
    """Fraction of ``device``'s peak FLOP/s (for ``dtype``) that an ``m×k · k×n`` GEMM sustains, in (0, 1].

    The product of tile quantization (M, N and K padding), wave quantization over
    ``device.sm_count`` SMs, the chosen tile's relative intensity, the short-K penalty, and
    ``device.gemm_efficiency`` (what a large, well-shaped GEMM reaches).
    """
    return gemm_tile_choice(m, n, k, device, batch, dtype)[0] * device.gemm_efficiency

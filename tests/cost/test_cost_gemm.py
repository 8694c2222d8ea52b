"""GEMM shape efficiency: tile and wave quantization."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from paratrain.cost.compute import layer_ops, op_time_split
from paratrain.cost.gemm import gemm_efficiency, gemm_tile_choice
from paratrain.spec.device import resolve_device
from paratrain.spec.model import preset

A100 = resolve_device("a100-80gb")


def _layer_time_per_flop(hidden: int) -> float:
    # Same model, only the hidden size differs; heads=1 keeps any hidden size legal.
    m = dataclasses.replace(preset("gpt3-6.7b"), hidden=hidden, heads=1, seq=2048)
    ops = [o for o in layer_ops(m, microbatch=4) if o.kind == "gemm" and o.has_weight]
    t = sum(sum(op_time_split(o, A100, "bf16")) for o in ops)
    return t / sum(o.fwd_flops + o.bwd_flops for o in ops)


def test_hidden_4096_faster_per_flop_than_4095_and_4100() -> None:
    t4096 = _layer_time_per_flop(4096)
    assert t4096 < _layer_time_per_flop(4095)
    assert t4096 < _layer_time_per_flop(4100)


def test_tile_quantization_one_extra_row_costs_a_tile_row() -> None:
    # 8192×8192 output in 256×128 tiles: 32×64 = 2048 tiles; one more row adds a whole tile row.
    full = gemm_efficiency(8192, 8192, 8192, A100)
    ragged = gemm_efficiency(8193, 8192, 8192, A100)
    assert ragged < full
    per_flop_full = 1 / full
    per_flop_ragged = 1 / ragged
    assert per_flop_ragged / per_flop_full > 1.0 + 1e-4


def test_wave_quantization_one_tile_past_a_full_wave() -> None:
    sms = A100.sm_count
    tm, tn = A100.gemm_tile_m, A100.gemm_tile_n
    # Exactly sms tiles: one full wave; sms + 1 tiles: a second wave with one busy SM.
    exact, _, _ = gemm_tile_choice(tm * sms, tn, 4096, A100)
    over, _, _ = gemm_tile_choice(tm * (sms + 1), tn, 4096, A100)
    assert exact > over
    assert over < 0.75 * exact  # the second wave is almost empty; only smaller tiles can rescue it


def test_full_wave_of_default_tiles_reaches_device_efficiency_times_k_term() -> None:
    tm, tn, tk = A100.gemm_tile_m, A100.gemm_tile_n, A100.gemm_tile_k
    k = 8192
    eff = gemm_efficiency(tm * A100.sm_count, tn * 4, k, A100)
    assert abs(eff - A100.gemm_efficiency * k / (k + 2 * tk)) < 1e-12


def test_half_a_wave_takes_the_tile_that_fills_the_sms() -> None:
    """13,824 × 128 on the A100 (108 SMs, 256×128 tiles): 54 default tiles fill half a wave (0.5).
    The candidates, wave fill × intensity relative to 256×128 (intensity tm·tn/(tm+tn), 85.3):
    128×128: 108 tiles, one wave, × 64/85.3 = 0.75; 256×64: 108 tiles × 51.2/85.3 = 0.6;
    128×64: 216 tiles, 2 waves, × 0.5; 64×64: 432, 4 waves, × 0.375; 64×32: 864, 8 waves, × 0.25.
    The best is 128×128 at 0.75, times the K term k/(k + 2·tk) with k a multiple of tk."""
    assert (A100.sm_count, A100.gemm_tile_m, A100.gemm_tile_n) == (108, 256, 128)
    tk, k = A100.gemm_tile_k, 8192
    assert k % tk == 0
    eff, tm, tn = gemm_tile_choice(256 * 54, 128, k, A100)
    assert (tm, tn) == (128, 128)
    assert eff == pytest.approx(0.75 * k / (k + 2 * tk), rel=1e-12)


def test_small_k_is_penalized() -> None:
    assert gemm_efficiency(4096, 4096, 64, A100) < gemm_efficiency(4096, 4096, 4096, A100)


@settings(max_examples=200, deadline=None)
@given(
    m=st.integers(1, 20000), n=st.integers(1, 20000), k=st.integers(1, 20000), batch=st.integers(1, 64),
    device=st.sampled_from(["a100-80gb", "h100", "v100", "p100", "cpu"]),
)
def test_efficiency_is_a_fraction(m: int, n: int, k: int, batch: int, device: str) -> None:
    dev = resolve_device(device)
    eff = gemm_efficiency(m, n, k, dev, batch)
    assert 0 < eff <= dev.gemm_efficiency <= 1

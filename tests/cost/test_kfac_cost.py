"""The cost of K-FAC's pieces (``paratrain.cost.kfac``) against closed forms and direct counts."""

from __future__ import annotations

import pytest

from paratrain.cost.kfac import (
    chunk_layer_costs,
    curvature_flops,
    factor_bytes,
    inversion_flops,
    layer_cost,
    linear_shapes,
    precondition_flops,
)
from paratrain.errors import ConfigError
from paratrain.spec.device_presets import DEVICE_PRESETS
from paratrain.spec.model import preset

A100 = DEVICE_PRESETS["a100-80gb"]


def _matmul_flops(m: int, k: int, n: int) -> int:
    """FLOPs of an (m×k)·(k×n) product counted entry by entry: k multiplies and k adds each
    (the accumulation starts from zero)."""
    return sum(2 * k for _ in range(m) for _ in range(n))


def test_curvature_flops_are_the_two_gram_matrices() -> None:
    t, d_in, d_out = 6, 5, 3
    # A = Xᵀ X with X t×d_in; G = Gᵀ G with G t×d_out
    assert curvature_flops(d_in, d_out, t) == _matmul_flops(d_in, t, d_in) + _matmul_flops(d_out, t, d_out)


def test_precondition_flops_are_the_two_products() -> None:
    d_in, d_out = 4, 7
    # G⁻¹ (d_out×d_out) · ∇W (d_out×d_in), then · A⁻¹ (d_in×d_in)
    assert precondition_flops(d_in, d_out) == _matmul_flops(d_out, d_out, d_in) + _matmul_flops(d_out, d_in, d_in)


def test_factor_bytes_and_inversion_constants() -> None:
    assert factor_bytes(1024, 4096) == 4 * (1024**2 + 4096**2)
    assert inversion_flops(100, "inverse") == 100**3
    assert inversion_flops(100, "eigen") == 9 * 100**3
    with pytest.raises(ConfigError, match="unknown method"):
        inversion_flops(10, "svd")


@pytest.mark.parametrize("name", ["bert-base", "bert-large"])
def test_linear_shapes_hold_the_layers_matmul_weights(name: str) -> None:
    model = preset(name)
    h = model.hidden
    # BERT: QKV and output projection 4h², FFN 2·h·4h: 12h² weights in the four linear layers
    assert sum(i * o for i, o in linear_shapes(model)) == 12 * h * h
    assert len(linear_shapes(model)) == 4


def test_times_follow_the_flops_when_compute_bound() -> None:
    big = layer_cost(4096, 4096, 8192, A100, "bf16", "inverse")
    eig = layer_cost(4096, 4096, 8192, A100, "bf16", "eigen")
    # the same roofline shape, 9× the FLOPs: 9× the time up to the per-kernel overhead
    assert eig.inversion_s / big.inversion_s == pytest.approx(9, rel=0.01)
    # no faster than the device's peak
    assert big.curvature_s >= curvature_flops(4096, 4096, 8192) / A100.peak_flops("bf16")
    assert big.inversion_s >= inversion_flops(4096) * 2 / A100.peak_flops("fp32")
    assert big.precondition_s >= precondition_flops(4096, 4096) / A100.peak_flops("fp32")
    # twice the tokens, about twice the curvature time (compute bound)
    twice = layer_cost(4096, 4096, 16384, A100, "bf16")
    assert twice.curvature_s / big.curvature_s == pytest.approx(2, rel=0.05)


def test_chunk_costs_repeat_the_layer_and_refuse_tensor_parallelism() -> None:
    model = preset("bert-base")
    chunks = chunk_layer_costs(model, A100, (3, 3, 3, 3), 8, "bf16")
    assert [len(c) for c in chunks] == [12, 12, 12, 12]
    assert chunks[0][:4] == chunks[1][4:8]
    with pytest.raises(ConfigError, match="tp=2"):
        chunk_layer_costs(model, A100, (6, 6), 8, "bf16", tp=2)

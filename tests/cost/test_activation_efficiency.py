"""Activation functions on a device whose GeLU/SiLU kernels run below the other element-wise
kernels' rate (a CPU: transcendental math): ``DeviceSpec.activation_efficiency``, measured by
``paratrain calibrate`` (tanh-GeLU forward and backward)."""

from __future__ import annotations

import dataclasses

import pytest

from paratrain.cost.compute import layer_ops, op_time_split
from paratrain.errors import ConfigError
from paratrain.runtime.calibrate import device_from_measurement
from paratrain.spec.device_presets import DEVICE_PRESETS
from paratrain.spec.model import preset

GPT = dataclasses.replace(preset("gpt-tiny"), hidden=256, heads=4, seq=128)
CPU = dataclasses.replace(DEVICE_PRESETS["cpu"], memory_efficiency=0.5, kernel_overhead_s=0.0)


def _ops(model=GPT, fused: bool = False) -> dict[str, object]:  # noqa: ANN001
    return {op.name: op for op in layer_ops(model, microbatch=2, dtype="fp32", fused=fused)}


def test_only_the_activation_is_an_activation() -> None:
    ops = _ops()
    assert [name for name, op in ops.items() if op.activation] == ["gelu"]
    swiglu = dataclasses.replace(GPT, activation="swiglu", ffn=512)
    assert [op.name for op in layer_ops(swiglu, microbatch=2, dtype="fp32") if op.activation] == ["swiglu"]


def test_an_activation_runs_at_the_activation_efficiency_and_the_rest_as_before() -> None:
    """GeLU over n = 256 tokens x 1024 elements in fp32: forward 2 x 4n bytes, backward 3 x 4n, at
    bandwidth x efficiency (memory-bound: its 8 FLOPs an element at 50 GFLOP/s are far shorter)."""
    ops = _ops()
    n = 2 * GPT.seq * GPT.ffn_size
    slow = dataclasses.replace(CPU, activation_efficiency=0.2)
    bw = CPU.memory_bandwidth_Bps
    f, bi, bw_ = op_time_split(ops["gelu"], slow, "fp32")
    assert (f, bi + bw_) == pytest.approx((8 * n / (bw * 0.2), 12 * n / (bw * 0.2)), rel=1e-12)
    assert op_time_split(ops["gelu"], CPU, "fp32")[0] == pytest.approx(8 * n / (bw * 0.5), rel=1e-12)  # 0: as the rest
    for name in ("ln_1", "softmax", "attn_residual", "qkv"):
        assert op_time_split(ops[name], slow, "fp32") == op_time_split(ops[name], CPU, "fp32")


def test_calibration_stores_the_activation_rate_over_the_copy_per_core() -> None:
    m = {"peak_fp32_flops": 100e9, "gemm_flops_by_size": {512: 100e9}, "memory_bandwidth_Bps": 10e9,
         "elementwise_Bps": 6e9, "kernel_overhead_s": 10e-6, "small_add_s": 1e-6, "small_matmul_s": 2e-6,
         "duration_cv": 0.05, "threads": 1, "procs": 4, "cores": 2}
    assert device_from_measurement(m).activation_efficiency == 0.0  # older calibrations: as the rest
    dev = device_from_measurement({**m, "activation_Bps": 2.5e9})
    assert dev.memory_efficiency == pytest.approx(0.6) and dev.activation_efficiency == pytest.approx(0.25)


@pytest.mark.parametrize("value", [-0.1, 1.5])
def test_a_bad_activation_efficiency_names_the_field(value: float) -> None:
    with pytest.raises(ConfigError, match="activation_efficiency"):
        dataclasses.replace(CPU, activation_efficiency=value)

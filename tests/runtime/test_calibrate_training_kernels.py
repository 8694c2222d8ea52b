"""The efficiencies ``paratrain calibrate`` gives the ``cpu`` device from a training step's kernels,
read back through the cost model's own timing:

- GEMM efficiency: the rate of a transformer MLP's two Linear layers, forward and backward through
  autograd;
- fused attention: the runtime's layers call torch's SDPA, which runs its flash-attention kernels
  on a CPU, so calibrate times SDPA (causal, forward and backward through autograd) and the device
  gets fused attention at the rate measured."""

from __future__ import annotations

import pytest

from paratrain.cost.compute import default_attention, op_time_split
from paratrain.cost.gemm import gemm_efficiency, gemm_tile_choice
from paratrain.runtime.calibrate import (
    ATTENTION_SHAPE,
    VARIATION_SHAPE,
    device_from_measurement,
    reference_attention_op,
    training_attention_efficiency,
    training_gemm_efficiency,
    training_gemm_shapes,
)
from paratrain.runtime.calibrate_timing import drift_corrected, paired_times

MEASURED = {"peak_fp32_flops": 100e9, "gemm_flops_by_size": {512: 100e9}, "memory_bandwidth_Bps": 10e9,
            "elementwise_Bps": 5e9, "kernel_overhead_s": 10e-6, "small_add_s": 1e-6, "small_matmul_s": 2e-6,
            "duration_cv": 0.05, "threads": 1}


def _modelled_s(device) -> float:
    """The six GEMMs as cost.compute times a weight GEMM (compute-bound here): FLOPs at the peak
    times the GEMM efficiency of the shape, plus one kernel overhead each."""
    return sum(2 * m * n * k / (device.peak_fp32_flops * gemm_efficiency(m, n, k, device, 1, "fp32"))
               + device.kernel_overhead_s for m, n, k in training_gemm_shapes())


def test_the_shapes_are_two_linear_layers_forward_input_and_weight_gradients() -> None:
    t, h, f = VARIATION_SHAPE
    assert training_gemm_shapes() == [(t, f, h), (t, h, f), (h, f, t), (t, h, f), (t, f, h), (f, h, t)]


@pytest.mark.parametrize("procs_cores", [(1, 0), (4, 2)])
def test_the_model_times_the_training_gemms_as_measured(procs_cores: tuple[int, int]) -> None:
    procs, cores = procs_cores
    base = device_from_measurement({**MEASURED, "procs": procs, "cores": cores})
    assert base.gemm_efficiency == 1.0  # without the measurement: the best square GEMM's rate
    ideal = _modelled_s(base)
    share = 0.5 if cores else 1.0
    wall = 1.25 * ideal / share  # each process measured its GEMMs at 80 % of the ideal, with `share` of a core
    dev = device_from_measurement({**MEASURED, "procs": procs, "cores": cores, "training_gemm_s": wall})
    assert _modelled_s(dev) == pytest.approx(wall * share, rel=1e-9)
    assert dev.gemm_efficiency == pytest.approx((ideal - 6 * base.kernel_overhead_s)
                                                / (1.25 * ideal - 6 * base.kernel_overhead_s), rel=1e-9)


def test_a_host_slower_while_timing_the_training_gemms_is_corrected_by_the_reference() -> None:
    # the square GEMM took 10 ms when the peak was measured and 12.5 ms beside the training GEMMs:
    # the host ran at 80 % of its speed, so 50 ms measured then are 40 ms at the stored peak
    assert drift_corrected(0.050, 0.0125, 0.010) == pytest.approx(0.040, rel=1e-12)
    assert drift_corrected(0.050, 0.010, 0.010) == pytest.approx(0.050, rel=1e-12)  # no drift
    base = device_from_measurement(MEASURED)
    slow = 1.25 * _modelled_s(base)  # the training GEMMs at the ideal, timed on a host 25 % slower
    assert training_gemm_efficiency(base, drift_corrected(slow, 0.0125, 0.010)) == pytest.approx(1.0, rel=1e-9)
    with pytest.raises(ValueError):
        drift_corrected(0.05, 0.0, 0.01)


def test_paired_times_alternate_the_two_calls_under_one_deadline() -> None:
    import time

    calls: list[str] = []
    ta, tb = paired_times(lambda: calls.append("a"), lambda: calls.append("b"), best=True,
                           deadline=time.perf_counter() - 1.0)  # past: the minimum of three pairs
    assert calls == ["a", "b"] * 4  # one warm-up pair, then three timed pairs, alternating
    assert 0.0 <= ta < 0.01 and 0.0 <= tb < 0.01


def test_training_gemms_faster_than_the_model_allows_cap_the_efficiency_at_one() -> None:
    base = device_from_measurement(MEASURED)
    assert training_gemm_efficiency(base, 0.5 * _modelled_s(base)) == 1.0
    assert training_gemm_efficiency(base, 1e-6) == 1.0  # less than the kernels' overhead: no figure


def _compute_s(device) -> float:
    """Closed form of the reference attention at efficiency 1: a causal kernel executes half of
    ``4·b·a·s²·d`` FLOPs forward and 2.5 times that backward (FlashAttention-2), at the peak times
    the tile efficiency of ``b·a`` blocks of ``s×s×d``."""
    b, a, s, d = ATTENTION_SHAPE
    executed = 0.5 * 4 * b * a * s * s * d
    tile = gemm_tile_choice(s, s, d, device, b * a, "fp32")[0]
    return 3.5 * executed / (device.peak_fp32_flops * tile)


def test_the_reference_operator_is_the_causal_flash_kernel_of_the_shape() -> None:
    b, a, s, d = ATTENTION_SHAPE
    op = reference_attention_op()
    assert op.attention_shape == (s, s, d) and op.batch == b * a
    assert op.fwd_flops == 4 * b * a * s * s * d
    assert op.exec_fwd_flops == op.fwd_flops / 2 and op.exec_bwd_flops == 2.5 * op.exec_fwd_flops


@pytest.mark.parametrize("procs_cores", [(1, 0), (4, 2)])
def test_the_model_times_the_attention_as_measured(procs_cores: tuple[int, int]) -> None:
    procs, cores = procs_cores
    base = device_from_measurement({**MEASURED, "procs": procs, "cores": cores})
    share = 0.5 if cores else 1.0
    overheads = 4 * base.kernel_overhead_s  # one kernel forward, three backward
    per_core = 2 * _compute_s(base) + overheads  # attention at half the peak's rate
    dev = device_from_measurement({**MEASURED, "procs": procs, "cores": cores, "attention_s": per_core / share})
    assert dev.fused_attention and default_attention(dev) == "flash"
    assert dev.attention_efficiency == pytest.approx(0.5, rel=1e-9)
    fwd, bwd, weight = op_time_split(reference_attention_op(), dev, "fp32")
    assert weight == 0.0 and fwd + bwd == pytest.approx(per_core, rel=1e-9)


def test_calibrations_without_the_measurement_keep_the_explicit_kernels() -> None:
    dev = device_from_measurement(MEASURED)
    assert not dev.fused_attention and default_attention(dev) == "math"


def test_attention_faster_than_the_model_allows_caps_the_efficiency_at_one() -> None:
    base = device_from_measurement(MEASURED)
    assert training_attention_efficiency(base, 0.5 * _compute_s(base)) == 1.0
    assert training_attention_efficiency(base, 1e-6) == 1.0  # less than the kernels' overhead: no figure


def test_the_activation_runs_at_its_own_measured_rate() -> None:
    """calibrate times the runtime's MLP activation apart from the other element-wise kernels (a
    CPU evaluates GeLU's tanh slower than it streams memory): the cost model then times the GeLU
    operator, and only it, at that rate; an older calibration keeps one rate for all."""
    from paratrain.cost.compute import layer_ops
    from paratrain.spec.model import preset

    ops = {o.name: o for o in layer_ops(preset("gpt-tiny"), microbatch=2, dtype="fp32", attention="flash")}
    gelu, add = ops["gelu"], ops["mlp_residual"]
    old = device_from_measurement(MEASURED)
    assert old.activation_efficiency is None and old.activation_memory_efficiency == old.memory_efficiency == 0.5
    dev = device_from_measurement({**MEASURED, "activation_Bps": 2e9})
    assert dev.activation_efficiency == pytest.approx(0.2) and dev.memory_efficiency == 0.5
    fwd, bwd, _ = op_time_split(gelu, dev, "fp32")
    assert fwd == pytest.approx(gelu.fwd_bytes / 2e9 + dev.kernel_overhead_s, rel=1e-12)
    # backward: gelu_backward and the bias gradient's sum, a kernel overhead each
    assert bwd == pytest.approx(gelu.bwd_bytes / 2e9 + 2 * dev.kernel_overhead_s, rel=1e-12)
    assert op_time_split(add, dev, "fp32") == op_time_split(add, old, "fp32")  # 5 GB/s either way
    assert op_time_split(gelu, old, "fp32")[0] == pytest.approx(gelu.fwd_bytes / 5e9 + old.kernel_overhead_s)
    # what calibrate times is this operator's bytes: GeLU 2, its backward 3, the bias gradient 1
    n = preset("gpt-tiny").seq * 2 * preset("gpt-tiny").ffn_size
    assert (gelu.fwd_bytes + gelu.bwd_bytes) / (4 * n) == 2 + 3 + 1


def test_the_overhead_block_is_charged_one_overhead_per_counted_kernel() -> None:
    """calibrate divides the runtime block's time by ``overhead_block_kernels``; the cost model
    charges a layer of that shape exactly that many kernel overheads (multi-kernel composites
    included), so the model gives back the block's measured time when its arithmetic is free."""
    import dataclasses

    import torch

    from paratrain.cost.compute import layer_ops
    from paratrain.runtime.calibrate import OVERHEAD_BLOCK, _overhead_spec, overhead_block, overhead_block_kernels
    from paratrain.spec.device_presets import DEVICE_PRESETS

    free = dataclasses.replace(DEVICE_PRESETS["cpu"], peak_fp32_flops=1e30, memory_bandwidth_Bps=1e30,
                               kernel_overhead_s=1e-6, fused_attention=True)
    ops = layer_ops(_overhead_spec(), microbatch=OVERHEAD_BLOCK[3], dtype="fp32", attention="flash")
    charged = sum(sum(op_time_split(o, free, "fp32")) for o in ops)
    assert charged == pytest.approx(overhead_block_kernels() * 1e-6, rel=1e-9)
    block, x = overhead_block()
    out = block(x)
    assert out.shape == x.shape and x.shape[-1] == OVERHEAD_BLOCK[0]
    grads = torch.autograd.grad([out.sum()], [x, *block.parameters()])
    assert all(g is not None for g in grads)

"""The GEMM efficiency ``paratrain calibrate`` gives the ``cpu`` device: the rate of a training
step's GEMMs (a transformer MLP's two Linear layers, forward and backward through autograd), read
back through the cost model's own GEMM timing."""

from __future__ import annotations

import pytest

from paratrain.cost.gemm import gemm_efficiency
from paratrain.runtime.calibrate import (
    VARIATION_SHAPE,
    device_from_measurement,
    training_gemm_efficiency,
    training_gemm_shapes,
)

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


def test_training_gemms_faster_than_the_model_allows_cap_the_efficiency_at_one() -> None:
    base = device_from_measurement(MEASURED)
    assert training_gemm_efficiency(base, 0.5 * _modelled_s(base)) == 1.0
    assert training_gemm_efficiency(base, 1e-6) == 1.0  # less than the kernels' overhead: no figure

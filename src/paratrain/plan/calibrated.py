"""Calibrated efficiency parameters (data, produced by ``paratrain validate --fit``).

``VTRAIN_A100`` was fitted on 2026-11-22 with

    paratrain validate vtrain-single --fit --lut vtrain-a100

(the measured runs and all-reduce tables shipped in ``paratrain/data/vtrain/``)

in two steps: (1) the intra-node link's bandwidth and latency, by least squares on the log of the
nccl-tests all-reduce times of 2–8 A100s in one node (vTrain's ``AR_GPU*_LUT`` microbenchmarks,
sizes 1 MiB–1 GiB); (2) the A100's ``gemm_efficiency``, ``memory_efficiency`` and
``host_issue_s`` (host time to issue one kernel, overlapping the device's work:
:func:`paratrain.cost.compute.host_bound_time`), by least squares (soft-L1) on the log of
predicted / measured iteration time of every fourth run of vTrain's single-node file (360 of
1,440 runs, 2–8 GPUs, Megatron-DeepSpeed, predicted with Megatron's fused element-wise kernels
and the data-parallel all-reduce after the backward: :func:`paratrain.plan.validate.megatron_predictor`).
``kernel_overhead_s`` (the device-side cost of a kernel) stays the preset's. No multi-node run was
used. ``link_efficiency`` = fitted / nominal intra-node bandwidth (the dgx-a100 preset's 300 GB/s)
is applied to the inter-node links as well.

The fitted issue time (~73 µs per modelled operator) covers what the eager framework does per
operator on the host: Python, autograd and dispatch, and the one or more CUDA launches behind it.
"""

from __future__ import annotations

from paratrain.plan.validate import Calibration
from paratrain.spec.device import resolve_device

_A100 = resolve_device("a100-80gb")
_H100 = resolve_device("h100")

__all__ = ["CALIBRATIONS", "VTRAIN_A100", "VTRAIN_A100_LINKS", "FITTED_A100", "FITTED_H100", "FITTED_H100_HBM2E",
           "FITTED_BY_DEVICE"]

VTRAIN_A100 = Calibration(
    gemm_efficiency=0.8823,
    memory_efficiency=0.6593,
    kernel_overhead_s=_A100.kernel_overhead_s,
    intra_bandwidth_Bps=2.176e11,
    intra_latency_s=1.21e-05,
    link_efficiency=0.7255,
    host_issue_s=7.276e-05,
)

# Step (1) alone: the links fitted to the all-reduce microbenchmarks, the device presets untouched.
VTRAIN_A100_LINKS = Calibration(
    gemm_efficiency=_A100.gemm_efficiency,
    memory_efficiency=_A100.memory_efficiency,
    kernel_overhead_s=_A100.kernel_overhead_s,
    intra_bandwidth_Bps=2.176e11,
    intra_latency_s=1.210e-05,
    link_efficiency=0.7255,
)

# Fitted on every source at once (vTrain's single-node file, every 8th row, its multi-node file, the
# public-runs table, and the layers timed on an H100 SXM in paratrain/data/measured/), one calibration
# per device, with
#
#     paratrain validate all --fit
#
# (paratrain.plan.crossval: gemm, attention and memory efficiency, one scale of the nominal NVLink
# and NIC bandwidths, host issue time per kernel; each source weighs the same). How well each source
# is predicted by the others' fit: ``paratrain validate all --loso``.
#
# Stored before the A100 fit gained its measured host prior (crossval.host_issue_prior, 2026-12-02):
# the fit with it gives host 74.9 µs and link scale 0.851 (0.839 here), the other three within 0.0013;
# not re-fitted (the GPT-3 175B plan's winner moves 57.1 -> 57.2 % MFU with it).
FITTED_A100 = Calibration(
    gemm_efficiency=0.7345,
    memory_efficiency=0.7763,
    kernel_overhead_s=_A100.kernel_overhead_s,
    intra_bandwidth_Bps=2.51577e11,
    intra_latency_s=3e-06,
    link_efficiency=0.8386,
    host_issue_s=7.343e-05,
    attention_efficiency=0.7915,
)
# SXM H100 80 GB (NeMo, Megatron-Bridge, MPT rows). The fit ends at the bounds of memory efficiency
# (1.0) and link scale (1.5 × nominal NVLink/NIC): these sources run faster than the model allows at
# the nominal figures (Transformer Engine's fused FP8 casts are not modelled; NVLink SHARP's
# all-reduce, modelled since, moves these rows by under 0.1 %); read the H100 figures with that in mind.
FITTED_H100 = Calibration(
    gemm_efficiency=0.7082,
    memory_efficiency=1.0000,
    kernel_overhead_s=_H100.kernel_overhead_s,
    intra_bandwidth_Bps=6.74995e11,
    intra_latency_s=3e-06,
    link_efficiency=1.49999,
    host_issue_s=1e-05,
    attention_efficiency=0.3991,
)
# torchtitan's H100 96 GB HBM2e parts at 500 W (device preset h100-96gb-hbm2e): GEMM and attention
# efficiencies are the SXM part's times a fitted clock factor, 0.9084 (crossval.TIED).
FITTED_H100_HBM2E = Calibration(
    gemm_efficiency=0.6433,
    memory_efficiency=0.9312,
    kernel_overhead_s=_H100.kernel_overhead_s,
    intra_bandwidth_Bps=2.70658e11,
    intra_latency_s=3e-06,
    link_efficiency=0.6015,
    host_issue_s=1e-05,
    attention_efficiency=0.3625,
)

# What ``--calibration fitted`` applies, by device preset.
FITTED_BY_DEVICE = {"a100-80gb": FITTED_A100, "a100-40gb": FITTED_A100, "h100": FITTED_H100,
                    "h100-96gb-hbm2e": FITTED_H100_HBM2E}

CALIBRATIONS = {
    "vtrain-a100": VTRAIN_A100,
    "vtrain-a100-links": VTRAIN_A100_LINKS,
    "fitted-a100": FITTED_A100,
    "fitted-h100": FITTED_H100,
    "fitted-h100-hbm2e": FITTED_H100_HBM2E,
}

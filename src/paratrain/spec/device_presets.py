"""Device presets. Every number cites the public datasheet it comes from.

Peak FLOP/s are dense tensor-core figures (the datasheets' "with sparsity" figures are halved).
Efficiency parameters are paratrain's own defaults for the roofline model; ``paratrain validate``
reports how they fit measured runs.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from paratrain.spec.device import DeviceSpec

__all__ = ["DEVICE_PRESETS", "DEVICE_ALIASES", "GPU_MEMORY_RESERVE"]

T = 1e12
GB = 10**9
GiB = 2**30

# What a GPU training process cannot use for tensors, so the planner does not pick layouts that
# fill 79.8 of 80 GiB and then fail to allocate:
# - fixed: the CUDA context with the cuBLAS/cuDNN handles and workspaces (a few hundred MiB once
#   kernels are loaded) plus NCCL's buffers (NCCL_BUFFSIZE, 4 MiB by default per channel and peer in
#   the NCCL environment-variable reference; a rank in tp, pp and dp communicators holds a few
#   hundred MiB): 1 GiB in all;
# - fragmentation: PyTorch's caching allocator splits cached blocks, and the holes cannot take
#   larger tensors. GMLake (Guo et al., ASPLOS 2024) measured 15 % on average (up to 33 %) for
#   eight LLMs trained on A100-80GB with recomputation and ZeRO; 10 % is charged here.
GPU_MEMORY_RESERVE: dict[str, Any] = dict(memory_reserved_bytes=1 * GiB, memory_fragmentation=0.10)

# Fused attention (FlashAttention-2 needs Ampere or newer: Dao 2023, and torch SDPA's flash backend
# sm80+). Sustained forward+backward rates, long sequences, head size 128: A100 up to 225 of 312
# TFLOP/s (FlashAttention-2 paper, fig. 6–7, 72 %); H100 with FlashAttention-2 (what torch SDPA and
# FA2-based stacks run) about 335–370 of 989 TFLOP/s (FlashAttention-3 paper, Shah et al. 2024,
# fig. 5–6, ~35 %). The fitted calibrations refine these.
_A100_ATTENTION: dict[str, Any] = dict(fused_attention=True, attention_efficiency=0.72)
_H100_ATTENTION: dict[str, Any] = dict(fused_attention=True, attention_efficiency=0.35)

# NVIDIA H100 SXM5 datasheet (2023): FP32 67 TF, TF32 494.7 TF, BF16/FP16 989.5 TF,
# FP8 1,979 TF, INT8 1,979 TOPS (dense: half the "with sparsity" figures, e.g. "FP8 Tensor Core
# 3,958 teraFLOPS*"), 80 GB HBM3 at 3.35 TB/s; 132 SMs (Hopper whitepaper). A100 has no FP8
# tensor cores (peak_fp8_flops 0: FP8 GEMMs there are a ConfigError, cost.gemm.gemm_peak_flops).
_H100_SXM = DeviceSpec(
    name="h100",
    **GPU_MEMORY_RESERVE,
    **_H100_ATTENTION,
    peak_fp32_flops=67 * T,
    peak_tf32_flops=494.7 * T,
    peak_bf16_flops=989.5 * T,
    peak_fp16_flops=989.5 * T,
    peak_fp8_flops=1979 * T,
    peak_int8_flops=1979 * T,
    memory_bytes=80 * GiB,
    memory_bandwidth_Bps=3350 * GB,
    sm_count=132,
    gemm_tile_m=256,
    gemm_tile_n=128,
    gemm_tile_k=64,
    gemm_efficiency=0.75,
)

DEVICE_PRESETS: dict[str, DeviceSpec] = {
    # NVIDIA Tesla K80 datasheet (2014): per board two GK210 GPUs, 8.73 TF FP32 (boost), 24 GB GDDR5
    # at 480 GB/s; one GPU (what a cloud "K80" and Gavel's k80 worker are) has half: 4.37 TF, 12 GB,
    # 240 GB/s, 13 SMX (GK210: 13 of 15 enabled). No fast FP16 and no tensor cores.
    "k80": DeviceSpec(
        name="k80",
        **GPU_MEMORY_RESERVE,
        peak_fp32_flops=4.37 * T,
        peak_fp16_flops=0.0,
        peak_bf16_flops=0.0,
        memory_bytes=12 * GiB,
        memory_bandwidth_Bps=240 * GB,
        sm_count=13,
        gemm_tile_m=64,
        gemm_tile_n=64,
        gemm_efficiency=0.75,
    ),
    # NVIDIA Tesla P100 SXM2 datasheet (2016): FP32 10.6 TF, FP16 21.2 TF, 16 GB HBM2 at 732 GB/s;
    # 56 SMs (Pascal GP100 whitepaper, Table 1). No tensor cores: small tiles.
    "p100": DeviceSpec(
        name="p100",
        **GPU_MEMORY_RESERVE,
        peak_fp32_flops=10.6 * T,
        peak_fp16_flops=21.2 * T,
        peak_bf16_flops=0.0,
        memory_bytes=16 * GiB,
        memory_bandwidth_Bps=732 * GB,
        sm_count=56,
        gemm_tile_m=128,
        gemm_tile_n=64,
        gemm_efficiency=0.80,
    ),
    # NVIDIA V100 SXM2 datasheet (2018): FP32 15.7 TF, tensor FP16 125 TF, 32 GB HBM2 at 900 GB/s;
    # 80 SMs (Volta whitepaper, Table 1). No bf16 (falls back to fp16 tensor cores).
    "v100": DeviceSpec(
        name="v100",
        **GPU_MEMORY_RESERVE,
        peak_fp32_flops=15.7 * T,
        peak_fp16_flops=125 * T,
        peak_bf16_flops=0.0,
        memory_bytes=32 * GiB,
        memory_bandwidth_Bps=900 * GB,
        sm_count=80,
        gemm_efficiency=0.75,
    ),
    # NVIDIA A100 datasheet (2021): FP32 19.5 TF, TF32 156 TF, BF16/FP16 312 TF, INT8 624 TOPS;
    # A100 40GB SXM HBM2 at 1,555 GB/s; 108 SMs (Ampere GA100 whitepaper, Table 3).
    # cuBLAS's large-tile kernels on Ampere use 256×128 output tiles.
    "a100-40gb": DeviceSpec(
        name="a100-40gb",
        **GPU_MEMORY_RESERVE,
        **_A100_ATTENTION,
        peak_fp32_flops=19.5 * T,
        peak_tf32_flops=156 * T,
        peak_bf16_flops=312 * T,
        peak_fp16_flops=312 * T,
        peak_int8_flops=624 * T,
        memory_bytes=40 * GiB,
        memory_bandwidth_Bps=1555 * GB,
        sm_count=108,
        gemm_tile_m=256,
        gemm_tile_n=128,
    ),
    # As above; A100 80GB SXM: HBM2e at 2,039 GB/s (A100 datasheet).
    "a100-80gb": DeviceSpec(
        name="a100-80gb",
        **GPU_MEMORY_RESERVE,
        **_A100_ATTENTION,
        peak_fp32_flops=19.5 * T,
        peak_tf32_flops=156 * T,
        peak_bf16_flops=312 * T,
        peak_fp16_flops=312 * T,
        peak_int8_flops=624 * T,
        memory_bytes=80 * GiB,
        memory_bandwidth_Bps=2039 * GB,
        sm_count=108,
        gemm_tile_m=256,
        gemm_tile_n=128,
    ),
    "h100": _H100_SXM,
    # The H100 parts of Meta's Grand Teton servers that torchtitan's H100 benchmarks ran on
    # (pytorch/torchtitan benchmarks/llama3_h100_202412_torchtitan.md: "H100 GPUs with 96GB HBM2e",
    # "500W power limit"; docs/performance.md at 3faaa1a0d: "HBM2e lower-TDP"): the GH100 die of the
    # SXM5 part (132 SMs, the same tensor cores and dense peaks, H100 datasheet), with six HBM2e
    # stacks of 16 GB instead of five HBM3 ones. NVIDIA publishes no datasheet for this part; its
    # bandwidth is taken at the per-stack rate of the H100 PCIe's five HBM2e stacks (2.0 TB/s for
    # 80 GB, H100 datasheet): 6/5 × 2.0 = 2.4 TB/s. The 500 W cap (the SXM5's is 700 W) lowers the
    # sustained clock under load, which the peaks (at boost clock) do not show: the per-preset
    # calibration's GEMM and attention efficiencies carry it.
    "h100-96gb-hbm2e": dataclasses.replace(
        _H100_SXM,
        name="h100-96gb-hbm2e",
        memory_bytes=96 * GiB,  # six 16 GiB stacks, as the 80 GB parts have five
        memory_bandwidth_Bps=2400 * GB,
    ),
    # NVIDIA H200 SXM datasheet (2024): same compute as H100 SXM; 141 GB HBM3e at 4.8 TB/s.
    "h200": dataclasses.replace(_H100_SXM, name="h200", memory_bytes=141 * GB, memory_bandwidth_Bps=4800 * GB),
    # Uncalibrated stand-in for a small x86 server core pair; `paratrain calibrate` replaces it
    # with figures measured on this machine (stored at ~/.cache/paratrain/cpu.json).
    "cpu": DeviceSpec(
        name="cpu",
        peak_fp32_flops=50e9,
        peak_bf16_flops=0.0,
        memory_bytes=16 * GiB,
        memory_bandwidth_Bps=10 * GB,
        sm_count=2,
        gemm_tile_m=16,
        gemm_tile_n=16,
        gemm_tile_k=16,
        gemm_efficiency=1.0,
        memory_efficiency=1.0,
        kernel_overhead_s=10e-6,
        # torch's SDPA runs fused flash-attention kernels on a CPU too; 0.43-0.58 of the best GEMM's
        # rate in `paratrain calibrate --procs 4 --threads 1` on a 2-core x86 host (2026-11-25)
        fused_attention=True,
        attention_efficiency=0.45,
    ),
}

DEVICE_ALIASES = {
    "a100": "a100-80gb",
    "h100-sxm": "h100",
    "h100-80gb": "h100",
    "h100-sxm-80gb": "h100",
    "h100-hbm2e-500w": "h100-96gb-hbm2e",
    "h200-sxm": "h200",
    "v100-32gb": "v100",
    "p100-16gb": "p100",
}

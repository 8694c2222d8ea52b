"""Data-parallel gradient reduction at scale: what it moves, how much of it bucketing hides, and the
wait for the slowest of many ranks.

**Bytes reduced.** Megatron-LM reduces bf16 gradients in fp32: "bfloat16 requires gradient
accumulation and all-reduce to be done in fp32" (``megatron/arguments.py``, ``validate_args``:
``accumulate_allreduce_grads_in_fp32`` is forced on with ``--bf16``; Megatron-Core passes it on as
``DistributedDataParallelConfig.grad_reduce_in_fp32``). PyTorch AMP keeps fp32 parameters, so its
gradients are fp32 as well. fp16 runs reduce in fp16 (Megatron's default for ``--fp16``). The
distributed optimizer's parameter all-gather moves the 16-bit parameters.

**Bucketing** (Megatron-Core ``DistributedDataParallel`` with ``overlap_grad_reduce``; PyTorch DDP
likewise): gradients are grouped in buckets of ``max(40,000,000, 1,000,000 · dp)`` elements
(Megatron-Core ``DistributedDataParallelConfig.bucket_size`` docstring, core v0.7), and a bucket's
reduction is launched as soon as the backward has produced all of its gradients. With the backward
producing gradients at a steady rate over ``compute_s`` and ``k`` equal buckets each reducing in
``comm_s / k`` on one communication stream, bucket ``i`` is ready at ``i · compute_s / k`` and the
stream finishes the last one at ``max(compute_s + comm_s/k, compute_s/k + comm_s)``: only the last
bucket is exposed when the stream keeps up, else all but the first bucket's share of the compute
(:func:`bucketed_exposed_s`). ``overlap_param_gather`` is the mirror image: the distributed
optimizer's all-gather of bucket ``i`` is issued ahead of the forward that needs it, so the first
bucket is exposed before the forward starts. vTrain's runs (``use_gradient_bucket: false``) reduce
after the backward, unbucketed: that path does not use this module.

**Interference.** Communication that overlaps compute is not free: the collective's kernels take
streaming multiprocessors and memory bandwidth from the GEMMs beside them. Measured on A100, H100,
MI250 and MI210 with GPT and Llama layers, compute overlapped with collectives runs 18.9 % slower on
average (40 % at most) than alone (arXiv 2507.03114, "Characterizing Compute-Communication Overlap in
GPU-Accelerated Distributed Deep Learning", abstract): :data:`OVERLAP_SLOWDOWN`.
:func:`overlapped_s` is the time of ``compute_s`` of work run beside ``comm_s`` of communication:
while the collective runs the compute advances at ``1 / (1 + slowdown)`` of its rate.

**Skew.** A synchronous collective over ``N`` ranks starts when the last rank arrives. If the ranks'
compute times between synchronisations are independent with standard deviation ``cv · t``, the
expected wait of the mean rank for the slowest is at most ``cv · t · sqrt(2 ln N)`` (the expected
maximum of ``N`` standard normal draws is below ``sqrt(2 ln N)`` and approaches it as ``N`` grows;
e.g. David & Nagaraja, "Order Statistics", 3rd ed., sec. 4.4). :data:`RANK_CV` = 1 % follows from
Sinha et al. 2022 ("Not All GPUs Are Created Equal", SC'22): identical data-centre GPUs differ in
performance by 8 % on average across a cluster; for the range of a few thousand normal draws,
``2 · sqrt(2 ln N_c) ≈ 8`` standard deviations, so one standard deviation is about 1 %. MegaScale
(Jiang et al., NSDI'24, sec. 6.3) describes the mechanism at 10,000+ GPUs: the data-parallel
reduce-scatter waits for the ranks that launch it last.
"""

from __future__ import annotations

import math

from paratrain.errors import ConfigError
from paratrain.spec.device import DeviceSpec

__all__ = [
    "MEGATRON_MIN_BUCKET_ELEMENTS",
    "OVERLAP_SLOWDOWN",
    "RANK_CV",
    "bucketed_exposed_s",
    "default_overlap_slowdown",
    "default_skew_cv",
    "grad_reduce_bytes",
    "megatron_bucket_elements",
    "num_buckets",
    "overlapped_s",
    "skew_s",
]

MEGATRON_MIN_BUCKET_ELEMENTS = 40_000_000  # Megatron-Core default bucket (module docstring)
_PER_RANK_BUCKET_ELEMENTS = 1_000_000  # ... grown with the data-parallel size
RANK_CV = 0.01  # per-rank compute-time standard deviation / mean (module docstring: Sinha et al. 2022)
OVERLAP_SLOWDOWN = 0.189  # compute slowdown beside a collective (module docstring: arXiv 2507.03114)
_REDUCE_BYTES = {"bf16": 4, "fp16": 2, "fp32": 4}


def _check(name: str, value: float) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        raise ConfigError(name, f"must be a non-negative number, got {value!r}", f"give a finite {name} >= 0")


def grad_reduce_bytes(grad_bytes: float, dtype: str) -> float:
    """Bytes the data-parallel reduction moves for ``grad_bytes`` of ``dtype`` gradients (fp32 for
    bf16 training, as Megatron-LM and AMP reduce them; module docstring)."""
    _check("grad_bytes", grad_bytes)
    if dtype not in _REDUCE_BYTES:
        raise ConfigError("dtype", f"unknown training dtype {dtype!r}", f"use one of: {', '.join(_REDUCE_BYTES)}")
    per = {"bf16": 2, "fp16": 2, "fp32": 4}[dtype]
    return grad_bytes * _REDUCE_BYTES[dtype] / per


def megatron_bucket_elements(dp: int) -> int:
    """Megatron-Core's default gradient bucket size in elements for a data-parallel size ``dp``."""
    if isinstance(dp, bool) or not isinstance(dp, int) or dp < 1:
        raise ConfigError("dp", f"must be a positive integer, got {dp!r}", "give dp >= 1")
    return max(MEGATRON_MIN_BUCKET_ELEMENTS, _PER_RANK_BUCKET_ELEMENTS * dp)


def num_buckets(elements: float, bucket_elements: int) -> int:
    """Buckets needed for ``elements`` gradients (at least one)."""
    _check("elements", elements)
    if bucket_elements < 1:
        raise ConfigError("bucket_elements", f"must be positive, got {bucket_elements}", "give a bucket size >= 1")
    return max(1, math.ceil(elements / bucket_elements))


def bucketed_exposed_s(compute_s: float, comm_s: float, buckets: int) -> float:
    """Communication left exposed after ``compute_s`` of compute that produces (or, for the parameter
    all-gather, consumes) ``buckets`` equal buckets at a steady rate, ``comm_s`` being the unbucketed
    collective's time: ``max(comm_s / k, comm_s − compute_s · (k − 1) / k)`` (module docstring).
    One bucket exposes everything."""
    _check("compute_s", compute_s)
    _check("comm_s", comm_s)
    if isinstance(buckets, bool) or not isinstance(buckets, int) or buckets < 1:
        raise ConfigError("buckets", f"must be a positive integer, got {buckets!r}", "give at least one bucket")
    k = buckets
    return max(comm_s / k, comm_s - compute_s * (k - 1) / k)


def skew_s(busy_s: float, ranks: int, cv: float = RANK_CV) -> float:
    """Expected wait, at a synchronisation of ``ranks`` ranks, for the slowest of them after
    ``busy_s`` of compute each: ``cv · busy_s · sqrt(2 ln ranks)`` (module docstring)."""
    _check("busy_s", busy_s)
    _check("cv", cv)
    if isinstance(ranks, bool) or not isinstance(ranks, int) or ranks < 1:
        raise ConfigError("ranks", f"must be a positive integer, got {ranks!r}", "give ranks >= 1")
    return cv * busy_s * math.sqrt(2.0 * math.log(ranks))


def overlapped_s(compute_s: float, comm_s: float, slowdown: float = OVERLAP_SLOWDOWN) -> float:
    """Time of ``compute_s`` of compute run beside ``comm_s`` of communication (module docstring):
    ``comm_s`` if the compute, slowed by ``1 + slowdown``, ends first, else
    ``compute_s + comm_s · slowdown / (1 + slowdown)`` (the work it lost while the collective ran).
    ``slowdown`` 0 gives ``max(compute_s, comm_s)``."""
    _check("compute_s", compute_s)
    _check("comm_s", comm_s)
    _check("slowdown", slowdown)
    if compute_s * (1 + slowdown) <= comm_s:
        return comm_s
    return compute_s + comm_s * slowdown / (1 + slowdown)


def default_skew_cv(device: DeviceSpec) -> float:
    """:data:`RANK_CV` for an accelerator preset whose durations the simulator takes as modelled
    (``duration_cv`` 0); 0 where the durations are drawn around a measured variation instead (a
    calibrated CPU) or for the uncalibrated CPU preset, which the GPU figure does not describe."""
    return RANK_CV if device.duration_cv == 0 and device.name != "cpu" else 0.0


def default_overlap_slowdown(device: DeviceSpec) -> float:
    """:data:`OVERLAP_SLOWDOWN` on the accelerators it was measured on; 0 on the CPU, where gloo's
    collectives run on host threads that the measurement does not describe."""
    return 0.0 if device.name == "cpu" else OVERLAP_SLOWDOWN

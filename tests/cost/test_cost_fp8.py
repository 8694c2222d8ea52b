"""FP8 linear layers in the cost model: GEMMs at the FP8 peak, the cast kernels' bytes, and the
devices without FP8 tensor cores."""

from __future__ import annotations

import dataclasses

import pytest

from paratrain.cost.compute import layer_ops, op_kernels, op_time_split
from paratrain.cost.fp8 import fp8_cast_bytes
from paratrain.cost.gemm import gemm_efficiency, gemm_k_step, gemm_peak_flops
from paratrain.cost.stage import chunk_costs
from paratrain.errors import ConfigError
from paratrain.parallel.config import ParallelConfig
from paratrain.spec.cluster import resolve_cluster
from paratrain.spec.device import resolve_device
from paratrain.spec.model import Activation, ModelSpec, Norm, Position

H100 = resolve_device("h100")
A100 = resolve_device("a100-80gb")
LLAMA = ModelSpec(layers=4, hidden=4096, heads=32, kv_heads=8, ffn=14336, seq=8192, vocab=128256, name="llama-8b-ish",
                  dtype="bf16", norm=Norm.RMSNORM, activation=Activation.SWIGLU, position=Position.ROTARY,
                  tied_embeddings=False, bias=False)


def test_h100_fp8_peak_is_the_datasheet_dense_figure_and_twice_bf16():
    # H100 SXM5 datasheet: FP8 3,958 TFLOP/s with sparsity = 1,979 dense; BF16 989.5 dense.
    assert gemm_peak_flops(H100, "fp8") == pytest.approx(1979e12)
    assert gemm_peak_flops(H100, "fp8") == pytest.approx(2 * gemm_peak_flops(H100, "bf16"), rel=1e-3)
    assert resolve_device("h100-96gb-hbm2e").peak_fp8_flops == H100.peak_fp8_flops


def test_fp8_gemm_time_is_the_roofline_at_the_fp8_peak():
    # A large, tile-aligned GEMM: m, n multiples of the 256×128 tile filling whole waves of 132 SMs,
    # k a multiple of the FP8 K step (128). Shape efficiency = k/(k + 2·128) (the epilogue).
    m, n, k = 256 * 132, 128 * 8, 8192
    assert gemm_k_step(H100, "fp8") == 2 * gemm_k_step(H100, "bf16") == 128
    shape = k / (k + 2 * 128)
    assert gemm_efficiency(m, n, k, H100, dtype="fp8") == pytest.approx(shape * H100.gemm_efficiency)
    (fc2,) = [op for op in layer_ops(LLAMA, microbatch=1, gemm_dtype="fp8") if op.name == "fc2"]
    tm, tn, tk = fc2.gemm
    assert fc2.dtype == "fp8"
    # bytes: one-byte inputs, the bf16 output
    assert fc2.fwd_bytes == (tm * tk + tk * tn) * 1 + tm * tn * 2
    fwd, _, _ = op_time_split(fc2, H100, "bf16")
    flops = 2.0 * tm * tn * tk
    compute = flops / (1979e12 * gemm_efficiency(tm, tn, tk, H100, dtype="fp8"))
    memory = fc2.fwd_bytes / (H100.memory_bandwidth_Bps * H100.memory_efficiency)
    assert fwd == pytest.approx(max(compute, memory) + H100.kernel_overhead_s)
    assert compute > memory  # 8192 tokens × 4096 × 14336: compute-bound


def test_fp8_doubles_the_rate_of_a_compute_bound_gemm_but_not_of_the_rest():
    bf16 = {op.name: op for op in layer_ops(LLAMA, microbatch=1, attention="flash")}
    fp8 = {op.name: op for op in layer_ops(LLAMA, microbatch=1, attention="flash", gemm_dtype="fp8")}
    for name in ("qkv", "attn_proj", "fc1", "fc2"):
        t16 = op_time_split(bf16[name], H100, "bf16")[0] - H100.kernel_overhead_s
        t8 = op_time_split(fp8[name], H100, "bf16")[0] - H100.kernel_overhead_s
        # twice the peak; the FP8 K step changes the short-K penalty a little (k/(k+2·tk))
        assert 1.9 < t16 / t8 <= 2.0, name
        assert f"{name}_fp8_cast" in fp8 and f"{name}_fp8_cast" not in bf16
    # attention, norms and the activation stay as they were
    for name in ("flash_attention", "ln_1", "ln_2", "swiglu"):
        assert op_time_split(fp8[name], H100, "bf16") == op_time_split(bf16[name], H100, "bf16")


def _cast_bytes_by_hand(x: int, w: int, y: int, e: int, delayed: bool, fused: bool) -> tuple[int, int]:
    """Tensor by tensor: amax pass (current scaling only) + cast (+ transposed copies)."""
    fwd = bwd = 0
    for n in (x, w):  # the forward casts the input and the weight
        fwd += 0 if delayed else n * e  # amax: read
        fwd += n * e + n  # cast: read bf16, write fp8
        fwd += n if fused else 0  # the transposed copy written by the same kernel
    bwd += (0 if delayed else y * e) + y * e + y + (y if fused else 0)  # output gradient
    if not fused:  # separate transposes of W (input gradient), x and dy (weight gradient): read 1, write 1
        bwd += 2 * w + 2 * x + 2 * y
    return fwd, bwd


@pytest.mark.parametrize("delayed", [False, True])
@pytest.mark.parametrize("fused", [False, True])
def test_cast_pass_bytes_match_a_tensor_by_tensor_count(delayed, fused):
    x, w, y = 8192 * 4096, 4096 * 14336, 8192 * 14336
    assert fp8_cast_bytes(x, w, y, 2, delayed=delayed, fused=fused) == _cast_bytes_by_hand(x, w, y, 2, delayed, fused)


def test_cast_op_of_a_layer_uses_its_gemm_shape_and_counts_its_kernels():
    ops = {op.name: op for op in layer_ops(LLAMA, microbatch=2, fused=True, gemm_dtype="fp8-delayed")}
    m, n, k = ops["fc1"].gemm  # tokens × (2·ffn) · hidden
    assert (m, n, k) == (2 * 8192, 2 * 14336, 4096)
    cast = ops["fc1_fp8_cast"]
    assert (cast.fwd_bytes, cast.bwd_bytes) == fp8_cast_bytes(m * k, k * n, m * n, 2, delayed=True, fused=True)
    assert op_kernels(cast) == (2, 1, 0)  # cast x and W; cast dy (delayed scaling: no amax pass)
    current = {op.name: op for op in layer_ops(LLAMA, microbatch=2, fused=False, gemm_dtype="fp8")}["fc1_fp8_cast"]
    assert op_kernels(current) == (4, 2 + 3, 0)  # amax + cast each; then three transposes
    assert current.fwd_flops == 0  # memory passes only


def test_fp8_in_a_parallel_config_makes_an_h100_step_faster_and_mfu_flops_unchanged():
    cluster = resolve_cluster("dgx-h100").resized(gpus=8)
    base = ParallelConfig(dp=8, microbatch=1, global_batch=8)
    (bf16,) = chunk_costs(LLAMA, cluster, base)
    (fp8,) = chunk_costs(LLAMA, cluster, dataclasses.replace(base, gemm_dtype="fp8"))
    assert fp8.forward_s < bf16.forward_s
    assert fp8.model_flops == bf16.model_flops  # the same model FLOPs, faster


def test_fp8_on_a100_is_a_config_error():
    with pytest.raises(ConfigError) as err:
        gemm_peak_flops(A100, "fp8")
    assert err.value.field == "gemm_dtype" and "no FP8" in err.value.problem
    cluster = resolve_cluster("dgx-a100").resized(gpus=8)
    with pytest.raises(ConfigError, match="FP8"):
        chunk_costs(LLAMA, cluster, ParallelConfig(dp=8, microbatch=1, global_batch=8, gemm_dtype="fp8"))


def test_unknown_gemm_dtype_is_a_config_error():
    with pytest.raises(ConfigError) as err:
        ParallelConfig(gemm_dtype="fp4")
    assert err.value.field == "gemm_dtype"

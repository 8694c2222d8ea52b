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


def _cast_bytes_by_hand(x: int, w: int, y: int, e: int, delayed: bool, fused: bool,
                        reuse: int = 1) -> tuple[float, float]:
    """Tensor by tensor: amax pass (current scaling only) + cast (+ transposed copies). A weight
    cast that serves ``reuse`` forward passes is charged 1/reuse of its bytes in each."""
    fwd = bwd = 0.0
    for n, share in ((x, 1), (w, reuse)):  # the forward casts the input and the weight
        fwd += (0 if delayed else n * e) / share  # amax: read
        fwd += (n * e + n) / share  # cast: read bf16, write fp8
        fwd += (n if fused else 0) / share  # the transposed copy written by the same kernel
    bwd += (0 if delayed else y * e) + y * e + y + (y if fused else 0)  # output gradient
    if not fused:  # separate transposes of W (input gradient), x and dy (weight gradient): read 1, write 1
        bwd += 2 * w / reuse + 2 * x + 2 * y
    return fwd, bwd


@pytest.mark.parametrize("delayed", [False, True])
@pytest.mark.parametrize("fused", [False, True])
def test_cast_pass_bytes_match_a_tensor_by_tensor_count(delayed, fused):
    x, w, y = 8192 * 4096, 4096 * 14336, 8192 * 14336
    assert fp8_cast_bytes(x, w, y, 2, delayed=delayed, fused=fused) == _cast_bytes_by_hand(x, w, y, 2, delayed, fused)


@pytest.mark.parametrize("delayed", [False, True])
@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("reuse", [2, 16, 128])
def test_a_cached_weight_cast_is_shared_by_the_passes_it_serves(delayed, fused, reuse):
    x, w, y = 8192 * 4096, 4096 * 14336, 8192 * 14336
    got = fp8_cast_bytes(x, w, y, 2, delayed=delayed, fused=fused, weight_reuse=reuse)
    assert got == pytest.approx(_cast_bytes_by_hand(x, w, y, 2, delayed, fused, reuse), rel=1e-15)
    # ``reuse`` passes together cast the weight exactly once: their bytes beyond the input's and
    # the output gradient's casts add up to one uncached pass's weight share
    no_weight = fp8_cast_bytes(x, 0, y, 2, delayed=delayed, fused=fused)
    once = fp8_cast_bytes(x, w, y, 2, delayed=delayed, fused=fused)
    for i in (0, 1):
        assert reuse * (got[i] - no_weight[i]) == pytest.approx(once[i] - no_weight[i], rel=1e-12)


def test_weight_reuse_must_be_a_positive_whole_number():
    for bad in (0, -2, 1.5, True):
        with pytest.raises(ConfigError) as err:
            fp8_cast_bytes(8, 8, 8, 2, delayed=False, fused=True, weight_reuse=bad)
        assert err.value.field == "weight_reuse"


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
    # cached weights: a forward launches the input's cast alone, the backward no weight transpose
    cached = {op.name: op for op in layer_ops(LLAMA, microbatch=2, fused=False, gemm_dtype="fp8",
                                              fp8_weight_reuse=8)}["fc1_fp8_cast"]
    assert op_kernels(cached) == (2, 2 + 2, 0)
    assert (cached.fwd_bytes, cached.bwd_bytes) == pytest.approx(
        fp8_cast_bytes(m * k, k * n, m * n, 2, delayed=False, fused=False, weight_reuse=8))


@pytest.mark.parametrize("recompute", ["none", "selective", "full"])
def test_with_the_weight_cache_a_step_casts_each_weight_once(recompute):
    # m micro-batches; full recomputation runs every layer's forward twice per micro-batch, and
    # both passes use the cached weights: each pass is charged 1/(m·passes) of the cast.
    from paratrain.cost.stage import fp8_weight_reuse

    m = 12
    cfg = ParallelConfig(dp=8, microbatch=1, global_batch=8 * m, gemm_dtype="fp8", fp8_weight_cache=True,
                         recompute=recompute, attention="flash")
    passes = 2 if recompute == "full" else 1
    assert fp8_weight_reuse(cfg) == m * passes
    assert fp8_weight_reuse(dataclasses.replace(cfg, fp8_weight_cache=False)) == 1
    ops = {op.name: op for op in layer_ops(LLAMA, gemm_dtype="fp8", attention="flash",
                                           fp8_weight_reuse=fp8_weight_reuse(cfg))}
    plain = {op.name: op for op in layer_ops(LLAMA, gemm_dtype="fp8", attention="flash")}
    for name in ("qkv", "attn_proj", "fc1", "fc2"):
        mm, nn, kk = plain[name].gemm
        weight_once = plain[f"{name}_fp8_cast"].fwd_bytes - fp8_cast_bytes(mm * kk, 0, mm * nn, 2, delayed=False,
                                                                           fused=False)[0]
        per_step = m * passes * (ops[f"{name}_fp8_cast"].fwd_bytes - (plain[f"{name}_fp8_cast"].fwd_bytes
                                                                      - weight_once))
        assert per_step == pytest.approx(weight_once, rel=1e-12)


def test_the_weight_cache_makes_a_step_faster_and_changes_nothing_for_a_single_pass():
    cluster = resolve_cluster("dgx-h100").resized(gpus=8)
    many = ParallelConfig(dp=8, microbatch=1, global_batch=64, gemm_dtype="fp8", attention="flash")
    (uncached,) = chunk_costs(LLAMA, cluster, many, fused=True)
    (cached,) = chunk_costs(LLAMA, cluster, dataclasses.replace(many, fp8_weight_cache=True), fused=True)
    assert cached.forward_s < uncached.forward_s
    assert cached.backward_s == uncached.backward_s  # the output gradient's cast is not cached
    assert cached.model_flops == uncached.model_flops
    # unfused casts transpose the weight in the backward: that copy is cached too
    (uncached,) = chunk_costs(LLAMA, cluster, many)
    (cached,) = chunk_costs(LLAMA, cluster, dataclasses.replace(many, fp8_weight_cache=True))
    assert cached.forward_s < uncached.forward_s and cached.backward_s < uncached.backward_s
    one = ParallelConfig(dp=8, microbatch=1, global_batch=8, gemm_dtype="fp8", attention="flash")
    (cached_one,) = chunk_costs(LLAMA, cluster, dataclasses.replace(one, fp8_weight_cache=True))
    (plain_one,) = chunk_costs(LLAMA, cluster, one)
    # one micro-batch, no recomputation: the one cast is the cached one; only the cache's memory differs
    assert dataclasses.replace(cached_one, fp8_cache_bytes=0) == plain_one and cached_one.fp8_cache_bytes > 0


@pytest.mark.parametrize("tp", [1, 2])
def test_the_weight_cache_holds_each_linear_weight_and_its_transpose_in_fp8(tp):
    # Llama-shaped layer: QKV h x (h + 2 kv_heads head_dim), projection h x h, gate+up h x 2 ffn,
    # down ffn x h, split over tp; one byte an element for the FP8 copy and one for its transpose.
    from paratrain.sim import simulate_config

    h, hd, ffn = 4096, 4096 // 32, 14336
    per_layer = 2 * (h * (h + 2 * 8 * hd) + h * h + h * 2 * ffn + ffn * h) // tp
    cluster = resolve_cluster("dgx-h100").resized(gpus=8)
    base = ParallelConfig(dp=8 // (2 * tp), tp=tp, pp=2, microbatch=1, global_batch=16, gemm_dtype="fp8",
                          attention="flash", sequence_parallel=tp > 1)
    cached = dataclasses.replace(base, fp8_weight_cache=True)
    costs = chunk_costs(LLAMA, cluster, cached)
    assert [c.fp8_cache_bytes for c in costs] == [2 * per_layer, 2 * per_layer]  # 4 layers on 2 stages
    assert all(c.fp8_cache_bytes == 0 for c in chunk_costs(LLAMA, cluster, base))
    assert all(c.static_bytes == c.weight_bytes + c.grad_bytes + c.optimizer_bytes + c.fp8_cache_bytes for c in costs)
    from paratrain.plan.analytic import RankStats  # the planner's memory filter counts the cache too

    assert RankStats.of(costs, 2).static == tuple(float(c.static_bytes) for c in costs)
    with_cache, without = simulate_config(LLAMA, cluster, cached), simulate_config(LLAMA, cluster, base)
    assert [m.fp8_weight_cache_bytes for m in with_cache.memory] == [2 * per_layer] * 2
    assert [a - b for a, b in zip(with_cache.memory_by_rank, without.memory_by_rank, strict=True)] == \
        [2 * per_layer] * 2


def test_the_weight_cache_needs_fp8_linear_layers():
    with pytest.raises(ConfigError) as err:
        ParallelConfig(fp8_weight_cache=True)
    assert err.value.field == "fp8_weight_cache" and "--gemm-dtype" in err.value.fix
    with pytest.raises(ConfigError) as err:
        ParallelConfig(gemm_dtype="fp8", fp8_weight_cache="yes")
    assert err.value.field == "fp8_weight_cache"
    assert ParallelConfig.from_dict({"gemm_dtype": "fp8-delayed", "fp8_weight_cache": True}).fp8_weight_cache


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

"""FLOPs of the operator model against the published closed forms and an independent count."""

from __future__ import annotations

import dataclasses

import pytest
from tests.spec.test_gemma_geglu import GEMMA_7B

from paratrain.cost.compute import (
    embedding_ops,
    head_ops,
    layer_ops,
    op_time,
    op_time_split,
)
from paratrain.cost.flops import (
    elementwise_flops_per_iteration,
    matmul_flops_per_iteration,
    model_flops_per_iteration,
)
from paratrain.errors import ConfigError
from paratrain.spec.device import resolve_device
from paratrain.spec.model import from_hf_config, preset

GPT3 = ["gpt3-125m", "gpt3-350m", "gpt3-760m", "gpt3-1.3b", "gpt3-2.7b", "gpt3-6.7b", "gpt3-13b", "gpt3-175b"]
TOL = 1e-3  # the bound: < 0.1 %


def closed_form(model, batch: int, full_recompute: bool) -> float:
    """Narayanan et al. 2021 (appendix), eq. for forward + backward (+ recomputation) FLOPs."""
    B, s, L, h, V = batch, model.seq, model.layers, model.hidden, model.vocab  # noqa: N806 (paper's symbols)
    if full_recompute:
        return 96 * B * s * L * h * h * (1 + s / (6 * h) + V / (16 * L * h))
    return 72 * B * s * L * h * h * (1 + s / (6 * h) + V / (12 * L * h))


@pytest.mark.parametrize("name", GPT3)
@pytest.mark.parametrize("batch", [1, 512, 1536])
def test_matmul_flops_equal_closed_form(name: str, batch: int) -> None:
    m = preset(name)
    got = matmul_flops_per_iteration(m, batch, "none")
    assert abs(got / closed_form(m, batch, False) - 1) < TOL
    got_full = matmul_flops_per_iteration(m, batch, "full")
    assert abs(got_full / closed_form(m, batch, True) - 1) < TOL
    assert model_flops_per_iteration(m, batch) == got


def test_closed_form_is_matched_exactly_not_just_within_tolerance() -> None:
    # For MHA with f = 4h the operator sum is the closed form term by term.
    m = preset("gpt3-175b")
    assert matmul_flops_per_iteration(m, 8) == pytest.approx(closed_form(m, 8, False), rel=1e-12)
    assert matmul_flops_per_iteration(m, 8, "full") == pytest.approx(closed_form(m, 8, True), rel=1e-12)


@pytest.mark.parametrize("name", ["llama2-70b", "llama3-8b", "bert-large", "gpt2-xl", "llama2-7b"])
def test_matmul_flops_from_parameter_count(name: str) -> None:
    """Independent count: forward matmul FLOPs = 2 · tokens · (matrix parameters the token passes
    through) + attention's 4·s·h per token per layer; backward is twice the forward."""
    m = preset(name)
    s, h = m.seq, m.hidden
    matrix_params_layer = m.params_per_layer() - 2 * m.norm_params()
    if m.bias:
        gates = 2 if m.activation.value == "swiglu" else 1
        matrix_params_layer -= h + 2 * m.kv_dim + h + gates * m.ffn_size + h
    head_matrix = m.vocab * h + (h * h if m.arch.value == "bert" else 0)
    fwd = s * (m.layers * (2 * matrix_params_layer + 4 * s * h) + 2 * head_matrix)
    assert matmul_flops_per_iteration(m, 1) == pytest.approx(3 * fwd, rel=1e-12)


def test_selective_recompute_adds_attention_core_only() -> None:
    m = preset("gpt3-13b")
    extra = matmul_flops_per_iteration(m, 4, "selective") - matmul_flops_per_iteration(m, 4, "none")
    assert extra == pytest.approx(4 * 4 * m.seq**2 * m.hidden * m.layers, rel=1e-12)


def test_elementwise_flops_reported_apart() -> None:
    """GPT-3 175B (LayerNorm, GeLU, biases, dropout), per token, forward, from the per-element
    counts of cost.elementwise (LayerNorm 7, scale+mask 2, softmax 5, dropout 2, GeLU 8):
    a layer: two LayerNorms 2·7h, the fc1 bias and GeLU (1 + 8)·4h, two residual adds with their
    bias and dropout 2·(1 + 2 + 1)h, 58h in all; scale+mask, softmax and dropout over the a·s
    scores, 9as; the backward twice that. Ends: the token embedding's gradient h (backward only), the position add h and
    its gradient 2h, embedding dropout 2h + 4h, the final LayerNorm 7h + 14h, the loss 5V + 2V."""
    m = preset("gpt3-175b")
    s, h, a, v, layers = m.seq, m.hidden, m.heads, m.vocab, m.layers
    per_token = 3 * layers * (58 * h + 9 * a * s) + (h + 3 * h + 6 * h + 21 * h) + 7 * v
    assert elementwise_flops_per_iteration(m, 3) == 3 * s * per_token
    ops = layer_ops(m) + embedding_ops(m) + head_ops(m)
    assert 0 < elementwise_flops_per_iteration(m, 1) < 0.01 * matmul_flops_per_iteration(m, 1)
    assert all(not o.is_matmul for o in ops if o.kind != "gemm")


@pytest.mark.parametrize("tp", [1, 2, 4, 8])
@pytest.mark.parametrize("sp", [False, True])
def test_tensor_parallel_ranks_split_the_matmul_flops(tp: int, sp: bool) -> None:
    m = preset("gpt3-6.7b")
    one = sum(o.fwd_flops for o in layer_ops(m, microbatch=2) if o.is_matmul)
    per_rank = sum(o.fwd_flops for o in layer_ops(m, tp=tp, sequence_parallel=sp, microbatch=2) if o.is_matmul)
    assert per_rank * tp == pytest.approx(one, rel=1e-12)


def test_gqa_splits_kv_heads_then_replicates() -> None:
    m = preset("llama2-70b")  # 64 heads, 8 kv heads, head size 128
    qkv = {o.name: o for o in layer_ops(m, tp=8)}["qkv"]
    assert qkv.gemm[1] == 8192 // 8 + 2 * 128
    qkv16 = {o.name: o for o in layer_ops(m, tp=16)}["qkv"]
    assert qkv16.gemm[1] == 8192 // 16 + 2 * 128  # one kv head per rank, replicated


def test_fused_kernels_move_fewer_bytes_same_flops() -> None:
    m = preset("gpt3-1.3b")
    plain, fused = layer_ops(m, microbatch=4), layer_ops(m, microbatch=4, fused=True)
    assert sum(o.fwd_flops for o in plain) == pytest.approx(sum(o.fwd_flops for o in fused))
    assert sum(o.fwd_bytes for o in fused) < sum(o.fwd_bytes for o in plain)
    assert len(fused) < len(plain)


def test_roofline_time_is_max_of_compute_and_memory_plus_overhead() -> None:
    dev = resolve_device("a100-80gb")
    m = preset("gpt3-175b")
    ops = {o.name: o for o in layer_ops(m, microbatch=1)}
    gelu = ops["gelu"]
    assert op_time(gelu, dev, "bf16") == pytest.approx(
        gelu.fwd_bytes / (dev.memory_bandwidth_Bps * dev.memory_efficiency) + dev.kernel_overhead_s
    )
    from paratrain.cost.gemm import gemm_efficiency

    fc1 = ops["fc1"]
    m_, n_, k_ = fc1.gemm
    expect = fc1.fwd_flops / (dev.peak_flops("bf16") * gemm_efficiency(m_, n_, k_, dev)) + dev.kernel_overhead_s
    assert op_time(fc1, dev, "bf16") == pytest.approx(expect)
    fwd, bwd_in, bwd_w = op_time_split(fc1, dev, "bf16")
    assert op_time(fc1, dev, "bf16", backward=True) == pytest.approx(bwd_in + bwd_w)
    assert bwd_w > 0 and bwd_in > 0
    scores = ops["attn_scores"]
    assert op_time_split(scores, dev, "bf16")[2] == 0.0  # no weights: all input gradient


def test_layer_ops_rejects_bad_placements() -> None:
    m = preset("gpt3-175b")
    with pytest.raises(ConfigError, match="tp"):
        layer_ops(m, tp=5)
    with pytest.raises(ConfigError, match="microbatch"):
        layer_ops(m, microbatch=0)
    with pytest.raises(ConfigError, match="sequence"):
        layer_ops(dataclasses.replace(m, seq=2047, max_positions=None), tp=8, sequence_parallel=True)
    with pytest.raises(ConfigError, match="global_batch"):
        matmul_flops_per_iteration(m, 0)


def test_gated_gelu_mlp_flops_by_hand() -> None:
    """Gemma-7B (GeGLU, 16 heads of 256 beside hidden 3072), one sequence of T = 8192 tokens: the
    forward runs x·W_gate and x·W_up (one fc1 GEMM of width 2f), tanh-GeLU of the gate and the
    product (8 + 1 FLOPs an element), then ·W_down: 2·T·h·2f + 2·T·f·h = 6·T·h·f, against 4·T·h·f
    for a non-gated MLP of the same f. Attention: Q, K, V and the projection are 4096 wide, the
    core 4·T·s·(a·d). Backward twice the forward."""
    m = from_hf_config(GEMMA_7B)
    t, s, h, f, q, v, layers = 8192, 8192, 3072, 24576, 4096, 256000, 28
    ops = {o.name: o for o in layer_ops(m, microbatch=1)}
    assert ops["fc1"].fwd_flops == 2 * t * h * 2 * f
    assert ops["fc2"].fwd_flops == 2 * t * f * h
    assert ops["geglu"].fwd_flops == 9 * t * f and "gelu" not in ops
    plain = {o.name: o for o in layer_ops(dataclasses.replace(m, activation="gelu"), microbatch=1)}
    assert plain["fc1"].fwd_flops + plain["fc2"].fwd_flops == 4 * t * h * f
    layer_fwd = 2 * t * (h * 3 * q + q * h) + 4 * t * s * q + 6 * t * h * f
    assert matmul_flops_per_iteration(m, 1) == pytest.approx(3 * (layers * layer_fwd + 2 * t * v * h), rel=1e-12)

"""Memory model against Korthikanti et al. 2022 and mixed-precision Adam byte counts."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from paratrain.cost.memory import (
    activation_bytes_per_layer,
    activation_terms,
    optimizer_bytes,
    static_memory,
)
from paratrain.errors import ConfigError
from paratrain.spec.model import ModelSpec, preset

# Shapes of Korthikanti et al. 2022, Table 3 (22B, 175B, 530B, 1T), and GPT-3 13B.
SHAPES = [
    dict(layers=48, hidden=6144, heads=64, seq=2048, vocab=51200),
    dict(layers=96, hidden=12288, heads=96, seq=2048, vocab=51200),
    dict(layers=105, hidden=20480, heads=128, seq=2048, vocab=51200),
    dict(layers=128, hidden=25600, heads=160, seq=2048, vocab=51200),
    dict(layers=40, hidden=5120, heads=40, seq=2048, vocab=51200),
]


def _m(shape: dict) -> ModelSpec:
    return ModelSpec(**shape, dtype="bf16")  # GPT: learned positions, dropout, GELU, 4h FFN


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("b", [1, 4])
def test_no_parallelism(shape: dict, b: int) -> None:
    m = _m(shape)
    s, h, a = m.seq, m.hidden, m.heads
    assert activation_bytes_per_layer(m, microbatch=b) == s * b * h * 34 + 5 * a * s * s * b


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("t", [1, 2, 4, 8])
def test_tensor_parallel(shape: dict, t: int) -> None:
    m, b = _m(shape), 2
    s, h, a = m.seq, m.hidden, m.heads
    # sbh(10 + 24/t + 5as/(ht)), multiplied through by t to stay in integers
    expect_times_t = s * b * h * (10 * t + 24) + 5 * a * s * s * b
    assert activation_bytes_per_layer(m, microbatch=b, tp=t) * t == expect_times_t


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("t", [1, 2, 4, 8])
def test_tensor_and_sequence_parallel(shape: dict, t: int) -> None:
    m, b = _m(shape), 1
    s, h, a = m.seq, m.hidden, m.heads
    got = activation_bytes_per_layer(m, microbatch=b, tp=t, sequence_parallel=True)
    assert got * t == s * b * h * 34 + 5 * a * s * s * b
    sel = activation_bytes_per_layer(m, microbatch=b, tp=t, sequence_parallel=True, recompute="selective")
    assert sel * t == s * b * h * 34


@pytest.mark.parametrize("shape", SHAPES)
def test_full_recompute_keeps_layer_input(shape: dict) -> None:
    m, b = _m(shape), 3
    s, h = m.seq, m.hidden
    assert activation_bytes_per_layer(m, microbatch=b, recompute="full") == 2 * s * b * h
    assert activation_bytes_per_layer(m, microbatch=b, tp=8, recompute="full") == 2 * s * b * h
    sharded = activation_bytes_per_layer(m, microbatch=b, tp=8, sequence_parallel=True, recompute="full")
    assert sharded * 8 == 2 * s * b * h


def test_terms_follow_the_papers_breakdown() -> None:
    m = _m(SHAPES[1])
    s, b, h, a = m.seq, 1, m.hidden, m.heads
    terms = activation_terms(m, microbatch=b)
    core = sum(n for _, n, is_core in terms if is_core)
    assert core == 5 * a * s * s * b  # softmax output 2, dropout mask 1, dropout output 2 (×as²b)
    mlp = {name: n for name, n, _ in terms}
    assert mlp["activation input"] == mlp["fc2 input"] == 8 * s * b * h


def test_generalizations_gqa_swiglu_no_dropout_fp32() -> None:
    m = preset("llama2-70b")  # GQA, SwiGLU, no dropout
    s, b, h, a, f, kv = m.seq, 1, m.hidden, m.heads, m.ffn_size, m.kv_dim
    e = 2
    expect = e * s * b * (h + h + h + kv + kv + h + h + h + 2 * f + f) + e * a * s * s * b
    assert activation_bytes_per_layer(m, microbatch=b) == expect
    tiny = dataclasses.replace(preset("gpt-tiny"), dropout=True)  # fp32: 4-byte activations, 1-byte masks
    s, h, a = tiny.seq, tiny.hidden, tiny.heads
    # 16 h-wide tensors (the 32 of the 2-byte formula) at 4 bytes, two 1-byte masks
    assert activation_bytes_per_layer(tiny) == s * h * (4 * 16 + 2) + (4 + 1 + 4) * a * s * s
    # Without dropout (gpt-tiny as paratrain trains it): no masks, and the ·V GEMM reads the
    # softmax output itself, the one s×s tensor kept
    plain = preset("gpt-tiny")
    assert not plain.uses_dropout
    assert activation_bytes_per_layer(plain) == s * h * 4 * 16 + 4 * a * s * s


def test_mixed_precision_adam_is_16_bytes_per_param() -> None:
    p = 1_000_003
    mem = static_memory(p, "fp16")
    assert (mem.weight_bytes, mem.grad_bytes, mem.optimizer_bytes) == (2 * p, 2 * p, 12 * p)
    assert mem.total_bytes == 16 * p
    # bf16 accumulates its gradients in fp32: 18 B (Megatron-Core's distributed-optimizer table)
    mem = static_memory(p, "bf16")
    assert (mem.weight_bytes, mem.grad_bytes, mem.optimizer_bytes) == (2 * p, 4 * p, 12 * p)
    fp32 = static_memory(p, "fp32")
    assert fp32.total_bytes == 16 * p and fp32.optimizer_bytes == 8 * p


@pytest.mark.parametrize("dp", [1, 2, 8, 64, 7])
def test_zero1_shards_optimizer_state(dp: int) -> None:
    p = 175_000_000
    sharded = static_memory(p, "bf16", dp=dp, optimizer_sharding=True)
    assert sharded.weight_bytes == 2 * p and sharded.grad_bytes == 4 * p  # fp32 gradients, not sharded
    assert sharded.optimizer_bytes == -(-12 * p // dp)
    assert optimizer_bytes(p, "bf16", dp=dp) == 12 * p  # not sharded unless asked


def test_bad_inputs() -> None:
    m = _m(SHAPES[0])
    with pytest.raises(ConfigError, match="tp"):
        activation_bytes_per_layer(m, tp=3)
    with pytest.raises(ValueError):
        activation_bytes_per_layer(m, recompute="sometimes")
    with pytest.raises(ConfigError, match="dp"):
        optimizer_bytes(10, "bf16", dp=0, sharded=True)
    with pytest.raises(ConfigError, match="dtype"):
        activation_bytes_per_layer(dataclasses.replace(m), dtype="fp7")


@settings(max_examples=200, deadline=None)
@given(
    head_dim=st.sampled_from([16, 64, 128]), heads_per_rank=st.integers(1, 8), t=st.sampled_from([1, 2, 4, 8]),
    s_per_rank=st.integers(1, 64), b=st.integers(1, 8),
)
def test_korthikanti_formulas_for_random_shapes(head_dim: int, heads_per_rank: int, t: int, s_per_rank: int,
                                                b: int) -> None:
    a = heads_per_rank * t
    h, s = a * head_dim, s_per_rank * t
    m = ModelSpec(layers=1, hidden=h, heads=a, seq=s, vocab=100, dtype="bf16")
    sbh, as2b = s * b * h, a * s * s * b
    assert activation_bytes_per_layer(m, microbatch=b) == 34 * sbh + 5 * as2b
    assert activation_bytes_per_layer(m, microbatch=b, tp=t) * t == sbh * (10 * t + 24) + 5 * as2b
    assert activation_bytes_per_layer(m, microbatch=b, tp=t, sequence_parallel=True) * t == 34 * sbh + 5 * as2b
    sel = activation_bytes_per_layer(m, microbatch=b, tp=t, sequence_parallel=True, recompute="selective")
    assert sel * t == 34 * sbh
    assert activation_bytes_per_layer(m, microbatch=b, tp=t, recompute="full") == 2 * sbh


def test_gemma_7b_terms_carry_its_wide_heads_and_gated_mlp() -> None:
    """Gemma-7B in bf16, one sequence (s·b = 8192 tokens), no dropout, fused kernels: Q and the
    projection's input are a·d = 4096 wide beside hidden 3072; the GeGLU keeps gate and up (2f)."""
    from tests.spec.test_gemma_geglu import GEMMA_7B

    from paratrain.spec.model import from_hf_config

    terms = {name: n for name, n, _ in activation_terms(from_hf_config(GEMMA_7B), attention="flash")}
    sb, h, q, f = 8192, 3072, 4096, 24576
    assert (terms["qkv input"], terms["Q"], terms["K"], terms["V"]) == (2 * sb * h, 2 * sb * q, 2 * sb * q, 2 * sb * q)
    assert terms["projection input"] == 2 * sb * q
    assert (terms["gate and up (activation input)"], terms["fc2 input"]) == (2 * sb * 2 * f, 2 * sb * f)

"""What autograd keeps for the backward of eager PyTorch's element-wise composites (RMSNorm in fp32,
SwiGLU and GeGLU as the activation then the product, the rotary embedding through complex numbers) and of a fused norm,
against the memory model's per-layer terms; and FP8 linear layers' saved inputs in closed form."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from tests.cost.eager_composites import geglu, rmsnorm, rotary, swiglu

from paratrain.cost.memory import activation_bytes_per_layer, activation_terms
from paratrain.spec.model import preset

# A Llama-shaped layer small enough to run: RMSNorm, rotary positions, SwiGLU, no dropout.
TINY = dataclasses.replace(preset("llama3-8b"), layers=1, hidden=32, heads=4, kv_heads=2, ffn=48, seq=16, vocab=64)
TOKENS, H, F = TINY.seq, TINY.hidden, TINY.ffn_size
_TORCH = {"bf16": torch.bfloat16, "fp32": torch.float32}


def _saved_storages(fn, inputs: list[torch.Tensor], shared: list[torch.Tensor]) -> list[tuple[int, int]]:  # noqa: ANN001
    """``(bytes, elements)`` of every distinct storage ``fn``'s forward saves for its backward,
    leaving out the storages of ``shared`` (parameters, and buffers every layer shares)."""
    skip = {t.untyped_storage().data_ptr() for t in shared}
    seen: dict[int, tuple[int, int]] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        st = t.untyped_storage()
        if st.data_ptr() not in skip:
            seen[st.data_ptr()] = (st.nbytes(), st.nbytes() // t.element_size())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn(*inputs)
    return list(seen.values())


def _activation_sized(saved: list[tuple[int, int]], rows: int) -> int:
    """Bytes of the saved tensors larger than one value per row; the rest must be per-row
    statistics, which the model leaves out (as Korthikanti et al. do)."""
    assert all(n <= rows for _, n in saved if n < rows * 2), saved
    return sum(b for b, n in saved if n > rows)


def _terms(dtype: str, *, fused: bool, model: object = TINY, **kw: object) -> dict[str, int]:
    return {name: n for name, n, _ in activation_terms(model, dtype=dtype, attention="flash", fused=fused, **kw)}


@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_eager_rmsnorm_then_qkv_keeps_what_the_model_counts(dtype: str) -> None:
    tdt = _TORCH[dtype]
    x = torch.randn(TOKENS, H, dtype=tdt, requires_grad=True)
    w = torch.randn(H, dtype=tdt, requires_grad=True)
    wqkv = torch.randn(H, H + 2 * TINY.kv_dim, dtype=tdt, requires_grad=True)
    saved = _saved_storages(lambda a: rmsnorm(a, w) @ wqkv, [x], [w, wqkv])
    terms = _terms(dtype, fused=False)
    model = terms["ln_1 input in fp32"] + terms["ln_1 normalized (weight's input)"] + terms["qkv input"]
    assert _activation_sized(saved, TOKENS) == model
    fused = _terms(dtype, fused=True)
    # 4 bytes an element more than a fused norm, whatever the dtype (in fp32 the copy is x itself)
    assert model - (fused["ln_1 input"] + fused["qkv input"]) == 4 * TOKENS * H


@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_a_fused_norm_keeps_its_input_and_per_row_statistics(dtype: str) -> None:
    """torch's native LayerNorm kernel stands for a fused norm (Transformer Engine's, Apex's, compiled
    RMSNorm): the input and one value per row, which is today's ``ln_1 input`` term."""
    tdt = _TORCH[dtype]
    x = torch.randn(TOKENS, H, dtype=tdt, requires_grad=True)
    w, bias = torch.randn(H, dtype=tdt, requires_grad=True), torch.randn(H, dtype=tdt, requires_grad=True)
    saved = _saved_storages(lambda a: torch.nn.functional.layer_norm(a, (H,), w, bias), [x], [w, bias])
    assert len(saved) == 3  # input, mean, reciprocal standard deviation
    assert _activation_sized(saved, TOKENS) == _terms(dtype, fused=True)["ln_1 input"]


@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
@pytest.mark.parametrize("activation, fn, act_name", [("swiglu", swiglu, "SiLU"), ("geglu", geglu, "GELU")])
def test_eager_gated_mlp_keeps_activation_output_besides_gate_and_up(dtype: str, activation: str, fn,  # noqa: ANN001
                                                                      act_name: str) -> None:
    tdt = _TORCH[dtype]
    x = torch.randn(TOKENS, H, dtype=tdt, requires_grad=True)
    w1, w3 = (torch.randn(H, F, dtype=tdt, requires_grad=True) for _ in range(2))
    w2 = torch.randn(F, H, dtype=tdt, requires_grad=True)
    saved = _saved_storages(lambda a: fn(a @ w1, a @ w3) @ w2, [x], [w1, w2, w3])
    out = f"{act_name} output (product's input)"
    terms = _terms(dtype, fused=False, model=dataclasses.replace(TINY, activation=activation))
    model = terms["fc1 input"] + terms["gate and up (activation input)"] + terms[out] + terms["fc2 input"]
    assert _activation_sized(saved, TOKENS) == model
    # a fused kernel recomputes the activation from the gate
    fused = _terms(dtype, fused=True, model=dataclasses.replace(TINY, activation=activation))
    assert out not in fused
    assert model - terms[out] == (
        fused["fc1 input"] + fused["gate and up (activation input)"] + fused["fc2 input"])


@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_eager_rotary_keeps_only_the_shared_frequency_table(dtype: str) -> None:
    tdt = _TORCH[dtype]
    heads, d = TINY.heads, TINY.head_dim
    x = torch.randn(TOKENS, heads, d, dtype=tdt, requires_grad=True)
    freqs = torch.polar(torch.ones(TOKENS, 1, d // 2), torch.randn(TOKENS, 1, d // 2))
    assert _saved_storages(rotary, [x, freqs], [freqs]) == []
    assert len(_saved_storages(rotary, [x, freqs], [])) == 1  # the table, one buffer for every layer
    assert not any("rotary" in name for name in _terms(dtype, fused=False))


def test_flash_attention_and_projection_keep_q_k_v_log_sum_exp_and_one_output() -> None:
    """torch's fused attention (SDPA, GQA without repeating K and V) keeps Q, K, V, its output and the
    fp32 log-sum-exp; the projection's input is that output (SDPA writes it token-major, so
    ``transpose(1, 2).contiguous()`` copies nothing): the model's attention terms, one output."""
    heads, kvh, d = TINY.heads, TINY.num_kv_heads, TINY.head_dim
    q = torch.randn(1, TOKENS, heads, d, dtype=torch.bfloat16, requires_grad=True)
    k, v = (torch.randn(1, TOKENS, kvh, d, dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
    wo = torch.randn(H, H, dtype=torch.bfloat16, requires_grad=True)

    def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        o = torch.nn.functional.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True, enable_gqa=True)
        return o.transpose(1, 2).contiguous().view(TOKENS, H) @ wo

    saved = _saved_storages(attention, [q, k, v], [wo])
    terms = _terms("bf16", fused=True)
    names = ("Q", "K", "V", "attention log-sum-exp", "projection input")
    assert sorted(b for b, _ in saved) == sorted(terms[n] for n in names)


def test_fused_bf16_terms_are_unchanged_by_the_new_arguments() -> None:
    base = activation_terms(TINY, attention="flash")
    assert activation_terms(TINY, attention="flash", fused=True, gemm_dtype=None) == base
    assert [name for name, _, _ in base] == [
        "ln_1 input", "qkv input", "Q", "K", "attention log-sum-exp", "V", "projection input", "ln_2 input",
        "fc1 input", "gate and up (activation input)", "fc2 input"]


@pytest.mark.parametrize("attention", ["flash", "math"])
def test_fp8_linear_inputs_are_one_byte_where_te_or_compile_keep_the_cast(attention: str) -> None:
    """Closed form from the cited sources (module docstring): Transformer Engine and compiled torchao
    keep the FP8 cast of each linear input (1 byte); eager torchao keeps the bf16 input."""
    m, b, t = preset("llama3-8b"), 2, 4
    s, h, f_r = m.seq, m.hidden, m.ffn_size // t
    kw = dict(microbatch=b, tp=t, sequence_parallel=True, attention=attention)
    bf16 = activation_bytes_per_layer(m, fused=True, **kw)
    fp8 = activation_bytes_per_layer(m, fused=True, gemm_dtype="fp8", **kw)
    rep = s * b // t
    shrink = (2 - 1) * (rep * h + rep * h + s * b * f_r)  # QKV, MLP up and down inputs: 2 bytes → 1
    if attention == "flash":
        shrink -= 1 * s * b * h // t  # the projection's FP8 copy beside the kernel's kept output
    else:
        shrink += (2 - 1) * s * b * h // t
    assert bf16 - fp8 == shrink
    assert activation_bytes_per_layer(m, fused=True, gemm_dtype="fp8-delayed", **kw) == fp8
    assert activation_bytes_per_layer(m, fused=False, gemm_dtype="fp8", **kw) == activation_bytes_per_layer(
        m, fused=False, **kw)
    full = dict(kw, recompute="full")  # the layer input only, in bf16, either way
    assert activation_bytes_per_layer(m, fused=True, gemm_dtype="fp8", **full) == activation_bytes_per_layer(m, **full)


def test_chunk_activations_carry_the_eager_and_fp8_terms() -> None:
    """The stage cost holds ``layers ×`` the per-layer terms plus the head's, with the flags the
    config and the caller give (eager: the final norm's fp32 copy too)."""
    from paratrain.cost.stage import chunk_costs
    from paratrain.parallel.config import ParallelConfig
    from paratrain.spec.cluster import resolve_cluster

    m = dataclasses.replace(preset("llama3-8b"), layers=4)
    cluster = resolve_cluster("dgx-h100", gpus=8)
    cfg = ParallelConfig(dp=8, microbatch=1, global_batch=8, attention="flash")
    fp8 = dataclasses.replace(cfg, gemm_dtype="fp8")
    kw = dict(microbatch=1, attention="flash")
    (eager,) = chunk_costs(m, cluster, cfg, fused=False)
    (fused,) = chunk_costs(m, cluster, cfg, fused=True)
    (fused8,) = chunk_costs(m, cluster, fp8, fused=True)
    (eager8,) = chunk_costs(m, cluster, fp8, fused=False)
    per_layer = activation_bytes_per_layer(m, fused=False, **kw) - activation_bytes_per_layer(m, fused=True, **kw)
    assert eager.activation_bytes - fused.activation_bytes == 4 * per_layer + 4 * m.seq * m.hidden
    per_layer8 = activation_bytes_per_layer(m, fused=True, **kw) - activation_bytes_per_layer(
        m, fused=True, gemm_dtype="fp8", **kw)
    assert per_layer8 > 0 and fused.activation_bytes - fused8.activation_bytes == 4 * per_layer8
    assert eager8.activation_bytes == eager.activation_bytes

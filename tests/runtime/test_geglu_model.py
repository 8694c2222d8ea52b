"""The runtime's GeGLU model computes ``down(gelu_tanh(x·W_gate) · (x·W_up))`` (Shazeer 2020,
Gemma's MLP), with heads wider than hidden/heads (Gemma-7B's head_dim): against a forward pass
written out here from the parameters, in float64, and against Hugging Face's LlamaForCausalLM
with ``hidden_act`` gelu_pytorch_tanh and ``head_dim``, both ways (import and export)."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from hf_fixtures import hf_class, hf_float64, relative_error  # noqa: E402

from paratrain.runtime.models import build_model  # noqa: E402
from paratrain.runtime.models.hf import check_weights, hf_config, hf_tensors, load_weights  # noqa: E402
from paratrain.spec.model import Activation, ModelSpec, resolve_model  # noqa: E402

RTOL = 1e-12
# 4 heads of 8 (Q 32 wide) beside hidden 24, 2 key/value heads, GeGLU, Llama's other options
TINY = ModelSpec(layers=2, hidden=24, heads=4, kv_heads=2, head_size=8, ffn=40, seq=12, vocab=50, norm="rmsnorm",
                 activation="geglu", position="rotary", tied_embeddings=False, bias=False, rope_theta=1000.0,
                 norm_eps=1e-5)


def _gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    # Hendrycks & Gimpel 2016, sec. 2: 0.5·x·(1 + tanh(√(2/π)·(x + 0.044715·x³)))
    return 0.5 * x * (1 + torch.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x**3)))


def _reference_logits(spec: ModelSpec, p: dict[str, torch.Tensor], tokens: torch.Tensor) -> torch.Tensor:
    """The model written out from its parameters ``p``: pre-norm blocks, RMSNorm, rotary
    (rotate-half), causal grouped-query attention, the GeGLU MLP, final norm, untied head."""
    s, d, a, k = tokens.shape[1], spec.head_dim, spec.heads, spec.num_kv_heads

    def rms(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return w * x / torch.sqrt((x * x).mean(-1, keepdim=True) + spec.norm_eps)

    inv = spec.rope_theta ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    ang = torch.arange(s, dtype=torch.float64)[:, None] * inv
    cos, sin = torch.cat((ang, ang), -1).cos(), torch.cat((ang, ang), -1).sin()

    def rope(x: torch.Tensor) -> torch.Tensor:  # x [B, heads, S, d]
        return x * cos + torch.cat((-x[..., d // 2:], x[..., :d // 2]), -1) * sin

    x = p["embed.tok.weight"][tokens]
    mask = torch.ones(s, s, dtype=torch.bool).triu(1)
    for i in range(spec.layers):
        b = f"blocks.{i}."
        y = rms(x, p[b + "norm1.weight"])
        q, kk, v = (y @ p[f"{b}attn.{n}.weight"].T for n in "qkv")
        q = rope(q.unflatten(-1, (a, d)).transpose(1, 2))
        kk = rope(kk.unflatten(-1, (k, d)).transpose(1, 2))
        v = v.unflatten(-1, (k, d)).transpose(1, 2)
        heads = []
        for j in range(a):  # query head j reads key/value head j // (a/k)
            sc = q[:, j] @ kk[:, j // (a // k)].transpose(-1, -2) / math.sqrt(d)
            heads.append(torch.softmax(sc.masked_fill(mask, -math.inf), -1) @ v[:, j // (a // k)])
        x = x + torch.cat(heads, -1) @ p[b + "attn.o.weight"].T
        y = rms(x, p[b + "norm2.weight"])
        gated = _gelu_tanh(y @ p[b + "mlp.gate.weight"].T) * (y @ p[b + "mlp.fc1.weight"].T)
        x = x + gated @ p[b + "mlp.fc2.weight"].T
    return rms(x, p["head.norm.weight"]) @ p["head.proj.weight"].T


def _float64_model(spec: ModelSpec) -> torch.nn.Module:
    torch.set_default_dtype(torch.float64)
    try:
        model = build_model(spec, seed=0)
    finally:
        torch.set_default_dtype(torch.float32)
    with torch.no_grad():  # norm scales away from 1, so a swapped or missing scale shows
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(len(name)), dtype=p.dtype) * 0.2)
    return model


def test_forward_is_the_hand_written_geglu_model() -> None:
    model = _float64_model(TINY)
    assert tuple(model.blocks[0].attn.q.weight.shape) == (32, 24)
    assert tuple(model.blocks[0].mlp.gate.weight.shape) == (40, 24)
    tokens = torch.randint(0, TINY.vocab, (2, TINY.seq), generator=torch.Generator().manual_seed(1))
    params = {n: p.detach() for n, p in model.named_parameters()}
    got = model(tokens).detach()
    assert got.dtype == torch.float64
    assert relative_error(got, _reference_logits(TINY, params, tokens)) <= RTOL


def test_hf_llama_with_gated_tanh_gelu_and_wide_heads_round_trips(tmp_path: Path) -> None:
    """A HF directory (hidden_act gelu_pytorch_tanh, head_dim 8 beside hidden 24 and 4 heads) loads
    into the model its config describes, computes HF's logits, and exports to a directory from
    which transformers builds the same model."""
    pytest.importorskip("transformers")
    from safetensors.torch import save_file
    from transformers import LlamaConfig

    cfg = LlamaConfig(num_hidden_layers=2, hidden_size=24, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                      intermediate_size=40, vocab_size=50, max_position_embeddings=12, hidden_act="gelu_pytorch_tanh",
                      rms_norm_eps=1e-5, rope_theta=1000.0, tie_word_embeddings=False, bos_token_id=0,
                      eos_token_id=0, initializer_range=0.1)
    torch.manual_seed(0)
    hf = hf_class("llama")(cfg)
    with torch.no_grad():
        for p in hf.parameters():
            if p.dim() == 1:
                p.add_(torch.randn_like(p) * 0.2)
    hf.save_pretrained(tmp_path / "hf")
    spec = resolve_model(str(tmp_path / "hf"))
    assert (spec.activation, spec.q_dim, spec.hidden) == (Activation.GEGLU, 32, 24)
    check_weights(tmp_path / "hf", spec)
    model = _float64_model(spec)
    load_weights(model, tmp_path / "hf", spec)
    tokens = torch.randint(0, 50, (2, 12), generator=torch.Generator().manual_seed(2))
    with hf_float64(), torch.no_grad():
        original = hf_class("llama").from_pretrained(tmp_path / "hf", dtype=torch.float64).eval()(tokens).logits
    assert relative_error(model(tokens).detach(), original) <= 1e-6  # test_hf_weights.py's bound

    (tmp_path / "out").mkdir()
    save_file(hf_tensors({n: p.detach() for n, p in model.named_parameters()}, spec),
              tmp_path / "out" / "model.safetensors", metadata={"format": "pt"})
    exported_cfg = hf_config(spec)
    assert (exported_cfg["hidden_act"], exported_cfg["head_dim"]) == ("gelu_pytorch_tanh", 8)
    (tmp_path / "out" / "config.json").write_text(json.dumps(exported_cfg))
    with hf_float64(), torch.no_grad():
        exported = hf_class("llama").from_pretrained(tmp_path / "out", dtype=torch.float64).eval()(tokens).logits
    assert relative_error(exported, original) <= 1e-6
    assert resolve_model(str(tmp_path / "out")).param_count() == spec.param_count() == hf.num_parameters()

"""Gated GELU (GeGLU) and Gemma's Hugging Face configs: the gated MLP's three matrices, the
activation a config names, Gemma's wide heads and tied head, against published parameter counts."""

from __future__ import annotations

import json

import pytest

from paratrain.errors import ConfigError
from paratrain.spec.model import Activation, ModelSpec, from_hf_config, resolve_model

# google/gemma-7b's config.json as released (the legacy "hidden_act": "gelu", no tie key: GemmaConfig ties)
GEMMA_7B = {
    "architectures": ["GemmaForCausalLM"], "model_type": "gemma", "attention_bias": False, "attention_dropout": 0.0,
    "bos_token_id": 2, "eos_token_id": 1, "pad_token_id": 0, "head_dim": 256, "hidden_act": "gelu",
    "hidden_size": 3072, "intermediate_size": 24576, "max_position_embeddings": 8192, "num_attention_heads": 16,
    "num_hidden_layers": 28, "num_key_value_heads": 16, "rms_norm_eps": 1e-6, "rope_scaling": None,
    "rope_theta": 10000.0, "torch_dtype": "bfloat16", "vocab_size": 256000,
}
# google/gemma-2b's, with the hidden_activation key that later revisions of the Gemma configs carry
GEMMA_2B = {**GEMMA_7B, "hidden_size": 2048, "intermediate_size": 16384, "num_attention_heads": 8,
            "num_hidden_layers": 18, "num_key_value_heads": 1, "hidden_activation": "gelu_pytorch_tanh"}

# Gemma Team 2024, "Gemma: Open Models Based on Gemini Research and Technology", Table 2: the
# non-embedding parameters (every layer and the final norm); totals as the model cards round them.
NON_EMBEDDING = {"7b": 7_751_248_896, "2b": 1_981_884_416}
TOTAL_BILLIONS = {"7b": 8.54, "2b": 2.51}


def _llama(**kw: object) -> dict[str, object]:
    return {"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
            "intermediate_size": 96, "vocab_size": 100, "rms_norm_eps": 1e-5, **kw}


@pytest.mark.parametrize("size, cfg", [("7b", GEMMA_7B), ("2b", GEMMA_2B)])
def test_gemma_parameter_counts_are_the_published(size: str, cfg: dict[str, object]) -> None:
    m = from_hf_config(cfg)
    assert m.activation is Activation.GEGLU and m.tied_embeddings and m.head_dim == 256
    assert m.param_count() - m.vocab * m.hidden == NON_EMBEDDING[size]
    assert round(m.param_count() / 1e9, 2) == TOTAL_BILLIONS[size]


def test_gemma_7b_layer_by_hand() -> None:
    """Q and the attention output are 16·256 = 4096 wide, beside a 3072 residual stream; the MLP
    holds gate, up and down, 3·3072·24576."""
    m = from_hf_config(GEMMA_7B)
    h, q, f = 3072, 16 * 256, 24576
    assert m.q_dim == q and m.kv_dim == q
    assert m.attention_params() == h * q + 2 * h * q + q * h
    assert m.mlp_params() == 3 * h * f
    assert m.params_per_layer() == m.attention_params() + m.mlp_params() + 2 * h


def test_gemma_reads_hidden_activation_first_and_takes_gelu_as_the_tanh_form(tmp_path) -> None:
    # what transformers' Gemma runs: hidden_activation when set, and its legacy "gelu" is tanh-GELU
    for cfg in (GEMMA_7B, {**GEMMA_7B, "hidden_act": "silu", "hidden_activation": "gelu_pytorch_tanh"},
                {k: v for k, v in GEMMA_7B.items() if k != "hidden_act"}):
        assert from_hf_config(cfg).activation is Activation.GEGLU
    with pytest.raises(ConfigError, match="'hidden_activation'.*'relu'"):
        from_hf_config({**GEMMA_7B, "hidden_activation": "relu"})
    (tmp_path / "config.json").write_text(json.dumps(GEMMA_2B))
    assert resolve_model(str(tmp_path)).param_count() == from_hf_config(GEMMA_2B).param_count()


@pytest.mark.parametrize("act", ["gelu_pytorch_tanh", "gelu_new", "gelu_fast"])
def test_llama_family_gated_tanh_gelu_is_geglu_with_three_matrices(act: str) -> None:
    m = from_hf_config(_llama(hidden_act=act))
    assert m.activation is Activation.GEGLU
    assert m.mlp_params() == 3 * 64 * 96
    assert from_hf_config(_llama(hidden_act="silu")).param_count() == m.param_count()


@pytest.mark.parametrize("act", ["gelu", "relu", "tanh"])
def test_gated_configs_with_unmodelled_activations_are_refused(act: str) -> None:
    # HF's LlamaMLP gates with ACT2FN[hidden_act]: "gelu" is the erf form there, "relu" ReGLU;
    # neither may fall back to a non-gated MLP (two matrices instead of three)
    with pytest.raises(ConfigError, match=f"gated MLP '{act}'.*use one of: silu"):
        from_hf_config(_llama(hidden_act=act))


@pytest.mark.parametrize("mtype", ["gemma2", "gemma3_text", "recurrent_gemma"])
def test_later_gemma_generations_are_refused(mtype: str) -> None:
    with pytest.raises(ConfigError, match=f"'{mtype}' is not modelled"):
        from_hf_config({**GEMMA_7B, "model_type": mtype, "hidden_activation": "gelu_pytorch_tanh"})


def test_head_dim_of_a_llama_config_sets_the_attention_width() -> None:
    """Mistral-NeMo-style: 32 heads of 128 beside hidden 5120 (not 5120/32 = 160)."""
    cfg = _llama(hidden_size=5120, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                 intermediate_size=14336, hidden_act="silu")
    m = from_hf_config(cfg)
    assert (m.head_dim, m.q_dim, m.kv_dim) == (128, 4096, 1024)
    assert m.attention_params() == 2 * 5120 * 4096 + 2 * 5120 * 1024
    assert from_hf_config({**cfg, "head_dim": None}).head_dim == 160


def test_geglu_spec_defaults_and_head_size_validation() -> None:
    swiglu = ModelSpec(layers=1, hidden=4096, heads=32, seq=8, vocab=10, activation="swiglu")
    geglu = ModelSpec(layers=1, hidden=4096, heads=32, seq=8, vocab=10, activation="geglu")
    assert geglu.ffn_size == swiglu.ffn_size == 11008  # the gated rule, 2/3·4h rounded up to 256
    assert geglu.param_count() == swiglu.param_count()
    assert ModelSpec(layers=1, hidden=30, heads=4, head_size=8, seq=8, vocab=10).q_dim == 32
    with pytest.raises(ConfigError, match="head_size"):
        ModelSpec(layers=1, hidden=32, heads=4, head_size=0, seq=8, vocab=10)

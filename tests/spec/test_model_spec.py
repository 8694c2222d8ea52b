"""ModelSpec: exact parameter counts, presets, loaders and validation."""

from __future__ import annotations

import json

import pytest

from paratrain.errors import ConfigError
from paratrain.spec.model import ModelSpec, from_hf_config, preset, resolve_model
from paratrain.spec.model_presets import MODEL_PRESETS

# Published parameter counts, independent of our formula: the totals the model cards and
# HuggingFace report for these checkpoints.
PUBLISHED = {
    "gpt2-small": 124_439_808,  # HF gpt2, tied LM head
    "llama2-7b": 6_738_415_616,  # HF meta-llama/Llama-2-7b-hf
    "llama2-70b": 68_976_648_192,  # HF meta-llama/Llama-2-70b-hf
    "llama3-8b": 8_030_261_248,  # HF meta-llama/Meta-Llama-3-8B
    "bert-base": 109_514_298,  # HF BertForMaskedLM(bert-base-uncased), without the pooler
}


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_param_count_matches_published_checkpoints(name):
    assert preset(name).param_count() == PUBLISHED[name]


def test_gpt3_175b_is_175b():
    # 12·l·h² dominates: 96 layers × 12 × 12288² ≈ 173.9B, plus embeddings.
    n = preset("gpt3-175b").param_count()
    assert 174e9 < n < 175.5e9


def test_gpt_param_count_by_hand():
    m = ModelSpec(layers=2, hidden=8, heads=2, seq=4, vocab=10)
    h, f, v, p = 8, 32, 10, 4
    per_layer = (4 * h * h + 4 * h) + (2 * h * f + f + h) + 2 * 2 * h
    assert m.param_count() == v * h + p * h + 2 * per_layer + 2 * h


def test_gqa_and_swiglu_shapes():
    m = ModelSpec(
        layers=1,
        hidden=64,
        heads=8,
        kv_heads=2,
        seq=16,
        vocab=32,
        activation="swiglu",
        norm="rmsnorm",
        position="rotary",
        tied_embeddings=False,
        bias=False,
    )
    assert m.kv_dim == 16
    assert m.ffn_size == 256  # 2/3·4·64 = 170.7 → rounded up to a multiple of 256
    assert m.attention_params() == 64 * 64 * 2 + 2 * 64 * 16
    assert m.mlp_params() == 3 * 64 * 256
    assert m.embedding_params() == 32 * 64  # no position table
    assert m.head_params() == 64 + 32 * 64  # final RMSNorm + untied head


def test_every_preset_builds_and_is_positive():
    for name in MODEL_PRESETS:
        assert preset(name).param_count() > 0


def test_tiny_preset_shape():
    m = preset("gpt-tiny")
    assert (m.layers, m.hidden, m.heads, m.seq, m.vocab) == (2, 64, 4, 64, 256)


def test_overrides_and_unknown_field():
    m = resolve_model("gpt3-175b", layers=48, seq=4096)
    assert m.layers == 48 and m.seq == 4096 and m.hidden == 12288
    with pytest.raises(ConfigError, match="depth"):
        preset("gpt2").with_overrides(depth=3)


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(layers=0), "layers"),
        (dict(hidden=-8), "hidden"),
        (dict(heads=3), "heads"),  # does not divide 64
        (dict(kv_heads=3), "kv_heads"),
        (dict(activation="tanh"), "activation"),
        (dict(dtype="fp64"), "dtype"),
        (dict(dropout="yes"), "dropout"),
    ],
)
def test_validation_names_the_field(kwargs, field):
    base = dict(layers=2, hidden=64, heads=4, seq=8, vocab=16)
    with pytest.raises(ConfigError) as e:
        ModelSpec(**{**base, **kwargs})
    assert e.value.field == field
    assert "\n" not in str(e.value)


def test_load_json_yaml_toml(tmp_path):
    doc = dict(layers=3, hidden=32, heads=4, seq=16, vocab=50, activation="swiglu")
    (tmp_path / "m.json").write_text(json.dumps(doc))
    (tmp_path / "m.yaml").write_text("\n".join(f"{k}: {v}" for k, v in doc.items()))
    (tmp_path / "m.toml").write_text("\n".join(f"{k} = {json.dumps(v)}" for k, v in doc.items()))
    specs = [resolve_model(str(tmp_path / f"m.{ext}")) for ext in ("json", "yaml", "toml")]
    assert specs[0] == specs[1] == specs[2]
    assert specs[0].layers == 3


def test_preset_plus_overrides_in_a_file(tmp_path):
    (tmp_path / "m.json").write_text(json.dumps({"preset": "llama2-7b", "layers": 4}))
    m = resolve_model(str(tmp_path / "m.json"))
    assert m.layers == 4 and m.ffn_size == 11008


def test_hf_llama_config():
    cfg = {
        "model_type": "llama",
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "vocab_size": 128256,
        "max_position_embeddings": 8192,
        "rms_norm_eps": 1e-5,
        "hidden_act": "silu",
        "tie_word_embeddings": False,
    }
    assert from_hf_config(cfg).param_count() == PUBLISHED["llama3-8b"]


def test_hf_gpt2_and_bert_configs(tmp_path):
    gpt2 = {"model_type": "gpt2", "n_embd": 768, "n_layer": 12, "n_head": 12, "n_positions": 1024, "vocab_size": 50257}
    assert from_hf_config(gpt2).param_count() == PUBLISHED["gpt2-small"]
    bert = {
        "model_type": "bert",
        "hidden_size": 768,
        "num_hidden_layers": 12,
        "num_attention_heads": 12,
        "intermediate_size": 3072,
        "max_position_embeddings": 512,
        "vocab_size": 30522,
    }
    p = tmp_path / "config.json"
    p.write_text(json.dumps(bert))
    assert resolve_model(str(p)).param_count() == PUBLISHED["bert-base"]


def test_dropout_follows_the_family_unless_set():
    """GPT-2/3 and BERT train with dropout, the Llama family without; a spec or a HF config's
    probabilities decide otherwise (gpt-tiny: none, as paratrain's runtime trains it)."""
    assert preset("gpt3-1.3b").uses_dropout and preset("bert-base").uses_dropout
    assert not preset("llama3-8b").uses_dropout and not preset("gpt-tiny").uses_dropout
    assert not preset("gpt3-1.3b").with_overrides(dropout=False).uses_dropout
    assert preset("llama3-8b").with_overrides(dropout=True).uses_dropout
    gpt2 = {"model_type": "gpt2", "n_embd": 64, "n_layer": 2, "n_head": 4, "vocab_size": 256}
    assert from_hf_config(gpt2).dropout is None and from_hf_config(gpt2).uses_dropout
    assert from_hf_config({**gpt2, "resid_pdrop": 0.0, "attn_pdrop": 0.0, "embd_pdrop": 0.0}).dropout is False
    assert from_hf_config({**gpt2, "resid_pdrop": 0.1}).dropout is True
    llama = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
             "num_attention_heads": 4, "vocab_size": 256, "rms_norm_eps": 1e-5, "attention_dropout": 0.0}
    assert from_hf_config(llama).dropout is False
    bert = {"model_type": "bert", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
            "vocab_size": 256, "hidden_dropout_prob": 0.1, "attention_probs_dropout_prob": 0.1}
    assert from_hf_config(bert).dropout is True


def test_malformed_and_missing_files(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text("{ layers: ")
    with pytest.raises(ConfigError, match="malformed"):
        resolve_model(str(bad))
    with pytest.raises(ConfigError, match="does not exist"):
        resolve_model(str(tmp_path / "nope.yaml"))
    with pytest.raises(ConfigError, match="unknown model preset"):
        resolve_model("gpt-17")

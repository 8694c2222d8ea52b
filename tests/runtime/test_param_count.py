"""The reference models hold exactly ModelSpec.param_count() parameters, and every part of the
count (embedding, per layer, head) matches the module that implements it."""

from __future__ import annotations

import pytest
import torch

from paratrain.runtime.models import BERT, GPT, build_model
from paratrain.spec.model import ModelSpec, preset


def _numel(module: torch.nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())  # parameters() de-duplicates tied weights


SHAPES = {
    # GPT-2-like: learned positions, LayerNorm with biases, GELU, tied output projection.
    "gpt2-like": ModelSpec(layers=3, hidden=48, heads=4, seq=32, vocab=97),
    "gpt2-like-more-positions": ModelSpec(layers=2, hidden=32, heads=2, seq=16, vocab=50, max_positions=40),
    # Llama-like: rotary, RMSNorm, SwiGLU, GQA (2 kv heads for 8 query heads), untied, no biases.
    "llama-like": ModelSpec(
        layers=2, hidden=64, heads=8, kv_heads=2, ffn=96, seq=32, vocab=128,
        norm="rmsnorm", activation="swiglu", position="rotary", tied_embeddings=False, bias=False,
    ),
    # SwiGLU with the default FFN rule (2/3 * 4h rounded up to 256) and biases kept.
    "swiglu-default-ffn": ModelSpec(layers=1, hidden=40, heads=5, seq=8, vocab=30, activation="swiglu"),
    # GeGLU (Gemma's MLP) with the default gated FFN rule, and Gemma-7B-style heads wider than hidden/heads.
    "geglu-wide-heads": ModelSpec(layers=2, hidden=40, heads=4, kv_heads=2, head_size=16, seq=8, vocab=30,
                                  norm="rmsnorm", activation="geglu", position="rotary", bias=True),
    "relu-untied-bias-free-layernorm": ModelSpec(
        layers=2, hidden=24, heads=3, seq=8, vocab=40, activation="relu", tied_embeddings=False, bias=False,
    ),
    "bert-like": ModelSpec(arch="bert", layers=2, hidden=32, heads=4, seq=16, vocab=64),
    "bert-untied-no-bias": ModelSpec(arch="bert", layers=1, hidden=32, heads=2, seq=16, vocab=64,
                                     tied_embeddings=False, bias=False),
    "gpt-tiny": preset("gpt-tiny"),
}


@pytest.mark.parametrize("name", sorted(SHAPES))
def test_total_matches_spec(name: str) -> None:
    spec = SHAPES[name]
    model = build_model(spec, seed=0)
    assert _numel(model) == spec.param_count()


@pytest.mark.parametrize("name", sorted(SHAPES))
def test_parts_match_spec(name: str) -> None:
    spec = SHAPES[name]
    model = build_model(spec, seed=0)
    for block in model.blocks:
        assert _numel(block) == spec.params_per_layer()
        assert _numel(block.attn) == spec.attention_params()
        assert _numel(block.mlp) == spec.mlp_params()
    assert _numel(model.embed) == spec.embedding_params()
    tied = model.embed.tok.weight if spec.tied_embeddings else None
    head_own = sum(p.numel() for p in model.head.parameters() if p is not tied)
    assert head_own == spec.head_params()


def test_tied_projection_is_the_embedding() -> None:
    spec = SHAPES["gpt2-like"]
    model = GPT(spec)
    assert model.head.proj.weight is model.embed.tok.weight
    untied = BERT(SHAPES["bert-untied-no-bias"])
    assert untied.head.proj.weight is not untied.embed.tok.weight


def test_init_depends_on_seed_only() -> None:
    spec = SHAPES["llama-like"]
    a, b, c = build_model(spec, 7), build_model(spec, 7), build_model(spec, 8)
    for (name, pa), pb, pc in zip(a.named_parameters(), b.parameters(), c.parameters(), strict=True):
        assert torch.equal(pa, pb), name
        if pa.dim() == 2:
            assert not torch.equal(pa, pc), name


def test_chunks_compose_to_the_full_model() -> None:
    spec = ModelSpec(layers=4, hidden=32, heads=4, seq=16, vocab=64, position="rotary")
    model = build_model(spec, seed=3)
    tokens = torch.randint(0, spec.vocab, (2, spec.seq), generator=torch.Generator().manual_seed(0))
    chunks = [model.chunk(0, 1), model.chunk(1, 3), model.chunk(3, 4)]
    x = tokens
    for c in chunks:
        x = c(x)
    torch.testing.assert_close(x, model(tokens), rtol=0, atol=0)
    assert chunks[0].is_first and chunks[-1].is_last and not chunks[1].is_first
    with pytest.raises(ValueError):
        model.chunk(2, 2)

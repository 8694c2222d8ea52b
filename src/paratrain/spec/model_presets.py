"""Model presets: public shapes of well-known models.

Each entry holds only what differs from :class:`~paratrain.spec.model.ModelSpec`'s defaults
(learned positions, LayerNorm, GELU, tied embeddings, biases). Sources are cited per family.
"""

from __future__ import annotations

from typing import Any

__all__ = ["MODEL_PRESETS"]

_GPT2_VOCAB = 50257  # GPT-2 BPE; GPT-3 reuses it (Brown et al. 2020, sec. 2.1)

_LLAMA: dict[str, Any] = dict(norm="rmsnorm", activation="swiglu", position="rotary", tied_embeddings=False, bias=False)

MODEL_PRESETS: dict[str, dict[str, Any]] = {
    # Tiny byte-level GPT for tests and the demo; no dropout, as paratrain's runtime trains it.
    "gpt-tiny": dict(layers=2, hidden=64, heads=4, seq=64, vocab=256, dtype="fp32", dropout=False),
    # GPT-2 (Radford et al. 2019, Table 2; HF configs gpt2, gpt2-medium, gpt2-large, gpt2-xl).
    "gpt2-small": dict(layers=12, hidden=768, heads=12, seq=1024, vocab=_GPT2_VOCAB),
    "gpt2-medium": dict(layers=24, hidden=1024, heads=16, seq=1024, vocab=_GPT2_VOCAB),
    "gpt2-large": dict(layers=36, hidden=1280, heads=20, seq=1024, vocab=_GPT2_VOCAB),
    "gpt2-xl": dict(layers=48, hidden=1600, heads=25, seq=1024, vocab=_GPT2_VOCAB),
    # GPT-3 family (Brown et al. 2020, Table 2.1), context 2048.
    "gpt3-125m": dict(layers=12, hidden=768, heads=12, seq=2048, vocab=_GPT2_VOCAB),
    "gpt3-350m": dict(layers=24, hidden=1024, heads=16, seq=2048, vocab=_GPT2_VOCAB),
    "gpt3-760m": dict(layers=24, hidden=1536, heads=16, seq=2048, vocab=_GPT2_VOCAB),
    # Table 2.1 lists 24 heads of 128 for d_model 2048, which is inconsistent; 16×128 is used.
    "gpt3-1.3b": dict(layers=24, hidden=2048, heads=16, seq=2048, vocab=_GPT2_VOCAB),
    "gpt3-2.7b": dict(layers=32, hidden=2560, heads=32, seq=2048, vocab=_GPT2_VOCAB),
    "gpt3-6.7b": dict(layers=32, hidden=4096, heads=32, seq=2048, vocab=_GPT2_VOCAB),
    # Table 2.1 gives d_model 5140 with 40 heads of 128; 5120 = 40×128 is the consistent reading.
    "gpt3-13b": dict(layers=40, hidden=5120, heads=40, seq=2048, vocab=_GPT2_VOCAB),
    "gpt3-175b": dict(layers=96, hidden=12288, heads=96, seq=2048, vocab=_GPT2_VOCAB),
    # 1T GPT of Narayanan et al. 2021 (Megatron-LM, Table 1), vocabulary padded to 51200.
    "gpt-1t": dict(layers=128, hidden=25600, heads=160, seq=2048, vocab=51200),
    # BERT (Devlin et al. 2019; HF bert-base-uncased / bert-large-uncased): WordPiece 30522.
    "bert-base": dict(arch="bert", layers=12, hidden=768, heads=12, seq=512, vocab=30522),
    "bert-large": dict(arch="bert", layers=24, hidden=1024, heads=16, seq=512, vocab=30522),
    # Llama 2 (Touvron et al. 2023; HF meta-llama/Llama-2-*-hf config.json).
    "llama2-7b": dict(layers=32, hidden=4096, heads=32, ffn=11008, seq=4096, vocab=32000, **_LLAMA),
    "llama2-13b": dict(layers=40, hidden=5120, heads=40, ffn=13824, seq=4096, vocab=32000, **_LLAMA),
    "llama2-70b": dict(layers=80, hidden=8192, heads=64, kv_heads=8, ffn=28672, seq=4096, vocab=32000, **_LLAMA),
    # Llama 3 (Llama Team 2024, "The Llama 3 Herd of Models", Table 3; HF Meta-Llama-3.1-* configs).
    "llama3-8b": dict(layers=32, hidden=4096, heads=32, kv_heads=8, ffn=14336, seq=8192, vocab=128256, **_LLAMA),
    "llama3-70b": dict(layers=80, hidden=8192, heads=64, kv_heads=8, ffn=28672, seq=8192, vocab=128256, **_LLAMA),
    "llama3-405b": dict(layers=126, hidden=16384, heads=128, kv_heads=8, ffn=53248, seq=8192, vocab=128256, **_LLAMA),
}

# Aliases people type.
MODEL_PRESETS["gpt2"] = MODEL_PRESETS["gpt2-small"]

"""Tiny Hugging Face models for the weight tests, built locally with ``transformers`` (random
init from a config, ``save_pretrained``), and HF's loss and gradients to compare with.

The configs exercise what the mapping must carry: GPT-2's fused Q/K/V in Conv1D layout and tied
head; Llama's grouped K/V heads, untied head, a non-default RMSNorm epsilon and rotary base; BERT's
exact GELU, 1e-12 LayerNorm epsilon, token types and decoder bias. Every 1-D parameter (norm scales
and shifts, biases) is drawn at random, since HF initialises them to ones and zeros, where a
swapped weight and bias or a wrong epsilon would go unseen.

Float64: HF's Llama computes RMSNorm and the rotary tables in float32 whatever the model's dtype
(transformers 5, modeling_llama.py: ``hidden_states.to(torch.float32)`` and ``.float()`` in the
rotary embedding), a precision choice, not a different function. :func:`hf_float64` evaluates the
same formulas in the input's dtype, so a float64 comparison measures the models, not float32
rounding.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.nn.functional as F

VOCAB, SEQ = 96, 16  # vocabulary divisible by tp=2 (vocabulary-parallel embedding)
IGNORE_INDEX = -100


def _configs() -> dict[str, object]:
    from transformers import BertConfig, GPT2Config, LlamaConfig

    return {
        "gpt2": GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=VOCAB, n_positions=32, bos_token_id=0,
                           eos_token_id=0, initializer_range=0.1),
        "llama": LlamaConfig(num_hidden_layers=2, hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
                             intermediate_size=48, vocab_size=VOCAB, max_position_embeddings=32, bos_token_id=0,
                             eos_token_id=0, rms_norm_eps=1e-5, rope_theta=500000.0, tie_word_embeddings=False,
                             initializer_range=0.1),
        "bert": BertConfig(num_hidden_layers=2, hidden_size=32, num_attention_heads=4, intermediate_size=64,
                           vocab_size=VOCAB, max_position_embeddings=32, initializer_range=0.1),
    }


FAMILIES = ("gpt2", "llama", "bert")


def hf_class(family: str) -> type:
    from transformers import BertForMaskedLM, GPT2LMHeadModel, LlamaForCausalLM

    return {"gpt2": GPT2LMHeadModel, "llama": LlamaForCausalLM, "bert": BertForMaskedLM}[family]


def make_hf_dir(family: str, directory: Path, seed: int = 0) -> Path:
    """``save_pretrained`` of a randomly initialised tiny ``family`` model into ``directory``."""
    torch.manual_seed(seed)
    model = hf_class(family)(_configs()[family])
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:
                p.add_(torch.randn_like(p) * 0.2)
    model.save_pretrained(directory)
    return directory


@contextlib.contextmanager
def hf_float64() -> Iterator[None]:
    """HF's Llama RMSNorm and rotary tables computed in the input's dtype (see the module docstring)."""
    from transformers.models.llama import modeling_llama as ml

    def rms_norm(self, x):  # LlamaRMSNorm.forward without the float32 round trip
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon))

    def rotary(self, x, position_ids):  # LlamaRotaryEmbedding.forward (default rope) in float64
        d = 2 * self.inv_freq.numel()
        inv_freq = 1.0 / (self.config.rope_parameters["rope_theta"] ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
        freqs = position_ids[..., None].double() * inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(x.dtype), emb.sin().to(x.dtype)

    saved = ml.LlamaRMSNorm.forward, ml.LlamaRotaryEmbedding.forward
    ml.LlamaRMSNorm.forward, ml.LlamaRotaryEmbedding.forward = rms_norm, rotary
    try:
        yield
    finally:
        ml.LlamaRMSNorm.forward, ml.LlamaRotaryEmbedding.forward = saved


def load_hf(family: str, directory: Path) -> torch.nn.Module:
    """The saved model, float64, eval mode (no dropout)."""
    return hf_class(family).from_pretrained(directory, dtype=torch.float64).eval()


def hf_loss_and_grads(family: str, directory: Path, inputs: torch.Tensor, targets: torch.Tensor
                      ) -> tuple[float, torch.Tensor, dict[str, torch.Tensor]]:
    """HF's loss (paratrain's: mean over micro-batches of each one's mean cross-entropy), logits
    ``[M, B, S, V]`` and gradients by HF name, for micro-batches ``inputs``/``targets`` ``[M, B, S]``."""
    with hf_float64():
        model = load_hf(family, directory)
        n = inputs.shape[0]
        total = torch.zeros((), dtype=torch.float64)
        logits = []
        for i in range(n):
            out = model(inputs[i]).logits
            loss = F.cross_entropy(out.flatten(0, 1), targets[i].flatten(), ignore_index=IGNORE_INDEX) / n
            loss.backward()
            total += loss.detach()
            logits.append(out.detach())
    grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    # BERT's decoder bias is cls.predictions.bias under another name (tied): one gradient
    if "cls.predictions.decoder.bias" in grads:
        grads["cls.predictions.bias"] = grads.pop("cls.predictions.decoder.bias")
    return float(total), torch.stack(logits), grads


def relative_error(a: torch.Tensor, ref: torch.Tensor) -> float:
    """``|a - ref| / |ref|`` (Frobenius), the per-tensor measure of the equivalence tests."""
    return float((a.detach().double() - ref.detach().double()).norm() / ref.detach().double().norm())

"""Building blocks shared by the reference GPT and BERT: attention, MLP, norms, rotary positions.

Legend: ``B`` batch (micro-batch), ``S`` sequence, ``H`` hidden, ``D`` head size, ``F`` FFN size,
``V`` vocabulary, ``N`` query heads held by this rank, ``K`` key/value heads held by this rank.

Head counts are never stored: every projection output is reshaped with ``-1`` heads, so the same
module runs unchanged when tensor parallelism gives each rank a column slice of the projections
(the ``N/tp`` local heads), as in torchtitan's Llama.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from paratrain.spec.model import Activation, ModelSpec, Norm

__all__ = ["Attention", "MLP", "Block", "activation", "make_norm", "token_embedding", "token_positions",
           "rotary_tables", "apply_rotary", "init_weights"]


def make_norm(spec: ModelSpec) -> nn.Module:
    # ModelSpec.norm_params: RMSNorm has a scale only; LayerNorm adds a bias unless ``bias`` is off.
    if spec.norm is Norm.RMSNORM:
        return nn.RMSNorm(spec.hidden, eps=1e-6 if spec.norm_eps is None else spec.norm_eps)
    return nn.LayerNorm(spec.hidden, eps=1e-5 if spec.norm_eps is None else spec.norm_eps, bias=spec.bias)


def activation(spec: ModelSpec, a: torch.Tensor) -> torch.Tensor:
    """The non-gated activation of the FFN (and of BERT's MLM transform)."""
    if spec.activation is Activation.RELU:
        return F.relu(a)
    return F.gelu(a, approximate="none" if spec.activation is Activation.GELU_EXACT else "tanh")


def token_embedding(tok: nn.Module, tokens_BS: torch.Tensor, pad_token: int | None) -> torch.Tensor:
    """``tok(tokens)``; with a pad token, its positions pass no gradient to the table (what
    ``nn.Embedding(padding_idx=...)`` does, written out so that it holds for a vocabulary-sharded
    table too). The forward value is unchanged."""
    x_BSH = tok(tokens_BS)
    if pad_token is None:
        return x_BSH
    return torch.where((tokens_BS == pad_token).unsqueeze(-1), x_BSH.detach(), x_BSH)


def token_positions(tokens_BS: torch.Tensor, positions: torch.Tensor | None) -> torch.Tensor:
    """The sequence positions of ``tokens_BS``'s columns: ``positions`` when this rank holds only
    some of the sequence's tokens (context parallelism), else 0 … S−1."""
    pos = positions if positions is not None else torch.arange(tokens_BS.shape[1])
    return pos.to(tokens_BS.device)


def rotary_tables(spec: ModelSpec) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin tables ``[S, D/2]`` of rotary position embedding (Su et al. 2021, eq. 34).

    Kept in float64: :func:`apply_rotary` casts them to the activations' dtype, so fp32 runs use
    the same rounded tables as before and float64 runs (the HF equivalence tests) lose nothing."""
    d = spec.head_dim
    inv_freq = 1.0 / (spec.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    angles = torch.outer(torch.arange(spec.seq, dtype=torch.float64), inv_freq)
    return angles.cos(), angles.sin()


def apply_rotary(x_BNSD: torch.Tensor, cos_SD2: torch.Tensor, sin_SD2: torch.Tensor) -> torch.Tensor:
    # Rotate the two halves of each head (the GPT-NeoX / Llama "rotate_half" convention).
    s = x_BNSD.shape[-2]
    cos, sin = cos_SD2[:s].to(x_BNSD.dtype), sin_SD2[:s].to(x_BNSD.dtype)
    x1, x2 = x_BNSD.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


class Attention(nn.Module):
    """Multi-head attention with optional grouped key/value heads (Ainslie et al. 2023)."""

    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        h, q, kv = spec.hidden, spec.q_dim, spec.kv_dim  # q = h unless head_size widens the heads
        self.head_dim = spec.head_dim
        self.q_per_kv = spec.heads // spec.num_kv_heads
        self.causal = spec.is_causal
        self.q = nn.Linear(h, q, bias=spec.bias)
        self.k = nn.Linear(h, kv, bias=spec.bias)
        self.v = nn.Linear(h, kv, bias=spec.bias)
        self.o = nn.Linear(q, h, bias=spec.bias)
        # context parallelism: ring attention over this rank's cp group (runtime.context_parallel.Ring,
        # called as ring(q, k, v)); None: the whole sequence is here
        self.ring: Any = None

    def forward(self, x_BSH: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        b, s = x_BSH.shape[0], x_BSH.shape[1]
        q_BNSD = self.q(x_BSH).view(b, s, -1, self.head_dim).transpose(1, 2)
        k_BKSD = self.k(x_BSH).view(b, s, -1, self.head_dim).transpose(1, 2)
        v_BKSD = self.v(x_BSH).view(b, s, -1, self.head_dim).transpose(1, 2)
        if rope is not None:
            q_BNSD = apply_rotary(q_BNSD, *rope)
            k_BKSD = apply_rotary(k_BKSD, *rope)
        if self.ring is not None:  # the ring carries the key/value heads and expands them per block
            y_BNSD = self.ring(q_BNSD, k_BKSD, v_BKSD)
            return self.o(y_BNSD.transpose(1, 2).reshape(b, s, -1))
        if self.q_per_kv > 1:
            # Each K/V head serves q_per_kv consecutive query heads; tensor parallelism splits
            # whole groups, so the local ratio is the global one.
            k_BKSD = k_BKSD.repeat_interleave(self.q_per_kv, dim=1)
            v_BKSD = v_BKSD.repeat_interleave(self.q_per_kv, dim=1)
        y_BNSD = F.scaled_dot_product_attention(q_BNSD, k_BKSD, v_BKSD, is_causal=self.causal)
        return self.o(y_BNSD.transpose(1, 2).reshape(b, s, -1))


class MLP(nn.Module):
    """Feed-forward block: ``fc2(act(fc1 x))``, or gated (Shazeer 2020): SwiGLU ``fc2(silu(gate x) * fc1 x)``,
    GeGLU ``fc2(gelu_tanh(gate x) * fc1 x)``."""

    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        h, f = spec.hidden, spec.ffn_size
        self.spec = spec
        self.fc1 = nn.Linear(h, f, bias=spec.bias)
        self.gate = nn.Linear(h, f, bias=spec.bias) if spec.activation.gated else None
        self.fc2 = nn.Linear(f, h, bias=spec.bias)

    def forward(self, x_BSH: torch.Tensor) -> torch.Tensor:
        if self.gate is not None:
            g = self.gate(x_BSH)
            g = F.silu(g) if self.spec.activation is Activation.SWIGLU else F.gelu(g, approximate="tanh")
            return self.fc2(g * self.fc1(x_BSH))
        return self.fc2(activation(self.spec, self.fc1(x_BSH)))


class Block(nn.Module):
    """A transformer layer. Pre-norm (GPT-2 onwards) or post-norm (the original BERT)."""

    def __init__(self, spec: ModelSpec, *, pre_norm: bool) -> None:
        super().__init__()
        self.pre_norm = pre_norm
        self.norm1 = make_norm(spec)
        self.attn = Attention(spec)
        self.norm2 = make_norm(spec)
        self.mlp = MLP(spec)

    def forward(self, x_BSH: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        if self.pre_norm:
            x_BSH = x_BSH + self.attn(self.norm1(x_BSH), rope)
            return x_BSH + self.mlp(self.norm2(x_BSH))
        x_BSH = self.norm1(x_BSH + self.attn(x_BSH, rope))
        return self.norm2(x_BSH + self.mlp(x_BSH))


def init_weights(model: nn.Module, seed: int, layers: int) -> None:
    """Initialize every parameter from ``seed`` alone, in a fixed (name-sorted) order.

    Normal(0, 0.02) for matrices and embeddings (GPT-2, Radford et al. 2019), scaled by
    ``1/sqrt(2·layers)`` for the projections that write into the residual stream (attention
    output and second FFN matrix, GPT-2 sec. 2.3); zeros for biases, ones for norm scales.
    Runs on full (unsharded) CPU tensors, so every parallel layout starts from the same numbers.
    """
    gen = torch.Generator(device="cpu").manual_seed(seed)
    residual_std = 0.02 / math.sqrt(2 * layers)
    seen: set[int] = set()
    for name, p in sorted(model.named_parameters(remove_duplicate=False), key=lambda kv: kv[0]):
        if id(p) in seen:
            continue
        seen.add(id(p))
        with torch.no_grad():
            if "norm" in name.split(".")[-2] or name.split(".")[-2].startswith("ln"):
                p.copy_(torch.ones_like(p) if name.endswith("weight") else torch.zeros_like(p))
            elif name.endswith("bias"):
                p.zero_()
            else:
                std = residual_std if name.endswith(("attn.o.weight", "mlp.fc2.weight")) else 0.02
                p.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float32) * std)

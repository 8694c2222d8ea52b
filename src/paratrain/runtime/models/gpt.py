"""Reference decoder-only GPT in plain torch, built from a :class:`ModelSpec`.

Pre-norm blocks (GPT-2, Radford et al. 2019), learned or rotary positions, optional grouped-query
attention and a gated MLP (SwiGLU or GeGLU), LayerNorm or RMSNorm, tied or untied output projection. With the Llama
options (rotary, RMSNorm, SwiGLU, no biases, untied) it is the Llama architecture.
Parameter count equals ``ModelSpec.param_count()`` exactly (tests/runtime/test_param_count.py).

Legend: ``B`` batch, ``S`` sequence, ``H`` hidden, ``V`` vocabulary.
"""

from __future__ import annotations

import torch
from torch import nn

from paratrain.spec.model import ModelSpec

from .base import TransformerLM
from .layers import Block, make_norm, token_embedding, token_positions

__all__ = ["GPT", "GPTEmbedding", "LMHead"]


class GPTEmbedding(nn.Module):
    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.tok = nn.Embedding(spec.vocab, spec.hidden)
        self.pos = nn.Embedding(spec.num_positions, spec.hidden) if spec.num_positions else None
        self.pad_token = spec.pad_token
        # the tokens' positions in the sequence when this rank holds only some of them (context
        # parallelism); None: all of them, in order
        self.positions: torch.Tensor | None = None

    def forward(self, tokens_BS: torch.Tensor) -> torch.Tensor:
        x_BSH = token_embedding(self.tok, tokens_BS, self.pad_token)
        if self.pos is not None:
            x_BSH = x_BSH + self.pos(token_positions(tokens_BS, self.positions))
        return x_BSH


class LMHead(nn.Module):
    """Final norm and output projection (no bias, as in GPT-2 and Llama)."""

    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.norm = make_norm(spec)
        self.proj = nn.Linear(spec.hidden, spec.vocab, bias=False)

    def forward(self, x_BSH: torch.Tensor) -> torch.Tensor:
        return self.proj(self.norm(x_BSH))


class GPT(TransformerLM):
    def __init__(self, spec: ModelSpec) -> None:
        super().__init__(spec)
        self.embed = GPTEmbedding(spec)
        self.blocks = nn.ModuleList(Block(spec, pre_norm=True) for _ in range(spec.layers))
        self.head = LMHead(spec)
        if spec.tied_embeddings:
            self.head.proj.weight = self.embed.tok.weight  # same [V, H] matrix (Press & Wolf 2017)

    def tie_weights(self) -> None:
        """Re-tie after a transformation that replaced the embedding's Parameter (sharding)."""
        if self.spec.tied_embeddings:
            self.head.proj.weight = self.embed.tok.weight

"""Reference BERT encoder with its masked-LM head, in plain torch, from a :class:`ModelSpec`.

Post-norm blocks as in the original (Devlin et al. 2019; Vaswani et al. 2017), learned
positions, two token types, embedding LayerNorm; the MLM head is dense -> activation -> norm ->
decoder (tied to the token embedding unless ``tied_embeddings`` is off) with its own bias.
Parameter count equals ``ModelSpec.param_count()`` exactly.

Legend: ``B`` batch, ``S`` sequence, ``H`` hidden, ``V`` vocabulary.
"""

from __future__ import annotations

import torch
from torch import nn

from paratrain.spec.model import ModelSpec

from .base import TransformerLM
from .layers import Block, activation, make_norm, token_embedding, token_positions

__all__ = ["BERT", "BertEmbedding", "MLMHead"]


class BertEmbedding(nn.Module):
    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.tok = nn.Embedding(spec.vocab, spec.hidden)
        self.pos = nn.Embedding(spec.num_positions, spec.hidden)
        self.segment = nn.Embedding(2, spec.hidden)  # token types: sentence A / B
        self.norm = make_norm(spec)
        self.pad_token = spec.pad_token
        self.positions: torch.Tensor | None = None  # context parallelism: this rank's tokens' positions

    def forward(self, tokens_BS: torch.Tensor) -> torch.Tensor:
        pos_S = token_positions(tokens_BS, self.positions)
        # One segment per sequence: every token has type 0 (masked LM without next-sentence).
        x_BSH = token_embedding(self.tok, tokens_BS, self.pad_token)
        x_BSH = x_BSH + self.pos(pos_S) + self.segment(torch.zeros_like(pos_S))
        return self.norm(x_BSH)


class MLMHead(nn.Module):
    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.spec = spec
        self.dense = nn.Linear(spec.hidden, spec.hidden, bias=spec.bias)
        self.norm = make_norm(spec)
        self.proj = nn.Linear(spec.hidden, spec.vocab, bias=True)

    def forward(self, x_BSH: torch.Tensor) -> torch.Tensor:
        return self.proj(self.norm(activation(self.spec, self.dense(x_BSH))))


class BERT(TransformerLM):
    def __init__(self, spec: ModelSpec) -> None:
        super().__init__(spec)
        self.embed = BertEmbedding(spec)
        self.blocks = nn.ModuleList(Block(spec, pre_norm=False) for _ in range(spec.layers))
        self.head = MLMHead(spec)
        if spec.tied_embeddings:
            self.head.proj.weight = self.embed.tok.weight

    def tie_weights(self) -> None:
        if self.spec.tied_embeddings:
            self.head.proj.weight = self.embed.tok.weight

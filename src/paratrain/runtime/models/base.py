"""The shape every reference model shares, so that tensor, data and pipeline parallelism treat
GPT and BERT alike: ``embed`` (tokens -> hidden states), ``blocks`` (a ModuleList of transformer
layers) and ``head`` (hidden states -> logits), plus ``loss``.

A pipeline engine cuts a model into :class:`ModelChunk` objects with :meth:`TransformerLM.chunk`:
the first chunk owns the embedding, the last one the head, every chunk a contiguous slice
``blocks[start:end]``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from paratrain.errors import ConfigError
from paratrain.spec.model import ModelSpec, Position

from .layers import rotary_tables

__all__ = ["TransformerLM", "ModelChunk", "IGNORE_INDEX"]

IGNORE_INDEX = -100  # targets with this value add nothing to the loss (PyTorch's convention)


class TransformerLM(nn.Module):
    """Base of :class:`GPT` and :class:`BERT`. Subclasses set ``embed``, ``blocks`` and ``head``."""

    embed: nn.Module
    blocks: nn.ModuleList
    head: nn.Module

    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.spec = spec
        if spec.position is Position.ALIBI:
            raise ConfigError("position", "alibi is modelled by the cost model only, the runtime's models have "
                              "learned or rotary positions", "train with --position rotary or learned")
        if spec.position is Position.ROTARY:
            cos, sin = rotary_tables(spec)
            # Not persistent: a function of the spec, not state to checkpoint or shard.
            self.register_buffer("rope_cos", cos, persistent=False)
            self.register_buffer("rope_sin", sin, persistent=False)
        else:
            self.rope_cos = None
            self.rope_sin = None
        self.positions: torch.Tensor | None = None  # set by context parallelism (see GPTEmbedding)

    def rope(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The rotary tables of the tokens this rank holds, in the order it holds them."""
        if self.rope_cos is None:
            return None
        return rope_at((self.rope_cos, self.rope_sin), self.positions)

    def forward(self, tokens_BS: torch.Tensor) -> torch.Tensor:
        x_BSH = self.embed(tokens_BS)
        rope = self.rope()
        for block in self.blocks:
            x_BSH = block(x_BSH, rope)
        return self.head(x_BSH)

    @staticmethod
    def loss(logits_BSV: torch.Tensor, targets_BS: torch.Tensor) -> torch.Tensor:
        """Mean cross-entropy over the targets that are not ``IGNORE_INDEX``.

        Works on plain logits and on vocabulary-sharded DTensor logits inside
        ``torch.distributed.tensor.parallel.loss_parallel()``.
        """
        return F.cross_entropy(logits_BSV.flatten(0, 1), targets_BS.flatten(), ignore_index=IGNORE_INDEX)

    def chunk(self, start: int, end: int) -> ModelChunk:
        """The pipeline chunk holding ``blocks[start:end]`` (plus embedding/head at the ends).

        The chunk shares parameters with this model (no copy). With tied embeddings and the
        embedding and head in different chunks, both chunks hold the same Parameter; a pipeline
        engine placing them on different ranks must keep a copy on the last stage and all-reduce
        the two gradients (Megatron-LM's "embedding group").
        """
        n = len(self.blocks)
        if not 0 <= start < end <= n:
            raise ValueError(f"chunk [{start}, {end}) is not a non-empty slice of {n} blocks")
        return ModelChunk(self, start, end)


def rope_at(tables: tuple[torch.Tensor, torch.Tensor], positions: torch.Tensor | None
            ) -> tuple[torch.Tensor, torch.Tensor]:
    """The rows of the rotary tables at ``positions`` (all of them, in order, for None)."""
    if positions is None:
        return tables
    pos = positions.to(tables[0].device)
    return tables[0][pos], tables[1][pos]


class ModelChunk(nn.Module):
    """``embed`` (first chunk only) -> ``blocks[start:end]`` -> ``head`` (last chunk only).

    Input: token ids ``[B, S]`` for the first chunk, hidden states ``[B, S, H]`` otherwise.
    Output: logits ``[B, S, V]`` for the last chunk, hidden states otherwise.
    """

    def __init__(self, model: TransformerLM, start: int, end: int) -> None:
        super().__init__()
        self.start, self.end = start, end
        self.is_first = start == 0
        self.is_last = end == len(model.blocks)
        self.embed = model.embed if self.is_first else None
        self.blocks = nn.ModuleList(model.blocks[start:end])
        self.head = model.head if self.is_last else None
        self._rope = model.rope  # bound method: the buffers stay owned by the full model
        self.positions: torch.Tensor | None = None  # set by context parallelism (see TransformerLM)
        self.loss = model.loss

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.embed is not None:
            x = self.embed(x)
        rope = self._rope()
        if rope is not None:
            rope = rope_at(rope, self.positions)
        for block in self.blocks:
            x = block(x, rope)
        if self.head is not None:
            x = self.head(x)
        return x

"""Reference models built from a :class:`~paratrain.spec.model.ModelSpec`."""

from __future__ import annotations

from paratrain.spec.model import Arch, ModelSpec

from .base import IGNORE_INDEX, ModelChunk, TransformerLM
from .bert import BERT
from .gpt import GPT
from .layers import init_weights

__all__ = ["BERT", "GPT", "IGNORE_INDEX", "ModelChunk", "TransformerLM", "build_model"]


def build_model(spec: ModelSpec, seed: int) -> TransformerLM:
    """The full model on CPU in fp32, initialized from ``seed`` alone (layout-independent)."""
    model: TransformerLM = BERT(spec) if spec.arch is Arch.BERT else GPT(spec)
    init_weights(model, seed, spec.layers)
    return model

"""Model-shape advice: nearby shapes with the same parameter count that run faster.

Anthony et al., "The Case for Co-Designing Model Architectures with Hardware" (2024), show that
GEMM shapes decide much of a transformer's speed: a hidden size, head size or vocabulary that is
not a multiple of the tensor-core tile (and of the tile × tensor-parallel degree) wastes part of
every kernel, and the tile count's wave quantization wastes more. This module enumerates shapes
near the given one — hidden size, attention heads, padded vocabulary, with the layer count
re-chosen to keep the parameter count within ±1 % — and ranks them by the GEMM-efficiency cost
model's time per token.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from paratrain.cost.compute import embedding_ops, head_ops, layer_ops, op_time_split
from paratrain.errors import ConfigError
from paratrain.spec.device import DeviceSpec
from paratrain.spec.model import ModelSpec

__all__ = ["ShapeAdvice", "model_time_s", "advise"]

_HEAD_DIMS = (64, 80, 96, 128, 160, 192, 256)  # head sizes used by public models


@dataclass(frozen=True)
class ShapeAdvice:
    layers: int
    hidden: int
    heads: int
    vocab: int
    ffn: int
    params: int
    time_s: float  # forward + backward of one micro-batch through the whole model, one TP rank
    speedup: float  # original time / this time, per token (same tokens per micro-batch)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def model_time_s(model: ModelSpec, device: DeviceSpec, *, tp: int = 1, microbatch: int = 1) -> float:
    """Forward + backward time of one micro-batch through all layers, embedding and head."""
    kw = dict(tp=tp, microbatch=microbatch, dtype=model.dtype)

    def total(ops: list) -> float:
        return sum(sum(op_time_split(op, device, model.dtype)) for op in ops)

    return (
        model.layers * total(layer_ops(model, **kw)) + total(embedding_ops(model, **kw)) + total(head_ops(model, **kw))
    )


def _padded(vocab: int, multiple: int) -> int:
    return -(-vocab // multiple) * multiple


def advise(
    model: ModelSpec,
    device: DeviceSpec,
    *,
    tp: int = 1,
    microbatch: int = 1,
    tolerance: float = 0.01,
    hidden_span: float = 0.15,
    limit: int = 8,
) -> list[ShapeAdvice]:
    """Shapes within ``tolerance`` of the parameter count predicted faster, best first.

    Hidden sizes within ±``hidden_span`` that are multiples of 8, heads giving a public head size,
    the vocabulary as given or padded to 64 and to 128·tp (Megatron-LM's padding rule); the FFN
    keeps its ratio to the hidden size.
    """
    if tp < 1 or model.heads % tp:
        raise ConfigError("tp", f"tp({tp}) must divide the {model.heads} heads", "pick a divisor of the head count")
    base_params = model.param_count()
    base_time = model_time_s(model, device, tp=tp, microbatch=microbatch)
    ffn_ratio = model.ffn_size / model.hidden
    vocabs = sorted({model.vocab, _padded(model.vocab, 64), _padded(model.vocab, 128 * tp)})
    lo, hi = int(model.hidden * (1 - hidden_span)), int(model.hidden * (1 + hidden_span))
    out: dict[tuple[int, int, int], ShapeAdvice] = {}
    for hidden in range(max(8, lo - lo % 8), hi + 1, 8):
        heads_options = {hidden // d for d in _HEAD_DIMS if hidden % d == 0}
        for heads in sorted(heads_options):
            if heads % tp or heads < 1:
                continue
            kv = model.num_kv_heads if model.kv_heads is not None and heads % model.num_kv_heads == 0 else None
            if model.kv_heads is not None and kv is None:
                continue
            ffn = int(round(hidden * ffn_ratio / (8 * tp))) * 8 * tp if model.ffn is not None else None
            for vocab in vocabs:
                try:
                    probe = model.with_overrides(
                        hidden=hidden, heads=heads, vocab=vocab, layers=1, kv_heads=kv, ffn=ffn
                    )
                    if probe.head_size is not None:  # the head size is hidden/heads, one of _HEAD_DIMS
                        probe = dataclasses.replace(probe, head_size=None)
                except ConfigError:
                    continue
                per_layer = probe.params_per_layer()
                fixed = probe.param_count() - per_layer
                layers = round((base_params - fixed) / per_layer)
                if layers < 1:
                    continue
                cand = dataclasses.replace(probe, layers=layers)
                params = cand.param_count()
                if abs(params - base_params) > tolerance * base_params:
                    continue
                t = model_time_s(cand, device, tp=tp, microbatch=microbatch)
                # Per token of useful work: scale by the parameter ratio so a slightly smaller
                # model is not credited with its smaller FLOP count.
                speedup = base_time / t * (params / base_params)
                key = (layers, hidden, heads)  # keep the best vocabulary padding of each shape
                if key not in out or speedup > out[key].speedup:
                    out[key] = ShapeAdvice(layers, hidden, heads, vocab, cand.ffn_size, params, t, speedup)
    ranked = sorted((a for a in out.values() if a.speedup > 1.0 + 1e-6), key=lambda a: -a.speedup)
    return ranked[:limit]

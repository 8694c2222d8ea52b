"""Gradient compression: Ok-Topk (Li & Hoefler, PPoPP'22) and its baselines, in one interface.

``--compress NAME --density D``: each data-parallel rank reduces its whole gradient as one flat
view with a :class:`~paratrain.runtime.compress.base.Compressor` (residual / error feedback kept by
the compressor) after a number of dense warm-up steps (``--compress-warmup``):

- ``oktopk``: :class:`~paratrain.runtime.compress.oktopk.OkTopk`, sparse all-reduce below 6k.
- ``topka``, ``gtopk``, ``gaussiank``: :mod:`~paratrain.runtime.compress.baselines`.
- ``powersgd``: torch's own PowerSGD hook (:mod:`~paratrain.runtime.compress.powersgd`), rank 4.

With ``--optimizer sgd``, :mod:`~paratrain.runtime.compress.momentum` adds Deep Gradient
Compression's momentum correction, masking, local clipping and density warm-up around the sparse ones.

:class:`~paratrain.runtime.compress.sync.CompressedGradSync` is the data-parallel reduction that
uses them; the pipeline executor calls :func:`make_compressor` per model chunk.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from paratrain.errors import ConfigError

from .base import Comm, Compressor, ReductionStats
from .baselines import Gaussiank, GTopk, TopkA
from .oktopk import OkTopk
from .powersgd import POWERSGD_RANK, PowerSGD

__all__ = ["Comm", "Compressor", "ReductionStats", "OkTopk", "TopkA", "GTopk", "Gaussiank", "PowerSGD",
           "POWERSGD_RANK", "make_compressor", "check_group_size"]


def check_group_size(name: str, size: int) -> None:
    """gTop-k's recursive doubling pairs ranks: it needs a power-of-two group."""
    if name == "gtopk" and size & (size - 1):
        raise ConfigError("--compress", f"gtopk pairs ranks by recursive doubling and needs a power-of-two "
                          f"reduction group, got {size} ranks", "use --dp 1, 2, 4, 8, ... or another compressor")


def make_compressor(name: str, group: dist.ProcessGroup | None, density: float,
                    shapes: list[torch.Size]) -> Compressor:
    """A fresh compressor (its own residual) for one flat gradient made of pieces of ``shapes``."""
    check_group_size(name, dist.get_world_size(group))
    if name == "oktopk":
        return OkTopk(group, density)
    if name == "topka":
        return TopkA(group, density)
    if name == "gtopk":
        return GTopk(group, density)
    if name == "gaussiank":
        return Gaussiank(group, density)
    if name == "powersgd":
        return PowerSGD(group, shapes)
    raise ConfigError("--compress", f"unknown compressor {name!r}",
                      "use one of: none, oktopk, topka, gtopk, gaussiank, powersgd")

"""Deep Gradient Compression's corrections for sparse reduction under SGD with momentum (Lin et al.,
ICLR'18, arXiv:1712.01887, §3), around any sparse compressor of this package.

With plain error feedback the optimizer applies momentum *after* the reduction, to a sparse
vector: an entry that waited in the residual for ~1/density steps arrives at once and is then
amplified by the momentum over the following steps, while the momentum of every entry not sent
decays. DGC moves the momentum before the compression, onto each rank:

- **Momentum correction**: ``u = m·u + g`` (this rank's momentum), ``v = v + u`` (the residual,
  kept by the compressor), the compressor sends entries of ``v``; the optimizer then steps
  without momentum. Sending everything (density 1) sends ``u`` each step, whose mean over the
  ranks is the dense momentum: exactly SGD with momentum on the mean gradient.
- **Momentum factor masking**: where an entry was sent (left the residual), its ``u`` is zeroed
  too, so a stale momentum does not keep pushing it. This changes density 1 into plain SGD (every
  ``u`` is zeroed each step); it is the paper's remedy for staleness at low density.
- **Local gradient clipping**: the residual accumulates local gradients, so clipping moves before
  the accumulation, on each rank, by its share of the global threshold: ``1/sqrt(P)`` of it
  (the paper's scaling for ranks with identically distributed gradients), applied here to the
  rank's contribution ``g/P`` to the mean. The global-norm clip after the reduction is skipped
  (it would scale a sum of momenta, and lose what error feedback counted as applied).
- **Warm-up** (:func:`density_at`): density starts at 25 % on the first compressed step and
  falls exponentially to the target (the paper: 75 % → 93.75 % → … → 99.9 % sparsity over the
  first epochs).

Apart from DGC, for every sparse compressor (:class:`ResidualLrScaling`, on by default): error
feedback in units of the update. The optimizer multiplies what arrives by the current learning
rate, so a residual of raw gradients sends ``lr_t · Σ g_j`` for the steps ``j`` an entry waited,
where dense SGD applied ``Σ lr_j · g_j``: under warm-up (lr rising 30× over the first steps) early
gradients land amplified, under cosine decay late ones shrunk, and the run's last residuals are
never applied. The error-feedback analyses keep ``lr · g`` in the memory instead (Stich,
Cordonnier & Jaggi, NeurIPS'18, "Sparsified SGD with memory": ``m + η_t g_t``; Karimireddy et al.,
ICML'19, EF-SGD: ``p_t = γ g_t + e_t``). Here the residuals are rescaled by ``lr_{t-1} / lr_t``
before step ``t``'s reduction, which is the same and keeps them (and the reused thresholds) in the
current step's gradient units: entry × ``lr_t`` = ``Σ lr_j · g_j``. Under a constant learning
rate it changes nothing.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from ..config import TrainConfig

__all__ = ["DgcSettings", "MomentumCorrection", "density_at", "clip_local_", "live_entries", "dgc_settings",
           "ResidualLrScaling", "residuals_of"]

DGC_START_DENSITY = 0.25  # the paper's first warm-up stage (75 % sparsity)


@dataclass(frozen=True)
class DgcSettings:
    """What of DGC a reduction uses (module docstring). ``momentum`` 0: no momentum correction (the
    optimizer keeps its own); ``clip``: the run's global clip threshold (inf: none);
    ``density_warmup``: compressed steps of the 25 % → target ramp (0: none)."""

    momentum: float = 0.0
    masking: bool = True
    clip: float = math.inf
    density_warmup: int = 0

    @property
    def corrects(self) -> bool:
        return self.momentum > 0


def density_at(call: int, target: float, warmup: int) -> float:
    """Density of compressed call ``call`` (0-based): 25 % at call 0, geometrically down to
    ``target`` at call ``warmup`` and after (a target above 25 % is used from the start)."""
    if call >= warmup or target >= DGC_START_DENSITY:
        return target
    return DGC_START_DENSITY * (target / DGC_START_DENSITY) ** (call / warmup)


def clip_local_(grads: list[torch.Tensor], clip: float, ranks: int) -> None:
    """DGC's local clipping: scale this rank's gradients (its mean-loss gradient, whose ``1/ranks``
    is its share of the group mean) so that that share has norm at most ``clip / sqrt(ranks)``,
    i.e. ``||g|| <= clip * sqrt(ranks)``; the same coefficient form as the global clip."""
    if math.isinf(clip):
        return
    norm = torch.sqrt(sum((g.double().pow(2).sum() for g in grads), torch.zeros((), dtype=torch.float64)))
    coef = torch.clamp(clip * math.sqrt(ranks) / (norm + 1e-6), max=1.0)
    with torch.no_grad():
        for g in grads:
            g.mul_(coef.to(g.dtype))


class MomentumCorrection:
    """This rank's momentum ``u`` of one flat gradient (module docstring).

    ``accumulate(flat)`` turns the gradient into ``u = m·u + g`` in place (what the compressor then
    adds to its residual ``v`` and selects from); ``mask(sent)`` zeroes ``u`` where entries were sent.
    """

    def __init__(self, momentum: float) -> None:
        self.momentum = momentum
        self.u: torch.Tensor | None = None

    def accumulate(self, flat: torch.Tensor) -> torch.Tensor:
        if self.u is None:  # torch's SGD: the first buffer is the gradient itself
            self.u = flat.detach().clone()
        else:
            self.u.mul_(self.momentum).add_(flat)
            flat.copy_(self.u)
        return flat

    def mask(self, sent: torch.Tensor) -> None:
        """Momentum factor masking: ``sent`` is a boolean mask of the entries that left the residual."""
        if self.u is not None:
            self.u.masked_fill_(sent, 0)


def live_entries(residual: torch.Tensor | None, u: torch.Tensor) -> torch.Tensor:
    """Entries of ``v = residual + u`` that are nonzero before a reduction: afterwards, those whose
    residual is 0 are the ones this rank sent (every compressor zeroes exactly what it sent)."""
    return (u != 0) if residual is None else (residual + u) != 0


def dgc_settings(train: TrainConfig) -> DgcSettings | None:
    """The run's DGC settings (``None``: plain error feedback, the optimizer keeps its momentum)."""
    from ..optim import SGD_MOMENTUM

    if not (train.compress_momentum_correction or train.compress_density_warmup):
        return None
    return DgcSettings(momentum=SGD_MOMENTUM if train.compress_momentum_correction else 0.0,
                       masking=train.compress_momentum_masking, clip=train.grad_clip,
                       density_warmup=train.compress_density_warmup)


def residuals_of(executor: Any) -> list[torch.Tensor]:
    """The error-feedback residuals of an executor's compressed reductions: the data-parallel
    reduction's (one flat view) or the pipeline's (one per local chunk); those not made yet (dense
    warm-up, no compression) and PowerSGD's (inside torch's hook state) are not listed."""
    sync = getattr(executor, "grad_sync", None)
    reducers = [sync.reducer] if hasattr(sync, "reducer") else list(getattr(executor, "reducers", []))
    found = (getattr(r.compressor, "residual", None) for r in reducers)
    return [t for t in found if isinstance(t, torch.Tensor)]


class ResidualLrScaling:
    """Keeps error feedback in units of the update under a varying learning rate (module
    docstring): ``before_step(executor, lr)`` multiplies every residual by ``lr_prev / lr``."""

    def __init__(self) -> None:
        self.prev: float | None = None

    @staticmethod
    def factor(prev: float | None, lr: float) -> float:
        """The residual's factor before a step at ``lr`` after one at ``prev`` (1: nothing to do; a
        step at lr 0 applies nothing, so the residual waits in the last nonzero step's units)."""
        return 1.0 if prev is None or lr <= 0 or prev == lr else prev / lr

    def before_step(self, executor: Any, lr: float) -> None:
        f = self.factor(self.prev, lr)
        if f != 1.0:
            with torch.no_grad():
                for r in residuals_of(executor):
                    r.mul_(f)
        if lr > 0:
            self.prev = lr

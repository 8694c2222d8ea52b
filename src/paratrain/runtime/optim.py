"""The optimizer step every executor shares: learning-rate schedule, gradient norm over shards,
global-norm clipping and AdamW.

The step loop (:mod:`paratrain.runtime.train`) clips and steps once the gradients of a step are
reduced; a pipeline schedule does so at each of its ``U`` actions, with the norm it computed over
the ranks that step together.
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Replicate

from .comm import layer as comm
from .config import TrainConfig
from .data_parallel import local_tensor
from .mesh import RuntimeContext

__all__ = ["lr_at", "counts_here", "grad_norm_sq", "global_grad_norm", "clip_grads_", "Optimizer", "SGD_MOMENTUM"]

SGD_MOMENTUM = 0.9  # --optimizer sgd (the Ok-Topk and DGC papers' runs)


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Linear warm-up over ``warmup`` steps, then cosine decay to ``lr * min_lr_ratio`` at the last step."""
    w = cfg.warmup
    if step < w:
        return cfg.lr * (step + 1) / w
    span = max(1, cfg.steps - 1 - w)
    progress = min(1.0, (step - w) / span)
    floor = cfg.lr * cfg.min_lr_ratio
    return floor + 0.5 * (cfg.lr - floor) * (1.0 + math.cos(math.pi * progress))


def counts_here(p: torch.Tensor, ctx: RuntimeContext) -> bool:
    """Whether this rank's copy of ``p`` is the one counted in the global norm.

    A shard counts on every rank holding a distinct piece; a replicated copy counts only on the
    rank at coordinate 0 of each mesh axis it is replicated over (dp, cp and tp; pipeline stages
    hold distinct parameters, so pp never duplicates).
    """
    coords = ctx.coords
    sharded_axes: set[str] = set()
    g = p.grad
    if isinstance(g, DTensor):
        names = g.device_mesh.mesh_dim_names or ()
        # a flattened axis ("dp_cp": FSDP over data- and context-parallel ranks) shards both
        sharded_axes = {a for n, pl in zip(names, g.placements, strict=True) if not isinstance(pl, Replicate)
                        for a in n.split("_")}
    return all(coords[a] == 0 for a in ("dp", "cp", "tp") if a not in sharded_axes)


def grad_norm_sq(params: list[torch.Tensor], ctx: RuntimeContext) -> torch.Tensor:
    """This rank's share of the squared global gradient norm (fp64 scalar; sum it over the ranks)."""
    sq = torch.zeros((), dtype=torch.float64, device=ctx.device)  # a scalar: fp64 costs nothing
    for p in params:
        if p.grad is not None and counts_here(p, ctx):
            g = local_tensor(p.grad).detach()
            sq += g.to(torch.promote_types(g.dtype, torch.float32)).pow(2).sum()
    return sq


def global_grad_norm(params: list[nn.Parameter], ctx: RuntimeContext) -> torch.Tensor:
    """L2 norm of all gradients of the whole model, identical on every rank (one all-reduce)."""
    sq = grad_norm_sq(list(params), ctx)
    if ctx.world_size > 1:
        comm.all_reduce(sq, axis="none", purpose="grad_norm")
    return sq.sqrt()


def clip_grads_(params: list[nn.Parameter], norm: torch.Tensor, max_norm: float) -> float:
    """Scale gradients so that ``norm`` (theirs, computed by the caller) becomes at most ``max_norm``."""
    coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    grads = [local_tensor(p.grad) for p in params if p.grad is not None]
    with torch.no_grad():
        if grads and _on_gpu(grads):  # one multi-tensor kernel instead of one launch per tensor
            torch._foreach_mul_(grads, coef)
        else:
            for g in grads:
                g.mul_(coef)
    return float(norm)


def _on_gpu(tensors: list[torch.Tensor]) -> bool:
    return tensors[0].device.type == "cuda"


class Optimizer:
    """AdamW (``--optimizer sgd``: SGD with momentum) over this rank's parameters with the run's
    learning-rate schedule and clipping.

    No weight decay on biases and norm scales (nanoGPT). On the CPU ``foreach=False`` keeps the
    per-tensor kernels, whose results do not depend on how parameters are grouped across ranks; on
    a GPU the multi-tensor (``foreach``) kernels, element-wise too, launch a few kernels per step
    instead of several per tensor, which held a one-GPU GPT-2 step host-bound.
    """

    def __init__(self, params: list[torch.Tensor], train: TrainConfig, *, decay: list[bool] | None = None) -> None:
        """``decay``: which of ``params`` take weight decay (default: the matrices, ``dim() >= 2``)."""
        self.params, self.train = params, train
        flags = [p.dim() >= 2 for p in params] if decay is None else decay
        decay = [p for p, d in zip(params, flags, strict=True) if d]
        rest = [p for p, d in zip(params, flags, strict=True) if not d]
        groups = [{"params": decay, "weight_decay": train.weight_decay}, {"params": rest, "weight_decay": 0.0}]
        self.inner: torch.optim.Optimizer
        foreach = bool(params) and _on_gpu(params)
        if train.optimizer == "sgd":
            # --optimizer sgd: SGD with momentum, the optimizer sparse all-reduce is analysed and
            # trained with (Ok-Topk, Li & Hoefler 2022); decay decoupled as in AdamW (self.step)
            self.decay, self.lr = decay, train.lr
            # --compress-momentum-correction: each rank accumulates the momentum before compression
            # (DGC, runtime/compress/momentum.py); what arrives is already a sum of momenta
            momentum = 0.0 if train.compress_momentum_correction else SGD_MOMENTUM
            self.inner = torch.optim.SGD(params, lr=train.lr, momentum=momentum, foreach=foreach)
        else:
            self.adamw = torch.optim.AdamW(groups, lr=train.lr, betas=train.betas, eps=1e-8, foreach=foreach)
            self.inner = self.adamw

    def grad_norm_sq(self, params: list[nn.Parameter], ctx: RuntimeContext) -> torch.Tensor:
        """This rank's share of the squared norm of ``params``' gradients (:func:`grad_norm_sq`)."""
        return grad_norm_sq(params, ctx)

    def global_norm(self, ctx: RuntimeContext) -> torch.Tensor:
        """The gradients' L2 norm over every rank (:func:`global_grad_norm`)."""
        return global_grad_norm(self.params, ctx)

    def set_step(self, step: int) -> float:
        """Set the learning rate of ``step`` (0-based); returns it."""
        lr = self.lr = lr_at(step, self.train)
        for group in self.inner.param_groups:
            group["lr"] = lr
        return lr

    def clip(self, norm: torch.Tensor) -> float:
        """Scale the gradients by ``min(1, grad_clip / norm)``; ``norm`` is their norm over the ranks
        that step together. Returns the norm. With ``--compress-momentum-correction`` each rank
        clipped its own gradient before compression (DGC's local clipping) and nothing is scaled here."""
        if self.train.compress_momentum_correction:
            return float(norm)
        return clip_grads_(self.params, norm, self.train.grad_clip)

    def step(self) -> None:
        """AdamW (or SGD) on the (reduced, clipped) gradients, then drop them."""
        if self.train.optimizer == "sgd" and self.train.weight_decay:
            with torch.no_grad():
                for p in self.decay:
                    p.mul_(1 - self.lr * self.train.weight_decay)
        self.inner.step()
        self.inner.zero_grad(set_to_none=True)

"""K-FAC (Martens & Grosse, ICML'15) for the reference models' linear layers, in pieces a pipeline
schedule can place in its bubbles (PipeFisher, Osawa et al. MLSys'23).

For a linear layer ``y = x Wᵀ + b`` the Fisher block of ``[W | b]`` is approximated by the
Kronecker product ``A ⊗ G`` of two small matrices (the K-FAC independence assumption):

* ``A = (1/n) Σ_i a_i a_iᵀ`` over the ``n`` token rows of the global batch, ``a_i = [x_i, 1]``
  (the 1 only with a bias);
* ``G = (1/n) Σ_i g_i g_iᵀ`` with ``g_i = n ∂L/∂y_i``, the output gradient of token row ``i`` of
  the mean loss ``L``, rescaled to a per-row gradient (kfac-pytorch multiplies by the batch size
  the same way). This is the empirical Fisher: the gradients of the training loss, no sampled labels.

Every micro-batch adds its own rows, scaled up front (PipeFisher's scaling: inputs by ``1/n``,
output gradients by ``n / dp²`` because each rank's loss is the mean over its own share and the
data-parallel reduction divides by ``dp``), so the pieces of all micro-batches and all
data-parallel ranks *sum* to the full-batch factors; the factor all-reduce is a plain sum.

The work comes in the pieces the fill pass (``paratrain.sim.fill``) schedules as filler actions:

* ``kfac.curv.<mb>`` — :meth:`Kfac.curvature`: ``aᵀa`` and ``gᵀg`` of micro-batch ``mb``'s saved
  inputs and output gradients (captured by hooks, only in the first step of a cycle);
* ``kfac.reduce`` — :meth:`Kfac.reduce`: sum this cycle's factors over the ranks holding the same
  layers (data-parallel ranks; Chimera's other replica), then the running average
  ``F ← decay·F + (1−decay)·F_new`` (the first cycle takes ``F_new``; kfac-pytorch's
  ``factor_decay``);
* ``kfac.inv.<k>`` — :meth:`Kfac.invert`: the damped inverses ``(A + λI)⁻¹`` and ``(G + λI)⁻¹``
  of the ``k``-th group of layers (Cholesky; each factor damped by ``λ`` separately, kfac-pytorch's
  INVERSE method, not the π-split of Martens & Grosse).

Refresh: a cycle is ``refresh`` steps. Curvature comes from the first step of each cycle; the
inverses computed during cycle ``c`` become active at the first step of cycle ``c+1``, wherever in
cycle ``c`` their pieces ran. So a run whose pieces sit in bubbles and a run that does them all at
the optimizer step of the cycle's first step (:meth:`Kfac.run_cycle_work`, no pipeline) compute the
same numbers. Cycle 0 has no inverses: it steps on the raw gradients (PipeFisher instead runs one
synchronous K-FAC step first; leaving that out keeps both runtimes identical).

Every step (the ``U`` action): the gradient ``M = [∇W | ∇b]`` of each preconditioned layer becomes
``G⁻¹ M A⁻¹``, then all of them are scaled by kfac-pytorch's KL clip
``ν = min(1, sqrt(kl_clip / |Σ lr² ⟨precond, grad⟩|))`` (the sum over the whole model). The base
update is SGD with momentum (kfac-pytorch's examples; K-FAC's step already carries curvature) with
AdamW-style decoupled weight decay on matrices. Preconditioned: every ``nn.Linear`` inside the
transformer blocks. Not preconditioned (plain SGD): embeddings, norms and the output head (a
``vocab × vocab`` factor, and often tied to the embedding).
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from paratrain.errors import ConfigError
from paratrain.schedule.filled import CURV, INV, REDUCE, FilledSchedule, curv_group, kfac_piece, layer_groups
from paratrain.schedule.ir import ActionKind, Schedule
from paratrain.schedule.validate import validate

from .comm import layer as comm
from .config import TrainConfig
from .mesh import RuntimeContext
from .optim import Optimizer, clip_grads_, lr_at

__all__ = ["KfacLayer", "Kfac", "KfacOptimizer", "linear_layers", "cost_indices", "inv_group_count", "damped_inverse",
           "build_kfac_optimizer", "make_optimizer", "load_filled"]

FILLER_PREFIX = "kfac."


def linear_layers(module: nn.Module) -> list[tuple[str, nn.Linear]]:
    """The preconditioned layers of a model or chunk: ``nn.Linear`` modules inside ``blocks``."""
    return [(n, m) for n, m in module.named_modules()
            if isinstance(m, nn.Linear) and re.search(r"(^|\.)blocks\.", n)]


# The fill pass counts four K-FAC layers per transformer layer (cost/kfac.py: QKV, attention
# output, FFN up with its gate, FFN down); the runtime's linears map onto them so that a split
# curvature piece ``kfac.curv.<m>.<k>`` and ``kfac.inv.<k>`` cover the layers the pass assumed
# (under Chimera a micro-batch passes one of a rank's two chunks: a group straddling the chunks
# would leave some layers without curvature).
_COST_LAYER = {"q": 0, "k": 0, "v": 0, "o": 1, "fc1": 2, "gate": 2, "fc2": 3}
COST_LAYERS_PER_BLOCK = 4


def cost_indices(names: Sequence[str]) -> list[int]:
    """Index of each linear layer of a chunk (names as :func:`linear_layers` gives them) among the
    chunk's K-FAC layers as the cost model counts them; their own positions for unknown layers."""
    out = []
    for n in names:
        m = re.search(r"(?:^|\.)blocks\.(\d+)\.", n)
        leaf = n.rsplit(".", 1)[-1]
        if m is None or leaf not in _COST_LAYER:
            return list(range(len(names)))
        out.append(COST_LAYERS_PER_BLOCK * int(m.group(1)) + _COST_LAYER[leaf])
    return out


def inv_group_count(iterations: Sequence[Schedule], rank: int) -> int:
    """Inversion groups of ``rank`` in a filled schedule (distinct ``kfac.inv.<k>`` tags, numbered
    0..k-1); other ``kfac.*`` tags than the three pieces are an error."""
    invs = set()
    for s in iterations:
        for a in s.actions[rank]:
            if a.kind is not ActionKind.FILLER or not (a.tag or "").startswith(FILLER_PREFIX):
                continue
            piece = kfac_piece(a.tag)
            if piece is None:
                raise ConfigError("filled schedule", f"unknown K-FAC filler {a.tag!r} on rank {rank}",
                                  f"use {CURV}.<micro-batch>, {REDUCE} or {INV}.<group>")
            if piece[0] == "inv":
                invs.add(piece[1])
    if invs != set(range(len(invs))):
        raise ConfigError("filled schedule", f"K-FAC inversion groups of rank {rank} must be numbered 0..k-1, "
                          f"got {sorted(invs)}", "number the kfac.inv pieces of a rank from 0")
    return len(invs)


@dataclass
class KfacLayer:
    """One preconditioned linear layer and its K-FAC state."""

    name: str
    module: nn.Linear
    key: tuple[int, str] = (0, "")  # (chunk, name in chunk): the order of the factor all-reduce
    cost_index: int = -1  # index among the rank's K-FAC layers as the fill pass counts them (-1: own position)
    group: dist.ProcessGroup | None = None  # ranks whose curvature of this layer is summed (None: alone)
    counted: bool = True  # this copy counts in the model-wide KL sum (one copy per layer)
    saved_a: dict[int, list[torch.Tensor]] = field(default_factory=dict)  # micro-batch -> inputs
    saved_g: dict[int, list[torch.Tensor]] = field(default_factory=dict)  # micro-batch -> output grads
    new_a: torch.Tensor | None = None  # this cycle's factors, summed over micro-batches
    new_g: torch.Tensor | None = None
    a: torch.Tensor | None = None  # running averages
    g: torch.Tensor | None = None
    pending: tuple[torch.Tensor, torch.Tensor] | None = None  # inverses of this cycle (A⁻¹, G⁻¹)
    active: tuple[torch.Tensor, torch.Tensor] | None = None  # inverses the preconditioner uses

    @property
    def has_bias(self) -> bool:
        return self.module.bias is not None

    def grad_matrix(self) -> torch.Tensor | None:
        w = self.module.weight.grad
        if w is None:
            return None
        b = self.module.bias.grad if self.has_bias else None
        if self.has_bias:
            b = torch.zeros_like(self.module.bias) if b is None else b
            return torch.cat([w, b.unsqueeze(1)], dim=1)
        return w


class Kfac:
    """K-FAC state of this rank's layers, split into the pieces of the module docstring.

    ``tokens``: the ``n`` token rows of the global batch; ``dp``: the ranks the batch's tokens are
    split over, data- times context-parallel (the loss each rank differentiates is the mean over
    its own tokens; the reduction divides by ``dp``).
    """

    def __init__(self, layers: list[KfacLayer], *, tokens: int, dp: int, damping: float = 1e-3,
                 factor_decay: float = 0.95, kl_clip: float = 1e-3, refresh: int = 1, inv_groups: int = 1) -> None:
        self.layers = layers
        self.damping, self.factor_decay, self.kl_clip, self.refresh = damping, factor_decay, kl_clip, refresh
        self.scale_a = 1.0 / tokens
        self.scale_g = tokens / dp**2
        self.capturing = False
        self.key = 0  # the micro-batch whose forward runs (set by the executor)
        self.step = -1
        # inversion group k: the layers whose cost-model index is in the pass's group k
        idx = [lay.cost_index if lay.cost_index >= 0 else i for i, lay in enumerate(layers)]
        ranges = layer_groups(max(idx) + 1 if idx else 0, inv_groups)
        self.groups = [[i for i, c in enumerate(idx) if c in r] for r in ranges]
        self._handles = [lay.module.register_forward_hook(self._hook(lay)) for lay in layers]

    # ----- capture ---------------------------------------------------------------------------------
    def _hook(self, lay: KfacLayer) -> Callable[..., None]:
        def forward_hook(module: nn.Module, args: tuple[torch.Tensor, ...], out: torch.Tensor) -> None:
            if not (self.capturing and torch.is_grad_enabled() and out.requires_grad):
                return
            key = self.key  # bound now: the backward of this micro-batch may run much later
            lay.saved_a.setdefault(key, []).append(args[0].detach())

            fired: list[bool] = []

            def grad_hook(g: torch.Tensor) -> None:
                if not fired:  # once per forward, whatever later passes (zero-bubble W) do
                    fired.append(True)
                    lay.saved_g.setdefault(key, []).append(g.detach())

            out.register_hook(grad_hook)
        return forward_hook

    def remove_hooks(self) -> None:
        for h in self._handles:
            h.remove()

    # ----- the cycle -------------------------------------------------------------------------------
    def begin_step(self, step: int) -> None:
        """Start ``step`` (idempotent): at a cycle's first step turn capture on and activate the
        inverses the previous cycle computed; otherwise capture is off."""
        if step == self.step:
            return
        self.step = step
        first = step % self.refresh == 0
        if first:
            for lay in self.layers:
                if lay.pending is not None:
                    lay.active, lay.pending = lay.pending, None
        self.capturing = first

    def curvature(self, mb: int, group: int | None = None) -> None:
        """Add micro-batch ``mb``'s factor pieces (``kfac.curv.<mb>``; with ``group``, only the
        layers of that inversion group: ``kfac.curv.<mb>.<group>``); frees the saved tensors."""
        layers = self.layers if group is None else [self.layers[i] for i in self.groups[group]]
        for lay in layers:
            xs, gs = lay.saved_a.pop(mb, None), lay.saved_g.pop(mb, None)
            if xs is None and gs is None:
                continue
            if xs is None or gs is None or len(xs) != len(gs):
                raise RuntimeError(f"K-FAC curvature of micro-batch {mb}, layer {lay.name}: "
                                   f"{len(xs or [])} saved inputs but {len(gs or [])} output gradients "
                                   "(the piece was placed before the micro-batch's backward)")
            for x, gy in zip(xs, gs, strict=True):
                x2 = x.reshape(-1, x.shape[-1])
                if lay.has_bias:
                    x2 = torch.cat([x2, x2.new_ones(x2.shape[0], 1)], dim=1)
                g2 = gy.reshape(-1, gy.shape[-1])
                pa = (x2.T @ x2) * self.scale_a
                pg = (g2.T @ g2) * self.scale_g
                lay.new_a = pa if lay.new_a is None else lay.new_a + pa
                lay.new_g = pg if lay.new_g is None else lay.new_g + pg

    def pending_curvature(self) -> list[int]:
        """Micro-batches whose saved tensors no curvature piece has consumed yet."""
        return sorted({k for lay in self.layers for k in (*lay.saved_a, *lay.saved_g)})

    def reduce(self) -> None:
        """Sum this cycle's factors over each layer's group, then update the running averages
        (``kfac.reduce``). One all-reduce per group, over the flattened factors in layer order."""
        by_group: dict[int, list[KfacLayer]] = {}
        for lay in self.layers:
            if lay.new_a is None:
                raise RuntimeError(f"K-FAC reduce before any curvature of layer {lay.name}")
            by_group.setdefault(id(lay.group), []).append(lay)
        for lays in by_group.values():
            lays.sort(key=lambda lay: lay.key)  # every member flattens the same layers in the same order
            group = lays[0].group
            if group is None:
                continue
            flat = torch.cat([t.reshape(-1) for lay in lays for t in (lay.new_a, lay.new_g)])
            comm.all_reduce(flat, group, axis="dp", purpose="kfac_factors")
            off = 0
            for lay in lays:
                for attr in ("new_a", "new_g"):
                    t = getattr(lay, attr)
                    setattr(lay, attr, flat[off: off + t.numel()].view_as(t))
                    off += t.numel()
        d = self.factor_decay
        for lay in self.layers:
            lay.a = lay.new_a if lay.a is None else d * lay.a + (1 - d) * lay.new_a
            lay.g = lay.new_g if lay.g is None else d * lay.g + (1 - d) * lay.new_g
            lay.new_a = lay.new_g = None

    def invert(self, k: int) -> None:
        """Damped inverses of the ``k``-th layer group (``kfac.inv.<k>``), active next cycle."""
        for i in self.groups[k]:
            lay = self.layers[i]
            if lay.a is None or lay.g is None:
                raise RuntimeError(f"K-FAC inversion before the factor reduction of layer {lay.name}")
            lay.pending = (damped_inverse(lay.a, self.damping), damped_inverse(lay.g, self.damping))

    def run_cycle_work(self) -> None:
        """Every piece at once (no fillers): at the optimizer step of a cycle's first step."""
        if self.step % self.refresh:
            return
        for mb in self.pending_curvature():
            self.curvature(mb)
        self.reduce()
        for k in range(len(self.groups)):
            self.invert(k)

    def fillers(self) -> dict[str, Callable[[], None]]:
        """The callables a pipeline engine runs for the tags (``kfac.curv.<mb>`` for any mb)."""
        return _FillerMap(self)

    # ----- every step ------------------------------------------------------------------------------
    @property
    def preconditioning(self) -> bool:
        """Whether this step preconditions: from the first step of cycle 1 on (the same step on every rank)."""
        return self.step >= self.refresh

    def precondition_(self, lr: float, reduce_sum: Callable[[torch.Tensor], None] | None = None) -> float | None:
        """Replace each layer's gradient ``M`` by ``ν G⁻¹ M A⁻¹`` (ν: the KL clip factor over the
        whole model; ``reduce_sum`` sums the KL term over the ranks, in place). Returns ν, or None
        before the first inverses (gradients untouched)."""
        if not self.preconditioning:
            return None
        done: list[tuple[KfacLayer, torch.Tensor]] = []
        vg = torch.zeros((), dtype=torch.float64)
        for lay in self.layers:
            if lay.active is None:
                raise RuntimeError(f"K-FAC layer {lay.name} has no inverses at step {self.step}: a cycle's "
                                   "inversion pieces did not all run")
            m = lay.grad_matrix()
            if m is None:
                continue
            a_inv, g_inv = lay.active
            p = g_inv @ m @ a_inv
            if lay.counted:
                vg += (p * m).sum().double().cpu() * lr**2
            done.append((lay, p))
        if reduce_sum is not None:
            reduce_sum(vg)
        v = abs(float(vg))
        nu = min(1.0, math.sqrt(self.kl_clip / v)) if v > 0 else 1.0
        with torch.no_grad():
            for lay, p in done:
                p = p * nu
                if lay.has_bias:
                    lay.module.weight.grad.copy_(p[:, :-1])
                    b = lay.module.bias
                    if b.grad is None:
                        b.grad = torch.zeros_like(b)
                    b.grad.copy_(p[:, -1])
                else:
                    lay.module.weight.grad.copy_(p)
        return nu


class _FillerMap(dict):  # type: ignore[type-arg]
    """``tag -> callable`` for the K-FAC fillers; answers every ``kfac.curv.<mb>`` and
    ``kfac.curv.<mb>.<k>`` (``k`` an inversion group of this rank)."""

    def __init__(self, kfac: Kfac) -> None:
        super().__init__()
        self.kfac = kfac
        self[REDUCE] = kfac.reduce
        for k in range(len(kfac.groups)):
            self[f"{INV}.{k}"] = lambda k=k: kfac.invert(k)

    def __contains__(self, tag: object) -> bool:
        return super().__contains__(tag) or self._curv(tag) is not None

    def _curv(self, tag: object) -> tuple[int, int | None] | None:
        piece = kfac_piece(tag) if isinstance(tag, str) else None
        if piece is None or piece[0] != "curv" or piece[1] is None:
            return None
        k = curv_group(tag)  # type: ignore[arg-type]
        if k is not None and k >= len(self.kfac.groups):
            return None
        return piece[1], k

    def __missing__(self, tag: str) -> Callable[[], None]:
        got = self._curv(tag)
        if got is None:
            raise KeyError(tag)
        mb, k = got
        return lambda: self.kfac.curvature(mb, k)


def damped_inverse(f: torch.Tensor, damping: float) -> torch.Tensor:
    """``(F + λI)⁻¹`` of a symmetric positive semi-definite factor, in float64 whatever the factor's
    dtype (a float32 Cholesky of an ill-conditioned factor fails; the factors are small), by
    Cholesky; if rounding left ``F`` indefinite, by an eigendecomposition with the negative
    eigenvalues clamped to zero."""
    f64 = f.double()
    f64 = (f64 + f64.T) / 2
    eye = torch.eye(f.shape[0], dtype=torch.float64, device=f.device)
    chol, info = torch.linalg.cholesky_ex(f64 + damping * eye)
    if int(info) == 0:
        inv = torch.cholesky_inverse(chol)
    else:
        vals, vecs = torch.linalg.eigh(f64)
        inv = (vecs / (vals.clamp(min=0) + damping)) @ vecs.T
    return inv.to(f.dtype)


class KfacOptimizer:
    """K-FAC preconditioning then SGD with momentum (module docstring), with the interface of
    :class:`paratrain.runtime.optim.Optimizer` (``set_step``, ``clip``, ``step``, ``params``).

    ``kl_sum(t)`` sums the KL term over the ranks that step together (in place; None: alone).
    ``by_fillers``: the cycle's pieces run as pipeline fillers; otherwise :meth:`step` runs them
    at the cycle's first step.
    """

    def __init__(self, params: list[nn.Parameter], train: TrainConfig, kfac: Kfac, *,
                 kl_sum: Callable[[torch.Tensor], None] | None = None, by_fillers: bool = False,
                 momentum: float = 0.9) -> None:
        self.params, self.train, self.kfac = params, train, kfac
        self.kl_sum, self.by_fillers = kl_sum, by_fillers
        self.decay = [p for p in params if p.dim() >= 2]
        self.sgd = torch.optim.SGD(params, lr=train.lr, momentum=momentum, foreach=False)
        self.lr = train.lr
        self.last_nu: float | None = None

    def set_step(self, step: int) -> float:
        self.lr = lr_at(step, self.train)
        for group in self.sgd.param_groups:
            group["lr"] = self.lr
        self.kfac.begin_step(step)
        return self.lr

    def clip(self, norm: torch.Tensor) -> float:
        return clip_grads_(self.params, norm, self.train.grad_clip)

    # the norm over this optimizer's whole parameters, as AdamW's
    grad_norm_sq = Optimizer.grad_norm_sq
    global_norm = Optimizer.global_norm

    def step(self) -> None:
        if not self.by_fillers:
            self.kfac.run_cycle_work()
        self.kfac.capturing = False  # the cycle's curvature is the first step's
        self.last_nu = self.kfac.precondition_(self.lr, self.kl_sum)
        wd = self.train.weight_decay
        if wd:
            with torch.no_grad():
                for p in self.decay:
                    p.mul_(1 - self.lr * wd)
        self.sgd.step()
        self.sgd.zero_grad(set_to_none=True)


def build_kfac_optimizer(params: list[nn.Parameter], train: TrainConfig, ctx: RuntimeContext, tokens: int,
                         chunks: list[tuple[int, int, nn.Module, dist.ProcessGroup | None]], *,
                         inv_groups: int = 1, by_fillers: bool = False) -> KfacOptimizer:
    """The K-FAC optimizer of a rank holding ``chunks`` — ``(chunk, replica, module, group)``, where
    ``group`` holds every copy of the chunk (data-parallel ranks, Chimera's other replica).
    ``tokens``: token rows of the global batch. A layer counts in the KL sum on one copy only
    (replica 0 at data-parallel coordinate 0)."""
    layers = []
    offset = 0
    for c, rep, module, group in chunks:
        found = linear_layers(module)
        cost = cost_indices([n for n, _ in found])
        for (n, m), ci in zip(found, cost, strict=True):
            layers.append(KfacLayer(f"c{c}r{rep}.{n}", m, key=(c, n), group=group, cost_index=offset + ci,
                                    counted=rep == 0 and ctx.dp_rank == 0 and ctx.cp_rank == 0 and ctx.tp_rank == 0))
        offset += max(cost, default=-1) + 1
    kfac = Kfac(layers, tokens=tokens, dp=ctx.data_degree, damping=train.kfac_damping, refresh=train.kfac_refresh,
                inv_groups=inv_groups)

    def world_sum(t: torch.Tensor) -> None:
        comm.all_reduce(t, axis="none", purpose="kfac_kl_clip")

    return KfacOptimizer(params, train, kfac, kl_sum=world_sum if ctx.world_size > 1 else None, by_fillers=by_fillers)


def make_optimizer(params: list[nn.Parameter], train: TrainConfig, ctx: RuntimeContext, tokens: int,
                   chunks: list[tuple[int, int, nn.Module, dist.ProcessGroup | None]],
                   iterations: Sequence[Schedule] = ()) -> Optimizer | KfacOptimizer:
    """The run's optimizer: AdamW, or K-FAC over ``chunks`` (:func:`build_kfac_optimizer`) whose
    pieces run as the fillers of ``iterations`` (a bubble-filled schedule) or, without one, at
    the optimizer step of each cycle's first step."""
    if train.optimizer != "kfac":
        return Optimizer(params, train)
    groups = max(1, inv_group_count(iterations, ctx.pp_rank))
    return build_kfac_optimizer(params, train, ctx, tokens, chunks, inv_groups=groups, by_fillers=bool(iterations))


def load_filled(train: TrainConfig, ctx: RuntimeContext) -> list[Schedule]:
    """The iterations of the bubble-filled schedule handed over in ``train.kfac_filled``
    (:class:`~paratrain.schedule.filled.FilledSchedule` as JSON), each validated (the IR's deadlock
    check covers the collective ``kfac.reduce``) and the same on every rank."""
    from .pipeline import check_same_schedule

    if train.kfac_filled is None:
        return []
    filled = FilledSchedule.from_dict(json.loads(train.kfac_filled), "--fill-bubbles schedule")
    if filled.refresh_steps != train.kfac_refresh:
        raise ConfigError("--kfac-refresh", f"is {train.kfac_refresh} but the filled schedule needs "
                          f"{filled.refresh_steps} steps per K-FAC cycle",
                          "leave --kfac-refresh out with --fill-bubbles (the fill pass sets it)")
    for sched in filled.iterations:
        validate(sched)
        if ctx.world_size > 1:
            check_same_schedule(sched, ctx.rank, ctx.world_size)
    return list(filled.iterations)

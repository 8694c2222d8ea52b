"""ZeRO-1, the distributed optimizer: the optimizer state sharded over the data-parallel group
(``--sharding zero1``; Rajbhandari et al. 2020, "ZeRO", sec. 5.1, stage P_os; Megatron-LM's
``--use-distributed-optimizer``).

Each parameter's local tensor (its tensor-parallel shard, if any) is cut into ``dp`` equal slices,
the last padded; rank ``r`` of the data-parallel group owns slice ``r`` of every parameter and keeps
AdamW's moments for its slices only. A step:

1. gradients accumulate locally over the micro-batches (no reduction inside backward);
2. one reduce-scatter per unit (the whole model, or one pipeline chunk at its ``R`` action) leaves
   each rank the data-parallel mean of the gradient of its slices: the buffer holds slice ``r`` of
   every parameter in segment ``r``, so segment ``r`` is what rank ``r`` receives;
3. the global gradient norm is summed over the slices (every data-parallel rank counts its own),
   the slices are clipped and AdamW steps them in place (the slices are views of the parameters);
4. one all-gather per unit returns every rank's updated slices into the full parameters.

Reduce-scatter plus all-gather move what one all-reduce moves (the cost model charges the same,
``reduce_scatter+all_gather``); the gradient buffer stays whole, as the memory model has it for
zero1 (:func:`paratrain.cost.sharding.static_shares`). AdamW works element by element, so
stepping slices is the same arithmetic as stepping whole tensors.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Replicate

from .checkpoint.state import MOMENTS
from .comm import layer as comm
from .config import TrainConfig
from .data_parallel import SpanRecorder, local_tensor
from .mesh import RuntimeContext
from .optim import Optimizer

__all__ = ["ShardedParams", "ShardedOptimizer"]


def _flat(p: torch.Tensor) -> torch.Tensor:
    """The local tensor of ``p`` as a 1-D view of its storage (writes reach the parameter)."""
    local = local_tensor(p).detach()
    if not local.is_contiguous():
        raise ValueError("zero1 needs contiguous parameters")
    return local.view(-1)


class ShardedParams:
    """Parameters laid out for one reduce-scatter and one all-gather over ``world`` ranks (module
    docstring); ``rank``: this rank's index in the group."""

    def __init__(self, params: list[nn.Parameter], world: int, rank: int) -> None:
        if len({local_tensor(p).dtype for p in params}) > 1:
            raise ValueError("zero1 reduces parameters of one dtype per unit")
        self.params, self.world, self.rank = params, world, rank
        self.numels = [local_tensor(p).numel() for p in params]
        self.slices = [-(-n // world) for n in self.numels]  # per-rank slice length, the last padded
        self.offsets = [sum(self.slices[:i]) for i in range(len(params))]
        self.segment = sum(self.slices)  # one rank's share of the buffer
        # this rank's slice of every parameter: a view of the parameter's storage (may be empty)
        self.bounds = [(min(n, rank * c), min(n, (rank + 1) * c))
                       for n, c in zip(self.numels, self.slices, strict=True)]
        self.shards = [_flat(p)[lo:hi] for p, (lo, hi) in zip(params, self.bounds, strict=True)]

    def pack_grads(self) -> torch.Tensor:
        """The reduce-scatter's input: ``world`` segments, segment ``r`` holding slice ``r`` of every
        gradient (zeros for a parameter without one, and for the padding). Drops the gradients."""
        p0 = local_tensor(self.params[0])
        buf = torch.zeros(self.world, self.segment, dtype=p0.dtype, device=p0.device)
        for p, n, c, off in zip(self.params, self.numels, self.slices, self.offsets, strict=True):
            if p.grad is not None:
                g = p.grad
                if isinstance(g, DTensor) and isinstance(p, DTensor) and g.placements != p.placements:
                    g = g.redistribute(p.device_mesh, p.placements)  # e.g. a Partial sum over tp
                padded = torch.zeros(self.world * c, dtype=buf.dtype, device=buf.device)
                padded[:n] = local_tensor(g).reshape(-1)
                buf[:, off: off + c] = padded.view(self.world, c)
                p.grad = None
        return buf.view(-1)

    def set_shard_grads(self, segment: torch.Tensor) -> None:
        """Give each of this rank's slices its part of the reduced ``segment`` as its gradient."""
        for shard, off in zip(self.shards, self.offsets, strict=True):
            shard.grad = segment[off: off + shard.numel()].clone()

    def local_segment(self, values: list[torch.Tensor] | None = None) -> torch.Tensor:
        """The all-gather's input: this rank's slices (or ``values`` shaped like them, e.g. AdamW's
        moments of the slices), each at its offset (padding zero)."""
        mine = torch.zeros(self.segment, dtype=self.shards[0].dtype, device=self.shards[0].device)
        for v, off in zip(self.shards if values is None else values, self.offsets, strict=True):
            mine[off: off + v.numel()] = v
        return mine

    def gather_rows(self, mine: torch.Tensor, group: dist.ProcessGroup, purpose: str) -> torch.Tensor:
        """Every rank's ``mine`` (a :meth:`local_segment`) as ``(world, segment)`` rows."""
        rows = torch.empty(self.world, self.segment, dtype=mine.dtype, device=mine.device)
        comm.all_gather(list(rows.unbind(0)), mine, group, axis="dp", purpose=purpose)
        return rows

    def unpack_one(self, rows: torch.Tensor, i: int) -> torch.Tensor:
        """Parameter ``i``'s whole local tensor (a new one) out of all-gathered ``(world, segment)`` rows."""
        local = local_tensor(self.params[i])
        off, c, n = self.offsets[i], self.slices[i], self.numels[i]
        return rows[:, off: off + c].reshape(-1)[:n].reshape(local.shape).clone()

    def unpack_params(self, rows: torch.Tensor) -> None:
        """Write the all-gathered ``(world, segment)`` rows into the full parameters."""
        with torch.no_grad():
            for p, n, c, off in zip(self.params, self.numels, self.slices, self.offsets, strict=True):
                _flat(p).copy_(rows[:, off: off + c].reshape(-1)[:n])

    def gather_params(self, group: dist.ProcessGroup) -> None:
        """All-gather the updated slices into every rank's full parameters."""
        self.unpack_params(self.gather_rows(self.local_segment(), group, "zero1_params"))


@dataclass
class _Unit:
    sharded: ShardedParams
    group: dist.ProcessGroup
    pending: tuple[torch.Tensor, torch.Tensor, dist.Work | None, float] | None = field(default=None)


class ShardedOptimizer(Optimizer):
    """AdamW (or SGD) over this rank's slices of ``units`` (each: its parameters and the
    data-parallel group that shares them), with the interface of :class:`Optimizer` and of a
    :class:`~paratrain.runtime.data_parallel.GradSync` (it reduces the gradients itself).

    ``params`` (what the optimizer steps and clips) are the slices; ``model_params`` the parameters.
    """

    def __init__(self, units: list[tuple[list[nn.Parameter], dist.ProcessGroup | None]], train: TrainConfig,
                 ctx: RuntimeContext, *, recorder: SpanRecorder | None = None) -> None:
        """``units`` in an order every member of a shared group sees alike (a pipeline: by chunk):
        the step's all-gathers and a checkpoint's gathers run unit by unit."""
        self.ctx, self.recorder = ctx, recorder
        self.units: list[_Unit] = []
        for params, group in units:
            if group is None:
                raise ValueError("zero1 needs each unit's data-parallel group")
            if params:
                sharded = ShardedParams(params, dist.get_world_size(group), dist.get_rank(group))
                self.units.append(_Unit(sharded, group))
        self.model_params = [p for u in self.units for p in u.sharded.params]
        self._unit_index = {tuple(id(p) for p in u.sharded.params): i for i, u in enumerate(self.units)}
        self._shard_of: dict[int, torch.Tensor] = {}
        self._bounds_of: dict[int, tuple[int, int]] = {}  # the slice's element range in the flat parameter
        self._counted: dict[int, bool] = {}
        shards, decay = [], []
        for u in self.units:
            for p, shard, bounds in zip(u.sharded.params, u.sharded.shards, u.sharded.bounds, strict=True):
                if id(p) in self._shard_of:  # two slices of one storage would both be stepped
                    raise ValueError("zero1: a parameter is held by two chunks of this rank")
                self._shard_of[id(p)] = shard
                self._bounds_of[id(p)] = bounds
                self._counted[id(p)] = _counts_on_tp(p, ctx)
                if shard.numel():  # a rank past a small parameter's end owns nothing of it
                    shards.append(shard)
                    decay.append(p.dim() >= 2)
        super().__init__(shards, train, decay=decay)

    # ----- GradSync ---------------------------------------------------------------------------------
    @contextlib.contextmanager
    def accumulate(self) -> Iterator[None]:
        yield  # gradients accumulate locally until finish()

    def reduce(self, index: int) -> None:
        """Start unit ``index``'s reduce-scatter (asynchronous)."""
        u = self.units[index]
        flat = u.sharded.pack_grads()
        out = torch.empty(u.sharded.segment, dtype=flat.dtype, device=flat.device)
        segments = list(flat.view(u.sharded.world, u.sharded.segment).unbind(0))
        work = comm.reduce_scatter(out, segments, u.group, async_op=True, axis="dp", purpose="zero1_grads")
        u.pending = (out, flat, work, time.perf_counter())

    def finish(self) -> None:
        """Reduce every unit not yet started, wait for all, and set the slices' mean gradients."""
        for i, u in enumerate(self.units):
            if u.pending is None:
                self.reduce(i)
        for u in self.units:
            assert u.pending is not None
            out, _, work, start = u.pending
            if work is not None:
                work.wait()
            if self.recorder is not None:
                self.recorder.record("R@c0", "comm", start, time.perf_counter())
            # the mean over the replicas of the data: dp x cp ranks (a Chimera chunk's group also
            # holds the other pipeline's copy, whose micro-batches are the rest of the step's)
            out.div_(self.ctx.data_degree)
            u.sharded.set_shard_grads(out)
            u.pending = None

    def unit_of(self, params: list[nn.Parameter]) -> int:
        """The index of the unit holding exactly ``params`` (a pipeline chunk's)."""
        return self._unit_index[tuple(id(p) for p in params)]

    def shard_grad(self, p: nn.Parameter) -> torch.Tensor | None:
        """The reduced gradient of this rank's slice of ``p`` (after :meth:`finish`)."""
        return self._shard_of[id(p)].grad

    # ----- the step ---------------------------------------------------------------------------------
    def grad_norm_sq(self, params: list[nn.Parameter], ctx: RuntimeContext | None = None) -> torch.Tensor:
        """This rank's share of the squared norm of the gradients of ``params`` (model parameters):
        their slices, each counted on every data-parallel rank and, when replicated over tp, at tp 0."""
        sq = torch.zeros((), dtype=torch.float64, device=self.ctx.device)
        for p in params:
            g = self._shard_of[id(p)].grad
            if g is not None and self._counted[id(p)]:
                sq += g.to(torch.promote_types(g.dtype, torch.float32)).pow(2).sum()
        return sq

    def global_norm(self, ctx: RuntimeContext | None = None) -> torch.Tensor:
        """The gradients' L2 norm over every rank, from the reduced slices."""
        sq = self.grad_norm_sq(self.model_params)
        if self.ctx.world_size > 1:
            comm.all_reduce(sq, axis="none", purpose="grad_norm")
        return sq.sqrt()

    def step(self) -> None:
        super().step()
        for u in self.units:
            u.sharded.gather_params(u.group)

    # ----- checkpoints: AdamW's state as whole parameters, the format every layout loads ----------
    def full_state(self) -> dict[int, dict[str, torch.Tensor]]:
        """AdamW's state of every parameter as whole local tensors (DTensors where the parameter is
        one), gathered from the data-parallel ranks' slices, keyed by ``id(parameter)``; empty
        before the first step. A collective over each unit's group (every rank calls it)."""
        states = self.adamw.state
        step = next((st["step"] for st in states.values() if "step" in st), None)
        if step is None:
            return {}
        out: dict[int, dict[str, torch.Tensor]] = {}
        for u in self.units:
            sp = u.sharded
            rows_of = {k: sp.gather_rows(sp.local_segment([states[s][k] if s.numel() else s for s in sp.shards]),
                                         u.group, "zero1_checkpoint") for k in MOMENTS}
            for i, p in enumerate(sp.params):
                entry = {k: _like_param(p, sp.unpack_one(rows, i)) for k, rows in rows_of.items()}
                out[id(p)] = {**entry, "step": step.clone()}
        return out

    def load_full_state(self, p: nn.Parameter, state: dict[str, torch.Tensor]) -> None:
        """Set AdamW's state of this rank's slice of ``p`` from whole-parameter ``state`` (as
        :meth:`full_state` gives it and a checkpoint holds it)."""
        shard, (lo, hi) = self._shard_of[id(p)], self._bounds_of[id(p)]
        if shard.numel():  # a rank past a small parameter's end owns nothing of it
            st = self.adamw.state[shard]
            st["step"] = state["step"].detach().clone()
            for k in MOMENTS:
                st[k] = local_tensor(state[k]).detach().reshape(-1)[lo:hi].clone()


def _like_param(p: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    """``local`` (shaped like ``p``'s local tensor) with ``p``'s placements when ``p`` is a DTensor."""
    if isinstance(p, DTensor):
        return DTensor.from_local(local, p.device_mesh, p.placements, run_check=False, shape=p.shape, stride=p.stride())
    return local


def _counts_on_tp(p: torch.Tensor, ctx: RuntimeContext) -> bool:
    """Whether this rank counts ``p``'s slice in the norm along tp: always when ``p`` is sharded
    over tp, else at tp coordinate 0 (pipeline stages hold distinct parameters)."""
    if isinstance(p, DTensor):
        names = p.device_mesh.mesh_dim_names or ()
        if any(n == "tp" and not isinstance(pl, Replicate) for n, pl in zip(names, p.placements, strict=True)):
            return True
    return ctx.coords["tp"] == 0

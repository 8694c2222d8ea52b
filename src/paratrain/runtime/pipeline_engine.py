"""Execution of one pipeline rank's action list (the schedule IR, :mod:`paratrain.schedule.ir`).

The engine knows actions, not schedules: it runs ``schedule.actions[rank]`` in order under the
IR's execution semantics and never looks at the schedule's name.

* ``F`` runs a chunk on its input: token ids (chunk 0), the tensor an ``RF`` received, or the
  output of the neighbouring chunk when that one lives on this rank (detached, so that every
  chunk's backward is its own graph). The last chunk adds the loss, scaled by ``1/accumulation``.
* ``B`` is one backward of the chunk's output w.r.t. its input and its weights (``inputs=``, so
  nothing else accumulates a gradient).
  ``I`` computes the input gradient only and keeps the gradients flowing into the weights'
  consumers; ``W`` continues from those to the weight gradients (zero-bubble split, Qi et al.
  ICLR'24; the two halves are ``torch.distributed.pipelining``'s ``stage_backward_input`` and
  ``stage_backward_weight``, so ``I + W`` costs about one ``B``). Weight gradients are added to
  the live parameters' ``.grad``.
* A run of consecutive ``SF/RF/SB/RB`` is one ``batch_isend_irecv``; receive buffers are allocated
  from the activation shape known in advance (``[micro-batch, seq, hidden]``), never negotiated.
  The rank waits for the batch's receives; its sends complete in the background (the tensor is
  kept until they do, and all are waited for at the end of the list), the eager-send model the
  simulator uses by default and ``torch.distributed.pipelining`` implements. The IR's validator
  proves deadlock freedom under blocking sends, which implies it for eager ones.
* ``prefetch_receives=k`` (gloo): each peer's next ``k`` receives are posted ahead of their
  actions, in the list's order, so a transfer runs while this rank still computes and the
  receive action only waits for data already on its way (gloo moves a message once the receiver
  has posted it: a late post puts a round trip on the critical path). Matching is unchanged (FIFO
  per peer, posted in list order) and nothing new is waited for, so a valid list stays deadlock
  free. Off for NCCL, whose p2p operations on one communicator run in order on one stream: an
  early receive would hold back this rank's later sends to the same peer.
* ``R`` and ``U`` call the :class:`StepHooks` (gradient reduction launch; wait + optimizer step).
* ``version`` (asynchronous schedules): the forward runs on a snapshot of the weights as they were
  after ``version`` optimizer steps of this rank, and the backward of that micro-batch differentiates
  the same snapshot (weight stashing, Narayanan et al. SOSP'19); the resulting gradient is applied
  to the current weights at the next ``U``. A version is snapshotted when first used or right
  before the ``U`` that would overwrite it while a later action still needs it, and dropped after
  its last use.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining._backward import stage_backward_input, stage_backward_weight
from torch.func import functional_call

from paratrain.errors import ConfigError
from paratrain.schedule.ir import Action, ActionKind, Schedule
from paratrain.trace import CATEGORY_OF_KIND

from .comm import layer as comm
from .tensor_parallel import accumulating_partial_grads, is_partial_grad

__all__ = ["LocalChunk", "StepHooks", "PipelineEngine", "ActionSpan", "accumulation_count"]

K = ActionKind
Key = tuple[int, int, int]  # (micro-batch, chunk, replica)


@dataclass
class LocalChunk:
    """A model chunk held by this rank: its module and its trainable parameters by local name."""

    chunk: int
    replica: int
    module: nn.Module
    is_first: bool
    is_last: bool
    params: dict[str, nn.Parameter] = field(default_factory=dict)
    # FSDP2 holds the chunk's parameters: gathered copies, not ``params``, enter the graph
    fully_sharded: bool = field(init=False)

    def __post_init__(self) -> None:
        from torch.distributed.fsdp import FSDPModule

        if not self.params:
            self.params = {n: p for n, p in self.module.named_parameters() if p.requires_grad}
        self.fully_sharded = isinstance(self.module, FSDPModule)

    def gathered_params(self) -> list[nn.Parameter]:
        """FSDP2's unsharded parameters of the chunk: the leaves its autograd graph accumulates into
        (the split backward's weight part targets them; ``params`` hold the shards)."""
        from torch.distributed.fsdp import fully_shard

        return [fp._unsharded_param for state in fully_shard.state(self.module)._state_ctx.all_states
                for group in _param_groups(state) for fp in group.fsdp_params]

    def hold_gradients(self, hold: bool) -> None:
        """FSDP2 under a split backward (ZB-H1), as torch.distributed.pipelining runs it: while
        ``hold``, backwards accumulate unsharded gradients and keep the parameters gathered (the
        input-gradient pass would otherwise reduce-scatter and free them before the weight pass);
        :meth:`release_gradients` reduce-scatters once per step."""
        self.module.set_requires_gradient_sync(not hold)
        self.module.set_reshard_after_backward(not hold)
        self.module.set_is_last_backward(not hold)

    def release_gradients(self) -> None:
        """Reduce-scatter the held unsharded gradients into the shards and reshard, then hold again."""
        from torch.distributed.fsdp import fully_shard

        self.hold_gradients(False)
        state = fully_shard.state(self.module)
        for s in state._state_ctx.all_states:
            for group in _param_groups(s):
                group.post_backward()
        state._root_post_backward_final_callback()
        self.hold_gradients(True)


def _param_groups(state: Any) -> list[Any]:
    """An FSDP2 state's parameter groups: a list in torch 2.13, one optional group in 2.11."""
    if hasattr(state, "_fsdp_param_groups"):
        return list(state._fsdp_param_groups)
    group = getattr(state, "_fsdp_param_group", None)
    return [] if group is None else [group]


class StepHooks(Protocol):
    """What ``R`` and ``U`` do: data-parallel/replica reduction and the optimizer step."""

    def reduce(self, chunk: LocalChunk) -> None: ...

    def finish_reductions(self) -> None: ...

    def optimizer_step(self, index: int) -> None:
        """Apply the step; when recording, append its spans to the engine's ``spans``: compute
        work with category ``optimizer`` (the last one named ``U``, earlier parts ``U.<part>``),
        waits for other ranks with category ``reduce``."""


@dataclass(frozen=True, slots=True)
class ActionSpan:
    """One executed action (or p2p batch): wall-clock ``perf_counter`` seconds."""

    name: str
    category: str  # forward, backward, input, weight, p2p, reduce, optimizer, filler
    start_s: float
    end_s: float
    microbatch: int | None


def accumulation_count(schedule: Schedule) -> int:
    """Micro-batches whose gradients one optimizer step applies, read off the action lists: the
    last chunk's backwards (all replicas) over the optimizer steps of the rank holding it.
    Synchronous schedules: ``M``; PipeDream: 1 (a step per micro-batch); 2BW: ``M``."""
    last = schedule.num_chunks - 1
    backs = sum(1 for row in schedule.actions for a in row
                if a.chunk == last and a.kind in (K.BACKWARD, K.BACKWARD_WEIGHT))
    steps = sum(1 for a in schedule.actions[schedule.rank_of(last)] if a.kind is K.OPTIMIZER_STEP)
    if steps == 0 or backs % steps:
        raise ConfigError("schedule", f"{backs} backwards of the last chunk do not split evenly into {steps} "
                          "optimizer steps", "give every optimizer step the same number of micro-batches")
    return backs // steps


class PipelineEngine:
    """Runs ``schedule.actions[rank]`` (see the module docstring).

    ``microbatch(mb)`` returns ``(inputs, targets)`` of global micro-batch ``mb``; ``peer_rank``
    maps a pipeline rank to the global rank to exchange tensors with; ``loss_fn(output, targets)``
    is the per-micro-batch mean loss; ``loss_context()`` wraps the loss and every backward of the
    last chunk (vocabulary-parallel loss under tensor parallelism); ``autocast()`` wraps forwards.
    """

    def __init__(self, schedule: Schedule, rank: int, chunks: list[LocalChunk], hooks: StepHooks, *,
                 activation_shape: tuple[int, ...], activation_dtype: torch.dtype, device: torch.device,
                 peer_rank: Callable[[int], int], loss_fn: Callable[[Any, torch.Tensor], torch.Tensor],
                 loss_context: Callable[[], contextlib.AbstractContextManager[Any]] = contextlib.nullcontext,
                 autocast: Callable[[], contextlib.AbstractContextManager[Any]] = contextlib.nullcontext,
                 fillers: dict[str, Callable[[], None]] | None = None, record: bool = False,
                 before: Callable[[Action], None] | None = None,
                 group: dist.ProcessGroup | None = None, prefetch_receives: int = 0) -> None:
        self.schedule, self.rank, self.hooks = schedule, rank, hooks
        self.actions = schedule.actions[rank]
        self.chunks = {(c.chunk, c.replica): c for c in chunks}
        held = set(schedule.chunks_of(rank))
        if held != set(self.chunks):
            raise ConfigError("schedule placement", f"rank {rank} should hold chunks {sorted(held)}, the engine "
                              f"was given {sorted(self.chunks)}", "build the chunks from the schedule's placement")
        self.shape, self.dtype, self.device = activation_shape, activation_dtype, device
        self.peer_rank, self.loss_fn = peer_rank, loss_fn
        self.loss_context, self.autocast = loss_context, autocast
        self.fillers = fillers or {}
        self.before = before  # called with each compute/filler action before it runs (K-FAC's capture)
        for a in self.actions:
            if a.kind is K.FILLER and (a.tag or "") not in self.fillers:
                raise ConfigError(f"schedule rank {rank} filler {a.tag!r}", "no runtime work is registered for it",
                                  f"register one of: {sorted(self.fillers) or 'none'}")
        self.record, self.group = record, group
        if prefetch_receives < 0:
            raise ConfigError("prefetch_receives", f"must be at least 0, got {prefetch_receives}", "use 0 (off) or 1-2")
        self.prefetch = prefetch_receives
        self._recv_order: dict[int, list[int]] = {}  # peer -> indices of its receive actions, in order
        for i, a in enumerate(self.actions):
            if a.kind is K.RECV_ACT or a.kind is K.RECV_GRAD:
                self._recv_order.setdefault(a.peer, []).append(i)
        self.scale = 1.0 / accumulation_count(schedule)
        self.spans: list[ActionSpan] = []
        self.losses: dict[int, float] = {}  # micro-batch -> unscaled loss (last chunk only)
        self.steps_done = 0
        self._last_use = self._version_last_use()
        self._defer_partial = self._more_weight_grads_follow()
        self._current = -1  # index of the action being executed
        self._stash: dict[tuple[int, int, int], dict[str, torch.Tensor]] = {}  # (chunk, replica, version)

    # ----- running -------------------------------------------------------------------------------
    def run(self, microbatch: Callable[[int], tuple[torch.Tensor, torch.Tensor]],
            phase: Callable[[str], None] = lambda s: None) -> None:
        """Execute the whole action list once."""
        self._inputs: dict[Key, torch.Tensor] = {}  # input of (mb, chunk, replica)
        self._grads: dict[Key, torch.Tensor] = {}  # gradient w.r.t. the output of (mb, chunk, replica)
        self._saved: dict[Key, tuple[torch.Tensor, torch.Tensor | None, int | None]] = {}  # (output, input, version)
        self._to_send: dict[tuple[ActionKind, int, int, int], torch.Tensor] = {}
        self._split: dict[Key, tuple[list[dict[str, Any]], int | None]] = {}  # I done, W pending
        self._sends: list[tuple[Any, torch.Tensor]] = []  # posted sends and their tensors, until done
        self._posted: dict[int, tuple[Any, torch.Tensor]] = {}  # receive action index -> (work, buffer)
        self._next_recv = dict.fromkeys(self._recv_order, 0)  # peer -> position of its next unposted receive
        self._outstanding = dict.fromkeys(self._recv_order, 0)  # peer -> posted, not yet reached
        self._microbatch = microbatch
        for peer in self._recv_order:
            self._post_receives(peer)
        acts, n, i = self.actions, len(self.actions), 0
        while i < n:
            a = acts[i]
            if a.is_p2p:
                j = i
                while j < n and acts[j].is_p2p:
                    j += 1
                phase(f"p2p batch {' '.join(map(str, acts[i:j]))}")
                self._p2p(acts[i:j], i)
                i = j
                continue
            phase(f"action {a}")
            if self.before is not None:
                self.before(a)
            if a.kind is K.OPTIMIZER_STEP:
                self.hooks.finish_reductions()  # waiting for reductions is not optimizer work
            start = time.perf_counter()
            self._execute(a, i)
            if self.record and a.kind is not K.OPTIMIZER_STEP:  # the hooks time U's parts themselves
                end = time.perf_counter()
                self.spans.append(ActionSpan(str(a), CATEGORY_OF_KIND[a.kind], start, end, a.microbatch))
            i += 1
        for work, _ in self._sends:
            work.wait()
        self._sends.clear()
        leftover = [k for k in (*self._saved, *self._inputs, *self._grads, *self._split, *self._posted)]
        if leftover:
            raise RuntimeError(f"pipeline rank {self.rank}: tensors of {leftover[:4]} were never consumed")

    def _execute(self, a: Action, index: int) -> None:
        self._current = index
        k = a.kind
        if k is K.FORWARD:
            self._forward(a)
        elif k is K.BACKWARD or k is K.BACKWARD_INPUT:
            self._backward(a, inputs_only=k is K.BACKWARD_INPUT)
        elif k is K.BACKWARD_WEIGHT:
            self._backward_weight(a)
        elif k is K.REDUCE_GRAD:
            self.hooks.reduce(self.chunks[(a.chunk, a.replica)])
        elif k is K.OPTIMIZER_STEP:
            start = time.perf_counter()
            if self._stash_before_step(index) and self.record:
                self.spans.append(ActionSpan("U.stash", "optimizer", start, time.perf_counter(), None))
            self.hooks.optimizer_step(self.steps_done)
            self.steps_done += 1
        else:
            self.fillers[a.tag or ""]()
        if a.version is not None:
            self._drop_version(a, index)

    # ----- compute -------------------------------------------------------------------------------
    def _forward(self, a: Action) -> None:
        key = (a.microbatch, a.chunk, a.replica)
        ch = self.chunks[(a.chunk, a.replica)]
        if ch.is_first:
            tokens, _ = self._microbatch(a.microbatch)
            x, x_in = tokens.to(self.device), None
        else:
            x = self._inputs.pop(key).requires_grad_(True)
            x_in = x
        with self.autocast():
            params = None if a.version is None else self._version(ch, a.version)
            out = ch.module(x) if params is None else functional_call(ch.module, params, (x,))
        if ch.is_last:
            _, targets = self._microbatch(a.microbatch)
            with self.loss_context():
                loss = self.loss_fn(out, targets.to(self.device))
                self.losses[a.microbatch] = float(_local(loss.detach()))
                out = loss * self.scale
        else:
            nxt = (a.microbatch, a.chunk + 1, a.replica)
            y = out.detach()
            if self.schedule.rank_of(a.chunk + 1, a.replica) == self.rank:
                self._inputs[nxt] = y
            else:
                self._to_send[(K.SEND_ACT, *key)] = y
        self._saved[key] = (out, x_in, a.version)

    def _weights(self, ch: LocalChunk, version: int | None) -> list[torch.Tensor]:
        if ch.fully_sharded:
            return list(ch.gathered_params())
        if version is None:
            return list(ch.params.values())
        return list(self._stash[(ch.chunk, ch.replica, version)].values())

    def _backward(self, a: Action, *, inputs_only: bool) -> None:
        key = (a.microbatch, a.chunk, a.replica)
        ch = self.chunks[(a.chunk, a.replica)]
        if inputs_only and ch.is_first:
            return  # I of chunk 0: no input gradient to compute, its W does the whole backward
        out, x_in, version = self._saved.pop(key)
        grad_out = None if ch.is_last else self._grads.pop(key)
        ctx = self.loss_context() if ch.is_last else contextlib.nullcontext()
        if inputs_only:
            # torch.distributed.pipelining's split backward: the input gradient now, the gradients
            # flowing into the weights' consumers kept for W, so W does only the weight part.
            if ch.fully_sharded:
                ch.module.unshard()  # zero3 freed them after the forward; held gathered until R
            weights = self._weights(ch, version)
            with ctx:
                dinputs, groups = stage_backward_input([out], None if grad_out is None else [grad_out], [x_in],
                                                       iter(weights))
            x_in.grad = None
            self._split[key] = (groups, version)
            self._pass_input_grad(a, dinputs[0])
            return
        if ch.fully_sharded:
            # FSDP2's hooks reduce-scatter the gathered parameters' gradients into ``params`` after
            # this backward, so autograd must reach every leaf (the input and the gathered copies)
            with ctx:
                torch.autograd.backward(out, grad_tensors=grad_out)
            if x_in is not None:
                gx, x_in.grad = x_in.grad, None
                self._pass_input_grad(a, gx)
            return
        weights = self._weights(ch, version)
        targets = ([] if x_in is None else [x_in]) + weights
        if version is None:
            # current weights: let autograd accumulate into .grad (no extra add per parameter); the
            # tensor-parallel partial gradients are reduced by the chunk's last backward of the step
            with ctx, accumulating_partial_grads(self._current in self._defer_partial):
                torch.autograd.backward(out, grad_tensors=grad_out, inputs=targets)
            if x_in is not None:
                gx, x_in.grad = x_in.grad, None
                self._pass_input_grad(a, gx)
            return
        with ctx:
            grads = torch.autograd.grad(out, targets, grad_outputs=grad_out, allow_unused=True)
        if x_in is not None:
            self._pass_input_grad(a, grads[0])
        self._accumulate(ch, grads[len(grads) - len(weights):])

    def _backward_weight(self, a: Action) -> None:
        key = (a.microbatch, a.chunk, a.replica)
        ch = self.chunks[(a.chunk, a.replica)]
        split = self._split.pop(key, None)
        if split is None:  # chunk 0: the whole backward, weights only
            self._backward(a, inputs_only=False)
            return
        groups, version = split
        weights = self._weights(ch, version)
        if version is None:
            later = self._current in self._defer_partial  # a later W of the chunk reduces the partial sums
            with accumulating_partial_grads(later):
                stage_backward_weight(iter(weights), groups)  # accumulates into the live .grad
            for w in weights:
                if w.grad is not None and not (later and is_partial_grad(w.grad)):
                    w.grad = _like_param(w.grad, w)
            return
        before = [w.grad for w in weights]
        for w in weights:
            w.grad = None
        stage_backward_weight(iter(weights), groups)
        self._accumulate(ch, [w.grad for w in weights])
        for w, g in zip(weights, before, strict=True):
            w.grad = g

    def _pass_input_grad(self, a: Action, g: torch.Tensor | None) -> None:
        if g is None:
            raise RuntimeError(f"chunk {a.chunk}'s output does not depend on its input")
        prev = (a.microbatch, a.chunk - 1, a.replica)
        if self.schedule.rank_of(a.chunk - 1, a.replica) == self.rank:
            self._grads[prev] = g
        else:
            self._to_send[(K.SEND_GRAD, a.microbatch, a.chunk, a.replica)] = g

    @staticmethod
    def _accumulate(ch: LocalChunk, grads: tuple[torch.Tensor | None, ...] | list[torch.Tensor | None]) -> None:
        with torch.no_grad():
            for p, g in zip(ch.params.values(), grads, strict=True):
                if g is None:
                    continue
                g = _like_param(g, p)
                if p.grad is None:
                    p.grad = g.detach().clone() if g.requires_grad else g
                else:
                    p.grad.add_(g)

    def _more_weight_grads_follow(self) -> set[int]:
        """Indices of the backward actions (B, W) after which the same chunk computes weight
        gradients again before its gradients are used (its reduction R, the rank's optimizer step
        U): their partial tensor-parallel gradients can wait for the later one
        (tensor_parallel.accumulating_partial_grads)."""
        out: set[int] = set()
        pending: dict[tuple[int | None, int], int] = {}  # (chunk, replica) -> its latest backward since U
        for i, a in enumerate(self.actions):
            if a.kind is K.OPTIMIZER_STEP:
                pending.clear()
            elif a.kind is K.REDUCE_GRAD:
                pending.pop((a.chunk, a.replica), None)
            elif a.kind is K.BACKWARD or a.kind is K.BACKWARD_WEIGHT:
                key = (a.chunk, a.replica)
                if key in pending:
                    out.add(pending[key])
                pending[key] = i
        return out

    # ----- weight versions -----------------------------------------------------------------------
    def _version_last_use(self) -> dict[tuple[int, int, int], int]:
        last: dict[tuple[int, int, int], int] = {}
        for i, a in enumerate(self.actions):
            if a.version is not None:
                last[(a.chunk, a.replica, a.version)] = i
        return last

    def _version(self, ch: LocalChunk, version: int) -> dict[str, torch.Tensor]:
        key = (ch.chunk, ch.replica, version)
        snap = self._stash.get(key)
        if snap is None:
            if version != self.steps_done:
                raise ConfigError(f"schedule rank {self.rank}", f"weight version {version} of chunk {ch.chunk} is "
                                  f"needed but this rank holds version {self.steps_done} and did not stash it",
                                  "validate the schedule (paratrain.schedule.validate)")
            snap = {n: p.detach().clone().requires_grad_(True) for n, p in ch.params.items()}
            self._stash[key] = snap
        return snap

    def _stash_before_step(self, index: int) -> bool:
        """Snapshot the current weights where a later action still needs them; True if any was."""
        v, stashed = self.steps_done, False
        for (c, rep), ch in self.chunks.items():
            if self._last_use.get((c, rep, v), -1) > index and (c, rep, v) not in self._stash:
                self._version(ch, v)
                stashed = True
        return stashed

    def _drop_version(self, a: Action, index: int) -> None:
        key = (a.chunk, a.replica, a.version)
        if self._last_use.get(key) == index:
            self._stash.pop(key, None)  # graphs still alive keep their own references

    # ----- point-to-point ------------------------------------------------------------------------
    def _post_receives(self, peer: int) -> None:
        """Post ``peer``'s next receives (in list order) until ``prefetch`` of them are outstanding."""
        order, k = self._recv_order[peer], self._next_recv[peer]
        while k < len(order) and self._outstanding[peer] < self.prefetch:
            buf = torch.empty(self.shape, dtype=self.dtype, device=self.device)
            what = "activation" if self.actions[order[k]].kind is K.RECV_ACT else "gradient"
            self._posted[order[k]] = (comm.irecv(buf, self.peer_rank(peer), self.group, purpose=what), buf)
            self._outstanding[peer] += 1
            k += 1
        self._next_recv[peer] = k

    def _p2p(self, batch: tuple[Action, ...], first: int) -> None:
        start = time.perf_counter()
        ops = []
        landed: list[tuple[dict[Key, torch.Tensor], Key, torch.Tensor]] = []
        waits: list[Any] = []
        for j, a in enumerate(batch, first):
            peer = self.peer_rank(a.peer)
            if a.kind is K.SEND_ACT or a.kind is K.SEND_GRAD:
                t = self._to_send.pop((a.kind, a.microbatch, a.chunk, a.replica), None)
                if t is None:
                    raise RuntimeError(f"pipeline rank {self.rank}: {a} sends a tensor that was not computed")
                what = "activation" if a.kind is K.SEND_ACT else "gradient"
                ops.append(comm.P2P(True, t.contiguous(), peer, what))
            else:
                store = self._inputs if a.kind is K.RECV_ACT else self._grads
                posted = self._posted.pop(j, None)
                if posted is None:  # not prefetched: it is the peer's next receive, posted now
                    self._next_recv[a.peer] += 1
                    buf = torch.empty(self.shape, dtype=self.dtype, device=self.device)
                    ops.append(comm.P2P(False, buf, peer, "activation" if a.kind is K.RECV_ACT else "gradient"))
                else:
                    self._outstanding[a.peer] -= 1
                    waits.append(posted[0])
                    buf = posted[1]
                landed.append((store, (a.microbatch, a.chunk, a.replica), buf))
        works = comm.batch_isend_irecv(ops, self.group)
        for op, work in zip(ops, works, strict=True):
            if op.send:
                self._sends.append((work, op.tensor))
            else:
                waits.append(work)
        for work in waits:
            work.wait()
        self._sends = [(w, t) for w, t in self._sends if not w.is_completed()]
        for store, key, buf in landed:
            store[key] = buf
        if self.prefetch:
            for peer in {a.peer for a in batch if a.kind is K.RECV_ACT or a.kind is K.RECV_GRAD}:
                self._post_receives(peer)
        if self.record:
            mb = batch[0].microbatch if len(batch) == 1 else None
            self.spans.append(ActionSpan(" ".join(map(str, batch)), "p2p", start, time.perf_counter(), mb))


def _like_param(g: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """The gradient with its parameter's DTensor placements. Autograd's accumulation hooks do this
    for ``.backward()`` (the vocabulary-parallel embedding's backward yields a ``Replicate()``
    gradient for a ``Shard(0)`` table); gradients taken with ``autograd.grad`` need it here.
    Replicate -> Shard is a local slice, no communication."""
    from torch.distributed.tensor import DTensor

    if isinstance(g, DTensor) and isinstance(p, DTensor) and g.placements != p.placements:
        return g.redistribute(p.device_mesh, p.placements)
    return g


def _local(t: Any) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t

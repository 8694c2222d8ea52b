"""The pipeline executor of ``paratrain train``: ``--pp P --schedule NAME [--virtual-stages V]``.

The step loop (:class:`~paratrain.runtime.train.Trainer`) generates and validates the run's
schedule once (:func:`schedule_for`), checks that every rank holds the same one
(:func:`check_same_schedule`), cuts the model into the chunks the schedule places on this
pipeline rank and creates the process groups (:mod:`paratrain.runtime.pipeline_layout`), applies
tensor parallelism to each chunk (DTensor) and hands all of it to :class:`PipelineExecutor`,
which runs the rank's action list with :class:`~paratrain.runtime.pipeline_engine.PipelineEngine`
and returns the local loss.
Data parallelism is the schedule's ``R`` actions. With K-FAC in the bubbles
(``train --fill-bubbles``) each step runs its iteration of the filled schedule, whose ``X:kfac.*``
fillers call the pieces of :mod:`paratrain.runtime.kfac` (:meth:`PipelineExecutor.use_kfac`).

Mesh: global rank = ``ParallelConfig.rank_of(pp, dp, cp, tp)``. Activations travel between the
ranks with the same (dp, cp, tp) coordinates on neighbouring pipeline ranks (each tensor-parallel
rank sends its full replicated activation, Megatron-LM without the scatter/gather optimization; a
context-parallel rank its tokens of each sequence).

``R`` of chunk ``c`` all-reduces its gradients (sum) over every rank holding a copy of ``c``: the
data- and context-parallel ranks and, under Chimera, the rank holding the other replica; the sum
is divided by ``dp·cp`` (the replicas each saw different micro-batches of the same step, the
data-parallel ranks each a different ``1/dp`` of the global batch, the context-parallel ranks
each the mean over their own tokens). ``U`` waits for the reductions, sums the gradients
of a parameter that two pipeline ranks share (tied embedding and output projection: Megatron-LM's
embedding group), clips by the global norm and steps AdamW with the run's learning-rate schedule
(:class:`~paratrain.runtime.optim.Optimizer`, the step loop's). Clipping of synchronous schedules
uses the norm of the whole model (every rank steps at the same point); asynchronous schedules
(PipeDream, 2BW) step each stage at a different time on gradients of different micro-batches, so
each stage clips by its own norm (over its tensor/data-parallel ranks).

Asynchronous schedules are generated over all ``--steps`` batches and run as one action list: the
pipeline never flushes between steps, as in the papers. The per-step results are reported afterwards.
With :attr:`PipelineExecutor.drain_at` set (checkpointing does, at its checkpoint steps) the run is
cut into segments, each one action list generated over its own steps: at a segment's end every
micro-batch in flight has finished and been applied, no stashed version is left, and the next
segment starts from one weight state (its first batch computes on the current weights, where an
undrained 2BW run would use the version before). A drain costs one pipeline fill and drain.

Trace: ``pid`` = pipeline rank (the ranks at data- and tensor-parallel coordinate 0 report),
compute actions on thread 0, p2p batches and reductions on thread 1, each event's ``args.step``
its step (asynchronous schedules: 0, one timeline for the whole run).
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from paratrain.errors import ConfigError
from paratrain.parallel.config import ParallelConfig, prefetch_receives_on
from paratrain.schedule.ir import ActionKind, Schedule
from paratrain.schedule.registry import generate
from paratrain.schedule.validate import validate
from paratrain.spec.model import ModelSpec
from paratrain.trace import COMM_CATEGORIES, TraceEvent

from . import faults
from .comm import layer as comm
from .config import TrainConfig
from .data import Batch
from .data_parallel import local_tensor
from .executor import StepOutput
from .mesh import RuntimeContext
from .metrics import Tracer
from .models import TransformerLM
from .optim import Optimizer
from .pipeline_engine import ActionSpan, LocalChunk, PipelineEngine, accumulation_count
from .pipeline_layout import ChunkLayout, PipelineGroups
from .tensor_parallel import loss_context
from .zero import ShardedOptimizer

__all__ = ["PipelineExecutor", "check_same_schedule", "schedule_for", "validate_pipeline"]

K = ActionKind


def schedule_for(config: ParallelConfig, train_steps: int) -> Schedule:
    """The validated schedule of a run: asynchronous ones cover every step."""
    its = train_steps if config.schedule.is_async else None
    sched = generate(config.schedule, stages=config.pp, microbatches=config.num_microbatches,
                     virtual_stages=config.virtual_stages, iterations=its)
    validate(sched)
    return sched


def validate_pipeline(config: ParallelConfig, train: TrainConfig) -> Schedule:
    """Every pipeline check that needs no process group; returns the validated schedule."""
    if train.dp_impl == "ddp":  # FSDP2 reduces inside each chunk's backward, which the engine runs whole
        raise ConfigError("--dp-impl", "ddp does not run inside the pipeline engine, whose schedule places the "
                          "gradient reductions itself", "use --dp-impl paratrain (or fsdp) with --pp > 1")
    return schedule_for(config, train.steps)


def prefetch_receives(train: TrainConfig, config: ParallelConfig, backend: str) -> int:
    """Pipeline receives posted ahead per peer: ``--prefetch-receives``, else the layout's
    (``ParallelConfig.prefetch_receives``, as a plan wrote it), else the backend's default."""
    if train.prefetch_receives is not None:
        return train.prefetch_receives
    return prefetch_receives_on(config, gloo=backend == "gloo")


def check_same_schedule(schedule: Schedule, rank: int, world: int, group: dist.ProcessGroup | None = None) -> None:
    """Raise :class:`ConfigError` on every rank unless all ranks hold the same schedule.

    Messages carry no metadata (shapes are known from the spec), so two ranks running different
    lists would pair the wrong tensors or wait forever; one small all-gather up front rules it out.
    """
    digest = hashlib.sha256((schedule.to_text() + repr(schedule.placement)).encode()).hexdigest()[:16]
    everyone: list[Any] = [None] * world
    comm.all_gather_object(everyone, (digest, schedule.name, schedule.stages, schedule.microbatches), group,
                           purpose="schedule_check")
    odd = [r for r, d in enumerate(everyone) if d[0] != everyone[0][0]]
    if odd:
        first = everyone[odd[0]]
        raise ConfigError(
            "schedule", f"ranks disagree on the pipeline schedule: rank 0 has {everyone[0][1]} "
            f"(stages {everyone[0][2]}, micro-batches {everyone[0][3]}), rank {odd[0]} has {first[1]} "
            f"(stages {first[2]}, micro-batches {first[3]}); {len(odd)} rank(s) differ from rank 0 "
            f"(this is rank {rank})",
            "launch every rank with the same --schedule, --pp, --virtual-stages and batch flags")


def _local_grads(chunk: LocalChunk) -> list[torch.Tensor]:
    """The local tensors of the chunk's gradients, in parameter order (zeros where none arrived:
    every holder of the chunk must reduce the same layout)."""
    out = []
    for p in chunk.params.values():
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        out.append(local_tensor(p.grad))
    return out


def _copy_flat_into(flat: torch.Tensor, tensors: list[torch.Tensor]) -> None:
    """Copy the consecutive pieces of ``flat`` back into ``tensors`` (the inverse of concatenating them)."""
    offset = 0
    with torch.no_grad():
        for t in tensors:
            t.copy_(flat[offset: offset + t.numel()].view_as(t))
            offset += t.numel()


# ----- the executor ---------------------------------------------------------------------------------

class PipelineExecutor:
    """Runs this rank's action list of ``schedule`` per step (module docstring).

    ``modules`` are the layout's chunks after tensor parallelism; ``optimizer`` is the step loop's,
    stepped at each ``U``; ``batch_of(step)`` is this data-parallel rank's share of a step's batch.
    """

    def __init__(self, ctx: RuntimeContext, spec: ModelSpec, train: TrainConfig, schedule: Schedule,
                 layout: ChunkLayout, modules: list[nn.Module], groups: PipelineGroups, optimizer: Optimizer,
                 batch_of: Callable[[int], Batch], *, tracer: Tracer, phase: faults.Phase,
                 autocast: Callable[[], Any],
                 loss: Callable[[Any, torch.Tensor], torch.Tensor] = TransformerLM.loss) -> None:
        self.ctx, self.spec, self.train, self.schedule = ctx, spec, train, schedule
        self.config = ctx.config
        self.layout, self.groups, self.optimizer, self.batch_of = layout, groups, optimizer, batch_of
        self.tracer, self.phase = tracer, phase
        self.pp_rank, self.dp_rank, self.tp_rank, self.cp_rank = ctx.pp_rank, ctx.dp_rank, ctx.tp_rank, ctx.cp_rank
        self.is_async = self.config.schedule.is_async
        self.chunks = [
            LocalChunk(c, rep, module, is_first=c == 0, is_last=c == schedule.num_chunks - 1,
                       params={n: p for n, p in module.named_parameters() if p.requires_grad})
            for (c, rep), module in zip(layout.held, modules, strict=True)]
        self.chunks_sharded = any(ch.fully_sharded for ch in self.chunks)  # --dp-impl fsdp (zero2/zero3)
        # FSDP2 under a split backward (ZB-H1): gradients held unsharded until the chunk's R
        self.held_gradients = self.chunks_sharded and any(
            a.kind is K.BACKWARD_INPUT for row in schedule.actions for a in row)
        if self.held_gradients:
            for ch in self.chunks:
                ch.hold_gradients(True)
        # activations travel in the residual stream's dtype: the parameters' (autocast leaves it)
        dtype = next(p.dtype for ch in self.chunks for p in ch.params.values() if p.is_floating_point())
        cfg = self.config
        # K-FAC (runtime/kfac.py): capture keyed by micro-batch, filler pieces (see use_kfac)
        self.kfac: Any = None
        self.fillers: dict[str, Callable[[], None]] = {}
        self._iteration_engines: list[PipelineEngine] = []

        def new_engine(sched: Schedule) -> PipelineEngine:
            return PipelineEngine(
                sched, self.pp_rank, self.chunks, self,
                # sequence parallelism: chunks exchange the residual stream's sequence slice (of the
                # rank's tokens under context parallelism)
                activation_shape=(cfg.microbatch, spec.seq // cfg.cp // (cfg.tp if cfg.sequence_parallel else 1),
                                  spec.hidden),
                activation_dtype=dtype,
                device=ctx.device,
                peer_rank=lambda q: cfg.rank_of(pp=q, dp=self.dp_rank, cp=self.cp_rank, tp=self.tp_rank),
                loss_fn=loss, loss_context=lambda: loss_context(cfg.tp), autocast=autocast,
                record=train.trace is not None, fillers=self.fillers, before=self._before_action,
                # --prefetch-receives, else the run's layout's, else the backend's default (gloo
                # progresses each message on its own; NCCL's p2p run in order on one stream)
                prefetch_receives=prefetch_receives(train, cfg, ctx.backend))

        self._new_engine = new_engine
        self.engine = new_engine(schedule)
        self.accumulation = accumulation_count(schedule)
        self._pending: list[tuple[LocalChunk, torch.Tensor, Any, float]] = []
        self._step_spans: list[tuple[int, ActionSpan]] = []
        n_u = sum(1 for a in schedule.actions[self.pp_rank] if a.kind is K.OPTIMIZER_STEP)
        self._u_per_step = max(1, n_u // schedule.iterations)
        self._current_step = 0
        self._norm_of_step: dict[int, float] = {}
        self._async_out: dict[int, StepOutput] = {}
        # asynchronous schedules: the step after which the pipeline drains (every micro-batch in
        # flight finishes, the weight versions collapse to one), asked at the start of each segment;
        # None (the default): one segment, the whole run. Checkpointing drains at its checkpoint steps.
        self.drain_at: Callable[[int], int | None] | None = None
        self._segment = (0, train.steps)  # (first step, steps) of the segment running
        self._engines = {schedule.iterations: self.engine}  # by segment length
        # gradient compression (--compress): one reducer (its residual) per local chunk copy, and
        # this step's statistics for the metrics row
        self._reducers: dict[tuple[int, int], Any] = {}
        self._compressed: list[LocalChunk] = []
        self.compression_stats: list[Any] = []

    @property
    def reducers(self) -> list[Any]:
        """The compressed gradient reductions made so far, one per local chunk copy (their
        residuals are rescaled with the learning rate: compress/momentum.py)."""
        return list(self._reducers.values())

    # ----- one step --------------------------------------------------------------------------------
    def run(self, step: int) -> StepOutput:
        """Forward, backward, reductions and optimizer steps of ``step``; the local mean loss where
        the last chunk lives. Asynchronous schedules run a whole segment of steps (the whole run,
        or up to :attr:`drain_at`) at its first step."""
        faults.maybe_inject_fault(self.ctx.rank, step)
        if self.is_async:
            if step not in self._async_out:
                self._run_async(step)
            return self._async_out.pop(step)
        self._current_step = step
        if self._iteration_engines:  # bubble-filled K-FAC: this step's iteration of the cycle
            self.engine = self._iteration_engines[step % len(self._iteration_engines)]
        self.compression_stats = []
        batch = self.batch_of(step)
        mark = len(self.engine.spans)
        self.phase.name = f"step {step} pipeline"
        self.engine.losses.clear()
        self.engine.run(lambda mb: batch.microbatch(mb),
                        phase=lambda s: setattr(self.phase, "name", f"step {step} {s}"))
        self._step_spans.extend((step, sp) for sp in self.engine.spans[mark:])
        local = None
        if self.engine.losses:
            local = torch.tensor(sum(self.engine.losses.values()) / self.accumulation, dtype=torch.float64)
        return StepOutput(local, self._norm_of_step.get(step, float("nan")))

    def _run_async(self, first: int) -> None:
        """Steps ``first`` to the next drain as one action list: the schedule generated over those
        steps fills the pipeline at ``first`` and drains it at the end, where every stashed
        version has had its last use and the weights are one state again (the run's own
        schedule when the segment is the whole run)."""
        end = self.train.steps
        if self.drain_at is not None:
            end = min(end, max(first + 1, self.drain_at(first) or end))
        n = end - first
        if n != self.engine.schedule.iterations:
            if n not in self._engines:  # segments mostly share one length: generate each length once
                self._engines[n] = self._new_engine(schedule_for(self.config, n))
            self.engine = self._engines[n]
        self.engine.steps_done = 0  # the schedule numbers weight versions from the segment's start
        self._segment = (first, n)
        m = self.schedule.microbatches
        cache: dict[int, Batch] = {}

        def microbatch(mb: int) -> tuple[torch.Tensor, torch.Tensor]:
            k = first + mb // m
            if k not in cache:
                cache[k] = self.batch_of(k)
            return cache[k].microbatch(mb % m)

        start = time.perf_counter()
        self.engine.run(microbatch, phase=lambda s: setattr(self.phase, "name", f"asynchronous pipeline {s}"))
        if self.drain_at is not None:
            self._collapse_tied()
        per_step_s = (time.perf_counter() - start) / n
        self._step_spans.extend((first, sp) for sp in self.engine.spans)
        self.engine.spans.clear()
        for k in range(first, end):
            mine = [v for mb, v in self.engine.losses.items() if first + mb // m == k]
            local = torch.tensor(sum(mine) / m, dtype=torch.float64) if mine else None
            # this rank's stage norm at the step's last update (stages clip separately)
            self._async_out[k] = StepOutput(local, self._norm_of_step.get(k, float("nan")), per_step_s)
        self.engine.losses.clear()

    def _collapse_tied(self) -> None:
        """At a drain, make the copies of a parameter that two pipeline ranks share (the tied
        embedding and output projection) one state again: the first stage's weights and AdamW
        moments, sent to the other holders. Stages clip by their own norms in an asynchronous run,
        so the copies drift apart; one state is what a checkpoint, saved by full-model name, holds."""
        if not self.groups.tie:
            return
        adamw = self.optimizer.adamw
        copies = self._copies()
        with torch.no_grad():
            for name, group in sorted(self.groups.tie.items()):
                if group is None:
                    continue
                src = self.config.rank_of(pp=self.layout.tie_owner[name], dp=self.dp_rank, cp=self.cp_rank,
                                          tp=self.tp_rank)
                first = next(p for rep, p in copies[name] if rep == 0)
                st = adamw.state.get(first, {})
                for t in [first, *(st[k] for k in ("exp_avg", "exp_avg_sq") if k in st)]:
                    comm.broadcast(local_tensor(t), src, group, axis="pp", purpose="tie_drain")

    # ----- K-FAC ------------------------------------------------------------------------------------
    def use_kfac(self, kfac: Any, iterations: list[Schedule]) -> None:
        """Key K-FAC's capture by micro-batch and, given a bubble-filled schedule (one action list
        per iteration of a K-FAC cycle: the run's schedule plus ``X:kfac.*`` fillers), run step
        ``t`` as iteration ``t % len(iterations)`` with the fillers calling ``kfac``'s pieces."""
        self.kfac = kfac
        if not iterations:
            return
        base = self.schedule.actions[self.pp_rank]
        for i, sched in enumerate(iterations):
            mine = tuple(a for a in sched.actions[self.pp_rank] if a.kind is not K.FILLER)
            if mine != base or sched.placement != self.schedule.placement:
                raise ConfigError(f"filled schedule iteration {i}", f"rank {self.pp_rank}'s actions differ from the "
                                  f"run's {self.schedule.name} schedule beyond its filler actions",
                                  "fill the run's own schedule (same --schedule, --pp and batch flags)")
        self.fillers = kfac.fillers()
        self._iteration_engines = [self._new_engine(s) for s in iterations]

    def _before_action(self, a: Any) -> None:
        if self.kfac is not None and a.kind is K.FORWARD:
            self.kfac.key = a.microbatch

    # ----- StepHooks: R and U --------------------------------------------------------------------
    def reduce(self, chunk: LocalChunk) -> None:
        group = self.groups.reduce.get(chunk.chunk)
        if group is None:
            return
        if self.config.compression != "none":
            self._compressed_reduce(chunk, group)
            return
        if self.chunks_sharded:  # FSDP2 reduce-scattered each micro-batch's gradients in its backward
            if self.held_gradients:  # ... or, under ZB-H1, holds them for this one reduce-scatter
                chunk.release_gradients()
            return
        if isinstance(self.optimizer, ShardedOptimizer):  # zero1: the chunk's reduce-scatter
            self.optimizer.reduce(self.optimizer.unit_of(list(chunk.params.values())))
            return
        flat = torch.cat([g.reshape(-1) for g in _local_grads(chunk)])
        start = time.perf_counter()
        work = comm.all_reduce(flat, group, async_op=True, axis="dp", purpose="grad_reduce")
        self._pending.append((chunk, flat, work, start))

    def _compressed_reduce(self, chunk: LocalChunk, group: dist.ProcessGroup) -> None:
        """``R`` with compression: the chunk's whole gradient as one flat view, reduced at once
        (selection needs all of it); averaged with the dense reductions in :meth:`finish_reductions`."""
        from .compress.momentum import dgc_settings
        from .compress.sync import FlatReducer

        key = (chunk.chunk, chunk.replica)
        if key not in self._reducers:
            self._reducers[key] = FlatReducer(self.config.compression, list(chunk.params.values()), group,
                                              self.config.compression_density, self.train.compress_warmup,
                                              dgc_settings(self.train))
        start = time.perf_counter()
        self.compression_stats.append(self._reducers[key].reduce())
        if self.engine.record:
            name = f"R@c{chunk.chunk}" + (f"r{chunk.replica}" if chunk.replica else "")
            self.engine.spans.append(ActionSpan(name, "reduce", start, time.perf_counter(), None))
        self._compressed.append(chunk)

    def finish_reductions(self) -> None:
        dp = self.ctx.data_degree
        with torch.no_grad():
            for chunk in self._compressed:
                for p in chunk.params.values():
                    local_tensor(p.grad).div_(dp)
        self._compressed.clear()
        for chunk, flat, work, start in self._pending:
            work.wait()
            if self.engine.record:
                name = f"R@c{chunk.chunk}" + (f"r{chunk.replica}" if chunk.replica else "")
                self.engine.spans.append(ActionSpan(name, "reduce", start, time.perf_counter(), None))
            flat.div_(dp)
            _copy_flat_into(flat, _local_grads(chunk))
        self._pending.clear()
        if isinstance(self.optimizer, ShardedOptimizer):
            start = time.perf_counter()
            self.optimizer.finish()
            if self.engine.record:
                self.engine.spans.append(ActionSpan("R.wait", "reduce", start, time.perf_counter(), None))
        if self.chunks_sharded and self.groups.replica:
            self._reduce_replicas()
        self._reduce_tied()

    def _reduce_replicas(self) -> None:
        """Chimera under FSDP2: each copy of a chunk holds the dp mean of its own pipeline's
        micro-batches in its shards; the sum over the copies (the same shard on each holder) is the
        step's gradient, as the dense ``R`` sums over both pipelines and divides by dp."""
        for chunk in sorted(self.chunks, key=lambda ch: ch.chunk):  # the same order on every holder
            group = self.groups.replica.get(chunk.chunk)
            if group is None:
                continue
            grads = _local_grads(chunk)
            flat = torch.cat([g.reshape(-1) for g in grads])
            comm.all_reduce(flat, group, axis="pp", purpose="replica_grads")
            _copy_flat_into(flat, grads)

    def _copies(self) -> dict[str, list[tuple[int, nn.Parameter]]]:
        """Local parameters by canonical (full-model) name: (replica, parameter), de-duplicated."""
        out: dict[str, list[tuple[int, nn.Parameter]]] = {}
        for ch in self.chunks:
            names = self.layout.canonical[(ch.chunk, ch.replica)]
            for n, p in ch.params.items():
                lst = out.setdefault(names[n], [])
                if all(q is not p for _, q in lst):
                    lst.append((ch.replica, p))
        return out

    def _reduce_tied(self) -> None:
        if not self.groups.tie:
            return
        copies = self._copies()
        for name, group in sorted(self.groups.tie.items()):
            if group is None:
                continue
            mine = copies[name]
            first = next(p for rep, p in mine if rep == 0)
            if isinstance(self.optimizer, ShardedOptimizer) and self.schedule.num_replicas > 1:
                # zero1 under Chimera: this rank holds one copy in the first chunk's unit and one in the
                # last's, the same group and so the same slice of both; their sum is the slice's total
                slices = [self.optimizer.shard_grad(p) for _, p in mine]
                total = torch.stack(slices).sum(0)
                for sl in slices:
                    sl.copy_(total)
                continue
            if isinstance(self.optimizer, ShardedOptimizer):  # zero1: the copies' slices, alike on both holders
                total = self.optimizer.shard_grad(first)
                assert total is not None
                comm.all_reduce(total, group, axis="pp", purpose="tied_grad")
                continue
            if first.grad is None:
                first.grad = torch.zeros_like(first)
            total = local_tensor(first.grad).clone()
            comm.all_reduce(total, group, axis="pp", purpose="tied_grad")
            for _, p in mine:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                local_tensor(p.grad).copy_(total)

    def _grad_norm_sq(self) -> torch.Tensor:
        """Squared norm of the gradients this rank counts: replica 0, first holder of a shared
        parameter (global norm only); :func:`grad_norm_sq` skips copies along replicated axes."""
        counted = []
        # zero1 under Chimera: a chunk's slices are spread over both pipelines' holders, each
        # slice on one rank, so every copy's slice counts
        every_copy = isinstance(self.optimizer, ShardedOptimizer) and self.schedule.num_replicas > 1
        for name, lst in self._copies().items():
            if every_copy:  # a tied parameter's copies hold the same (summed) slice here: once
                counted.extend(q for _, q in (lst[:1] if name in self.groups.tie else lst))
                continue
            p = next((q for rep, q in lst if rep == 0), None)
            if p is None:
                continue
            if not self.is_async and self.layout.tie_owner.get(name, self.pp_rank) != self.pp_rank:
                continue
            counted.append(p)
        return self.optimizer.grad_norm_sq(counted, self.ctx)

    def optimizer_step(self, index: int) -> None:
        record = self.engine.record
        spans = self.engine.spans
        start = time.perf_counter()
        if self.is_async:  # ``index``: the optimizer steps of this segment before this one
            first, n = self._segment
            step = first + min(index // self._u_per_step, n - 1)
        else:
            step = self._current_step
        self.optimizer.set_step(step)
        sq = self._grad_norm_sq()
        if record:  # the local pass over the gradients: optimizer work, before the wait
            spans.append(ActionSpan("U.norm", "optimizer", start, time.perf_counter(), None))
        start = time.perf_counter()
        if self.is_async:
            if self.groups.stage is not None:
                comm.all_reduce(sq, self.groups.stage, axis="none", purpose="grad_norm")
        elif self.ctx.world_size > 1:
            comm.all_reduce(sq, axis="none", purpose="grad_norm")
        if record:  # mostly waiting for the last rank to finish its backward work
            spans.append(ActionSpan("allreduce(grad norm)", "reduce", start, time.perf_counter(), None))
        start = time.perf_counter()
        self._norm_of_step[step] = self.optimizer.clip(sq.sqrt())  # the step's last optimizer step wins
        self.optimizer.step()
        if record:
            spans.append(ActionSpan("U", "optimizer", start, time.perf_counter(), None))

    # ----- end of run ------------------------------------------------------------------------------
    def full_parameters(self) -> dict[str, torch.Tensor]:
        """Unsharded parameters of the whole model by full-model name (a collective)."""
        mine: dict[str, torch.Tensor] = {}
        for name, lst in sorted(self._copies().items()):
            p = next((q for rep, q in lst if rep == 0), None)
            if p is None:
                continue
            full = p.full_tensor() if isinstance(p, DTensor) else p
            mine[name] = full.detach().cpu().clone()
        gathered: list[Any] = [None] * self.ctx.world_size
        comm.all_gather_object(gathered, mine if (self.dp_rank, self.cp_rank, self.tp_rank) == (0, 0, 0) else {},
                               purpose="final_params")
        out: dict[str, torch.Tensor] = {}
        for d in gathered:
            for k, v in d.items():
                out.setdefault(k, v)
        return out

    def trace_events(self) -> list[TraceEvent]:
        """This rank's measured spans, ``pid`` = pipeline rank; empty except at
        data-, context- and tensor-parallel coordinate 0 (one timeline per pipeline rank)."""
        if (self.dp_rank, self.cp_rank, self.tp_rank) != (0, 0, 0):
            return []
        out = []
        for step, sp in self._step_spans:
            stream = "comm" if sp.category in COMM_CATEGORIES else "compute"
            out.append(TraceEvent(self.pp_rank, stream, sp.name, self.tracer.trace_time(sp.start_s),
                                  sp.end_s - sp.start_s, sp.category, sp.microbatch, step))
        return out

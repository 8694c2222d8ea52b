"""The pipeline engine inside ``paratrain train``: ``--pp P --schedule NAME [--virtual-stages V]``.

:class:`PipelineExecutor` plugs into :class:`~paratrain.runtime.train.Trainer`. It generates the
schedule of the run's :class:`ParallelConfig` (:func:`paratrain.schedule.registry.generate`),
checks that every rank holds the same one, cuts the model into the chunks of the config's
partition, keeps those the schedule places on this pipeline rank (a second model copy for the
chunks of replica 1, Chimera's "up" pipeline), and runs the rank's action list with
:class:`~paratrain.runtime.pipeline_engine.PipelineEngine`. Tensor parallelism is applied to each
chunk by the trainer (DTensor); data parallelism is the schedule's ``R`` actions.

Mesh: global rank = ``ParallelConfig.rank_of(pp, dp, tp)``. Activations travel between the ranks
with the same (dp, tp) coordinates on neighbouring pipeline ranks (each tensor-parallel rank
sends its full replicated activation, Megatron-LM without the scatter/gather optimization).

``R`` of chunk ``c`` all-reduces its gradients (sum) over every rank holding a copy of ``c``: the
data-parallel ranks and, under Chimera, the rank holding the other replica; the sum is divided by
``dp`` (the replicas each saw different micro-batches of the same step, the data-parallel ranks
each a different ``1/dp`` of the global batch). ``U`` waits for the reductions, sums the gradients
of a parameter that two pipeline ranks share (tied embedding and output projection: Megatron-LM's
embedding group), clips by the global norm and steps AdamW with the run's learning-rate schedule.
Clipping of synchronous schedules uses the norm of the whole model (every rank steps at the same
point); asynchronous schedules (PipeDream, 2BW) step each stage at a different time on gradients
of different micro-batches, so each stage clips by its own norm (over its tensor/data-parallel
ranks).

Asynchronous schedules are generated over all ``--steps`` batches and run as one action list: the
pipeline never flushes between steps, as in the papers. The per-step rows are reported afterwards.
"""

from __future__ import annotations

import copy
import hashlib
import time
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from paratrain.errors import ConfigError
from paratrain.schedule.ir import ActionKind, Schedule
from paratrain.schedule.registry import generate
from paratrain.schedule.validate import validate

from .data_parallel import local_tensor
from .models import TransformerLM
from .pipeline_engine import ActionSpan, LocalChunk, PipelineEngine, accumulation_count
from .tensor_parallel import loss_context

if TYPE_CHECKING:
    from .train import Trainer

__all__ = ["PipelineExecutor", "check_same_schedule", "schedule_for", "validate_pipeline", "measured_trace"]

K = ActionKind


def schedule_for(trainer_config: Any, train_steps: int) -> Schedule:
    """The validated schedule of a run: asynchronous ones cover every step."""
    cfg = trainer_config
    its = train_steps if cfg.schedule.is_async else None
    sched = generate(cfg.schedule, stages=cfg.pp, microbatches=cfg.num_microbatches,
                     virtual_stages=cfg.virtual_stages, iterations=its)
    validate(sched)
    return sched


def validate_pipeline(config: Any, train: Any) -> None:
    """Every pipeline check that needs no process group (``validate_run`` calls it before launch)."""
    if train.dp_impl != "paratrain":
        raise ConfigError("--dp-impl", f"{train.dp_impl} does not run inside the pipeline engine, whose schedule "
                          "places the gradient reductions itself", "use --dp-impl paratrain with --pp > 1")
    schedule_for(config, train.steps)


def check_same_schedule(schedule: Schedule, rank: int, world: int, group: dist.ProcessGroup | None = None) -> None:
    """Raise :class:`ConfigError` on every rank unless all ranks hold the same schedule.

    Messages carry no metadata (shapes are known from the spec), so two ranks running different
    lists would pair the wrong tensors or wait forever; one small all-gather up front rules it out.
    """
    digest = hashlib.sha256((schedule.to_text() + repr(schedule.placement)).encode()).hexdigest()[:16]
    everyone: list[Any] = [None] * world
    dist.all_gather_object(everyone, (digest, schedule.name, schedule.stages, schedule.microbatches), group=group)
    odd = [r for r, d in enumerate(everyone) if d[0] != everyone[0][0]]
    if odd:
        first = everyone[odd[0]]
        raise ConfigError(
            "schedule", f"ranks disagree on the pipeline schedule: rank 0 has {everyone[0][1]} "
            f"(stages {everyone[0][2]}, micro-batches {everyone[0][3]}), rank {odd[0]} has {first[1]} "
            f"(stages {first[2]}, micro-batches {first[3]}); {len(odd)} rank(s) differ from rank 0 "
            f"(this is rank {rank})",
            "launch every rank with the same --schedule, --pp, --virtual-stages and batch flags")


class PipelineExecutor:
    """:class:`~paratrain.runtime.train.StepExecutor` running a pipeline schedule (module docstring)."""

    owns_grad_reduction = True  # the schedule's R actions reduce; the trainer must not wrap data parallelism

    def __init__(self, trainer: Trainer) -> None:
        self.trainer = t = trainer
        cfg, ctx = t.config, t.ctx
        validate_pipeline(cfg, t.train)
        self.schedule = schedule_for(cfg, t.train.steps)
        check_same_schedule(self.schedule, ctx.rank, ctx.world_size)
        self.pp_rank, self.dp_rank, self.tp_rank = ctx.pp_rank, ctx.dp_rank, ctx.tp_rank
        self.is_async = cfg.schedule.is_async
        self._make_groups()
        self.engine: PipelineEngine | None = None
        self._async_rows: list[dict[str, Any]] = []
        self._pending: list[tuple[LocalChunk, torch.Tensor, Any, float]] = []
        self._grad_norm = float("nan")
        self._step_spans: list[tuple[int, ActionSpan]] = []
        n_u = sum(1 for a in self.schedule.actions[self.pp_rank] if a.kind is K.OPTIMIZER_STEP)
        self._u_per_step = max(1, n_u // self.schedule.iterations)
        self._current_step = 0
        self._norm_of_step: dict[int, float] = {}

    # ----- process groups (created identically on every rank) ----------------------------------
    def _make_groups(self) -> None:
        cfg, s = self.trainer.config, self.schedule
        made: dict[tuple[int, ...], dist.ProcessGroup] = {}

        def group_of(ranks: list[int]) -> dist.ProcessGroup | None:
            key = tuple(sorted(ranks))
            if len(key) == 1:
                return None
            if key not in made:
                made[key] = dist.new_group(list(key))
            return made[key]

        self.reduce_groups: dict[int, dist.ProcessGroup | None] = {}
        for c in range(s.num_chunks):
            hosts = sorted({row[c] for row in s.placement})
            for t in range(cfg.tp):
                g = group_of([cfg.rank_of(pp=h, dp=d, tp=t) for h in hosts for d in range(cfg.dp)])
                if t == self.tp_rank and self.pp_rank in hosts:
                    self.reduce_groups[c] = g
        self.stage_group = None
        for h in range(cfg.pp):
            g = group_of([cfg.rank_of(pp=h, dp=d, tp=t) for d in range(cfg.dp) for t in range(cfg.tp)])
            if h == self.pp_rank:
                self.stage_group = g
        self._tie_groups_spec: list[tuple[str, tuple[int, ...]]] = []
        self._made = made
        self._group_of = group_of

    # ----- StepExecutor: the chunks of this rank --------------------------------------------------
    def build_parts(self, model: TransformerLM) -> list[nn.Module]:
        cfg, s = self.trainer.config, self.schedule
        sizes = cfg.layers_per_chunk(model.spec.layers)
        starts = [sum(sizes[:c]) for c in range(len(sizes))]
        models = [model] + [copy.deepcopy(model) for _ in range(s.num_replicas - 1)]
        canonical = [{id(p): n for n, p in m.named_parameters()} for m in models]
        # which chunks (of replica 0) hold each parameter, to find those two pipeline ranks share
        chunks_of_name: dict[str, set[int]] = {}
        for c, start in enumerate(starts):
            for _, p in model.chunk(start, start + sizes[c]).named_parameters(remove_duplicate=False):
                chunks_of_name.setdefault(canonical[0][id(p)], set()).add(c)
        self._canon: dict[tuple[int, int], dict[str, str]] = {}
        parts: list[nn.Module] = []
        self._held = s.chunks_of(self.pp_rank)
        for c, rep in self._held:
            ch = models[rep].chunk(starts[c], starts[c] + sizes[c])
            self._canon[(c, rep)] = {n: canonical[rep][id(p)] for n, p in ch.named_parameters(remove_duplicate=False)}
            parts.append(ch)
        # tied parameters across pipeline ranks: one group per (name, dp, tp), made on every rank
        self.tie_groups: dict[str, dist.ProcessGroup | None] = {}
        for name, cs in sorted(chunks_of_name.items()):
            hosts = sorted({s.placement[0][c] for c in cs})
            if len(hosts) < 2:
                continue
            for d in range(cfg.dp):
                for t in range(cfg.tp):
                    g = self._group_of([cfg.rank_of(pp=h, dp=d, tp=t) for h in hosts])
                    if (d, t) == (self.dp_rank, self.tp_rank) and self.pp_rank in hosts:
                        self.tie_groups[name] = g
        self._tie_owner = {n: s.placement[0][min(cs)] for n, cs in chunks_of_name.items()}
        self._parts = parts
        return parts

    def _local_chunks(self) -> list[LocalChunk]:
        out = []
        for (c, rep), module in zip(self._held, self.trainer.parts, strict=True):
            params = {n: p for n, p in module.named_parameters() if p.requires_grad}
            out.append(LocalChunk(c, rep, module, is_first=c == 0, is_last=c == self.schedule.num_chunks - 1,
                                  params=params))
        return out

    def _engine(self) -> PipelineEngine:
        if self.engine is None:
            t = self.trainer
            cfg, spec, ctx = t.config, t.spec, t.ctx
            self.chunks = self._local_chunks()
            # activations travel in the residual stream's dtype: the parameters' (autocast leaves it)
            dtype = next(p.dtype for ch in self.chunks for p in ch.params.values() if p.is_floating_point())
            self.engine = PipelineEngine(
                self.schedule, self.pp_rank, self.chunks, self,
                activation_shape=(cfg.microbatch, spec.seq, spec.hidden), activation_dtype=dtype,
                device=ctx.device, peer_rank=lambda q: cfg.rank_of(pp=q, dp=self.dp_rank, tp=self.tp_rank),
                loss_fn=TransformerLM.loss, loss_context=lambda: loss_context(cfg.tp), autocast=t.autocast,
                record=t.train.trace is not None,
                # gloo progresses each message on its own; NCCL's p2p run in order on one stream
                prefetch_receives=(2 if ctx.backend == "gloo" else 0) if t.train.prefetch_receives is None
                else t.train.prefetch_receives)
            self._accum = accumulation_count(self.schedule)
        return self.engine

    # ----- StepHooks: R and U ----------------------------------------------------------------------
    def reduce(self, chunk: LocalChunk) -> None:
        group = self.reduce_groups.get(chunk.chunk)
        if group is None:
            return
        grads = []
        for p in chunk.params.values():
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            grads.append(local_tensor(p.grad).reshape(-1))
        flat = torch.cat(grads)
        self._pending.append((chunk, flat, dist.all_reduce(flat, group=group, async_op=True), time.perf_counter()))

    def finish_reductions(self) -> None:
        dp = self.trainer.config.dp
        for chunk, flat, work, start in self._pending:
            work.wait()
            if self.engine is not None and self.engine.record:
                name = f"R@c{chunk.chunk}" + (f"r{chunk.replica}" if chunk.replica else "")
                self.engine.spans.append(ActionSpan(name, "reduce", start, time.perf_counter(), None))
            flat.div_(dp)
            offset = 0
            with torch.no_grad():
                for p in chunk.params.values():
                    g = local_tensor(p.grad)
                    g.copy_(flat[offset: offset + g.numel()].view_as(g))
                    offset += g.numel()
        self._pending.clear()
        self._reduce_tied()

    def _copies(self) -> dict[str, list[tuple[int, nn.Parameter]]]:
        """Local parameters by canonical (full-model) name: (replica, parameter), de-duplicated."""
        out: dict[str, list[tuple[int, nn.Parameter]]] = {}
        for ch in self.chunks:
            names = self._canon[(ch.chunk, ch.replica)]
            for n, p in ch.params.items():
                lst = out.setdefault(names[n], [])
                if all(q is not p for _, q in lst):
                    lst.append((ch.replica, p))
        return out

    def _reduce_tied(self) -> None:
        if not self.tie_groups:
            return
        copies = self._copies()
        for name, group in sorted(self.tie_groups.items()):
            if group is None:
                continue
            mine = copies[name]
            first = next(p for rep, p in mine if rep == 0)
            if first.grad is None:
                first.grad = torch.zeros_like(first)
            total = local_tensor(first.grad).clone()
            dist.all_reduce(total, group=group)
            for _, p in mine:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                local_tensor(p.grad).copy_(total)

    def _grad_norm_sq(self) -> torch.Tensor:
        """Squared norm of the gradients this rank counts: replica 0, first holder of a shared
        parameter (global norm only), first copy along replicated tensor/data-parallel axes."""
        from .train import _counts_here

        ctx = self.trainer.ctx
        sq = torch.zeros((), dtype=torch.float64, device=ctx.device)  # a scalar: fp64 costs nothing
        for name, lst in self._copies().items():
            p = next((q for rep, q in lst if rep == 0), None)
            if p is None or p.grad is None or not _counts_here(p, ctx):
                continue
            if not self.is_async and self._tie_owner.get(name, self.pp_rank) != self.pp_rank:
                continue
            g = local_tensor(p.grad).detach()
            sq += g.to(torch.promote_types(g.dtype, torch.float32)).pow(2).sum()
        return sq

    def optimizer_step(self, index: int) -> None:
        from .train import lr_at

        t = self.trainer
        record = self.engine is not None and self.engine.record
        start = time.perf_counter()
        step = min(index // self._u_per_step, t.train.steps - 1) if self.is_async else self._current_step
        lr = lr_at(step, t.train)
        for group in t.optimizer.param_groups:
            group["lr"] = lr
        sq = self._grad_norm_sq()
        if record:  # the local pass over the gradients: optimizer work, before the wait
            self.engine.spans.append(ActionSpan("U.norm", "optimizer", start, time.perf_counter(), None))
        start = time.perf_counter()
        if self.is_async:
            if self.stage_group is not None:
                dist.all_reduce(sq, group=self.stage_group)
        elif t.ctx.world_size > 1:
            dist.all_reduce(sq)
        if record:  # mostly waiting for the last rank to finish its backward work
            self.engine.spans.append(ActionSpan("allreduce(grad norm)", "reduce", start, time.perf_counter(), None))
        start = time.perf_counter()
        norm = sq.sqrt()
        coef = torch.clamp(t.train.grad_clip / (norm + 1e-6), max=1.0)
        with torch.no_grad():
            for p in t.params:
                if p.grad is not None:
                    local_tensor(p.grad).mul_(coef)
        t.optimizer.step()
        t.optimizer.zero_grad(set_to_none=True)
        self._grad_norm = float(norm)
        self._norm_of_step[step] = self._grad_norm  # the step's last optimizer step wins
        if record:
            self.engine.spans.append(ActionSpan("U", "optimizer", start, time.perf_counter(), None))

    # ----- the step ------------------------------------------------------------------------------
    def forward_backward(self, batch: Any, step: int) -> torch.Tensor | None:
        raise NotImplementedError("the pipeline engine runs whole steps: Trainer calls train_step")

    def train_step(self, step: int) -> dict[str, Any]:
        from . import faults

        t = self.trainer
        faults.maybe_inject_fault(t.ctx.rank, step)
        if self.is_async:
            if step == 0:
                self._run_async()
            row = dict(self._async_rows[step])
            row["loss"] = t._global_loss(row.pop("local_loss"))
            return row
        self._current_step = step
        engine = self._engine()
        batch = t.data.local_batch(step, t.ctx.dp_rank, t.config.dp)
        mark = len(engine.spans)
        start = time.perf_counter()
        t.phase.name = f"step {step} pipeline"
        engine.losses.clear()
        engine.run(lambda mb: batch.microbatch(mb), phase=lambda s: setattr(t.phase, "name", f"step {step} {s}"))
        step_s = time.perf_counter() - start
        self._step_spans.extend((step, sp) for sp in engine.spans[mark:])
        local = None
        if engine.losses:
            local = torch.tensor(sum(engine.losses.values()) / self._accum, dtype=torch.float64)
        t.phase.name = f"step {step} loss reduction"
        loss = t._global_loss(local)
        return self._row(step, loss, step_s)

    def _row(self, step: int, loss: float, step_s: float) -> dict[str, Any]:
        from .train import lr_at

        t = self.trainer
        tokens_per_s = t.config.global_batch * t.spec.seq / step_s
        mfu = tokens_per_s * t.flops_per_token / (t.peak_flops * t.ctx.world_size)
        return {"step": step, "loss": loss, "lr": lr_at(step, t.train), "grad_norm": self._grad_norm,
                "step_time_s": step_s, "tokens_per_s": tokens_per_s, "mfu": mfu}

    def _run_async(self) -> None:
        t = self.trainer
        engine = self._engine()
        m = self.schedule.microbatches
        cache: dict[int, Any] = {}

        def microbatch(mb: int) -> tuple[torch.Tensor, torch.Tensor]:
            k = mb // m
            if k not in cache:
                cache[k] = t.data.local_batch(k, t.ctx.dp_rank, t.config.dp)
            return cache[k].microbatch(mb % m)

        start = time.perf_counter()
        engine.run(microbatch, phase=lambda s: setattr(t.phase, "name", f"asynchronous pipeline {s}"))
        per_step_s = (time.perf_counter() - start) / t.train.steps
        self._step_spans.extend((0, sp) for sp in engine.spans)
        for k in range(t.train.steps):
            mine = [v for mb, v in engine.losses.items() if mb // m == k]
            local = torch.tensor(sum(mine) / m, dtype=torch.float64) if mine else None
            # asynchronous: this rank's stage norm at the step's last update (stages clip separately)
            self._grad_norm = self._norm_of_step.get(k, float("nan"))
            self._async_rows.append({**self._row(k, float("nan"), per_step_s), "local_loss": local})

    # ----- end of run: final parameters and measured trace ----------------------------------------
    def full_parameters(self) -> dict[str, torch.Tensor]:
        """Unsharded parameters of the whole model by full-model name (a collective)."""
        mine: dict[str, torch.Tensor] = {}
        for name, lst in sorted(self._copies().items()):
            p = next((q for rep, q in lst if rep == 0), None)
            if p is None:
                continue
            full = p.full_tensor() if isinstance(p, DTensor) else p
            mine[name] = full.detach().cpu().clone()
        ctx = self.trainer.ctx
        gathered: list[Any] = [None] * ctx.world_size
        dist.all_gather_object(gathered, mine if (self.dp_rank, self.tp_rank) == (0, 0) else {})
        out: dict[str, torch.Tensor] = {}
        for d in gathered:
            for k, v in d.items():
                out.setdefault(k, v)
        return out

    def finish(self) -> None:
        t = self.trainer
        if t.train.save_final is not None:
            params = self.full_parameters()
            if t.ctx.rank == 0:
                torch.save(params, t.train.save_final)
        if t.train.trace is not None:
            import json
            from pathlib import Path

            first = (self.dp_rank, self.tp_rank) == (0, 0)
            spans = [(step, sp) for step, sp in self._step_spans] if first else []
            gathered: list[Any] = [None] * t.ctx.world_size
            dist.all_gather_object(gathered, (self.pp_rank, first, t.tracer._perf_to_wall, spans))
            if t.ctx.rank == 0:
                doc = measured_trace([(pp, off, sp) for pp, ok, off, sp in gathered if ok], t.tracer.origin_s,
                                     self.schedule, t.train.steps)
                doc["metadata"].update({"model": t.spec.name, "model_spec": t.spec.to_dict(),
                                        "parallel": t.config.to_dict()})
                Path(t.train.trace).write_text(json.dumps(doc))


def measured_trace(per_rank: list[tuple[int, float, list[tuple[int, ActionSpan]]]], origin_s: float,
                   schedule: Schedule, steps: int) -> dict[str, Any]:
    """The simulator's Chrome-trace document (:func:`paratrain.sim.trace.chrome_trace`) of measured
    spans: ``pid`` = pipeline rank, compute actions on thread 0, p2p batches and reductions on
    thread 1, times in microseconds from the run's origin; each event's ``args.step`` is its step.
    ``metadata`` holds ``microbatches`` and ``iterations`` (optimizer steps one timeline window
    covers: 1 per step for synchronous schedules, all steps for asynchronous ones)."""
    from paratrain.trace import TraceEvent, chrome_trace

    events, steps_of = [], []
    for pp, perf_to_wall, spans in per_rank:
        for step, sp in spans:
            stream = "comm" if sp.category in ("p2p", "reduce") else "compute"
            start = sp.start_s + perf_to_wall - origin_s
            events.append(TraceEvent(pp, stream, sp.name, start, sp.end_s - sp.start_s, sp.category, sp.microbatch))
            steps_of.append(step)
    doc = chrome_trace(events)
    x_events = [e for e in doc["traceEvents"] if e.get("ph") == "X"]
    for e, step in zip(x_events, steps_of, strict=True):
        e["args"] = {**e.get("args", {}), "step": step}
    doc["metadata"] = {"source": "paratrain train (measured)", "schedule": schedule.name, "stages": schedule.stages,
                       "microbatches": schedule.microbatches, "iterations": schedule.iterations, "steps": steps}
    return doc

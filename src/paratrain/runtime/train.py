"""The training loop of one process (a torchrun worker).

Launch (see the README, "Real training")::

    paratrain train --model gpt-tiny --steps 50                        # one process
    paratrain train --model gpt-tiny --dp 2 --tp 2 --nproc 4           # launches 4 workers itself
    torchrun --nproc-per-node 4 -m paratrain train --model gpt-tiny --dp 2 --tp 2
    torchrun --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint HOST:29400 \\
        -m paratrain train --config plan.json                           # several nodes

:func:`worker_main` checks the run, forms the process group and builds a :class:`Trainer`, the
step loop. Set-up: the full model from the seed (same weights on every rank); with a pipeline the
chunks the schedule places on this rank; tensor parallelism (DTensor) on what the rank holds;
data parallelism (no pipeline; with one, the schedule's ``R`` actions reduce); AdamW. One step:
the learning rate of the step -> the executor runs forward and backward of the rank's
micro-batches with the data-parallel reduction (:class:`~paratrain.runtime.executor.SingleStageExecutor`,
or :class:`~paratrain.runtime.pipeline.PipelineExecutor`, whose ``U`` actions clip and step) ->
global-norm clipping and the optimizer step -> the loss, averaged over the global batch ->
the metrics row (step time, tokens/s, MFU). At the end :meth:`Trainer.finish` writes the final
parameters and the measured trace.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from paratrain.errors import ConfigError
from paratrain.fileio import atomic_writer
from paratrain.parallel.config import ParallelConfig
from paratrain.schedule.ir import Schedule
from paratrain.spec.model import ModelSpec
from paratrain.trace import write_trace

from . import faults
from .comm import layer as comm
from .comm.table import load_table
from .compress.momentum import ResidualLrScaling, dgc_settings
from .compress.sync import compression_metrics
from .config import (
    DP_IMPLS,
    TrainConfig,
    check_checkpointing,
    check_compression,
    check_context_parallel,
    check_eval,
    check_gemm_dtype,
    check_host_memory,
    check_kfac,
    check_outputs,
    check_sharding,
    check_sinks,
    check_task,
    check_tp_overlap,
)
from .context_parallel import apply_context_parallel, shard_batch
from .data import Batch
from .data.tokenized import run_data_sources
from .data_parallel import GradSync, fully_shard_model, uses_fsdp, wrap_data_parallel
from .eval import Evaluator
from .executor import SingleStageExecutor, StepExecutor, StepOutput
from .kfac import KfacOptimizer, load_filled, make_optimizer
from .mesh import RuntimeContext, check_model_layout, init_runtime
from .metrics import MetricsWriter, Tracer, max_memory_bytes, peak_flops_per_device, step_mfu
from .models import TransformerLM, build_model
from .optim import global_grad_norm, lr_at
from .pipeline import PipelineExecutor, check_same_schedule, schedule_for, validate_pipeline
from .pipeline_layout import cut_model, make_groups
from .progress import StepConsole
from .sinks import open_sinks
from .tensor_parallel import apply_tensor_parallel
from .zero import ShardedOptimizer

__all__ = ["TrainConfig", "Trainer", "StepExecutor", "StepOutput", "SingleStageExecutor", "lr_at",
           "global_grad_norm", "validate_run", "check_outputs", "check_host_memory",
           "worker_main", "DP_IMPLS"]


# ----- checks before anything starts ----------------------------------------------------------------

def validate_run(spec: ModelSpec, config: ParallelConfig, train: TrainConfig, *,
                 procs_on_host: int = 1) -> Schedule | None:
    """Every check that needs no process group: run it before launching anything. Returns the
    validated pipeline schedule (``None`` without a pipeline)."""
    check_model_layout(spec, config)
    check_context_parallel(config, train)
    check_tp_overlap(config)
    check_gemm_dtype(config)
    if train.dp_impl == "ddp" and config.tp > 1:
        raise ConfigError("--dp-impl", "ddp does not compose with tensor parallelism here",
                          "use --dp-impl paratrain or fsdp with --tp > 1")
    if train.data not in ("stdlib", "synthetic") and not os.path.exists(train.data):
        raise ConfigError("--data", f"{train.data!r} does not exist",
                          "give a file or directory, 'stdlib' or 'synthetic'")
    check_sharding(config, train)
    check_compression(config, train)
    check_kfac(config, train)
    check_checkpointing(config, train)
    check_host_memory(spec, procs_on_host, config)
    check_task(config, train)
    check_eval(config, train)
    check_sinks(train)
    check_outputs(train)
    if train.comm_table is not None:  # every backend the table names runs here (NCCL: CUDA, MPI: built in)
        from .comm.backends import check_table

        check_table(load_table(train.comm_table), "cuda" if torch.cuda.is_available() else "cpu")
    # the schedule's own rules (e.g. Chimera's even stage count)
    return validate_pipeline(config, train) if config.pp > 1 else None


# ----- the step loop -----------------------------------------------------------------------------------

class Trainer:
    """The step loop of one rank: owns the model parts, the executor, the optimizer, the data, the
    metrics rows and the end of the run (final parameters, trace).

    ``schedule``: the run's validated pipeline schedule (:func:`validate_run` returns it); generated
    here when not given.
    """

    def __init__(self, ctx: RuntimeContext, spec: ModelSpec, train: TrainConfig, *,
                 schedule: Schedule | None = None, phase: faults.Phase | None = None) -> None:
        self.ctx, self.spec, self.train, self.config = ctx, spec, train, ctx.config
        self.phase = phase if phase is not None else faults.Phase()
        origin = [time.time()]
        if ctx.world_size > 1:
            comm.broadcast_object_list(origin, 0, purpose="clock_origin")  # before the log's clock exists
        self.tracer = Tracer(ctx.rank, origin[0], enabled=train.trace is not None)
        # every call from here on goes through this run's layer: logged with the trace's clock and
        # step (--comm-log), routed by the tuning table (--comm-table)
        self.comm = comm.CommLayer(
            rank=ctx.rank, clock=self.tracer, log=train.comm_log is not None,
            table=load_table(train.comm_table) if train.comm_table is not None else None,
            default_backend=ctx.backend, device_type=ctx.device.type, timeout_s=train.timeout_s)
        comm.use(self.comm)
        self.lr_scaling: ResidualLrScaling | None = None  # set below for sparse compressors
        if train.task == "image":  # the CNN on an image folder: its own data, model and executor
            from .data.image_task import setup_image_task

            setup_image_task(self)
            return
        model = build_model(spec, train.seed)
        self.positions: torch.Tensor | None = None  # this cp rank's tokens of each sequence (cp > 1)
        if train.init == "pretrained" and train.init_from is not None:
            from .models.hf import load_weights  # into the full model: every layout cuts the same numbers

            load_weights(model, train.init_from, spec)
        tp_mesh = ctx.submesh("tp")
        self.schedule: Schedule | None = None
        self.executor: StepExecutor
        if self.config.pp == 1:
            # Move first, then shard: moving DTensor parameters swaps their tensors, which drops the
            # gradient hooks tensor parallelism registers on them.
            part = apply_tensor_parallel(model.to(ctx.device), tp_mesh,
                                         sequence_parallel=self.config.sequence_parallel)
            loss = self._context_parallel([part])
            grad_sync: GradSync
            if self._zero1():  # the distributed optimizer reduces the gradients itself (runtime/zero.py)
                self.optimizer = ShardedOptimizer([(_trainable([part]), ctx.data_group())], train, ctx,
                                                  recorder=self.tracer)
                grad_sync = self.optimizer
            else:
                part, grad_sync = wrap_data_parallel(part, ctx, train.dp_impl, bucket_bytes=train.bucket_bytes,
                                                     recorder=self.tracer, compress_warmup=train.compress_warmup,
                                                     dgc=dgc_settings(train))
                self.optimizer = make_optimizer(_trainable([part]), train, ctx, self.config.global_batch * spec.seq,
                                                [(0, 0, part, ctx.data_group() if ctx.data_degree > 1 else None)])
            self.executor = SingleStageExecutor(ctx, part, grad_sync, self._batch, tracer=self.tracer,
                                                phase=self.phase, autocast=self.autocast, loss=loss)
        else:
            self.schedule = schedule if schedule is not None else schedule_for(self.config, train.steps)
            check_same_schedule(self.schedule, ctx.rank, ctx.world_size)
            layout = cut_model(model, self.schedule, self.config, ctx.pp_rank)
            loss = self._context_parallel(layout.modules)
            groups = make_groups(self.config, self.schedule, layout, ctx)
            parts = [apply_tensor_parallel(m.to(ctx.device), tp_mesh, sequence_parallel=self.config.sequence_parallel)
                     for m in layout.modules]
            if uses_fsdp(train.dp_impl, ctx):  # zero2/zero3: every chunk sharded over its stage's dp group
                for m in parts:
                    fully_shard_model(m, ctx)
            filled = load_filled(train, ctx)  # --fill-bubbles: the schedule's iterations with K-FAC fillers
            if self._zero1():  # one unit per chunk, reduced at the chunk's R action; in chunk order, the
                # same on every holder of a chunk (Chimera: a rank's chunks share one group)
                held = sorted(zip(layout.held, parts, strict=True), key=lambda cm: cm[0])
                self.optimizer = ShardedOptimizer(
                    [([p for p in m.parameters() if p.requires_grad], groups.reduce[c]) for (c, _), m in held],
                    train, ctx)
            else:
                self.optimizer = make_optimizer(_trainable(parts), train, ctx, self.config.global_batch * spec.seq,
                                                [(c, rep, m, groups.reduce.get(c))
                                                 for (c, rep), m in zip(layout.held, parts, strict=True)], filled)
            self.executor = PipelineExecutor(ctx, spec, train, self.schedule, layout, parts, groups, self.optimizer,
                                             self._batch, tracer=self.tracer, phase=self.phase,
                                             autocast=self.autocast, loss=loss)
            if isinstance(self.optimizer, KfacOptimizer):
                self.executor.use_kfac(self.optimizer.kfac, filled)
        self.params = self.optimizer.params
        # sparse compressors' error feedback in units of the update (compress/momentum.py)
        self.lr_scaling = ResidualLrScaling() if (train.compress_lr_weighted_residual and self.config.compression
                                                  not in ("none", "powersgd")) else None
        # the byte corpus, or tokenized text (runtime/data/tokenized.py); the eval data alike
        self.data, eval_source = run_data_sources(
            spec, train.data, train.eval_data, train.tokenizer, seed=train.seed, global_batch=self.config.global_batch,
            microbatch=self.config.microbatch, cap_bytes=train.data_cap_bytes,
            tokenize_first=ctx.local_rank == 0, barrier=dist.barrier if ctx.world_size > 1 else None)
        self.evaluator = None if eval_source is None else Evaluator(
            ctx, self.executor, eval_source, batches=train.num_eval_batches, every=train.eval_every,
            steps=train.steps, autocast=self.autocast, positions=self.positions)
        if self.evaluator is not None and getattr(self.executor, "is_async", False):
            # PipeDream / 2BW: drain where an evaluation is due, so the weights are one state there
            self.executor.drain_at = self.evaluator.next_boundary
        self.peak_flops, self.peak_device = peak_flops_per_device(ctx.device, train.bf16)

    def _context_parallel(self, modules: list[torch.nn.Module]) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
        """With cp > 1, ring attention over the cp ranks, each on its tokens of every sequence (sets
        :attr:`positions`). Returns the loss to train ``modules`` with."""
        if self.config.cp == 1:
            return TransformerLM.loss
        self.positions, loss = apply_context_parallel(modules, self.ctx.group("cp"), self.spec)
        return loss

    def _zero1(self) -> bool:
        """``--sharding zero1`` with more than one data-parallel (or context-parallel) rank: one rank
        has nothing to shard."""
        return self.config.sharding == "zero1" and self.ctx.data_degree > 1

    def _batch(self, step: int) -> Batch:
        batch = self.data.local_batch(step, self.ctx.dp_rank, self.config.dp)
        return batch if self.positions is None else shard_batch(batch, self.positions)

    def autocast(self) -> contextlib.AbstractContextManager[Any]:
        if not self.train.bf16:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.ctx.device.type, dtype=torch.bfloat16)

    def run(self, writer: MetricsWriter) -> list[dict[str, Any]]:
        """Every step, each row written to ``writer`` and logged by rank 0; returns the rows.

        With ``--checkpoint-dir``: resumes from the newest complete checkpoint (``--resume``),
        checkpoints at step boundaries and at the end (:mod:`paratrain.runtime.checkpoint`)."""
        rows = []
        console = StepConsole(self.ctx.rank, self.train.steps, log_every=self.train.log_every,
                              progress_bar=self.train.progress)
        console.line(self.describe())
        ckpt = None
        if self.train.checkpoint_dir is not None:
            from .checkpoint.persist import Checkpointer

            ckpt = Checkpointer(self, console.line)
        first = 0 if ckpt is None else ckpt.restore() if self.train.resume else ckpt.begin()
        with console:
            for step in range(first, self.train.steps):
                row = self.train_step(step)
                row.update(self.after_step_metrics(step))
                if ckpt is not None:
                    row.update(ckpt.after_step(step, row))
                rows.append(row)
                writer.write({**row, "rank": self.ctx.rank})
                console.step(row)
            if ckpt is not None:
                self.phase.name = "final checkpoint"
                ckpt.finish(self.train.steps)
        return rows

    def train_step(self, step: int) -> dict[str, Any]:
        """One optimizer step; returns its metrics row (the same loss on every rank)."""
        self.tracer.step = step
        lr = self.optimizer.set_step(step)
        if self.lr_scaling is not None:
            self.lr_scaling.before_step(self.executor, lr)
        start = time.perf_counter()
        out = self.executor.run(step)
        grad_norm = out.grad_norm
        if grad_norm is None:  # the executor left the update to the loop
            self.phase.name = f"step {step} gradient clipping"
            with self.tracer.span("X:clip"):
                grad_norm = self.optimizer.clip(self.optimizer.global_norm(self.ctx))
            self.phase.name = f"step {step} optimizer"
            with self.tracer.span("U"):
                self.optimizer.step()
        step_s = out.step_s if out.step_s is not None else time.perf_counter() - start
        self.phase.name = f"step {step} loss reduction"
        loss = self._global_loss(out.local_loss)
        gb = self.config.global_batch
        image = self.train.task == "image"  # the CNN: no tokens, and the transformer FLOPs do not apply
        return {"step": step, "loss": loss, "lr": lr, "grad_norm": grad_norm, "step_time_s": step_s,
                "samples_per_s": gb / step_s,
                "tokens_per_s": None if image else gb * self.spec.seq / step_s,
                "mfu": None if image else step_mfu(self.spec, gb, step_s, self.peak_flops, self.ctx.world_size),
                # gradient compression's volume, density, threshold and residual (none: no keys)
                **compression_metrics(self.executor)}

    def after_step_metrics(self, step: int) -> dict[str, Any]:
        """The row's keys beyond the step itself: tokens trained on so far, peak memory, and on
        evaluation steps ``eval_loss`` and ``eval_ppl`` (runtime/eval.py)."""
        out: dict[str, Any] = {"max_memory_bytes": max_memory_bytes(self.ctx.device)}
        if self.train.task != "image":
            out["tokens"] = (step + 1) * self.config.global_batch * self.spec.seq
        evaluator = getattr(self, "evaluator", None)  # the image task sets none
        if evaluator is not None and evaluator.due(step):
            self.phase.name = f"step {step} evaluation"
            out.update(evaluator.evaluate())
        return out

    def _global_loss(self, local: torch.Tensor | None) -> float:
        # Ranks computing the loss hold it replicated over tp: count it once (tp coordinate 0),
        # sum over the world (dp replicas; a pipeline's last stage) and average over dp (and over
        # cp, whose ranks each hold the mean over their own tokens).
        t = torch.zeros((), dtype=torch.float64, device=self.ctx.device)  # reported losses keep fp64 runs' digits
        if local is not None and self.ctx.tp_rank == 0:
            t += local
        if self.ctx.world_size > 1:
            comm.all_reduce(t, axis="none", purpose="loss")
        return float(t) / self.ctx.data_degree

    def full_parameters(self) -> dict[str, torch.Tensor]:
        """Unsharded parameters of the whole model by name (a collective: every rank must call it)."""
        return self.executor.full_parameters()

    def finish(self) -> None:
        """Write the final parameters and the trace (collectives on every rank, then rank 0's I/O)."""
        if self.train.save_final is not None:
            params = self.full_parameters()
            if self.ctx.rank == 0:
                with atomic_writer(self.train.save_final, "--save-final", binary=True) as fh:
                    torch.save(params, fh)
        if self.train.trace is not None:
            mine = self.executor.trace_events()
            gathered: list[Any] = [None] * self.ctx.world_size
            if self.ctx.world_size > 1:
                comm.all_gather_object(gathered, mine, purpose="trace_gather")
            else:
                gathered = [mine]
            if self.ctx.rank == 0:
                c = self.config
                cp = f" cp={c.cp}" if c.cp > 1 else ""
                write_trace(self.train.trace, [e for evs in gathered for e in evs], field="--trace",
                            metadata=self.trace_metadata(),
                            title=f"measured: paratrain train {self.spec.name} dp={c.dp} tp={c.tp} pp={c.pp}{cp} "
                                  f"({self.train.dp_impl})")
        if self.train.comm_log is not None:  # last: the calls above are in it
            from .comm.log import write_comm_log

            write_comm_log(self.train.comm_log, self.comm)

    def trace_metadata(self) -> dict[str, Any]:
        """What the trace measured: enough to simulate the same run (``paratrain calibrate --from-trace``,
        ``paratrain compare``)."""
        s, c = self.schedule, self.config
        return {"source": "paratrain train (measured)", "model": self.spec.name, "model_spec": self.spec.to_dict(),
                "parallel": c.to_dict(), "dp_impl": self.train.dp_impl,
                # one stage running each micro-batch's forward and backward in turn is 1F1B's one-stage case
                "schedule": s.name if s is not None else "1f1b", "stages": c.pp,
                "microbatches": s.microbatches if s is not None else c.num_microbatches,
                "iterations": s.iterations if s is not None else 1, "steps": self.train.steps}

    def _sharding_words(self) -> str:
        level = self.config.sharding
        if level == "none" or self.config.dp == 1:
            return ""
        return ", zero1: optimizer state sharded" if level == "zero1" else f", {level}"

    def describe(self) -> str:
        c, ctx, data = self.config, self.ctx, self.data
        if self.train.task == "image":
            return data.describe(self.executor.model, c, ctx, self.train.dp_impl)
        cp = f" cp={c.cp} (ring attention, {self.spec.seq // c.cp} tokens of each sequence per rank)" if c.cp > 1 \
            else ""
        return (f"{self.spec.name}: {self.spec.param_count():,} parameters, dp={c.dp} tp={c.tp} pp={c.pp}{cp} "
                f"({self.train.dp_impl} data parallel{self._sharding_words()}) "
                f"on {ctx.world_size}x {ctx.device.type} ({ctx.backend}), "
                f"global batch {c.global_batch} = {c.num_microbatches} micro-batches of {c.microbatch} per replica, "
                f"data {data.corpus.name} ({data.corpus.size_bytes:,} bytes); MFU against "
                f"{self.peak_flops / 1e12:.3g} TFLOP/s ({self.peak_device})")


def _trainable(parts: list[torch.nn.Module]) -> list[torch.nn.Parameter]:
    return list({id(p): p for m in parts for p in m.parameters() if p.requires_grad}.values())


# ----- one worker ----------------------------------------------------------------------------------------

def worker_main(spec: ModelSpec, config: ParallelConfig, train: TrainConfig) -> list[dict[str, Any]]:
    """Body of one worker process: returns the per-step metrics (every rank holds the same losses).

    Failures never return: one line on stderr, then exit (see :mod:`paratrain.runtime.faults`).
    """
    rank = int(os.environ.get("RANK", "0"))
    alone = int(os.environ.get("WORLD_SIZE", "1")) == 1
    phase = faults.Phase()
    with faults.guard(rank, phase, train.timeout_s, alone=alone), faults.signal_handlers(rank, alone=alone):
        schedule = validate_run(spec, config, train,
                                procs_on_host=int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
        phase.name = "rendezvous"
        ctx = init_runtime(config, timeout_s=train.timeout_s)
        if ctx.backend == "gloo" and ctx.world_size > 1:
            phase.name = "start-up barrier"
            dist.monitored_barrier(timeout=datetime.timedelta(seconds=train.timeout_s), wait_all_ranks=True)
        torch.manual_seed(train.seed)
        phase.name = "set-up"
        trainer = Trainer(ctx, spec, train, schedule=schedule, phase=phase)
        with MetricsWriter(train.metrics, ctx.rank, sinks=open_sinks(train, ctx.rank)) as writer:
            rows = trainer.run(writer)
        phase.name = "final save"
        trainer.finish()
        phase.name = "shutdown"
        if ctx.world_size > 1:
            comm.barrier(purpose="shutdown")  # no rank tears its sockets down while a peer still talks to it
        dist.destroy_process_group()
        return rows
    raise AssertionError("unreachable: guard exits on failure")

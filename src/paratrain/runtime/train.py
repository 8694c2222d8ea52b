"""The training loop of one process (a torchrun worker).

Launch (see the README, "Real training")::

    paratrain train --model gpt-tiny --steps 50                        # one process
    paratrain train --model gpt-tiny --dp 2 --tp 2 --nproc 4           # launches 4 workers itself
    torchrun --nproc-per-node 4 -m paratrain train --model gpt-tiny --dp 2 --tp 2
    torchrun --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint HOST:29400 \\
        -m paratrain train --config plan.json                           # several nodes

One step: the rank's share of the global batch as micro-batches -> :class:`StepExecutor`
(forward and backward of every micro-batch, gradients accumulated; the pipeline engine replaces
this part) -> data-parallel gradient reduction finishes -> global-norm clipping -> AdamW ->
learning-rate schedule. The reported loss is the mean over the global batch.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import math
import os
import time
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Replicate

from paratrain.errors import ConfigError
from paratrain.parallel.config import ParallelConfig
from paratrain.spec.model import ModelSpec

from . import faults
from .data import Batch, DataSource, load_corpus
from .data_parallel import BucketedAllReduce, DDPGradSync, FSDPGradSync, GradSync, NoGradSync, local_tensor
from .mesh import RuntimeContext, check_model_layout, init_runtime
from .metrics import MetricsWriter, Tracer, model_flops_per_token, peak_flops_per_device, write_chrome_trace
from .models import TransformerLM, build_model
from .tensor_parallel import apply_tensor_parallel, loss_context

__all__ = ["TrainConfig", "Trainer", "StepExecutor", "SingleStageExecutor", "lr_at", "global_grad_norm",
           "clip_grad_norm_", "validate_run", "worker_main", "DP_IMPLS"]

DP_IMPLS = ("paratrain", "ddp", "fsdp")


@dataclass(frozen=True)
class TrainConfig:
    """Everything about a run that is not the model or the parallel layout."""

    steps: int = 20
    seed: int = 0
    lr: float = 1e-3
    min_lr_ratio: float = 0.1  # cosine decays to lr * min_lr_ratio (Chinchilla, Hoffmann et al. 2022)
    warmup_steps: int | None = None  # None: 10% of the steps
    weight_decay: float = 0.1
    betas: tuple[float, float] = (0.9, 0.95)  # GPT-3 (Brown et al. 2020, appendix B)
    grad_clip: float = 1.0
    bf16: bool = False
    data: str = "stdlib"
    data_cap_bytes: int = 8 * 2**20
    dp_impl: str = "paratrain"
    bucket_bytes: int = 25 * 2**20
    metrics: str | None = None
    trace: str | None = None
    save_final: str | None = None
    timeout_s: float = 300.0
    log_every: int = 1
    progress: bool = True
    # pipeline receives posted ahead per peer (runtime.pipeline_engine); None: 2 on gloo, 0 on NCCL
    prefetch_receives: int | None = None

    def __post_init__(self) -> None:
        if self.steps < 1:
            raise ConfigError("--steps", f"must be at least 1, got {self.steps}", "use --steps 1 or more")
        if self.dp_impl not in DP_IMPLS:
            raise ConfigError("--dp-impl", f"unknown value {self.dp_impl!r}", f"use one of: {', '.join(DP_IMPLS)}")
        if not self.lr > 0:
            raise ConfigError("--lr", f"must be positive, got {self.lr}", "use e.g. --lr 1e-3")
        if self.bucket_bytes < 1:
            raise ConfigError("--bucket-mb", f"must be positive, got {self.bucket_bytes / 2**20:g}", "use e.g. 25")
        if self.prefetch_receives is not None and self.prefetch_receives < 0:
            raise ConfigError("--prefetch-receives", f"must be at least 0, got {self.prefetch_receives}",
                              "use 0 (post each receive at its action) or 1-2")
        if not self.timeout_s > 0:
            raise ConfigError("--timeout", f"must be positive, got {self.timeout_s}", "use e.g. --timeout 60")

    @property
    def warmup(self) -> int:
        return self.warmup_steps if self.warmup_steps is not None else max(1, self.steps // 10)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Linear warm-up over ``warmup`` steps, then cosine decay to ``lr * min_lr_ratio`` at the last step."""
    w = cfg.warmup
    if step < w:
        return cfg.lr * (step + 1) / w
    span = max(1, cfg.steps - 1 - w)
    progress = min(1.0, (step - w) / span)
    floor = cfg.lr * cfg.min_lr_ratio
    return floor + 0.5 * (cfg.lr - floor) * (1.0 + math.cos(math.pi * progress))


def validate_run(spec: ModelSpec, config: ParallelConfig, train: TrainConfig) -> None:
    """Every check that needs no process group: run it before launching anything."""
    check_model_layout(spec, config)
    if config.sequence_parallel and config.pp > 1:
        raise ConfigError("sequence_parallel", "is not wired into the pipeline engine (its transfers carry the "
                          "full sequence)", "use sequence parallelism with --pp 1")
    if train.dp_impl == "ddp" and config.tp > 1:
        raise ConfigError("--dp-impl", "ddp does not compose with tensor parallelism here",
                          "use --dp-impl paratrain or fsdp with --tp > 1")
    if train.data not in ("stdlib", "synthetic") and not os.path.exists(train.data):
        raise ConfigError("--data", f"{train.data!r} does not exist",
                          "give a file or directory, 'stdlib' or 'synthetic'")
    if train.dp_impl == "fsdp" and config.pp > 1:
        raise ConfigError("--dp-impl", "fsdp is not wired into the pipeline engine", "use --dp-impl paratrain")
    if config.pp > 1:
        from .pipeline import validate_pipeline

        validate_pipeline(config, train)  # the schedule's own rules (e.g. Chimera's even stage count)


# ----- gradient norm across shards ---------------------------------------------------------------

def _counts_here(p: torch.Tensor, ctx: RuntimeContext) -> bool:
    """Whether this rank's copy of ``p`` is the one counted in the global norm.

    A shard counts on every rank holding a distinct piece; a replicated copy counts only on the
    rank at coordinate 0 of each mesh axis it is replicated over (dp and tp; pipeline stages hold
    distinct parameters, so pp never duplicates).
    """
    coords = ctx.coords
    sharded_axes: set[str] = set()
    g = p.grad
    if isinstance(g, DTensor):
        names = g.device_mesh.mesh_dim_names or ()
        sharded_axes = {n for n, pl in zip(names, g.placements, strict=True) if not isinstance(pl, Replicate)}
    return all(coords[a] == 0 for a in ("dp", "tp") if a not in sharded_axes)


def global_grad_norm(params: list[nn.Parameter], ctx: RuntimeContext) -> torch.Tensor:
    """L2 norm of all gradients of the whole model, identical on every rank (one all-reduce)."""
    sq = torch.zeros((), dtype=torch.float64, device=ctx.device)  # a scalar: fp64 costs nothing
    for p in params:
        if p.grad is not None and _counts_here(p, ctx):
            g = local_tensor(p.grad).detach()
            sq += g.to(torch.promote_types(g.dtype, torch.float32)).pow(2).sum()
    if ctx.world_size > 1:
        dist.all_reduce(sq)
    return sq.sqrt()


def clip_grad_norm_(params: list[nn.Parameter], max_norm: float, ctx: RuntimeContext) -> float:
    """Scale gradients so their global norm is at most ``max_norm``; returns the norm before."""
    norm = global_grad_norm(params, ctx)
    coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    with torch.no_grad():
        for p in params:
            if p.grad is not None:
                local_tensor(p.grad).mul_(coef)
    return float(norm)


# ----- the replaceable part of a step ------------------------------------------------------------

class StepExecutor(Protocol):
    """Runs forward and backward of every micro-batch of one step on this rank.

    ``build_parts`` receives the full model (same weights on every rank) and returns the modules
    this rank trains (a pipeline engine: its chunks); the trainer then applies tensor and data
    parallelism to them. ``forward_backward`` returns the rank's mean micro-batch loss
    (detached) where the loss is computed, ``None`` elsewhere (e.g. non-last pipeline stages), and
    must leave every gradient accumulated, with the data-parallel reduction started through
    ``trainer.grad_sync`` (``accumulate()`` around all but the last backward of each parameter).
    """

    def build_parts(self, model: TransformerLM) -> list[nn.Module]: ...

    def forward_backward(self, batch: Batch, step: int) -> torch.Tensor | None: ...


# Optional extension points, looked up with getattr so an executor implements only what it needs:
# - ``owns_grad_reduction = True``: the executor reduces gradients itself (a pipeline schedule's
#   R actions); the trainer then wraps no data parallelism (grad_sync is a no-op).
# - ``train_step(step) -> dict``: the executor runs the whole step (optimizer included) and returns
#   the metrics row; ``Trainer.train_step`` delegates to it.
# - ``finish()``: replaces the trainer's end of run (final parameters of every stage, the trace).


class SingleStageExecutor:
    """No pipeline: the whole model, micro-batches one after another (gradient accumulation)."""

    def __init__(self, trainer: Trainer) -> None:
        self.trainer = trainer

    def build_parts(self, model: TransformerLM) -> list[nn.Module]:
        return [model]

    def forward_backward(self, batch: Batch, step: int) -> torch.Tensor | None:
        t = self.trainer
        model = t.parts[0]
        n = batch.num_microbatches
        total = torch.zeros((), dtype=torch.float64, device=t.ctx.device)
        for i in range(n):
            inputs, targets = (x.to(t.ctx.device, non_blocking=True) for x in batch.microbatch(i))
            sync = t.grad_sync.accumulate() if i < n - 1 else contextlib.nullcontext()
            with sync:
                t.phase.name = f"step {step} forward of micro-batch {i}"
                with t.tracer.span(f"F{i}@c0", microbatch=i), t.autocast(), loss_context(t.config.tp):
                    loss = TransformerLM.loss(model(inputs), targets) / n
                if i == 0:
                    faults.maybe_inject_fault(t.ctx.rank, step)  # mid-step: forward done, backward not
                t.phase.name = f"step {step} backward of micro-batch {i}"
                with t.tracer.span(f"B{i}@c0", microbatch=i), loss_context(t.config.tp):
                    loss.backward()
            total += local_tensor(loss.detach()).double()
        return total


# ----- the trainer --------------------------------------------------------------------------------

class Trainer:
    """Owns the model parts, data-parallel gradient sync, optimizer, data, metrics and trace of a rank."""

    def __init__(self, ctx: RuntimeContext, spec: ModelSpec, train: TrainConfig,
                 executor_factory: Any = None) -> None:
        self.ctx, self.spec, self.train, self.config = ctx, spec, train, ctx.config
        self.phase = faults.Phase()
        origin = [time.time()]
        if ctx.world_size > 1:
            dist.broadcast_object_list(origin, src=0)
        self.tracer = Tracer(ctx.rank, origin[0], enabled=train.trace is not None)
        if executor_factory is None:
            executor_factory = SingleStageExecutor if self.config.pp == 1 else _pipeline_factory()
        self.executor: StepExecutor = executor_factory(self)
        full = build_model(spec, train.seed)
        parts = self.executor.build_parts(full)
        tp_mesh = ctx.submesh("tp")
        sp = self.config.sequence_parallel and self.config.pp == 1
        # Move first, then shard: moving DTensor parameters swaps their tensors, which drops the
        # gradient hooks tensor parallelism registers on them.
        self.parts = [apply_tensor_parallel(p.to(ctx.device), tp_mesh, sequence_parallel=sp) for p in parts]
        self.grad_sync: GradSync = self._wrap_data_parallel()
        self.params = list({id(p): p for m in self.parts for p in m.parameters() if p.requires_grad}.values())
        decay = [p for p in self.params if p.dim() >= 2]  # no decay on biases and norm scales (nanoGPT)
        rest = [p for p in self.params if p.dim() < 2]
        self.optimizer = torch.optim.AdamW(
            [{"params": decay, "weight_decay": train.weight_decay}, {"params": rest, "weight_decay": 0.0}],
            lr=train.lr, betas=train.betas, eps=1e-8, foreach=False,
        )
        self.data = DataSource(load_corpus(train.data, train.data_cap_bytes), spec, seed=train.seed,
                               global_batch=self.config.global_batch, microbatch=self.config.microbatch)
        self.flops_per_token = model_flops_per_token(spec)
        self.peak_flops, self.peak_device = peak_flops_per_device(ctx.device, train.bf16)

    def _wrap_data_parallel(self) -> GradSync:
        impl, dp = self.train.dp_impl, self.config.dp
        if getattr(self.executor, "owns_grad_reduction", False):
            return NoGradSync()  # the pipeline schedule's R actions reduce the gradients
        if impl == "fsdp" and (dp > 1 or self.config.optimizer_sharding):
            from torch.distributed.fsdp import fully_shard

            dp_mesh = self.ctx.submesh("dp")
            # Parameters stay gathered from forward to the end of backward: one all-gather and one
            # reduce-scatter per step, the traffic of ZeRO-1/2 that the planner's
            # optimizer-sharding cost assumes; between steps parameters, gradients and AdamW state
            # are sharded, so memory never exceeds the planner's estimate.
            for part in self.parts:
                for block in part.blocks:
                    fully_shard(block, mesh=dp_mesh, reshard_after_forward=False)
                fully_shard(part, mesh=dp_mesh, reshard_after_forward=False)
            return FSDPGradSync(self.parts[0]) if len(self.parts) == 1 else NoGradSync()
        if dp == 1:
            return NoGradSync()
        if impl == "ddp":
            ddp = nn.parallel.DistributedDataParallel(self.parts[0], process_group=self.ctx.group("dp"),
                                                      bucket_cap_mb=self.train.bucket_bytes / 2**20)
            self.parts = [ddp]
            return DDPGradSync(ddp)
        return BucketedAllReduce(self.parts, self.ctx.group("dp"), bucket_bytes=self.train.bucket_bytes,
                                 recorder=self.tracer)

    def autocast(self) -> contextlib.AbstractContextManager[Any]:
        if not self.train.bf16:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.ctx.device.type, dtype=torch.bfloat16)

    def _global_loss(self, local: torch.Tensor | None) -> float:
        # Ranks computing the loss hold it replicated over tp: count it once (tp coordinate 0),
        # sum over the world (dp replicas; a pipeline's last stage) and average over dp.
        t = torch.zeros((), dtype=torch.float64, device=self.ctx.device)  # reported losses keep fp64 runs' digits
        if local is not None and self.ctx.tp_rank == 0:
            t += local
        if self.ctx.world_size > 1:
            dist.all_reduce(t)
        return float(t) / self.config.dp

    def train_step(self, step: int) -> dict[str, Any]:
        own_step = getattr(self.executor, "train_step", None)
        if own_step is not None:  # the pipeline engine runs the schedule's optimizer steps itself
            return own_step(step)
        self.tracer.step = step
        start = time.perf_counter()
        lr = lr_at(step, self.train)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.optimizer.zero_grad(set_to_none=True)
        batch = self.data.local_batch(step, self.ctx.dp_rank, self.config.dp)
        local_loss = self.executor.forward_backward(batch, step)
        self.phase.name = f"step {step} gradient reduction"
        self.grad_sync.finish()
        self.phase.name = f"step {step} gradient clipping"
        with self.tracer.span("X:clip"):
            grad_norm = clip_grad_norm_(self.params, self.train.grad_clip, self.ctx)
        self.phase.name = f"step {step} optimizer"
        with self.tracer.span("U"):
            self.optimizer.step()
        self.phase.name = f"step {step} loss reduction"
        loss = self._global_loss(local_loss)
        step_s = time.perf_counter() - start
        tokens = self.config.global_batch * self.spec.seq
        tokens_per_s = tokens / step_s
        mfu = tokens_per_s * self.flops_per_token / (self.peak_flops * self.ctx.world_size)
        return {"step": step, "loss": loss, "lr": lr, "grad_norm": grad_norm, "step_time_s": step_s,
                "tokens_per_s": tokens_per_s, "mfu": mfu}

    def full_parameters(self) -> dict[str, torch.Tensor]:
        """Unsharded parameters by name (a collective: every rank must call it)."""
        out: dict[str, torch.Tensor] = {}
        for part in self.parts:
            for name, p in part.named_parameters():
                full = p.full_tensor() if isinstance(p, DTensor) else p
                out[name.removeprefix("module.")] = full.detach().cpu().clone()
        return out

    def finish(self) -> None:
        """Write the trace and the final parameters (collectives first, then rank 0's I/O)."""
        own_finish = getattr(self.executor, "finish", None)
        if own_finish is not None:  # pipeline: parameters gathered over stages, trace in the simulator's format
            own_finish()
            return
        if self.train.save_final is not None:
            params = self.full_parameters()
            if self.ctx.rank == 0:
                torch.save(params, self.train.save_final)
        if self.train.trace is not None:
            gathered: list[Any] = [None] * self.ctx.world_size
            if self.ctx.world_size > 1:
                dist.all_gather_object(gathered, self.tracer.events)
            else:
                gathered = [self.tracer.events]
            if self.ctx.rank == 0:
                c = self.config
                write_chrome_trace(self.train.trace, gathered, f"measured: paratrain train {self.spec.name} "
                                   f"dp={c.dp} tp={c.tp} pp={c.pp} ({self.train.dp_impl})")


def _pipeline_factory() -> Any:
    from paratrain.runtime import pipeline  # type: ignore[attr-defined]

    return pipeline.PipelineExecutor


def worker_main(spec: ModelSpec, config: ParallelConfig, train: TrainConfig) -> list[dict[str, Any]]:
    """Body of one worker process: returns the per-step metrics (every rank holds the same losses).

    Failures never return: one line on stderr, then exit (see :mod:`paratrain.runtime.faults`).
    """
    from .progress import run_loop

    rank = int(os.environ.get("RANK", "0"))
    alone = int(os.environ.get("WORLD_SIZE", "1")) == 1
    phase = faults.Phase()
    faults.install_sigterm_handler(rank)
    with faults.guard(rank, phase, train.timeout_s, alone=alone):
        validate_run(spec, config, train)
        phase.name = "rendezvous"
        ctx = init_runtime(config, timeout_s=train.timeout_s)
        if ctx.backend == "gloo" and ctx.world_size > 1:
            phase.name = "start-up barrier"
            dist.monitored_barrier(timeout=datetime.timedelta(seconds=train.timeout_s), wait_all_ranks=True)
        torch.manual_seed(train.seed)
        trainer = Trainer(ctx, spec, train)
        trainer.phase = phase
        writer = MetricsWriter(train.metrics, ctx.rank)
        try:
            rows = run_loop(trainer, writer)
            phase.name = "final save"
            trainer.finish()
        finally:
            writer.close()
        phase.name = "shutdown"
        if ctx.world_size > 1:
            dist.barrier()  # no rank tears its sockets down while a peer still talks to it
        dist.destroy_process_group()
        return rows
    raise AssertionError("unreachable: guard exits on failure")

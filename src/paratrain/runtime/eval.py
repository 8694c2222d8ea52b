"""Validation loss and perplexity during training (``--eval-data``, ``--eval-every``, ``--eval-batches``).

Eval batch ``k`` (``k = 0 .. K-1``) is batch ``k`` of a data source over the eval data built like
the training one (the run's seed, global batch and micro-batch): the same ``K`` batches at every
evaluation, a function of (eval data, seed, k) alone. Each data-parallel rank evaluates its share
of every batch, micro-batch by micro-batch, forward only, without gradients.

``eval_loss`` is the mean cross-entropy over every target token of the ``K`` batches (a sum of
token losses over a count of targets, both summed over the ranks in float64), so it does not
depend on how the batch is split; ``eval_ppl = exp(eval_loss)``.

Pipelines: the micro-batch goes through the chunks in order (replica 0's chunks under Chimera),
each holder sending its activation to the next chunk's holder with a blocking send the receiver
matches in the same chunk order, so the chain cannot deadlock; the last chunk computes the loss.
Asynchronous schedules (PipeDream, 2BW) run the whole run as one action list: there is no step
boundary to evaluate at, and :func:`paratrain.runtime.config.check_eval` rejects them.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from .comm import layer as comm
from .context_parallel import shard_batch
from .data import Batch, DataSource
from .data_parallel import local_tensor
from .mesh import RuntimeContext
from .models import TransformerLM
from .models.base import IGNORE_INDEX
from .tensor_parallel import loss_context

__all__ = ["Evaluator", "eval_row"]


def eval_row(loss_sum: float, count: float) -> dict[str, float]:
    """The metrics row's evaluation keys from the summed token loss and the target count."""
    loss = loss_sum / count
    return {"eval_loss": loss, "eval_ppl": math.exp(loss) if loss < 709 else math.inf}


class Evaluator:
    """Evaluates the trainer's current model on ``source``'s first ``batches`` batches.

    ``forward(mb_inputs, mb_targets)`` of a single-stage model or a pipeline is chosen from the
    executor: ``model`` (one stage) or ``chunks`` and ``schedule`` (a pipeline)."""

    def __init__(self, ctx: RuntimeContext, executor: Any, source: DataSource, *, batches: int, every: int | None,
                 steps: int, autocast: Callable[[], Any], positions: torch.Tensor | None = None) -> None:
        self.ctx, self.executor, self.source = ctx, executor, source
        self.positions = positions  # context parallelism: this rank's tokens of each sequence
        self.batches, self.every, self.steps, self.autocast = batches, every, steps, autocast
        self.config = ctx.config

    def due(self, step: int) -> bool:
        """After every ``every``-th step and after the last one."""
        return step == self.steps - 1 or (self.every is not None and (step + 1) % self.every == 0)

    def next_boundary(self, step: int) -> int | None:
        """The first step boundary after ``step`` (steps done) where an evaluation is due: where an
        asynchronous pipeline must drain so that the weights are one state to evaluate."""
        due = [self.steps] + ([(step // self.every + 1) * self.every] if self.every is not None else [])
        found = [b for b in due if step < b <= self.steps]
        return min(found) if found else None

    def after_step(self, step: int) -> dict[str, float]:
        return self.evaluate() if self.due(step) else {}

    def evaluate(self) -> dict[str, float]:
        """``eval_loss`` and ``eval_ppl`` (the same on every rank; a collective)."""
        total = torch.zeros(2, dtype=torch.float64, device=self.ctx.device)  # token-loss sum, targets
        with torch.no_grad():
            for k in range(self.batches):
                batch = self.source.local_batch(k, self.ctx.dp_rank, self.config.dp)
                if self.positions is not None:  # the cp ranks' sums over their tokens add up to the whole
                    batch = shard_batch(batch, self.positions)
                part = self._single_stage(batch) if self.config.pp == 1 else self._pipeline(batch)
                if part is not None and self.ctx.tp_rank == 0:  # tp ranks hold the same loss: count it once
                    total += part
        if self.ctx.world_size > 1:
            comm.all_reduce(total, axis="none", purpose="eval_loss")
        return eval_row(float(total[0]), float(total[1]))

    def _loss_sum(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        targets = targets.to(self.ctx.device)
        with loss_context(self.config.tp):
            mean = TransformerLM.loss(logits, targets)
        count = (targets != IGNORE_INDEX).sum()
        return torch.stack([local_tensor(mean).double() * count, count.double()])

    def _single_stage(self, batch: Batch) -> torch.Tensor:
        model: nn.Module = self.executor.model
        out = torch.zeros(2, dtype=torch.float64, device=self.ctx.device)
        for i in range(batch.num_microbatches):
            inputs, targets = batch.microbatch(i)
            with self.autocast():
                logits = model(inputs.to(self.ctx.device))
            out += self._loss_sum(logits, targets)
        return out

    def _pipeline(self, batch: Batch) -> torch.Tensor | None:
        ex = self.executor
        schedule, cfg, me = ex.schedule, self.config, self.ctx.pp_rank
        chunks = {(c.chunk, c.replica): c.module for c in ex.chunks}
        n = schedule.num_chunks
        dtype = next(p.dtype for m in chunks.values() for p in m.parameters() if p.is_floating_point())

        def global_rank(pp_rank: int) -> int:
            return cfg.rank_of(pp=pp_rank, dp=self.ctx.dp_rank, cp=self.ctx.cp_rank, tp=self.ctx.tp_rank)

        out: torch.Tensor | None = None
        for i in range(batch.num_microbatches):
            inputs, targets = batch.microbatch(i)
            x: torch.Tensor | None = None
            for c in range(n):
                holder = schedule.rank_of(c, 0)
                if holder != me:
                    continue
                if c == 0:
                    x = inputs.to(self.ctx.device)
                elif schedule.rank_of(c - 1, 0) != me:
                    x = torch.empty((*inputs.shape, self.source.spec.hidden), dtype=dtype,
                                    device=self.ctx.device)
                    for h in comm.batch_isend_irecv([comm.P2P(False, x, global_rank(schedule.rank_of(c - 1, 0)))],
                                                    purpose="eval_activation"):
                        h.wait()
                assert x is not None
                with self.autocast():
                    x = chunks[(c, 0)](x)
                if c == n - 1:
                    part = self._loss_sum(x, targets)
                    out = part if out is None else out + part
                elif schedule.rank_of(c + 1, 0) != me:
                    out_x = x.to(dtype).contiguous()
                    for h in comm.batch_isend_irecv([comm.P2P(True, out_x, global_rank(schedule.rank_of(c + 1, 0)))],
                                                    purpose="eval_activation"):
                        h.wait()
        return out

"""What the step loop asks of an executor, and the executor without a pipeline.

An executor runs the forward and backward passes of one step's micro-batches on this rank and
leaves the gradients reduced over data parallelism. :class:`SingleStageExecutor` holds the whole
model and leaves clipping and the optimizer step to the step loop;
:class:`~paratrain.runtime.pipeline.PipelineExecutor` runs a schedule whose ``U`` actions step the
optimizer it was handed, and reports the gradient norm it clipped by.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from paratrain.trace import TraceEvent

from . import faults
from .data import Batch
from .data_parallel import GradSync, local_tensor
from .mesh import RuntimeContext
from .metrics import Tracer
from .models import TransformerLM
from .tensor_parallel import accumulating_partial_grads, loss_context

__all__ = ["StepOutput", "StepExecutor", "SingleStageExecutor"]


@dataclass(frozen=True)
class StepOutput:
    """One step as an executor saw it on this rank.

    ``local_loss``: mean micro-batch loss (fp64, detached) where the loss is computed, ``None``
    elsewhere (non-last pipeline stages); the step loop reduces it over the ranks.
    ``grad_norm``: the norm the executor clipped by when it stepped the optimizer itself (a
    pipeline's ``U``), ``None`` when the step loop must clip and step.
    ``step_s``: the step's time when the executor cannot be timed per step (an asynchronous
    pipeline runs every step at once and reports the mean), else ``None``.
    """

    local_loss: torch.Tensor | None
    grad_norm: float | None = None
    step_s: float | None = None


class StepExecutor(Protocol):
    """The part of a step that differs with the layout (see the module docstring)."""

    def run(self, step: int) -> StepOutput: ...

    def full_parameters(self) -> dict[str, torch.Tensor]:
        """Unsharded parameters of the whole model by name (a collective: every rank calls it)."""

    def trace_events(self) -> list[TraceEvent]:
        """This rank's measured spans (each with its step), for the run's trace."""


class SingleStageExecutor:
    """No pipeline: the whole model, micro-batches one after another (gradient accumulation), the
    data-parallel reduction overlapped with backward by ``grad_sync``.

    ``loss(output, targets)``: the model's loss (the language models' cross-entropy by default);
    ``batch_of(step)`` gives the rank's micro-batches of a step (``num_microbatches``,
    ``microbatch(i) -> (inputs, targets)``)."""

    def __init__(self, ctx: RuntimeContext, model: nn.Module, grad_sync: GradSync, batch_of: Callable[[int], Batch],
                 *, tracer: Tracer, phase: faults.Phase, autocast: Callable[[], Any],
                 loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = TransformerLM.loss) -> None:
        self.ctx, self.model, self.grad_sync, self.batch_of = ctx, model, grad_sync, batch_of
        self.tracer, self.phase, self.autocast, self.loss = tracer, phase, autocast, loss
        self.tp = ctx.config.tp

    def fetch(self, step: int) -> Any:
        """The step's batch (a hook: an input pipeline may time its wait)."""
        return self.batch_of(step)

    def run(self, step: int) -> StepOutput:
        batch = self.fetch(step)
        n = batch.num_microbatches
        total = torch.zeros((), dtype=torch.float64, device=self.ctx.device)
        for i in range(n):
            inputs, targets = (x.to(self.ctx.device, non_blocking=True) for x in batch.microbatch(i))
            # every backward but the last accumulates without reducing (gradient accumulation)
            sync = self.grad_sync.accumulate() if i < n - 1 else contextlib.nullcontext()
            with sync, accumulating_partial_grads(i < n - 1):
                self.phase.name = f"step {step} forward of micro-batch {i}"
                with self.tracer.span(f"F{i}@c0", microbatch=i), self.autocast(), loss_context(self.tp):
                    loss = self.loss(self.model(inputs), targets) / n
                if i == 0:
                    faults.maybe_inject_fault(self.ctx.rank, step)  # mid-step: forward done, backward not
                self.phase.name = f"step {step} backward of micro-batch {i}"
                with self.tracer.span(f"B{i}@c0", microbatch=i), loss_context(self.tp):
                    loss.backward()
            total += local_tensor(loss.detach()).double()
        self.phase.name = f"step {step} gradient reduction"
        self.grad_sync.finish()
        return StepOutput(total)

    def full_parameters(self) -> dict[str, torch.Tensor]:
        out: dict[str, torch.Tensor] = {}
        for name, p in self.model.named_parameters():
            full = p.full_tensor() if isinstance(p, DTensor) else p
            out[name.removeprefix("module.")] = full.detach().cpu().clone()
        return out

    def trace_events(self) -> list[TraceEvent]:
        return list(self.tracer.events)

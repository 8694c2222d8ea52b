"""``paratrain train --task image``: the small CNN trained data-parallel on an image folder read by
a DataLoader with worker processes.

Sampling keeps the GPT path's invariant: step ``s`` of a run takes items ``[k*G, (k+1)*G)`` of
epoch ``e``'s seeded permutation (``e, k = divmod(s, D // G)``, ``G`` the global batch), sample
``j`` goes to data-parallel rank ``j // (G/dp)``, micro-batch ``(j mod G/dp) // microbatch``, and an
item's augmentation is seeded by ``(seed, epoch, index)``. So every layout sees the same
micro-batches as single-process training with gradient accumulation. Each rank's DataLoader
yields the rank's share of one step per batch, prepared ahead by ``loader_workers`` processes.

The model, data and executor are built here; :class:`~paratrain.runtime.train.Trainer` selects
them with one branch and runs its usual step loop (gradient reduction by ``wrap_data_parallel``,
clipping and AdamW by :class:`~paratrain.runtime.optim.Optimizer`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from paratrain.errors import ConfigError

from .. import faults
from ..data_parallel import GradSync, wrap_data_parallel
from ..executor import SingleStageExecutor
from ..mesh import RuntimeContext
from ..metrics import Tracer, peak_flops_per_device
from ..models.cnn import ResNetTiny, build_cnn
from ..optim import Optimizer
from .images import ImageFolder, make_loader

__all__ = ["IMAGE_SIZE", "StepBatches", "ImageData", "ImageBatch", "ImageExecutor", "setup_image_task"]

IMAGE_SIZE = 32  # pixels: CIFAR's size keeps a CPU step short


@dataclass(frozen=True)
class ImageBatch:
    """One rank's share of a step: ``images [M, mb, 3, H, W]``, ``labels [M, mb]``."""

    images: torch.Tensor
    labels: torch.Tensor

    @property
    def num_microbatches(self) -> int:
        return int(self.images.shape[0])

    def microbatch(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.images[i], self.labels[i]


class StepBatches(torch.utils.data.Sampler[list[tuple[int, int]]]):
    """Per step, the keys ``(epoch, index)`` of this data-parallel rank's share of the global batch."""

    def __init__(self, items: int, *, seed: int, steps: int, global_batch: int, dp_rank: int, dp: int) -> None:
        if global_batch > items:
            raise ConfigError("--global-batch", f"{global_batch} is more than the {items} images of the dataset",
                              "use a smaller --global-batch or generate more images (--items)")
        self.items, self.seed, self.steps, self.global_batch = items, seed, steps, global_batch
        self.dp_rank, self.dp = dp_rank, dp

    def step_keys(self, step: int) -> list[tuple[int, int]]:
        g = self.global_batch
        epoch, k = divmod(step, self.items // g)
        order = torch.randperm(self.items, generator=torch.Generator().manual_seed(self.seed * 1_000_003 + epoch))
        per_rank = g // self.dp
        start = k * g + self.dp_rank * per_rank
        return [(epoch, int(i)) for i in order[start:start + per_rank]]

    def __iter__(self) -> Iterator[list[tuple[int, int]]]:
        return (self.step_keys(s) for s in range(self.steps))

    def __len__(self) -> int:
        return self.steps


class ImageData:
    """The rank's batches of each step, in step order, from a DataLoader with ``workers`` processes."""

    def __init__(self, root: str, *, seed: int, steps: int, global_batch: int, microbatch: int, dp_rank: int,
                 dp: int, workers: int) -> None:
        self.dataset = ImageFolder(root, image_size=IMAGE_SIZE, seed=seed, dtype=torch.get_default_dtype())
        self.sampler = StepBatches(len(self.dataset), seed=seed, steps=steps, global_batch=global_batch,
                                   dp_rank=dp_rank, dp=dp)
        self.microbatch = microbatch
        self.loader = make_loader(self.dataset, batch_size=1, workers=workers, batch_sampler=self.sampler)
        self._it: Iterator[Any] | None = None
        self._next_step = 0
        self.workers = workers

    def describe(self, model: nn.Module, config: Any, ctx: RuntimeContext, dp_impl: str) -> str:
        """The step loop's first console line for the image task."""
        params = sum(p.numel() for p in model.parameters())
        ds = self.dataset
        return (f"cnn ({type(model).__name__}): {params:,} parameters, dp={config.dp} ({dp_impl} data parallel) "
                f"on {ctx.world_size}x {ctx.device.type} ({ctx.backend}), global batch {config.global_batch} = "
                f"{config.num_microbatches} micro-batches of {config.microbatch} per replica, data {ds.root} "
                f"({len(ds):,} images in {ds.num_classes} classes, {ds.total_bytes():,} bytes, "
                f"{IMAGE_SIZE}x{IMAGE_SIZE} crops), loader workers per rank: {self.workers}")

    def local_batch(self, step: int) -> ImageBatch:
        if step != self._next_step:
            raise RuntimeError(f"image batches are read in step order: asked for {step}, next is {self._next_step}")
        if self._it is None:
            self._it = iter(self.loader)
        images, labels = next(self._it)
        self._next_step += 1
        m = images.shape[0] // self.microbatch
        return ImageBatch(images.reshape(m, self.microbatch, *images.shape[1:]), labels.reshape(m, self.microbatch))


class ImageExecutor(SingleStageExecutor):
    """The whole CNN, micro-batches one after another (gradient accumulation), the data-parallel
    reduction overlapped with backward by ``grad_sync``: the GPT path's single-stage executor with
    the CNN's loss and the wait for the input pipeline traced."""

    def __init__(self, ctx: RuntimeContext, model: nn.Module, grad_sync: GradSync,
                 batch_of: Callable[[int], ImageBatch], *, tracer: Tracer, phase: faults.Phase,
                 autocast: Callable[[], Any]) -> None:
        super().__init__(ctx, model, grad_sync, batch_of, tracer=tracer, phase=phase, autocast=autocast,
                         loss=ResNetTiny.loss)

    def fetch(self, step: int) -> ImageBatch:
        self.phase.name = f"step {step} input pipeline"
        with self.tracer.span("X:data"):
            return self.batch_of(step)


def setup_image_task(trainer: Any) -> None:
    """Give ``trainer`` (a :class:`~paratrain.runtime.train.Trainer` being built) the image task's
    data, model, optimizer and executor: everything its step loop and end of run use."""
    ctx, train, config = trainer.ctx, trainer.train, trainer.config
    trainer.schedule = None
    trainer.data = ImageData(train.data, seed=train.seed, steps=train.steps, global_batch=config.global_batch,
                             microbatch=config.microbatch, dp_rank=ctx.dp_rank, dp=config.dp,
                             workers=train.loader_workers)
    model = build_cnn(trainer.data.dataset.num_classes, train.seed).to(ctx.device)
    part, grad_sync = wrap_data_parallel(model, ctx, train.dp_impl, bucket_bytes=train.bucket_bytes,
                                         recorder=trainer.tracer, compress_warmup=train.compress_warmup)
    trainer.optimizer = Optimizer([p for p in part.parameters() if p.requires_grad], train)
    trainer.executor = ImageExecutor(ctx, part, grad_sync, trainer.data.local_batch, tracer=trainer.tracer,
                                     phase=trainer.phase, autocast=trainer.autocast)
    trainer.params = trainer.optimizer.params
    trainer.peak_flops, trainer.peak_device = peak_flops_per_device(ctx.device, train.bf16)

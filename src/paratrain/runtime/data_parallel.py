"""Data parallelism: paratrain's bucketed all-reduce overlapped with backward, and torch's
library paths (``DistributedDataParallel``; FSDP2 ``fully_shard`` for optimizer-state sharding,
composed with tensor parallelism on a 2-D mesh).

All of them implement :class:`GradSync`, the interface the training loop and a pipeline engine use:
``accumulate()`` wraps a backward whose gradients must not be reduced yet (gradient accumulation),
``finish()`` returns once every gradient is reduced (averaged over the data-parallel group).

Why paratrain owns one path: later work needs sparse/compressed all-reduce and a per-operation
backend choice, which the library hooks do not expose. The design follows PyTorch DDP (Li et al.,
VLDB 2020): parameters are grouped into ~25 MiB buckets in reverse registration order (roughly
the order backward produces gradients); a post-accumulate-grad hook counts each bucket's ready
gradients and starts an asynchronous all-reduce when the bucket is complete, so communication of
late layers overlaps the backward of early ones. Buckets are launched strictly in index order so
every rank issues the same collectives in the same order.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Protocol

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from .comm import layer as comm

if TYPE_CHECKING:
    from .compress.momentum import DgcSettings
    from .mesh import RuntimeContext

__all__ = ["GradSync", "NoGradSync", "BucketedAllReduce", "DDPGradSync", "FSDPGradSync", "local_tensor",
           "wrap_data_parallel", "fully_shard_model", "uses_fsdp", "DEFAULT_BUCKET_BYTES"]

DEFAULT_BUCKET_BYTES = 25 * 2**20  # DDP's default bucket_cap_mb=25


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """The shard this rank holds (a DTensor's local tensor, or the tensor itself)."""
    return t.to_local() if isinstance(t, DTensor) else t


class SpanRecorder(Protocol):
    def record(self, name: str, stream: str, start_s: float, end_s: float) -> None: ...


class GradSync(Protocol):
    def accumulate(self) -> contextlib.AbstractContextManager[None]: ...

    def finish(self) -> None: ...


class NoGradSync:
    """One data-parallel rank: nothing to reduce."""

    def accumulate(self) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()

    def finish(self) -> None:
        return None


class _Bucket:
    def __init__(self, index: int, params: list[nn.Parameter]) -> None:
        self.index = index
        self.params = params
        self.numel = sum(local_tensor(p).numel() for p in params)
        self.pending = len(params)
        self.buffer: torch.Tensor | None = None
        self.work: dist.Work | None = None
        self.launch_s = 0.0


class BucketedAllReduce:
    """paratrain's data-parallel gradient reduction (see the module docstring)."""

    def __init__(self, modules: list[nn.Module], group: dist.ProcessGroup, *,
                 bucket_bytes: int = DEFAULT_BUCKET_BYTES, recorder: SpanRecorder | None = None) -> None:
        self.group = group
        self.world = dist.get_world_size(group)
        self.recorder = recorder
        # De-duplicated: a tied weight (or one shared by two pipeline chunks) is reduced once.
        params = list({id(p): p for m in modules for p in m.parameters() if p.requires_grad}.values())
        self.buckets: list[_Bucket] = []
        current: list[nn.Parameter] = []
        size = 0
        for p in reversed(params):
            lp = local_tensor(p)
            nbytes = lp.numel() * lp.element_size()
            if current and (size + nbytes > bucket_bytes or lp.dtype != local_tensor(current[0]).dtype):
                self.buckets.append(_Bucket(len(self.buckets), current))
                current, size = [], 0
            current.append(p)
            size += nbytes
        if current:
            self.buckets.append(_Bucket(len(self.buckets), current))
        self._bucket_of = {id(p): b for b in self.buckets for p in b.params}
        self._sync = True
        self._next = 0
        self._handles = [p.register_post_accumulate_grad_hook(self._on_grad_ready) for p in params]

    def remove_hooks(self) -> None:
        for h in self._handles:
            h.remove()

    @contextlib.contextmanager
    def accumulate(self) -> Iterator[None]:
        self._sync = False
        try:
            yield
        finally:
            self._sync = True

    def _on_grad_ready(self, p: torch.Tensor) -> None:
        if not self._sync:
            return
        bucket = self._bucket_of[id(p)]
        bucket.pending -= 1
        while self._next < len(self.buckets) and self.buckets[self._next].pending == 0:
            self._launch(self.buckets[self._next])
            self._next += 1

    def _launch(self, bucket: _Bucket) -> None:
        grads = []
        for p in bucket.params:
            if p.grad is None:  # unused in this step's graph: contributes zeros, as in DDP
                p.grad = torch.zeros_like(p)
            grads.append(local_tensor(p.grad).reshape(-1))
        flat = torch.cat(grads)
        flat.div_(self.world)  # pre-divide like DDP's default allreduce hook
        bucket.buffer = flat
        bucket.launch_s = time.perf_counter()
        bucket.work = comm.all_reduce(flat, self.group, async_op=True, axis="dp", purpose="grad_bucket")

    def finish(self) -> None:
        # Buckets whose hooks never all fired (parameters without gradients) go out now, in order.
        while self._next < len(self.buckets):
            self._launch(self.buckets[self._next])
            self._next += 1
        for bucket in self.buckets:
            assert bucket.work is not None and bucket.buffer is not None
            bucket.work.wait()
            end_s = time.perf_counter()
            if self.recorder is not None:
                self.recorder.record("R@c0", "comm", bucket.launch_s, end_s)
            offset = 0
            with torch.no_grad():
                for p in bucket.params:
                    g = local_tensor(p.grad)
                    g.copy_(bucket.buffer[offset: offset + g.numel()].view_as(g))
                    offset += g.numel()
            bucket.work, bucket.buffer = None, None
            bucket.pending = len(bucket.params)
        self._next = 0


class DDPGradSync:
    """torch's ``DistributedDataParallel``: the library reference for :class:`BucketedAllReduce`."""

    def __init__(self, ddp: nn.parallel.DistributedDataParallel) -> None:
        self.ddp = ddp

    def accumulate(self) -> contextlib.AbstractContextManager[None]:
        return self.ddp.no_sync()

    def finish(self) -> None:
        return None  # DDP's reducer waits for its buckets at the end of backward


class FSDPGradSync:
    """FSDP2 ``fully_shard``: gradients reduce-scattered, parameters and AdamW state sharded over dp."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model

    def accumulate(self) -> contextlib.AbstractContextManager[None]:
        # Every micro-batch's backward reduce-scatters (FSDP's default), so gradients stay sharded
        # between micro-batches: switching the sync off would accumulate unsharded gradients, the
        # memory zero2/zero3 exist to save. The cost model charges the same (cost.sharding).
        return contextlib.nullcontext()

    def finish(self) -> None:
        return None


def uses_fsdp(impl: str, ctx: RuntimeContext) -> bool:
    """Whether ``impl`` shards with FSDP2 here (one data-parallel rank shards only when asked)."""
    return impl == "fsdp" and (ctx.data_degree > 1 or ctx.config.optimizer_sharding)


def fully_shard_model(model: nn.Module, ctx: RuntimeContext) -> None:
    """FSDP2 ``fully_shard`` over the mesh's dp axis (dp x cp with context parallelism): each block a
    unit, the rest (embedding, head, final norm) the root's. ``model``: a whole model or one
    pipeline chunk (``blocks`` attribute).

    zero2 keeps each block's gathered parameters from its forward to its backward; zero3 frees them
    after the forward and gathers them again for the backward. Either way every micro-batch gathers
    and reduce-scatters each block once (cost.sharding), and between steps parameters, gradients and
    AdamW state are sharded."""
    from torch.distributed.fsdp import fully_shard

    dp_mesh = ctx.data_mesh()
    reshard = ctx.config.sharding == "zero3"
    for block in model.blocks:  # type: ignore[union-attr]
        fully_shard(block, mesh=dp_mesh, reshard_after_forward=reshard)
    fully_shard(model, mesh=dp_mesh, reshard_after_forward=reshard)


def wrap_data_parallel(model: nn.Module, ctx: RuntimeContext, impl: str, *, bucket_bytes: int,
                       recorder: SpanRecorder | None = None, compress_warmup: int = 0,
                       dgc: DgcSettings | None = None) -> tuple[nn.Module, GradSync]:
    """``model`` (the whole model, tensor parallelism applied) with data parallelism ``impl``
    ("paratrain", "ddp" or "fsdp") over the mesh's dp axis: the module to run and its GradSync.
    With ``ctx.config.compression`` set, paratrain's reduction compresses
    (:class:`~paratrain.runtime.compress.sync.CompressedGradSync`, dense for ``compress_warmup`` steps)."""
    dp = ctx.data_degree  # dp x cp: context-parallel ranks hold the same parameters as well
    if ctx.config.compression != "none" and dp > 1 and impl == "paratrain":
        from .compress.sync import CompressedGradSync

        return model, CompressedGradSync([model], ctx.data_group(), ctx.config.compression,
                                         ctx.config.compression_density, warmup=compress_warmup, recorder=recorder,
                                         dgc=dgc)
    if uses_fsdp(impl, ctx):
        fully_shard_model(model, ctx)
        return model, FSDPGradSync(model)
    if dp == 1:
        return model, NoGradSync()
    if impl == "ddp":
        ddp = nn.parallel.DistributedDataParallel(model, process_group=ctx.data_group(),
                                                  bucket_cap_mb=bucket_bytes / 2**20)
        return ddp, DDPGradSync(ddp)
    return model, BucketedAllReduce([model], ctx.data_group(), bucket_bytes=bucket_bytes, recorder=recorder)

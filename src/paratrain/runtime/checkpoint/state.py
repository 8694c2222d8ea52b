"""What a checkpoint holds, keyed by full-model name so that any layout can load it.

Keys (DCP state-dict keys; values are this rank's tensors, DTensors where the layout shards them)::

    model/<name>               parameter <name> of the whole model (``embed.tok.weight``, …)
    optim/<name>/exp_avg       AdamW's first moment of that parameter
    optim/<name>/exp_avg_sq    AdamW's second moment
    optim/<name>/step          AdamW's step count (a scalar)
    rng/rank<r>/cpu            torch's CPU generator state of global rank r
    rng/rank<r>/cuda           the CUDA generator of rank r's device (GPU runs)

The step (and so the learning rate and the data position: a batch is a function of seed and step)
lives in the completion marker. Parameters that a layout holds twice (a Chimera replica, a tied
embedding on the first and last pipeline stage) are saved from one copy and loaded into all.
"""

from __future__ import annotations

import contextlib
import ctypes
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch.distributed.tensor import DTensor

if TYPE_CHECKING:
    from paratrain.runtime.train import Trainer

__all__ = ["Capture", "named_parameters", "capture", "snapshot", "layout", "snapshot_into", "load_targets",
           "apply_loaded", "MOMENTS", "one_thread_here"]

MOMENTS = ("exp_avg", "exp_avg_sq")
ONE_THREAD_SNAPSHOT = True  # the snapshot thread runs its copies alone (one_thread_here); a bench compares


def named_parameters(trainer: Trainer) -> dict[str, list[torch.nn.Parameter]]:
    """This rank's trainable parameters by full-model name, every copy it holds (first: the one saved)."""
    ex: Any = trainer.executor
    out: dict[str, list[torch.nn.Parameter]] = {}
    if getattr(trainer, "schedule", None) is None:
        for name, p in ex.model.named_parameters():
            if p.requires_grad:
                out.setdefault(name.removeprefix("module."), []).append(p)
        return out
    # a pipeline: chunks of replica 0 first, so the first copy of a name is replica 0's
    for ch in sorted(ex.chunks, key=lambda c: (c.replica, c.chunk)):
        names = ex.layout.canonical[(ch.chunk, ch.replica)]
        for local, p in ch.params.items():
            copies = out.setdefault(names[local], [])
            if all(q is not p for q in copies):
                copies.append(p)
    return out


@dataclass
class Capture:
    """References taken at a step boundary: (key, tensor) pairs whose values the snapshot copies
    before the next optimizer step changes them; RNG states are already copies."""

    tensors: list[tuple[str, torch.Tensor]]
    rng: dict[str, torch.Tensor]


def capture(trainer: Trainer) -> Capture:
    """What to save, by reference (cheap; on the training thread, at the step boundary).

    FSDP2 swaps a module's registered parameters for gathered ones during forward, so the sharded
    tensors are taken here, not by the snapshot thread."""
    opt_state = trainer.optimizer.adamw.state
    # zero1 keeps slices: its state is gathered into whole parameters here (new tensors, a collective)
    full_state = getattr(trainer.optimizer, "full_state", None)
    whole = full_state() if full_state is not None else None
    tensors: list[tuple[str, torch.Tensor]] = []
    for name, copies in sorted(named_parameters(trainer).items()):
        p = copies[0]
        tensors.append((f"model/{name}", p))
        st = whole.get(id(p), {}) if whole is not None else opt_state.get(p, {})
        for k in (*MOMENTS, "step"):
            if k in st:
                tensors.append((f"optim/{name}/{k}", st[k]))
    rank = trainer.ctx.rank
    rng = {f"rng/rank{rank}/cpu": torch.get_rng_state()}
    if trainer.ctx.device.type == "cuda":
        rng[f"rng/rank{rank}/cuda"] = torch.cuda.get_rng_state(trainer.ctx.device)
    return Capture(tensors, rng)


def _host_copy(t: torch.Tensor) -> torch.Tensor:
    if isinstance(t, DTensor):
        local = t.to_local().detach().to("cpu", copy=True)
        return DTensor.from_local(local, t.device_mesh, t.placements, run_check=False, shape=t.shape,
                                  stride=t.stride())
    return t.detach().to("cpu", copy=True)


def snapshot(cap: Capture, *, halfway: Any = None) -> dict[str, Any]:
    """Host-memory copies of everything captured (the snapshot phase; runs on a background
    thread). ``halfway`` is called once half the tensors are copied (fault injection)."""
    out: dict[str, Any] = {}
    with torch.no_grad():
        for i, (key, t) in enumerate(cap.tensors):
            out[key] = _host_copy(t)
            if halfway is not None and i == len(cap.tensors) // 2:
                halfway()
    out.update(cap.rng)
    return out


def layout(cap: Capture) -> tuple[list[tuple[str, tuple[int, ...], torch.dtype]],
                                  dict[str, tuple[tuple[int, ...], tuple[int, ...]]]]:
    """What :func:`snapshot_into` fills: (key, this rank's local shape, dtype) of everything
    captured, and for each DTensor its (global size, offsets of the local piece), as DCP records them."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    items, shards = [], {}
    for key, t in cap.tensors:
        local = _local(t)
        items.append((key, tuple(local.shape), local.dtype))
        if isinstance(t, DTensor):
            _, offsets = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
            shards[key] = (tuple(t.shape), tuple(offsets))
    items += [(key, tuple(r.shape), r.dtype) for key, r in cap.rng.items()]
    return items, shards


def one_thread_here() -> None:
    """Run the torch ops of the calling (background) thread on that thread alone.

    A torch op's parallel region entered from a second Python thread starts an OpenMP team of its
    own, as many threads as training's, so a background snapshot copy put twice the cores' worth of
    threads on the machine and training's threads then waited at their barriers for the preempted
    ones. OpenMP's thread count is a per-thread setting, set here through the OpenMP runtime torch
    loaded; ``torch.set_num_threads`` would change the whole process's. A no-op where there is none."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None).omp_set_num_threads(1)


def snapshot_into(cap: Capture, dest: dict[str, torch.Tensor], *, halfway: Any = None) -> None:
    """The snapshot phase into host tensors allocated once (:func:`layout`; shared memory that the
    writer process reads). ``halfway`` as in :func:`snapshot`."""
    with torch.no_grad():
        for i, (key, t) in enumerate(cap.tensors):
            dest[key].copy_(_local(t).detach())
            if halfway is not None and i == len(cap.tensors) // 2:
                halfway()
        for key, r in cap.rng.items():
            dest[key].copy_(r)


def load_targets(trainer: Trainer, saved: dict[str, Any]) -> dict[str, torch.Tensor]:
    """The state dict to load into: this layout's own parameters and AdamW state (created here,
    as AdamW would on its first step), and this rank's RNG states when the checkpoint has them.

    ``saved``: the checkpoint's DCP metadata by key (shapes and dtypes). Raises ValueError naming
    the first parameter the checkpoint lacks or holds with another shape.
    """
    adamw = trainer.optimizer.adamw
    out: dict[str, torch.Tensor] = {}
    for name, copies in sorted(named_parameters(trainer).items()):
        p = copies[0]
        key = f"model/{name}"
        if key not in saved:
            raise ValueError(f"the checkpoint has no parameter {name!r}")
        shape = tuple(saved[key].size)
        if shape != tuple(p.shape):
            raise ValueError(f"parameter {name!r} is {list(shape)} in the checkpoint, {list(p.shape)} here")
        out[key] = p
        if f"optim/{name}/step" in saved and hasattr(trainer.optimizer, "load_full_state"):
            # zero1: whole-parameter targets, sliced into this rank's AdamW state by apply_loaded
            out.update({f"optim/{name}/{k}": torch.zeros_like(p) for k in MOMENTS})
            out[f"optim/{name}/step"] = torch.zeros((), dtype=saved[f"optim/{name}/step"].properties.dtype)
        elif f"optim/{name}/step" in saved:
            for q in copies:
                st = adamw.state[q]
                for k in MOMENTS:
                    st[k] = torch.zeros_like(q, memory_format=torch.preserve_format)
                st["step"] = torch.zeros((), dtype=saved[f"optim/{name}/step"].properties.dtype)
            st = adamw.state[p]
            for k in (*MOMENTS, "step"):
                out[f"optim/{name}/{k}"] = st[k]
    rank = trainer.ctx.rank
    for kind in ("cpu", "cuda"):
        key = f"rng/rank{rank}/{kind}"
        if key in saved and (kind == "cpu" or trainer.ctx.device.type == "cuda"):
            out[key] = torch.empty(tuple(saved[key].size), dtype=torch.uint8)
    return out


def apply_loaded(trainer: Trainer, loaded: dict[str, torch.Tensor]) -> None:
    """After DCP filled ``loaded`` in place: copy into the other copies of each parameter and its
    AdamW state, and restore this rank's generators."""
    adamw = trainer.optimizer.adamw
    load_full_state = getattr(trainer.optimizer, "load_full_state", None)
    with torch.no_grad():
        for name, copies in named_parameters(trainer).items():
            first = copies[0]
            if load_full_state is not None and f"optim/{name}/step" in loaded:
                # zero1: every copy's own slice (Chimera's copies of a chunk hold different slices)
                for q in copies:
                    load_full_state(q, {k: loaded[f"optim/{name}/{k}"] for k in (*MOMENTS, "step")})
            for q in copies[1:]:
                _local(q).copy_(_local(first))
                if first in adamw.state:
                    for k, v in adamw.state[first].items():
                        if isinstance(v, torch.Tensor):
                            _local(adamw.state[q][k]).copy_(_local(v))
    rank = trainer.ctx.rank
    if f"rng/rank{rank}/cpu" in loaded:
        torch.set_rng_state(loaded[f"rng/rank{rank}/cpu"])
    if f"rng/rank{rank}/cuda" in loaded:
        torch.cuda.set_rng_state(loaded[f"rng/rank{rank}/cuda"], trainer.ctx.device)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t

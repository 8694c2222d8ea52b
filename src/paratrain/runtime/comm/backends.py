"""The process groups a tuning table can route a call to, next to the runtime's own.

The runtime's groups (the default group, the mesh's, the pipeline's) use the run's backend: gloo
on CPU, NCCL on GPU. A call the tuning table sends elsewhere runs on a *shadow*: a second
communicator over exactly the same ranks, of the backend the table names
(:data:`paratrain.runtime.comm.table.BACKENDS`: ``gloo``, ``gloo_1t`` — gloo with one worker
thread —, ``nccl``, ``mpi``). A shadow is built directly from torch's backend classes on a store
prefix named after the backend and the ranks, so only the members of a group build it, at the
first call that needs it: every member reaches that call (same program, same choice), and no rank
outside the group has to take part, which ``dist.new_group`` would require.

Tensors on a device that the shadow's backend cannot read (a CUDA tensor on gloo or MPI) are
staged through host memory.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from paratrain.errors import ConfigError

from .table import BACKENDS, check_backend

__all__ = ["Shadow", "check_available", "check_table", "shadow_group", "torch_backend"]


def torch_backend(name: str) -> str:
    """The ``torch.distributed`` backend behind a table's backend name."""
    return BACKENDS[check_backend(name, "backend")][0]


def check_available(name: str, device_type: str, field: str = "--comm-table") -> None:
    """ConfigError unless backend ``name`` can run in this process (NCCL needs CUDA tensors, MPI a
    torch built with it)."""
    kind = BACKENDS[check_backend(name, field)][0]
    if kind == "nccl" and (device_type != "cuda" or not dist.is_nccl_available()):
        raise ConfigError(field, f"backend {name!r} needs CUDA tensors and NCCL; this run trains on {device_type}",
                          "regenerate the table on this machine (paratrain comm tune) or drop --comm-table")
    if kind == "mpi" and not dist.is_mpi_available():
        raise ConfigError(field, f"backend {name!r}: this torch was built without MPI "
                          "(torch.distributed.is_mpi_available() is False)",
                          "regenerate the table on this machine (paratrain comm tune) or drop --comm-table")


def check_table(table: Any, device_type: str, field: str = "--comm-table") -> None:
    """Every backend a :class:`~.table.TuningTable` names can run here (:func:`check_available`)."""
    for name in table.backends:
        check_available(name, device_type, field)


@dataclass
class Shadow:
    """A communicator over ``ranks`` (global, sorted) of backend ``name``; calls take group ranks."""

    name: str
    ranks: tuple[int, ...]
    backend: Any  # torch's Backend object (ProcessGroupGloo, ProcessGroupNCCL, ProcessGroupMPI)
    device_type: str  # where its tensors must live: "cpu" or "cuda"

    def group_rank(self, global_rank: int) -> int:
        return self.ranks.index(global_rank)


_SHADOWS: dict[tuple[int, str, tuple[int, ...]], Shadow] = {}
_WORLDS: list[Any] = []  # every default process group seen, in order (kept alive: their ids stay unique)


def _world_generation() -> int:
    """Which default process group this is, counting from the first the process formed: every rank
    forms them in the same order, so the number names the same world on all ranks."""
    world = dist.distributed_c10d._get_default_group()
    for i, w in enumerate(_WORLDS):
        if w is world:
            return i
    _WORLDS.append(world)
    return len(_WORLDS) - 1


def shadow_group(name: str, ranks: tuple[int, ...], timeout_s: float) -> Shadow:
    """The shadow communicator of backend ``name`` over ``ranks``, built on first use (module
    docstring). Kept while the default process group lives: a later run in the same process group
    (the layout tests train several) reuses it, as the store's keys cannot be written twice; a new
    default group (destroyed and formed again) gets new shadows under a new store prefix."""
    generation = _world_generation()
    key = (generation, name, ranks)
    found = _SHADOWS.get(key)
    if found is not None:
        return found
    kind, threads, _ = BACKENDS[name]
    rank = dist.get_rank()
    if rank not in ranks:
        raise RuntimeError(f"rank {rank} asked for a {name} group it is not part of ({list(ranks)})")
    from torch.distributed.distributed_c10d import _get_default_store

    store = dist.PrefixStore(f"paratrain.comm/{generation}/{name}/{'-'.join(map(str, ranks))}/",
                             _get_default_store())
    timeout = datetime.timedelta(seconds=timeout_s)
    me, size = ranks.index(rank), len(ranks)
    if kind == "gloo":
        from torch.distributed import ProcessGroupGloo

        opts = ProcessGroupGloo._Options()
        opts._timeout = timeout
        opts._devices = [ProcessGroupGloo.create_default_device()]
        if threads is not None:
            opts._threads = threads
        backend: Any = ProcessGroupGloo(store, me, size, opts)
        device_type = "cpu"
    elif kind == "nccl":
        from torch.distributed import ProcessGroupNCCL

        nccl_opts = ProcessGroupNCCL.Options()
        nccl_opts._timeout = timeout
        backend = ProcessGroupNCCL(store, me, size, nccl_opts)
        device_type = "cuda"
    else:  # mpi: torch makes MPI groups collectively over the world, which members alone cannot do
        if len(ranks) != dist.get_world_size():
            raise ConfigError("--comm-table", f"mpi serves calls over the whole world here, not a group of "
                              f"{len(ranks)} of {dist.get_world_size()} ranks",
                              "route the smaller groups to gloo in the table")
        from torch.distributed import ProcessGroupMPI  # type: ignore[attr-defined]

        backend = ProcessGroupMPI.create(list(ranks))
        device_type = "cpu"
    shadow = _SHADOWS[key] = Shadow(name, ranks, backend, device_type)
    return shadow


def needs_staging(shadow: Shadow, t: torch.Tensor) -> bool:
    return t.device.type != shadow.device_type

"""Process group and DeviceMesh from a :class:`ParallelConfig`.

The mesh's dims are the config's ``mesh_order`` (default ``("pp", "dp", "tp")``, outermost to
innermost), so a rank's mesh coordinate is exactly ``ParallelConfig.coords_of(rank)``: tensor-parallel
ranks are consecutive, pipeline stages outermost (Megatron-LM's layout). Device and backend:
:func:`runtime_device` (NCCL when every local process has a GPU of its own, gloo on the CPU
otherwise; ``PARATRAIN_DEVICE`` decides when set). The world size is checked against the config before any process
group exists, with the failing arithmetic in the message (torchtitan's ``parallel_dims.py``).
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from paratrain.parallel.config import ParallelConfig

from .config import check_model_layout, check_world_size

__all__ = ["RendezvousError", "RuntimeContext", "check_world_size", "check_model_layout", "init_runtime", "env_world",
           "runtime_device", "DEVICE_ENV"]

DEVICE_ENV = "PARATRAIN_DEVICE"


@dataclass(frozen=True)
class RuntimeContext:
    """Where this process sits: global rank, mesh and its per-axis sub-meshes and coordinates."""

    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    backend: str
    mesh: DeviceMesh
    config: ParallelConfig
    timeout_s: float
    # dp x cp ranks of this rank's (tp, pp) coordinate when cp > 1, flattened to one mesh axis:
    # parameters are replicated over both, so their gradients are reduced, and their optimizer
    # state and FSDP shards cut, over both (Megatron-LM's data-context group, torchtitan's dp_shard_cp)
    dp_cp_mesh: DeviceMesh | None = None

    @property
    def coords(self) -> dict[str, int]:
        return self.config.coords_of(self.rank)

    def submesh(self, axis: str) -> DeviceMesh:
        return self.mesh[axis]

    def group(self, axis: str) -> dist.ProcessGroup:
        return self.mesh.get_group(axis)

    def data_mesh(self) -> DeviceMesh:
        """The 1-D mesh a replicated parameter's gradient is averaged (and sharded) over: dp, or dp x cp."""
        return self.dp_cp_mesh if self.dp_cp_mesh is not None else self.submesh("dp")

    def data_group(self) -> dist.ProcessGroup:
        return self.data_mesh().get_group()

    @property
    def data_degree(self) -> int:
        """How many ranks hold each parameter replica's gradients to average: dp x cp."""
        return self.config.dp * self.config.cp

    @property
    def cp_rank(self) -> int:
        return self.coords["cp"]

    @property
    def dp_rank(self) -> int:
        return self.coords["dp"]

    @property
    def tp_rank(self) -> int:
        return self.coords["tp"]

    @property
    def pp_rank(self) -> int:
        return self.coords["pp"]


def env_world() -> tuple[int, int, int]:
    """(rank, world size, local rank) from the torchrun environment; (0, 1, 0) without one."""
    return (int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1")),
            int(os.environ.get("LOCAL_RANK", "0")))


def init_runtime(config: ParallelConfig, *, timeout_s: float = 300.0, device: str | None = None) -> RuntimeContext:
    """Create the process group and the mesh. Call once per process, after the checks.

    ``timeout_s`` bounds every collective and the rendezvous: a dead peer ends the job with an
    error instead of a hang (gloo raises when a peer's socket closes, or at the timeout).
    """
    rank, world, local_rank = env_world()
    check_world_size(config, world)
    use_cuda = runtime_device(int(os.environ.get("LOCAL_WORLD_SIZE", "1")), device, notice=rank == 0) == "cuda"
    backend = "nccl" if use_cuda else "gloo"
    dev = torch.device("cuda", local_rank) if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(dev)
    if not dist.is_initialized():
        timeout = datetime.timedelta(seconds=timeout_s)
        if world == 1 and "MASTER_PORT" not in os.environ:
            # Alone: an in-memory store, no port to collide with other jobs on the machine.
            dist.init_process_group(backend=backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
        else:
            _rendezvous(backend, rank, world, timeout, dev if use_cuda else None)
    # Without context parallelism the cp axis has size 1: leave it out of the mesh.
    dims = tuple(a for a in config.mesh_order if a != "cp" or config.cp > 1)
    mesh = init_device_mesh(dev.type, tuple(config.axis_size(a) for a in dims), mesh_dim_names=dims)
    # a sub-mesh of the world mesh (not a separate group), so FSDP2 composes it with the tp mesh
    dp_cp = mesh["dp", "cp"]._flatten("dp_cp") if config.cp > 1 else None
    return RuntimeContext(rank=rank, world_size=world, local_rank=local_rank, device=dev, backend=backend,
                          mesh=mesh, config=config, timeout_s=timeout_s, dp_cp_mesh=dp_cp)


def runtime_device(local_world: int, requested: str | None = None, *, notice: bool = False) -> str:
    """``"cuda"`` or ``"cpu"`` for a node running ``local_world`` processes.

    ``requested`` (else the ``PARATRAIN_DEVICE`` environment variable) names one; unset, CUDA when
    there is a visible GPU for each local process (NCCL gives every rank its own device), the CPU
    otherwise. When GPUs are visible but fewer than the processes, the run goes to the CPU and,
    with ``notice``, says so on stderr: a silent fallback would pass for a GPU run.
    """
    from paratrain.errors import ConfigError

    field = "device" if requested is not None else DEVICE_ENV
    want = requested if requested is not None else os.environ.get(DEVICE_ENV) or None
    if want is not None:
        want = want.strip().lower()
        if want.startswith("cuda"):
            gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
            if gpus < local_world:
                raise ConfigError(field, f"cuda asked for {local_world} process(es) per node, {gpus} GPU(s) visible",
                                  "launch one process per visible GPU, or use cpu")
            return "cuda"
        if want != "cpu":
            raise ConfigError(field, f"unknown device {want!r}", "use cpu or cuda")
        return "cpu"
    if not torch.cuda.is_available():
        return "cpu"
    gpus = torch.cuda.device_count()
    if gpus >= local_world:
        return "cuda"
    if notice:
        import sys

        print(f"paratrain: {local_world} processes on this node but {gpus} GPU(s) visible: running on the CPU "
              f"with gloo (launch at most {gpus} process(es) per node to train on the GPUs, or set "
              f"{DEVICE_ENV}=cpu to silence this)", file=sys.stderr, flush=True)
    return "cpu"


class RendezvousError(RuntimeError):
    """The process group could not be formed within the timeout."""


def _rendezvous(backend: str, rank: int, world: int, timeout: datetime.timedelta,
                device_id: torch.device | None) -> None:
    addr = os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    port = os.environ.setdefault("MASTER_PORT", "29500")
    try:
        dist.init_process_group(backend=backend, rank=rank, world_size=world, timeout=timeout, device_id=device_id)
    except Exception as e:  # noqa: BLE001 - store and network errors differ between torch versions
        cause = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        if rank == 0:
            what = f"not all {world} ranks joined the rendezvous at {addr}:{port}"
        else:
            what = f"cannot reach the rendezvous at {addr}:{port}"
        raise RendezvousError(f"{what} within {timeout.total_seconds():g} s (check MASTER_ADDR/MASTER_PORT, "
                              f"that rank 0 runs and every rank was launched); cause: {cause[:200]}") from e

"""Communication figures of ``paratrain calibrate`` on a CPU host: a ping-pong between two ranks
(alone, and while the other processes compute) and all-reduces over every group size, all
groups at once. Each figure is one the cost model reads from ``cpu-cluster.json``
(:func:`paratrain.sim.fit_links.links_document`): the link's alpha-beta, ``measured_p2p`` and
``measured_reductions``."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

from paratrain.runtime.calibrate_tp import tp_group_sizes

__all__ = ["COMM_STEPS", "measure_comm", "size_label"]

Progress = Callable[[int, int, str], None]  # (done, total, what): told before each measurement

_P2P_BYTES = (4 * 2**10, 64 * 2**10, 256 * 2**10, 1 * 2**20, 4 * 2**20)
# 4 bytes: the gradient-norm all-reduce of one scalar; 32 MiB: a data-parallel gradient bucket
# (DDP's default cap is 25 MiB)
_ALLREDUCE_BYTES = (4, 256 * 2**10, 4 * 2**20, 32 * 2**20)
_COMM_BUDGET_S = 2.5


def size_label(n: int) -> str:
    for unit, f in (("MiB", 2**20), ("KiB", 2**10)):
        if n >= f:
            return f"{n // f} {unit}"
    return f"{n} B"


COMM_STEPS = (
    *(f"p2p {size_label(n)}" for n in _P2P_BYTES),
    *(f"all-reduce {size_label(n)}" for n in _ALLREDUCE_BYTES),
)


def measure_comm(
    rank: int, world: int, budget_s: float = _COMM_BUDGET_S, *, progress: Progress | None = None,
    done: int = 0, total: int | None = None,
) -> dict[str, Any]:
    """Ping-pong between ranks 0 and 1 (``dist.send``/``dist.recv``, one-way time = half the
    round trip, mean of the repeats: a run pays the mean) and all-reduces over every group size
    that divides the world, all groups at once (the mean over repeats and ranks):
    ``{"p2p_s_by_bytes", "allreduce_s_by_bytes" (the whole world's), "measured_reductions" (rows
    ``(kind, group size, bytes, seconds)``), "procs"}``. Every rank must call it; the ping-pong's
    figures are rank 0's. ``progress`` is told before each message size (counting from
    ``done`` of ``total``)."""
    import torch
    import torch.distributed as dist

    start = time.perf_counter()
    steps = len(_P2P_BYTES) + len(_ALLREDUCE_BYTES)
    tell = progress or (lambda done, total, what: None)
    of = total if total is not None else steps
    p2p = {}
    for i, nbytes in enumerate(_P2P_BYTES):
        tell(done + i, of, COMM_STEPS[i])
        buf = torch.zeros(nbytes // 4)
        deadline = start + budget_s * (i + 1) / steps

        def ping_pong(buf: Any = buf) -> None:
            if rank == 0:
                dist.send(buf, 1)
                dist.recv(buf, 1)
            elif rank == 1:
                dist.recv(buf, 0)
                dist.send(buf, 0)

        ts = []
        ping_pong()
        for _ in range(50):
            t0 = time.perf_counter()
            ping_pong()
            ts.append(time.perf_counter() - t0)
            # every rank stops after the same repeat (the ends of a ping-pong must agree)
            stop = torch.tensor([1.0 if (time.perf_counter() > deadline and len(ts) >= 5) else 0.0])
            dist.all_reduce(stop, op=dist.ReduceOp.MAX)
            if stop.item() > 0:
                break
        p2p[nbytes] = statistics.fmean(ts) / 2
    loaded = _loaded_ping_pong(rank, world) if world > 2 else []
    allreduce = {}
    reductions: list[tuple[str, int, int, float]] = []
    # every group size that divides the world (consecutive ranks), all groups at once, as the
    # data-parallel groups of a layout reduce their gradients together
    groups = {g: (None if g == world else dist.new_subgroups(group_size=g)[0]) for g in tp_group_sizes(world)}
    for j, nbytes in enumerate(_ALLREDUCE_BYTES):
        tell(done + len(_P2P_BYTES) + j, of, COMM_STEPS[len(_P2P_BYTES) + j])
        buf = torch.zeros(max(1, nbytes // 4))
        end = start + budget_s * (len(_P2P_BYTES) + j + 1) / steps
        for k, (g, group) in enumerate(groups.items()):
            deadline = time.perf_counter() + (end - time.perf_counter()) / (len(groups) - k)
            ts = []
            dist.all_reduce(buf, group=group)
            for _ in range(50):
                dist.barrier()
                t0 = time.perf_counter()
                dist.all_reduce(buf, group=group)
                ts.append(time.perf_counter() - t0)
                stop = torch.tensor([1.0 if (time.perf_counter() > deadline and len(ts) >= 5) else 0.0])
                dist.all_reduce(stop, op=dist.ReduceOp.MAX)
                if stop.item() > 0:
                    break
            # the mean over the repeats and over every rank (each rank's group is one of the g-groups)
            mean = torch.tensor([statistics.fmean(ts)], dtype=torch.float64)
            dist.all_reduce(mean)
            seconds = float(mean.item()) / world
            reductions.append(("all_reduce", g, nbytes, seconds))
            if g == world:
                allreduce[nbytes] = seconds
    return {"p2p_s_by_bytes": p2p, "allreduce_s_by_bytes": allreduce, "measured_reductions": reductions,
            "measured_p2p": loaded, "procs": world}


# Exchanges per message size of the loaded ping-pong, the compute between two of them (a pipeline
# stage computes a micro-batch between its transfers), and how long the other ranks compute: well
# past the pair's exchanges (under 0.5 s here), which therefore all see busy cores.
_LOADED_EXCHANGES = 8
_LOADED_GAP_S = 0.005
_LOAD_S = 2.0


def _loaded_ping_pong(rank: int, world: int) -> list[tuple[str, int, int, float]]:
    """One-way times of a ping-pong between ranks 0 and 1 at ``_P2P_BYTES`` while every other
    rank computes, the pair computing ``_LOADED_GAP_S`` between exchanges: a pipeline's transfer
    on a host whose cores are all busy, where the receiver, woken by the message, waits for a core
    (the ping-pong alone finds them idle). Rows ``("p2p", 2, bytes, seconds)``, the mean over the
    exchanges, from rank 0; every rank must call it."""
    import torch
    import torch.distributed as dist

    a = torch.randn(128, 128)

    def compute(seconds: float) -> None:
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < seconds:
            a @ a

    rows: list[tuple[str, int, int, float]] = []
    dist.barrier()
    if rank >= 2:
        compute(_LOAD_S)
        dist.barrier()
        return rows
    for nbytes in _P2P_BYTES:
        buf = torch.zeros(nbytes // 4)
        ts = []
        for _ in range(_LOADED_EXCHANGES + 1):
            t0 = time.perf_counter()
            if rank == 0:
                dist.send(buf, 1)
                dist.recv(buf, 1)
            else:
                dist.recv(buf, 0)
                dist.send(buf, 0)
            ts.append(time.perf_counter() - t0)
            compute(_LOADED_GAP_S)
        rows.append(("p2p", 2, nbytes, statistics.fmean(ts[1:]) / 2))  # the first exchange warms up
    dist.barrier()
    return rows

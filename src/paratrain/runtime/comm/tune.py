"""``paratrain comm tune``: time every operation on every backend, choose per size, fit alpha-beta.

:func:`tune` starts ``procs`` local processes (spawned, joined over loopback through a file store,
as ``paratrain calibrate`` joins them). Every process builds one process group per backend and
group shape over the same ranks: the whole world, its halves, its quarters… down to groups of 2,
all groups of one shape measuring at once (as data-parallel groups of different stages reduce at
once). For each operation, group shape and message size, and for each backend in turn (back to
back, so that they compete under the same load), every rank runs ``warmup`` untimed calls, then
``repeats`` timed calls, each after a barrier of the group so that they start together; a rank's
figure is its median and a point's figure the slowest rank's median (a collective ends for the
job when its last rank has it). Send/recv is a ping-pong between the first two ranks of each
smallest group: one-way time = half the round trip.

Backends: ``gloo`` always and ``gloo_1t`` (a second gloo group, one worker thread); ``nccl`` when
every process has a GPU of its own (tensors on the GPU); ``mpi`` when torch was built with it *and* the processes
were started by ``mpirun`` (an MPI group cannot be created inside a world torch started itself).
Unavailable backends are skipped with the reason in the result.

:func:`fit_alpha_beta_by_op` fits the cost model's link latency alpha and bandwidth beta per
(operation, backend) to the measured medians: least squares on the ring algorithm's volume formula
that :mod:`paratrain.cost.collectives` uses (Thakur, Rabenseifner & Gropp 2005), with the group
size entering the coefficients, ``time = c_alpha(op, p)·alpha + c_beta(op, p)·bytes/beta``.
"""

from __future__ import annotations

import math
import os
import platform
import queue as queue_mod
import statistics
import tempfile
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from paratrain.errors import ConfigError
from paratrain.runtime.forkserver import forked_workers, worker_started

from .table import BACKENDS, OPS, Measurement, TuningTable, check_backend, choices_from_measurements

__all__ = [
    "DEFAULT_MAX_BYTES",
    "FULL_MAX_BYTES",
    "MIN_BYTES",
    "AlphaBeta",
    "available_backends",
    "fit_alpha_beta",
    "fit_alpha_beta_by_op",
    "message_sizes",
    "ring_coefficients",
    "tune",
]

MIN_BYTES = 2**10  # 1 KiB: below it every call is latency alone
FULL_MAX_BYTES = 2**28  # 256 MiB: the range; the largest gradient buckets of big models
# The default stops at 4 MiB: with two processes on a 2-core machine the full range takes minutes
# (a 256 MiB all-gather of 4 ranks allocates a GiB per rank), the quick range about 20 seconds.
DEFAULT_MAX_BYTES = 2**22
_SILENCE_S = 300.0  # seconds without a word from the workers before the parent gives up
_MAX_WARMUP = 100
_REPEAT_BUDGET_S = 0.5  # per point: big messages get fewer repeats (never fewer than 3)

# Called with (points done, points in all, what is measured now).
Progress = Callable[[int, int, str], None]


def message_sizes(min_bytes: int = MIN_BYTES, max_bytes: int = DEFAULT_MAX_BYTES, factor: int = 4) -> tuple[int, ...]:
    """``min_bytes``, ``min_bytes·factor``, … up to ``max_bytes`` (included when on the grid)."""
    if min_bytes < 4:
        raise ConfigError("--min-bytes", f"must be at least 4 (one float32), got {min_bytes}", "use e.g. 1024")
    if max_bytes < min_bytes:
        raise ConfigError("--max-bytes", f"{max_bytes} is below the smallest size {min_bytes}",
                          "give a --max-bytes of at least 1 KiB")
    if max_bytes > 2**31:
        raise ConfigError("--max-bytes", f"{max_bytes} bytes is more than 2 GiB per buffer", "use at most 256 MiB")
    if factor < 2:
        raise ConfigError("--factor", f"must be at least 2, got {factor}", "use 2 or 4")
    out, s = [], min_bytes
    while s <= max_bytes:
        out.append(s)
        s *= factor
    return tuple(out)


def available_backends(
    requested: Sequence[str] | None = None, procs: int = 1,
) -> tuple[tuple[str, ...], dict[str, str]]:
    """``(usable backends, {skipped backend: why})`` for ``procs`` local processes; ``requested``
    None asks for every one."""
    import torch
    import torch.distributed as dist

    names = list(BACKENDS) if requested is None else [check_backend(b, "--backend") for b in requested]
    ok, skipped = [], {}
    for b in names:
        base = BACKENDS[b][0]
        if base == "gloo" and not dist.is_gloo_available():
            skipped[b] = "torch was built without gloo"
        elif base == "nccl" and not (dist.is_nccl_available() and torch.cuda.is_available()):
            skipped[b] = "needs CUDA and a torch built with NCCL"
        elif base == "nccl" and torch.cuda.device_count() < procs:
            # NCCL refuses two ranks of a communicator on one GPU ("Duplicate GPU detected")
            skipped[b] = f"needs a GPU per process ({procs} processes, {torch.cuda.device_count()} GPU(s))"
        elif base == "mpi" and not dist.is_mpi_available():
            skipped[b] = "torch was built without MPI"
        elif base == "mpi" and "OMPI_COMM_WORLD_SIZE" not in os.environ and "PMI_SIZE" not in os.environ:
            skipped[b] = "MPI groups need processes started by mpirun"
        else:
            ok.append(b)
    if not ok:
        raise ConfigError("--backend", f"none of {', '.join(names)} is available here ({skipped})",
                          "use --backend gloo")
    return tuple(ok), skipped


def group_shapes(world: int) -> tuple[int, ...]:
    """Group sizes measured: the world, then halves while a group keeps at least 2 ranks."""
    out, g = [], world
    while g >= 2 and world % g == 0:
        out.append(g)
        if g % 2:
            break
        g //= 2
    return tuple(out)


# ---- measurement (in the worker processes) -------------------------------------------------------


def _new_group(ranks: list[int]) -> Any:
    """A group of the run's own backend over ``ranks``; the backend under test is chosen per call
    by the layer's hint (a shadow communicator, as ``train`` routes it), so a tuned point measures
    exactly what the runtime issues — ``gloo_1t`` included, whose one worker thread
    ``dist.new_group(pg_options=...)`` would silently drop."""
    import torch.distributed as dist

    return dist.new_group(ranks)


def _call(op: str, backend: str, group: Any, src: int, dst: int, rank: int, bufs: dict[str, Any]) -> None:
    """One call of ``op`` on ``backend`` through the runtime's communication layer, with
    preallocated buffers."""
    from . import layer as comm

    x = bufs["x"]
    if op == "all_reduce":
        comm.all_reduce(x, group, hint=backend)
    elif op == "reduce_scatter":
        comm.reduce_scatter(bufs["shard"], bufs["parts"], group, hint=backend)
    elif op == "all_gather":
        comm.all_gather(bufs["parts"], bufs["shard"], group, hint=backend)
    elif op == "all_to_all":
        comm.all_to_all(bufs["y"], x, group, hint=backend)
    elif op == "broadcast":
        comm.broadcast(x, src, group, hint=backend)
    elif rank in (src, dst):  # send_recv: a ping-pong, the caller halves the time
        peer = dst if rank == src else src
        for send in ((True, False) if rank == src else (False, True)):
            for h in comm.batch_isend_irecv([comm.P2P(send, x, peer)], group, hint=backend):
                h.wait()


def _measure_point(op: str, backend: str, group: Any, members: list[int], rank: int, nbytes: int, device: Any,
                   warmup: int, repeats: int) -> float | None:
    """This rank's median time of one call; None when the rank takes no part (send/recv)."""
    import torch
    import torch.distributed as dist

    p = len(members)
    numel = max(p, -(-nbytes // 4 // p) * p)  # float32 elements, a multiple of the group size
    x = torch.ones(numel, device=device)
    bufs = {"x": x, "shard": torch.ones(numel // p, device=device), "y": torch.empty(numel, device=device),
            "parts": list(x.chunk(p))}
    src, dst = members[0], members[1]
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    takes_part = op != "send_recv" or rank in (src, dst)
    for _ in range(warmup):
        if takes_part:
            _call(op, backend, group, src, dst, rank, bufs)
    sync()
    # Every rank must run the same number of repeats: agree on it from the slowest warm-up.
    t0 = time.perf_counter()
    if takes_part:
        _call(op, backend, group, src, dst, rank, bufs)
        sync()
    est = torch.tensor([time.perf_counter() - t0])
    dist.all_reduce(est, op=dist.ReduceOp.MAX)  # on the default group: every rank of the world
    n = max(3, min(repeats, int(_REPEAT_BUDGET_S / max(est.item(), 1e-9))))
    ts = []
    for _ in range(n):
        dist.barrier(group=group)
        t0 = time.perf_counter()
        if takes_part:
            _call(op, backend, group, src, dst, rank, bufs)
            sync()
        ts.append(time.perf_counter() - t0)
    if not takes_part:
        return None
    med = statistics.median(ts)
    return med / 2 if op == "send_recv" else med


def _worker(rank: int, world: int, store: str, backends: tuple[str, ...], ops: tuple[str, ...],
            sizes: tuple[int, ...], warmup: int, repeats: int, threads: int, out: Any) -> None:
    """One tuning process. Messages: ``("progress", done, total, what)`` from rank 0, then
    ``("result", rank, [(op, backend, group_size, bytes, median_s), ...])`` or ``("error", rank, text)``."""
    worker_started()
    try:
        import torch
        import torch.distributed as dist

        torch.set_num_threads(threads)
        cuda = "nccl" in backends
        if cuda:
            torch.cuda.set_device(rank)
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
        shapes = group_shapes(world)
        # Every rank creates every group, in the same order (new_group is collective over the world).
        groups: dict[int, tuple[Any, list[int]]] = {}
        for g in shapes:
            for start in range(0, world, g):
                members = list(range(start, start + g))
                pg = _new_group(members)
                if rank in members:
                    groups[g] = (pg, members)
        from . import layer as comm

        comm.use(comm.CommLayer(default_backend="gloo", device_type="cuda" if cuda else "cpu"))
        # the backends of one (op, group, size) back to back: they compete under the same load
        points = [(op, b, g, s) for op in ops for g in shapes for s in sizes for b in backends
                  if op != "send_recv" or g == shapes[-1]]  # send/recv: one pair is enough
        rows = []
        for i, (op, b, g, s) in enumerate(points):
            if rank == 0:
                out.put(("progress", i, len(points), f"{op} {b} {g} ranks {_size(s)}"))
            pg, members = groups[g]
            device = torch.device("cuda") if BACKENDS[b][0] == "nccl" else torch.device("cpu")
            t = _measure_point(op, b, pg, members, rank, s, device, warmup, repeats)
            if t is not None:
                rows.append((op, b, 2 if op == "send_recv" else g, s, t))
        dist.barrier()
        dist.destroy_process_group()
        out.put(("result", rank, rows))
    except Exception as e:  # reported by the parent as one line
        out.put(("error", rank, f"{type(e).__name__}: {e}"))


def _size(n: int) -> str:
    for unit, k in (("MiB", 2**20), ("KiB", 2**10)):
        if n >= k and n % k == 0:
            return f"{n // k} {unit}"
    return f"{n} B"


@dataclass(frozen=True)
class TuneResult:
    table: TuningTable
    skipped: dict[str, str]
    seconds: float


def tune(
    procs: int = 2, *, backends: Sequence[str] | None = None, ops: Sequence[str] | None = None,
    sizes: Sequence[int] | None = None, warmup: int = 2, repeats: int = 10, threads: int = 1,
    progress: Progress | None = None,
) -> TuneResult:
    """Measure, choose and return the table (not written: the caller writes it)."""
    if procs < 2:
        raise ConfigError("--nproc", f"collectives need at least 2 processes, got {procs}", "use --nproc 2")
    if procs > 64:
        raise ConfigError("--nproc", f"{procs} local processes is more than this command is meant for",
                          "use at most 64")
    ops_t = tuple(OPS if ops is None else ops)
    for op in ops_t:
        if op not in OPS:
            raise ConfigError("--op", f"unknown operation {op!r}", f"use one of: {', '.join(OPS)}")
    if repeats < 1:
        raise ConfigError("--repeats", f"must be at least 1, got {repeats}", "use e.g. --repeats 10")
    # The time budget per point caps the timed repeats, not the warm-up: a huge --warmup would run
    # that many calls at every size, backend and group before the first timing.
    if not 0 <= warmup <= _MAX_WARMUP:
        raise ConfigError("--warmup", f"must be in 0..{_MAX_WARMUP}, got {warmup}", "use e.g. --warmup 2")
    sizes_t = tuple(sorted(set(sizes))) if sizes else message_sizes()
    usable, skipped = available_backends(backends, procs)

    tell = progress or (lambda done, total, what: None)
    start = time.perf_counter()
    # workers fork from a server that imported torch once (runtime/forkserver.py)
    preload = ["torch", "torch.distributed", "paratrain.runtime.comm.tune"]
    with forked_workers(preload) as ctx, tempfile.TemporaryDirectory(prefix="paratrain-comm-tune-") as tmp:
        q = ctx.Queue()
        store = os.path.join(tmp, "store")
        ps = [ctx.Process(target=_worker, args=(r, procs, store, usable, ops_t, sizes_t, warmup, repeats, threads, q))
              for r in range(procs)]
        for p in ps:
            p.start()
        results: dict[int, list[tuple[str, str, int, int, float]]] = {}
        try:
            while len(results) < procs:
                try:
                    msg = q.get(timeout=_SILENCE_S)
                except queue_mod.Empty:
                    raise ConfigError("--nproc", f"the tuning processes sent nothing for {_SILENCE_S:.0f} s",
                                      "use a smaller --max-bytes or fewer --nproc") from None
                if msg[0] == "progress":
                    tell(*msg[1:])
                elif msg[0] == "error":
                    raise ConfigError("--nproc", f"tuning process {msg[1]} failed: {msg[2]}",
                                      "use a smaller --max-bytes or fewer --nproc")
                else:
                    results[msg[1]] = msg[2]
        finally:
            for p in ps:
                p.join(timeout=10)
                if p.is_alive():
                    p.terminate()
    slowest: dict[tuple[str, str, int, int], float] = {}
    for rows in results.values():
        for op, b, g, s, t in rows:
            key = (op, b, g, s)
            slowest[key] = max(t, slowest.get(key, 0.0))
    ms = tuple(Measurement(op, b, g, s, t) for (op, b, g, s), t in sorted(slowest.items()))
    import torch

    machine = {"procs": procs, "threads_per_proc": threads, "cpus": os.cpu_count(), "platform": platform.platform(),
               "torch": torch.__version__, "warmup": warmup, "repeats": repeats,
               "skipped_backends": skipped}
    table = TuningTable(ms, choices_from_measurements(ms, usable[0]), default_backend=usable[0], world_size=procs,
                        machine=machine)
    return TuneResult(table, skipped, time.perf_counter() - start)


# ---- alpha-beta fit ------------------------------------------------------------------------------


def ring_coefficients(op: str, p: int) -> tuple[float, float]:
    """``(c_alpha, c_beta)`` with ``time = c_alpha·alpha + c_beta·bytes/beta`` for ``op`` over ``p``
    ranks: the ring algorithms of :mod:`paratrain.cost.collectives` (Thakur et al. 2005, sec. 4;
    broadcast as a pipelined chain) and pairwise all-to-all; a send/recv is one message."""
    if op == "send_recv":
        return 1.0, 1.0
    frac = (p - 1) / p
    if op == "all_reduce":
        return 2.0 * (p - 1), 2.0 * frac
    if op in ("reduce_scatter", "all_gather", "all_to_all"):
        return float(p - 1), frac
    if op == "broadcast":
        return float(p - 1), 1.0
    raise ConfigError("op", f"no volume formula for {op!r}", f"use one of: {', '.join(OPS)}")


@dataclass(frozen=True)
class AlphaBeta:
    """A fitted link: ``latency_s`` (alpha) and ``bandwidth_Bps`` (beta), with the fit's points."""

    op: str
    backend: str
    latency_s: float
    bandwidth_Bps: float
    points: int

    def predict_s(self, nbytes: float, group_size: int) -> float:
        ca, cb = ring_coefficients(self.op, group_size)
        return ca * self.latency_s + cb * nbytes / self.bandwidth_Bps

    def to_dict(self) -> dict[str, Any]:
        return {"op": self.op, "backend": self.backend, "latency_s": self.latency_s,
                "bandwidth_Bps": self.bandwidth_Bps, "points": self.points}


def fit_alpha_beta(op: str, points: Iterable[tuple[int, float, float]]) -> tuple[float, float]:
    """Least-squares ``(alpha_s, beta_Bps)`` from ``(group_size, bytes, time_s)`` points of one op.

    Minimizes the squared *relative* error ``Σ ((model - t) / t)²``: the sizes span five orders of
    magnitude and an absolute fit would let the largest message decide alone. A negative alpha
    (noise on a latency below the resolution) is clipped to 0 and beta refitted alone.
    """
    rows, largest = [], (0.0, 0.0)
    for p, n, t in points:
        ca, cb = ring_coefficients(op, p)
        if t > 0:
            rows.append((ca / t, cb * n / t))  # each row divided by its t: relative residuals, target 1
            largest = max(largest, (cb * n, t))
    if len(rows) < 2:
        raise ConfigError("table", f"{op}: need at least two measured sizes to fit alpha and beta",
                          "measure more sizes (--max-bytes)")
    s11 = sum(a * a for a, _ in rows)
    s12 = sum(a * b for a, b in rows)
    s22 = sum(b * b for _, b in rows)
    y1 = sum(a for a, _ in rows)
    y2 = sum(b for _, b in rows)
    det = s11 * s22 - s12 * s12
    alpha, inv_beta = ((y1 * s22 - y2 * s12) / det, (s11 * y2 - s12 * y1) / det) if det > 0 else (-1.0, 0.0)
    if alpha < 0:
        alpha, inv_beta = 0.0, y2 / s22
    if inv_beta <= 0:  # every size equally fast: at least the largest message's rate
        inv_beta = largest[1] / largest[0]
    return alpha, 1.0 / inv_beta


def fit_alpha_beta_by_op(table: TuningTable) -> list[AlphaBeta]:
    """One fit per (op, backend) of the table with at least two measured sizes."""
    by: dict[tuple[str, str], list[tuple[int, float, float]]] = {}
    for m in table.measurements:
        by.setdefault((m.op, m.backend), []).append((m.group_size, float(m.bytes), m.time_s))
    out = []
    for (op, b), pts in sorted(by.items(), key=lambda kv: (OPS.index(kv[0][0]), kv[0][1])):
        if len({n for _, n, _ in pts}) < 2:
            continue
        alpha, beta = fit_alpha_beta(op, pts)
        out.append(AlphaBeta(op, b, alpha, beta, len(pts)))
    return out


def check_sizes(sizes: Iterable[int]) -> None:
    """Every size whole and within the tunable range."""
    for s in sizes:
        if s < 4 or s > 2**31 or math.isnan(s):
            raise ConfigError("--sizes", f"{s} bytes is outside 4 B .. 2 GiB", "give sizes like 1KiB,1MiB")


def links_from_table(table: TuningTable, existing: dict[str, Any] | None = None) -> dict[str, Any]:
    """The ``cpu`` cluster's link document (``cpu-cluster.json``, what ``paratrain calibrate``
    writes) with its alpha-beta fitted to the table: the default backend's send/recv, the same
    one-way message ``calibrate``'s ping-pong times, so the cost model's link means the same thing
    either way. Every (op, backend) fit goes in ``comm_fit``; the rest of ``existing`` (the
    tensor-parallel collectives measured by ``calibrate``) is kept."""
    fits = fit_alpha_beta_by_op(table)
    link = next((f for f in fits if f.op == "send_recv" and f.backend == table.default_backend), None)
    if link is None:
        raise ConfigError("--comm-table", f"has no send_recv times of {table.default_backend} at two sizes or more",
                          "tune with send_recv included (paratrain comm tune without --op)")
    default = table.default_backend
    doc = dict(existing or {})

    def by_bytes(op: str, group: int) -> dict[str, float]:
        return {str(m.bytes): m.time_s for m in table.measurements
                if (m.op, m.backend, m.group_size) == (op, default, group)}

    doc.update({
        "p2p_latency_s": link.latency_s,
        "p2p_bandwidth_Bps": link.bandwidth_Bps,
        "p2p_s_by_bytes": by_bytes("send_recv", 2),
        "allreduce_s_by_bytes": by_bytes("all_reduce", table.world_size),
        "procs": table.world_size,
        "threads": int(table.machine.get("threads_per_proc", 1)),
        "comm_fit": [f.to_dict() for f in fits],
        "comm_fit_backend": default,
    })
    doc.setdefault("measured_collectives", [])
    return doc

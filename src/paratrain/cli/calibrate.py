"""``paratrain calibrate``: measure this machine's CPU and store it as the ``cpu`` device and the
``cpu`` cluster's links.

Measures fp32 GEMM throughput with ``torch.matmul`` on a few square sizes, memory bandwidth with a
large tensor copy (read + write bytes over time), and the fixed cost of a tiny kernel (framework
dispatch: a small element-wise op and a small matmul), then writes a
:class:`~paratrain.spec.device.DeviceSpec` JSON to ``cpu_calibration_path()``
(``$PARATRAIN_CACHE/cpu.json``; ``~/.cache/paratrain/cpu.json`` by default), where
``resolve_device("cpu")`` picks it up.

With ``--procs P`` (default 2, the pipeline benchmark's setting) the measurement runs in ``P``
processes of ``--threads`` threads each, joined by gloo over the loopback interface as
``paratrain train`` joins them: all processes measure the compute figures at the same time (so
the figures are what one process gets while the others compute too: shared cores, caches and
memory bandwidth), then ranks 0 and 1 time a send/recv ping-pong over a few message sizes and
every rank an all-reduce. The ping-pong's one-way times are fitted with ``alpha + n/beta``
(Hockney 1994) by least squares; alpha and beta become the ``cpu`` cluster's link latency and
bandwidth (``cpu-cluster.json`` next to ``cpu.json``, read by the ``cpu`` cluster preset).

With several processes the compute figures are *sustained* rates: work done over the wall time
of back-to-back calls, not the best call. A training step is a long sum of kernels, so its
expected time is the number of kernels times their *mean* time, and on a machine shared with
other processes the mean includes the time slices they take (measured on a shared 2-core
machine: a 512x128x512 GEMM's best call ran at 93 GFLOP/s, its median at 71, its mean at 36).
The figures therefore describe the machine under the load it carries while calibrating.
It also measures how much one action's duration varies from call to call (the coefficient of
variation of a small MLP's forward + backward, every process at once): the ``duration_cv`` with
which the simulator draws action durations (:mod:`paratrain.sim.variability`).
Takes about 14 s.
"""

from __future__ import annotations

import dataclasses
import json
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Annotated, Any

import typer

from paratrain.cli.options import JsonOpt, print_json
from paratrain.errors import ConfigError
from paratrain.spec.cluster_presets import cpu_cluster_calibration_path
from paratrain.spec.device import DeviceSpec, cpu_calibration_path
from paratrain.spec.device_presets import DEVICE_PRESETS

__all__ = ["register", "calibrate", "measure_cpu", "measure_comm", "fit_alpha_beta",
           "combine_cpu", "links_document", "device_from_measurement"]

_GEMM_SIZES = (256, 512, 1024)
_COPY_BYTES = 128 * 2**20  # past the last-level cache of common CPUs
_EW_ELEMENTS = 2**20  # 4 MiB of fp32: an activation of a small model (512 tokens x 2048)
_CHAIN_LAYERS = 10  # long enough that the autograd.grad call's own cost is spread thin
_BUDGET_S = 2.5  # keeps the whole command, torch import included, under 10 s on a loaded machine
_P2P_BYTES = (4 * 2**10, 64 * 2**10, 256 * 2**10, 1 * 2**20, 4 * 2**20)
_ALLREDUCE_BYTES = (4, 256 * 2**10, 4 * 2**20)  # 4 bytes: the gradient-norm all-reduce of one scalar
_COMM_BUDGET_S = 2.5
_SUSTAINED_BUDGET_S = 3.0  # long enough to average over the scheduler's time slices (milliseconds)
_VARIATION_BUDGET_S = 2.5  # ~100 calls of the ~25 ms step below on a 2-core machine
_VARIATION_SHAPE = (512, 256, 1024)  # tokens, hidden, FFN: a small transformer MLP's forward + backward


def register(app: typer.Typer) -> None:
    app.command("calibrate", help="Measure this machine's CPU and store it as the `cpu` device.")(calibrate)


def _best_time(fn: Any, *, repeats: int, deadline: float) -> float:
    """Fastest of up to ``repeats`` timed calls (after one warm-up), stopping at ``deadline``
    (a ``time.perf_counter()`` value) once at least one call was timed."""
    fn()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        t1 = time.perf_counter()
        best = min(best, t1 - t0)
        if t1 > deadline:
            break
    return best


def _mean_time(fn: Any, *, repeats: int, deadline: float) -> float:
    """Mean time of back-to-back calls (after one warm-up) until ``deadline``, at least three:
    total time over calls, so that the time slices other processes take are counted in the
    proportion a long run of such calls loses to them."""
    fn()
    n = 0
    t0 = time.perf_counter()
    while True:
        fn()
        n += 1
        t1 = time.perf_counter()
        if t1 > deadline and n >= 3:
            return (t1 - t0) / n


def _variation(fn: Any, *, deadline: float) -> float:
    """Coefficient of variation (standard deviation / mean) of back-to-back call times, after
    one warm-up, until ``deadline`` (at least five calls)."""
    fn()
    ts: list[float] = []
    while True:
        t0 = time.perf_counter()
        fn()
        t1 = time.perf_counter()
        ts.append(t1 - t0)
        if t1 > deadline and len(ts) >= 5:
            return statistics.pstdev(ts) / statistics.fmean(ts)


def measure_variation(budget_s: float = _VARIATION_BUDGET_S) -> float:
    """How much the duration of one training action varies from call to call on this machine, as
    it is loaded now: the coefficient of variation of a transformer MLP's forward + backward
    (``_VARIATION_SHAPE``, ~20 ms on one thread), the simulator's ``duration_cv``. Run by every
    process at once, it includes what they do to each other (shared caches, memory bandwidth)."""
    import torch
    import torch.nn.functional as F

    tokens, hidden, ffn = _VARIATION_SHAPE
    x = torch.randn(tokens, hidden, requires_grad=True)
    w1 = torch.randn(ffn, hidden, requires_grad=True)
    w2 = torch.randn(hidden, ffn, requires_grad=True)

    def step() -> None:
        y = F.linear(F.gelu(F.linear(x, w1), approximate="tanh"), w2)
        torch.autograd.grad([y.sum()], [x, w1, w2])

    return _variation(step, deadline=time.perf_counter() + budget_s)


def measure_cpu(budget_s: float = _BUDGET_S, *, sustained: bool = False) -> dict[str, Any]:
    """Measured figures of this machine: GEMM FLOP/s per size, copy bandwidth, element-wise rate,
    per-kernel overhead of a training step.

    Each of the eight measurements gets a cumulative share of ``budget_s``, so a loaded machine
    takes fewer repeats rather than longer. By default each figure is the best repeat (what the
    hardware can do); ``sustained`` gives the mean over back-to-back calls for the whole share
    instead (what a long sequence of such kernels gets on a machine shared with other processes).
    """
    import torch
    import torch.nn.functional as F

    torch.manual_seed(0)
    start = time.perf_counter()
    steps = len(_GEMM_SIZES) + 5
    timed = _mean_time if sustained else _best_time

    def deadline(i: int) -> float:
        return start + budget_s * (i + 1) / steps

    per_size = {}
    for i, n in enumerate(_GEMM_SIZES):
        a = torch.randn(n, n, dtype=torch.float32)
        b = torch.randn(n, n, dtype=torch.float32)
        t = timed(lambda a=a, b=b: torch.matmul(a, b), repeats=8, deadline=deadline(i))
        per_size[n] = 2 * n**3 / t
    elems = _COPY_BYTES // 4
    src = torch.ones(elems, dtype=torch.float32)
    dst = torch.empty_like(src)
    t_copy = timed(lambda: dst.copy_(src), repeats=6, deadline=deadline(steps - 5))
    bandwidth = 2 * _COPY_BYTES / t_copy  # the copy reads and writes every byte
    # Element-wise kernels of a transformer layer on an activation-sized tensor, each with the
    # bytes the cost model counts for it (paratrain.cost.compute: reads + writes of n elements):
    # residual add 3, GeLU (tanh) 2, its backward 3, softmax 2, layer norm 2. Their total bytes over
    # their total time is the rate element-wise kernels sustain, below the copy's: on a CPU,
    # transcendental functions and row reductions run slower than the memory system.
    x = torch.randn(_EW_ELEMENTS // 128, 128)
    y, g = torch.randn_like(x), torch.randn_like(x)
    w, b = torch.ones(128), torch.zeros(128)

    def elementwise() -> None:
        torch.add(x, y)
        F.gelu(x, approximate="tanh")
        torch.ops.aten.gelu_backward(g, x, approximate="tanh")
        torch.softmax(x, -1)
        F.layer_norm(x, (128,), w, b)

    t_ew = timed(elementwise, repeats=20, deadline=deadline(steps - 4))
    ew_bandwidth = (3 + 2 + 3 + 2 + 2) * 4 * _EW_ELEMENTS / t_ew
    x = torch.ones(8)
    t_small = timed(lambda: torch.add(x, x), repeats=500, deadline=deadline(steps - 3))
    w = torch.ones(8, 8)
    t_small_mm = timed(lambda: torch.matmul(w, w), repeats=500, deadline=deadline(steps - 2))
    # A training step's per-operator cost includes autograd: recording the graph in the forward,
    # running the backward's nodes. Timed on a chain of tiny Linear + GeLU layers, forward and
    # backward through torch.autograd, divided by the kernels the cost model counts for them
    # (paratrain.cost.compute.op_kernels: a weight GEMM 1 forward + 2 backward, GeLU 1 + 1).
    chain = [torch.nn.Linear(8, 8) for _ in range(_CHAIN_LAYERS)]
    x8 = torch.randn(8, 8, requires_grad=True)
    leaves = [x8] + [p for lin in chain for p in lin.parameters()]

    def train_chain() -> None:
        h = x8
        for lin in chain:
            h = F.gelu(lin(h), approximate="tanh")
        torch.autograd.grad([h.sum()], leaves)

    t_chain = timed(train_chain, repeats=200, deadline=deadline(steps - 1))
    per_kernel = t_chain / (_CHAIN_LAYERS * (3 + 2))
    return {
        "gemm_flops_by_size": per_size,
        "peak_fp32_flops": max(per_size.values()),
        "memory_bandwidth_Bps": bandwidth,
        "elementwise_Bps": ew_bandwidth,
        # The fixed cost of one modelled kernel in a training step: on a CPU the host runs each
        # kernel itself, so dispatch and autograd add to every kernel (kernel_overhead_s) and
        # nothing overlaps them (host_issue_s 0).
        "kernel_overhead_s": per_kernel,
        "small_add_s": t_small,
        "small_matmul_s": t_small_mm,
        "threads": torch.get_num_threads(),
        "duration_cv": measure_variation(),
    }


def fit_alpha_beta(sizes_bytes: list[float], times_s: list[float]) -> tuple[float, float]:
    """Least-squares ``(alpha_s, beta_Bps)`` of ``time = alpha + bytes / beta`` (Hockney 1994).

    A fit whose slope is not positive (all sizes equally fast) falls back to the largest message's
    rate; a negative intercept is clipped to 0 (the line is then refitted through the origin).
    """
    n = len(sizes_bytes)
    if n != len(times_s) or n < 2:
        raise ValueError("need at least two (size, time) points")
    mx, my = sum(sizes_bytes) / n, sum(times_s) / n
    sxx = sum((x - mx) ** 2 for x in sizes_bytes)
    sxy = sum((x - mx) * (y - my) for x, y in zip(sizes_bytes, times_s, strict=True))
    slope = sxy / sxx if sxx > 0 else 0.0
    alpha = my - slope * mx
    if slope <= 0:
        i = max(range(n), key=lambda k: sizes_bytes[k])
        return min(times_s), sizes_bytes[i] / times_s[i]
    if alpha < 0:
        slope = sum(x * y for x, y in zip(sizes_bytes, times_s, strict=True)) / sum(x * x for x in sizes_bytes)
        alpha = 0.0
    return alpha, 1.0 / slope


def measure_comm(rank: int, world: int, budget_s: float = _COMM_BUDGET_S) -> dict[str, Any]:
    """Ping-pong between ranks 0 and 1 (``dist.send``/``dist.recv``, one-way time = half the
    round trip, mean of the repeats: a run pays the mean) and an all-reduce over all ranks, on the default group.
    Every rank must call it; the figures are rank 0's."""
    import torch
    import torch.distributed as dist

    start = time.perf_counter()
    steps = len(_P2P_BYTES) + len(_ALLREDUCE_BYTES)
    p2p = {}
    for i, nbytes in enumerate(_P2P_BYTES):
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
    allreduce = {}
    for j, nbytes in enumerate(_ALLREDUCE_BYTES):
        buf = torch.zeros(max(1, nbytes // 4))
        deadline = start + budget_s * (len(_P2P_BYTES) + j + 1) / steps
        ts = []
        dist.all_reduce(buf)
        for _ in range(50):
            dist.barrier()
            t0 = time.perf_counter()
            dist.all_reduce(buf)
            ts.append(time.perf_counter() - t0)
            stop = torch.tensor([1.0 if (time.perf_counter() > deadline and len(ts) >= 5) else 0.0])
            dist.all_reduce(stop, op=dist.ReduceOp.MAX)
            if stop.item() > 0:
                break
        allreduce[nbytes] = statistics.fmean(ts)
    alpha, beta = fit_alpha_beta([float(n) for n in p2p], list(p2p.values()))
    return {"p2p_s_by_bytes": p2p, "allreduce_s_by_bytes": allreduce, "p2p_latency_s": alpha,
            "p2p_bandwidth_Bps": beta, "procs": world}


def _worker(rank: int, world: int, threads: int, store: str, queue: Any) -> None:
    """One calibration process: compute figures measured while every process measures, then the
    communication figures."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(threads)
    try:
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
        dist.barrier()
        cpu = measure_cpu(_SUSTAINED_BUDGET_S, sustained=True)
        dist.barrier()
        comm = measure_comm(rank, world)
        dist.destroy_process_group()
        queue.put((rank, cpu, comm, None))
    except Exception as e:  # reported by the parent as one line
        queue.put((rank, None, None, f"{type(e).__name__}: {e}"))


def measure_machine(procs: int, threads: int) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """``(cpu figures, communication figures or None)``: one process in this one when ``procs``
    is 1, else ``procs`` spawned processes (compute figures averaged over them)."""
    if procs == 1:
        import torch

        torch.set_num_threads(threads)
        return measure_cpu(), None
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    with tempfile.TemporaryDirectory(prefix="paratrain-calibrate-") as tmp:
        store = os.path.join(tmp, "store")
        ps = [ctx.Process(target=_worker, args=(r, procs, threads, store, queue)) for r in range(procs)]
        for p in ps:
            p.start()
        results = {}
        try:
            for _ in range(procs):
                rank, cpu, comm, err = queue.get(timeout=120)
                if err is not None:
                    raise ConfigError("--procs", f"calibration process {rank} failed: {err}",
                                      "run with --procs 1 to calibrate the device alone")
                results[rank] = (cpu, comm)
        finally:
            for p in ps:
                p.join(timeout=10)
                if p.is_alive():
                    p.terminate()
    return combine_cpu([results[r][0] for r in range(procs)], threads), results[0][1]


def combine_cpu(cpus: list[dict[str, Any]], threads: int) -> dict[str, Any]:
    """The compute figures of processes that measured at the same time: their means."""
    sizes = cpus[0]["gemm_flops_by_size"]
    mean = statistics.fmean
    cpu = {
        "gemm_flops_by_size": {n: mean(c["gemm_flops_by_size"][n] for c in cpus) for n in sizes},
        "memory_bandwidth_Bps": mean(c["memory_bandwidth_Bps"] for c in cpus),
        "elementwise_Bps": mean(c["elementwise_Bps"] for c in cpus),
        "kernel_overhead_s": mean(c["kernel_overhead_s"] for c in cpus),
        "small_add_s": mean(c["small_add_s"] for c in cpus),
        "small_matmul_s": mean(c["small_matmul_s"] for c in cpus),
        "duration_cv": mean(c["duration_cv"] for c in cpus),
        "threads": threads,
    }
    cpu["peak_fp32_flops"] = max(cpu["gemm_flops_by_size"].values())
    return cpu


def links_document(comm: dict[str, Any], procs: int, threads: int) -> dict[str, Any]:
    """What ``cpu-cluster.json`` holds: the fitted link and the raw timings."""
    return {
        "p2p_latency_s": comm["p2p_latency_s"],
        "p2p_bandwidth_Bps": comm["p2p_bandwidth_Bps"],
        "p2p_s_by_bytes": {str(k): v for k, v in comm["p2p_s_by_bytes"].items()},
        "allreduce_s_by_bytes": {str(k): v for k, v in comm["allreduce_s_by_bytes"].items()},
        "procs": procs,
        "threads": threads,
    }


def _memory_bytes() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return DEVICE_PRESETS["cpu"].memory_bytes


def device_from_measurement(m: dict[str, Any]) -> DeviceSpec:
    """A ``cpu`` DeviceSpec whose peaks are the measured rates: GEMM efficiency 1; memory
    efficiency the element-wise kernels' rate over the copy's."""
    bw = float(m["memory_bandwidth_Bps"])
    return dataclasses.replace(
        DEVICE_PRESETS["cpu"],
        peak_fp32_flops=float(m["peak_fp32_flops"]),
        memory_bytes=int(_memory_bytes()),
        memory_bandwidth_Bps=float(m["memory_bandwidth_Bps"]),
        sm_count=int(m["threads"]),
        gemm_efficiency=1.0,
        # what element-wise kernels sustain relative to the copy (1 when not measured)
        memory_efficiency=min(1.0, float(m.get("elementwise_Bps", bw)) / bw),
        kernel_overhead_s=float(m["kernel_overhead_s"]),
        host_issue_s=0.0,  # the host runs each CPU kernel itself: its dispatch is in kernel_overhead_s
        duration_cv=min(1.0, float(m.get("duration_cv", 0.0))),
    )


def _fit_from_traces(target: Path, traces: list[Path], json_out: bool) -> None:
    """``--from-trace``: the stored calibration's compute speed and duration variation fitted to
    measured pipeline runs (:mod:`paratrain.sim.fit`), every other figure kept."""
    from paratrain.sim.fit import fit_trace, pooled_speed_factor, scaled_device

    if not target.is_file():
        raise ConfigError("--from-trace", f"there is no calibration at {str(target)!r} to update",
                          "run `paratrain calibrate` first (with the same --out, if any)")
    try:
        device = DeviceSpec(**json.loads(target.read_text()))
    except (ValueError, TypeError, ConfigError) as e:
        raise ConfigError("--from-trace", f"the calibration at {str(target)!r} cannot be read ({e})",
                          "run `paratrain calibrate` again to rewrite it") from None
    fits = [fit_trace(path, device) for path in traces]
    factor = pooled_speed_factor(fits)
    cv = min(1.0, statistics.fmean(f.duration_cv for f in fits))
    fitted = scaled_device(device, factor, cv)
    try:
        target.write_text(json.dumps(fitted.to_dict(), indent=2) + "\n")
    except OSError as e:
        raise ConfigError("--out", f"cannot write {str(target)!r}: {e.strerror or e}", "give a writable path") from None
    if json_out:
        print_json({"path": str(target), "device": fitted.to_dict(), "speed_factor": factor, "duration_cv": cv,
                    "previous_duration_cv": device.duration_cv,
                    "traces": [{**dataclasses.asdict(f), "speed_factor": f.speed_factor} for f in fits]})
        return
    for f in fits:
        print(f"{f.path}: compute {f.measured_busy_s:.4g} s per step measured vs {f.simulated_busy_s:.4g} s modelled "
              f"(x{f.speed_factor:.3f}); variation of action durations {f.duration_cv:.3f}")
    print(f"compute rates / {factor:.3f}, kernel overheads x {factor:.3f}; duration_cv {device.duration_cv:.3f} -> "
          f"{cv:.3f}; wrote {target}")


def calibrate(
    out: Annotated[Path | None, typer.Option("--out", help="Write the device JSON here instead.")] = None,
    threads: Annotated[int | None, typer.Option(
        "--threads", help="Torch threads per process (default: torch's, i.e. OMP_NUM_THREADS or all cores).")] = None,
    procs: Annotated[int, typer.Option(
        "--procs", help="Processes measuring at once, joined by gloo over loopback (1: the device alone, "
        "no link figures).")] = 2,
    from_trace: Annotated[list[Path] | None, typer.Option(
        "--from-trace", help="Measured pipeline runs (paratrain train --trace): fit the stored calibration's "
        "compute speed and duration variation to them instead of measuring anything. Repeatable.")] = None,
    json_out: JsonOpt = False,
) -> None:
    target = out if out is not None else cpu_calibration_path()
    if from_trace:
        _fit_from_traces(target, from_trace, json_out)
        return
    links = target.parent / cpu_cluster_calibration_path().name
    if threads is not None and threads < 1:
        raise ConfigError("--threads", f"must be at least 1, got {threads}", "use e.g. --threads 1")
    if procs < 1:
        raise ConfigError("--procs", f"must be at least 1, got {procs}", "use 2 (a pipeline of two stages) or 1")
    try:  # fail before measuring, not after
        target.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ConfigError("--out", f"cannot write {str(target)!r}: {e.strerror or e}", "give a writable path") from None
    if threads is None:
        import torch

        threads = torch.get_num_threads()
    t0 = time.perf_counter()
    m, comm = measure_machine(procs, threads)
    device = device_from_measurement(m)
    cluster_doc = links_document(comm, procs, threads) if comm is not None else None
    try:
        target.write_text(json.dumps(device.to_dict(), indent=2) + "\n")
        if cluster_doc is not None:
            links.write_text(json.dumps(cluster_doc, indent=2) + "\n")
    except OSError as e:
        raise ConfigError("--out", f"cannot write {str(target)!r}: {e.strerror or e}", "give a writable path") from None
    elapsed = time.perf_counter() - t0
    if json_out:
        print_json({
            "path": str(target),
            "device": device.to_dict(),
            "gemm_flops_by_size": {str(k): v for k, v in m["gemm_flops_by_size"].items()},
            "links_path": str(links) if cluster_doc is not None else None,
            "links": cluster_doc,
            "seconds": elapsed,
        })
        return
    how = f"{procs} processes measuring at once, sustained rates" if procs > 1 else "1 process, best of repeats"
    print(f"{threads} thread(s) per process, {how}")
    for n, f in m["gemm_flops_by_size"].items():
        print(f"fp32 GEMM {n}x{n}x{n}: {f / 1e9:.1f} GFLOP/s")
    print(f"memory bandwidth (copy of {_COPY_BYTES // 2**20} MiB): {device.memory_bandwidth_Bps / 1e9:.2f} GB/s")
    if "elementwise_Bps" in m:
        print(f"element-wise kernels (add, GeLU and its backward, softmax, layer norm; {_EW_ELEMENTS * 4 // 2**20} "
              f"MiB): {m['elementwise_Bps'] / 1e9:.2f} GB/s = memory efficiency {device.memory_efficiency:.2f}")
    print(f"kernel overhead (per modelled kernel of tiny Linear+GeLU layers, forward and backward through "
          f"autograd): {device.kernel_overhead_s * 1e6:.1f} us; tiny add {m['small_add_s'] * 1e6:.1f} us, tiny 8x8 "
          f"matmul {m['small_matmul_s'] * 1e6:.1f} us")
    print(f"duration variation (std / mean of a {_VARIATION_SHAPE[0]}x{_VARIATION_SHAPE[1]}x{_VARIATION_SHAPE[2]} MLP "
          f"forward + backward, back to back): {device.duration_cv:.3f}")
    print(f"threads: {device.sm_count}; memory: {device.memory_bytes / 2**30:.1f} GiB")
    if cluster_doc is not None:
        sizes = ", ".join(f"{int(k) // 1024} KiB {v * 1e6:.0f} us" for k, v in cluster_doc["p2p_s_by_bytes"].items())
        print(f"gloo p2p over loopback (one way): {sizes}")
        print(f"  fit alpha + n/beta: alpha {cluster_doc['p2p_latency_s'] * 1e6:.1f} us, "
              f"beta {cluster_doc['p2p_bandwidth_Bps'] / 1e9:.2f} GB/s")
        ar = ", ".join(f"{int(k)} B {v * 1e6:.0f} us" for k, v in cluster_doc["allreduce_s_by_bytes"].items())
        print(f"gloo all-reduce over {procs} processes: {ar}")
        print(f"wrote {target} and {links} in {elapsed:.1f} s")
    else:
        print(f"wrote {target} in {elapsed:.1f} s")

"""Measure this machine's CPU and gloo links: what ``paratrain calibrate`` stores as the ``cpu``
device and the ``cpu`` cluster's links.

Measures fp32 GEMM throughput with ``torch.matmul`` on a few square sizes, memory bandwidth with a
large tensor copy (read + write bytes over time), and the fixed cost of a tiny kernel (framework
dispatch: a small element-wise op and a small matmul); :func:`device_from_measurement` turns the
figures into a :class:`~paratrain.spec.device.DeviceSpec`.

With several processes (:func:`measure_machine`, ``procs > 1``; the pipeline benchmark runs two)
the measurement runs in ``procs`` processes of ``threads`` threads each, joined by gloo over the
loopback interface as ``paratrain train`` joins them: all processes measure the compute figures at
the same time (so the figures are what one process gets while the others compute too: shared
cores, caches and memory bandwidth), then the link (:mod:`paratrain.runtime.calibrate_comm`:
ping-pongs and all-reduces) and tensor parallelism (:mod:`paratrain.runtime.calibrate_tp`). The
link's alpha and beta are fitted to the ping-pong by :func:`paratrain.sim.fit_links.fit_alpha_beta`.

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
import os
import queue as queue_mod
import statistics
import tempfile
import time
from collections.abc import Callable
from typing import Any

from paratrain.cost.op import Op
from paratrain.errors import ConfigError
from paratrain.runtime.calibrate_comm import COMM_STEPS, measure_comm, size_label
from paratrain.runtime.calibrate_timing import best_time, drift_corrected, mean_time, paired_times, variation
from paratrain.runtime.calibrate_tp import measure_tp_collectives, measure_tp_dispatch, tp_group_sizes
from paratrain.runtime.forkserver import forked_workers, worker_started
from paratrain.spec.device import DeviceSpec
from paratrain.spec.device_presets import DEVICE_PRESETS

__all__ = [
    "ATTENTION_SHAPE",
    "COPY_BYTES",
    "OVERHEAD_BLOCK",
    "EW_ELEMENTS",
    "VARIATION_SHAPE",
    "Progress",
    "combine_cpu",
    "device_from_measurement",
    "measure_comm",
    "measure_cpu",
    "measure_machine",
    "measure_variation",
    "measurement_steps",
    "overhead_block", "overhead_block_kernels",
    "reference_attention_op",
    "size_label",
    "training_attention_efficiency",
    "training_gemm_efficiency",
    "training_gemm_shapes",
]

# Called before each measurement with (measurements done, measurements in all, what comes next).
Progress = Callable[[int, int, str], None]

_GEMM_SIZES = (256, 512, 1024)
COPY_BYTES = 128 * 2**20  # past the last-level cache of common CPUs
EW_ELEMENTS = 2**20  # 4 MiB of fp32: an activation of a small model (512 tokens x 2048)
# (hidden, heads, sequence, batch) of the block whose time over its modelled kernels is the
# per-kernel overhead: a layer of the runtime's GPT whose GEMMs and attention take well under a
# microsecond, so its time is the framework's per-operator cost
OVERHEAD_BLOCK = (16, 2, 8, 1)
_BUDGET_S = 2.5  # keeps the whole command, torch import included, under 10 s on a loaded machine
_SUSTAINED_BUDGET_S = 8.0  # ~0.8 s per figure: with 3 s the GEMM efficiency read 0.79-0.96 across runs
_VARIATION_BUDGET_S = 2.5  # ~100 calls of the ~25 ms step below on a 2-core machine
_DRIFT_REFERENCE = 512  # square GEMM (one of _GEMM_SIZES) timed beside the training GEMMs
VARIATION_SHAPE = (512, 256, 1024)  # tokens, hidden, FFN: a small transformer MLP's forward + backward
# micro-batch, heads, sequence, head size: the attention of that MLP's layer (512 tokens, hidden 256)
ATTENTION_SHAPE = (4, 4, 128, 64)
# What the progress callback names before each measurement, in order.
_CPU_STEPS = (
    *(f"fp32 GEMM {n}x{n}x{n}" for n in _GEMM_SIZES),
    "memory copy",
    "element-wise kernels",
    "tiny add",
    "tiny matmul",
    "kernel overhead",
    "training GEMMs",
    "attention",
    "duration variation",
)


def measurement_steps(procs: int) -> int:
    """How many measurements :func:`measure_machine` reports through its ``progress``."""
    return len(_CPU_STEPS) + (len(COMM_STEPS) + len(tp_group_sizes(procs)) + 1 if procs > 1 else 0)


def _no_progress(done: int, total: int, what: str) -> None:
    pass


def measure_variation(budget_s: float = _VARIATION_BUDGET_S) -> float:
    """How much the duration of one training action varies from call to call on this machine, as
    it is loaded now: the coefficient of variation of a transformer MLP's forward + backward
    (``VARIATION_SHAPE``, ~20 ms on one thread), the simulator's ``duration_cv``. Run by every
    process at once, it includes what they do to each other (shared caches, memory bandwidth)."""
    import torch
    import torch.nn.functional as F

    tokens, hidden, ffn = VARIATION_SHAPE
    x = torch.randn(tokens, hidden, requires_grad=True)
    w1 = torch.randn(ffn, hidden, requires_grad=True)
    w2 = torch.randn(hidden, ffn, requires_grad=True)

    def step() -> None:
        y = F.linear(F.gelu(F.linear(x, w1), approximate="tanh"), w2)
        torch.autograd.grad([y.sum()], [x, w1, w2])

    return variation(step, deadline=time.perf_counter() + budget_s)


def measure_cpu(
    budget_s: float = _BUDGET_S, *, sustained: bool = False, progress: Progress | None = None, total: int | None = None
) -> dict[str, Any]:
    """Measured figures of this machine: GEMM FLOP/s per size, copy bandwidth, element-wise rate,
    per-kernel overhead of a training step.

    Each of the eight measurements gets a cumulative share of ``budget_s``, so a loaded machine
    takes fewer repeats rather than longer. By default each figure is the best repeat (what the
    hardware can do); ``sustained`` gives the mean over back-to-back calls for the whole share
    instead (what a long sequence of such kernels gets on a machine shared with other processes).
    ``progress`` is told before each measurement (``total``: the count it reports against,
    default this function's own).
    """
    import torch
    import torch.nn.functional as F

    torch.manual_seed(0)
    start = time.perf_counter()
    steps = len(_GEMM_SIZES) + 7
    timed = mean_time if sustained else best_time
    tell = progress or _no_progress
    of = total if total is not None else len(_CPU_STEPS)

    def deadline(i: int) -> float:
        tell(i, of, _CPU_STEPS[i])
        return start + budget_s * (i + 1) / steps

    per_size = {}
    for i, n in enumerate(_GEMM_SIZES):
        a = torch.randn(n, n, dtype=torch.float32)
        b = torch.randn(n, n, dtype=torch.float32)
        t = timed(lambda a=a, b=b: torch.matmul(a, b), repeats=8, deadline=deadline(i))
        per_size[n] = 2 * n**3 / t
    elems = COPY_BYTES // 4
    src = torch.ones(elems, dtype=torch.float32)
    dst = torch.empty_like(src)
    t_copy = timed(lambda: dst.copy_(src), repeats=6, deadline=deadline(steps - 7))
    bandwidth = 2 * COPY_BYTES / t_copy  # the copy reads and writes every byte
    # Element-wise kernels of a transformer layer on an activation-sized tensor, each with the
    # bytes the cost model counts for it (paratrain.cost.elementwise: reads + writes of n elements):
    # residual add 3, softmax 2, layer norm 2. Their total bytes over their total time is the rate
    # element-wise kernels sustain, below the copy's (row reductions). The MLP's activation as the
    # runtime's GPT runs it is timed apart: GeLU (tanh) 2, its backward 3 and the first Linear's
    # bias gradient, a sum of the backward's output over the tokens, 1. On a CPU the tanh runs on
    # the vector units at a rate of its own (the cost model's activation_efficiency).
    x = torch.randn(EW_ELEMENTS // 128, 128)
    y, g = torch.randn_like(x), torch.randn_like(x)
    w, b = torch.ones(128), torch.zeros(128)

    def elementwise() -> None:
        torch.add(x, y)
        torch.softmax(x, -1)
        F.layer_norm(x, (128,), w, b)

    def activation() -> None:
        F.gelu(x, approximate="tanh")
        torch.ops.aten.gelu_backward(g, x, approximate="tanh").sum(0)

    end = deadline(steps - 6)
    now = time.perf_counter()
    t_ew = timed(elementwise, repeats=20, deadline=now + (end - now) / 2)
    ew_bandwidth = (3 + 2 + 2) * 4 * EW_ELEMENTS / t_ew
    t_act = timed(activation, repeats=20, deadline=end)
    activation_bandwidth = (2 + 3 + 1) * 4 * EW_ELEMENTS / t_act
    x = torch.ones(8)
    t_small = timed(lambda: torch.add(x, x), repeats=500, deadline=deadline(steps - 5))
    w = torch.ones(8, 8)
    t_small_mm = timed(lambda: torch.matmul(w, w), repeats=500, deadline=deadline(steps - 4))
    # A training step's per-operator cost includes autograd (recording the graph in the forward,
    # running the backward's nodes) and the glue of a layer the cost model has no operator for
    # (views, the heads' transposes and copies, the gradients' accumulation). Timed on the
    # runtime's own transformer block at a size where its arithmetic is negligible
    # (OVERHEAD_BLOCK), forward and backward through torch.autograd, over the kernels the cost
    # model counts for that layer (overhead_block_kernels). A chain of bare Linear + GeLU layers
    # misses that glue: 7 us per kernel here against the block's 16-18.
    block, block_x = overhead_block()
    block_leaves = [block_x, *block.parameters()]

    def train_block() -> None:
        torch.autograd.grad([block(block_x).sum()], block_leaves)

    t_block = timed(train_block, repeats=200, deadline=deadline(steps - 3))
    per_kernel = t_block / overhead_block_kernels()
    # The GEMMs of a training step as autograd runs them: a transformer MLP's two Linear layers
    # (VARIATION_SHAPE, no activation), forward and backward with the input's gradient. Inside a
    # step they run slower than the best square GEMM (transposed operands, bias gradients, operands
    # out of cache): measured here alone, 84-94 GFLOP/s against 98-101. Their rate sets the GEMM
    # efficiency (training_gemm_efficiency).
    tokens, hidden, ffn = VARIATION_SHAPE
    up, down = torch.nn.Linear(hidden, ffn), torch.nn.Linear(ffn, hidden)
    xt = torch.randn(tokens, hidden, requires_grad=True)

    def train_gemms() -> None:
        down(up(xt)).sum().backward()

    # Against a square GEMM of _DRIFT_REFERENCE timed in the same window, call for call: the
    # efficiency is a ratio of the two, and the host's speed drifts by several per cent between
    # the first measurement of this function and this one (on the 2-core machine the efficiency
    # read 0.79-0.96 over four calibrations without the reference, 0.91-0.98 over five with it
    # and the longer budget).
    ra, rb = (torch.randn(_DRIFT_REFERENCE, _DRIFT_REFERENCE) for _ in range(2))
    t_train, t_ref = paired_times(train_gemms, lambda: torch.matmul(ra, rb), best=not sustained,
                                   deadline=deadline(steps - 2))
    t_train = drift_corrected(t_train, t_ref, 2 * _DRIFT_REFERENCE**3 / per_size[_DRIFT_REFERENCE])
    # The attention of that layer as the runtime runs it (runtime.models.layers: torch's SDPA,
    # causal; on a CPU its fused flash-attention kernels), forward and backward through autograd.
    # Its rate sets the attention efficiency (training_attention_efficiency).
    q, k, v = (torch.randn(*ATTENTION_SHAPE, requires_grad=True) for _ in range(3))
    d_out = torch.randn(*ATTENTION_SHAPE)

    def train_attention() -> None:
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        torch.autograd.grad([out], [q, k, v], [d_out])

    t_attention = timed(train_attention, repeats=20, deadline=deadline(steps - 1))
    return {
        "gemm_flops_by_size": per_size,
        "peak_fp32_flops": max(per_size.values()),
        "memory_bandwidth_Bps": bandwidth,
        "elementwise_Bps": ew_bandwidth,
        "activation_Bps": activation_bandwidth,
        # The fixed cost of one modelled kernel in a training step: on a CPU the host runs each
        # kernel itself, so dispatch and autograd add to every kernel (kernel_overhead_s) and
        # nothing overlaps them (host_issue_s 0).
        "kernel_overhead_s": per_kernel,
        "training_gemm_s": t_train,
        "attention_s": t_attention,
        "small_add_s": t_small,
        "small_matmul_s": t_small_mm,
        "threads": torch.get_num_threads(),
        "duration_cv": _told(tell, len(_CPU_STEPS) - 1, of, measure_variation),
    }


def _told(tell: Progress, i: int, of: int, fn: Callable[[], float]) -> float:
    tell(i, of, _CPU_STEPS[i])
    return fn()


def _worker(rank: int, world: int, threads: int, store: str, queue: Any) -> None:
    """One calibration process: compute figures measured while every process measures, then the
    communication figures. Messages to the parent: ``("progress", rank, (done, total, what))``
    from rank 0, then ``("result", rank, (cpu, comm))`` or ``("error", rank, text)``."""
    worker_started()
    import torch
    import torch.distributed as dist

    torch.set_num_threads(threads)

    def tell(done: int, total: int, what: str) -> None:
        queue.put(("progress", rank, (done, total, what)))

    progress = tell if rank == 0 else None
    total = measurement_steps(world)
    try:
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
        dist.barrier()
        cpu = measure_cpu(_SUSTAINED_BUDGET_S, sustained=True, progress=progress, total=total)
        dist.barrier()
        comm = measure_comm(rank, world, progress=progress, done=len(_CPU_STEPS), total=total)
        done = len(_CPU_STEPS) + len(COMM_STEPS)
        if progress is not None:
            progress(done, total, "DTensor dispatch")
        # the mean over the processes: the collectives' figures are what a block costs beyond it
        dispatch = torch.tensor(measure_tp_dispatch(), dtype=torch.float64)
        dist.all_reduce(dispatch)
        fwd, bwd = (dispatch / world).tolist()
        cpu["tp_dispatch_forward_s"], cpu["tp_dispatch_backward_s"] = fwd, bwd
        cpu["tp_dispatch_per_core"] = True  # CPU time: not scaled by the core share (device_from_measurement)
        comm["measured_collectives"], comm["collective_cpu"] = measure_tp_collectives(
            rank, world, (fwd, bwd), progress=progress, done=done + 1, total=total)
        dist.destroy_process_group()
        queue.put(("result", rank, (cpu, comm)))
    except Exception as e:  # reported by the parent as one line
        queue.put(("error", rank, f"{type(e).__name__}: {e}"))


# Seconds without a word from the calibration processes before the parent gives up on them.
_SILENCE_S = 120.0


def measure_machine(
    procs: int, threads: int, progress: Progress | None = None
) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """``(cpu figures, communication figures or None)``: one process in this one when ``procs``
    is 1, else ``procs`` spawned processes (compute figures averaged over them). ``progress`` is
    told before each of the :func:`measurement_steps` measurements."""
    if procs == 1:
        import torch

        torch.set_num_threads(threads)
        # alone: no core count recorded (no cluster file carries it), its rates stay as measured
        return measure_cpu(progress=progress), None

    tell = progress or _no_progress
    # workers fork from a server that imported torch once (runtime/forkserver.py)
    preload = ["torch", "torch.distributed", "paratrain.runtime.calibrate"]
    with forked_workers(preload) as ctx, tempfile.TemporaryDirectory(prefix="paratrain-calibrate-") as tmp:
        queue = ctx.Queue()
        store = os.path.join(tmp, "store")
        ps = [ctx.Process(target=_worker, args=(r, procs, threads, store, queue)) for r in range(procs)]
        for p in ps:
            p.start()
        results: dict[int, tuple[dict[str, Any], dict[str, Any]]] = {}
        try:
            while len(results) < procs:
                try:
                    kind, rank, payload = queue.get(timeout=_SILENCE_S)
                except queue_mod.Empty:
                    raise ConfigError("--procs", f"the calibration processes sent nothing for {_SILENCE_S:.0f} s",
                                      "run with --procs 1 to calibrate the device alone") from None
                if kind == "progress":
                    tell(*payload)
                elif kind == "error":
                    raise ConfigError("--procs", f"calibration process {rank} failed: {payload}",
                                      "run with --procs 1 to calibrate the device alone")
                else:
                    results[rank] = payload
        finally:
            for p in ps:
                p.join(timeout=10)
                if p.is_alive():
                    p.terminate()
    cpu = combine_cpu([results[r][0] for r in range(procs)], threads)
    return {**cpu, "procs": procs, "cores": host_cores()}, results[0][1]


def host_cores() -> int:
    """Cores this process may run on (its CPU affinity: what a container or ``taskset`` grants)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not on Linux
        return os.cpu_count() or 1


def core_share(procs: int, threads: int, cores: int) -> float:
    """The fraction of a core each of ``procs`` processes of ``threads`` threads got while all of
    them computed at once on ``cores`` cores: ``min(1, cores / (procs × threads))`` (the
    scheduler time-slices them evenly; paratrain.sim.sharing models the same in the simulator)."""
    return min(1.0, cores / (procs * threads))


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
    for k in ("tp_dispatch_forward_s", "tp_dispatch_backward_s", "training_gemm_s", "attention_s", "activation_Bps"):
        if all(k in c for c in cpus):
            cpu[k] = mean(c[k] for c in cpus)
    if all(c.get("tp_dispatch_per_core") for c in cpus):
        cpu["tp_dispatch_per_core"] = True
    cpu["peak_fp32_flops"] = max(cpu["gemm_flops_by_size"].values())
    return cpu


def _memory_bytes() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return DEVICE_PRESETS["cpu"].memory_bytes


def device_from_measurement(m: dict[str, Any]) -> DeviceSpec:
    """A ``cpu`` DeviceSpec whose peaks are the measured rates (the peak FLOP/s the best square
    GEMM's); GEMM efficiency what the training GEMMs sustain (:func:`training_gemm_efficiency`; 1
    in calibrations without them); memory efficiency the element-wise kernels' rate over the copy's;
    fused attention at the rate torch's SDPA sustains (:func:`training_attention_efficiency`;
    calibrations without that measurement keep the explicit ``s×s`` kernels).

    The rates are those of one process alone on a core: when ``m`` records that ``procs``
    processes of ``threads`` threads measured at once on fewer ``cores`` than threads, each got
    :func:`core_share` of a core, so rates are divided and per-kernel times multiplied by it
    (the simulator shares the cores again among the processes computing at each instant)."""
    share = core_share(int(m.get("procs", 1)), int(m["threads"]), int(m.get("cores", 0))) if m.get("cores") else 1.0
    bw = float(m["memory_bandwidth_Bps"]) / share
    dispatch_share = 1.0 if m.get("tp_dispatch_per_core") else share
    device = dataclasses.replace(
        DEVICE_PRESETS["cpu"],
        peak_fp32_flops=float(m["peak_fp32_flops"]) / share,
        memory_bytes=int(_memory_bytes()),
        memory_bandwidth_Bps=bw,
        sm_count=int(m["threads"]),
        gemm_efficiency=1.0,
        # what element-wise kernels sustain relative to the copy (1 when not measured); calibrations
        # with the activation timed apart give it its own efficiency, older ones timed GeLU among
        # the element-wise kernels and keep it there
        memory_efficiency=min(1.0, float(m.get("elementwise_Bps", bw * share)) / share / bw),
        activation_efficiency=(min(1.0, float(m["activation_Bps"]) / share / bw) if "activation_Bps" in m else None),
        kernel_overhead_s=float(m["kernel_overhead_s"]) * share,
        host_issue_s=0.0,  # the host runs each CPU kernel itself: its dispatch is in kernel_overhead_s
        duration_cv=min(1.0, float(m.get("duration_cv", 0.0))),
        fused_attention=False,  # until measured below: older calibrations were read with the s x s kernels
        # measured on the CPU clock (per core already), or by the wall in older calibrations
        tp_dispatch_forward_s=float(m.get("tp_dispatch_forward_s", 0.0)) * dispatch_share,
        tp_dispatch_backward_s=float(m.get("tp_dispatch_backward_s", 0.0)) * dispatch_share,
    )
    # Older calibrations lack these: GEMMs at the best square GEMM's rate, the explicit s x s
    # attention kernels, as they were read when they were made.
    if "training_gemm_s" in m:
        device = dataclasses.replace(
            device, gemm_efficiency=training_gemm_efficiency(device, float(m["training_gemm_s"]) * share))
    if "attention_s" in m:
        device = dataclasses.replace(device, fused_attention=True, attention_efficiency=training_attention_efficiency(
            device, float(m["attention_s"]) * share))
    return device


def _overhead_spec() -> Any:
    from paratrain.spec.model import resolve_model

    hidden, heads, seq, _ = OVERHEAD_BLOCK
    return dataclasses.replace(resolve_model("gpt-tiny"), hidden=hidden, heads=heads, seq=seq, ffn=4 * hidden)


def overhead_block() -> tuple[Any, Any]:
    """The runtime's GPT block at ``OVERHEAD_BLOCK`` and its input (fp32, gradients on)."""
    import torch

    from paratrain.runtime.models.layers import Block

    torch.manual_seed(0)
    *_, seq, batch = OVERHEAD_BLOCK
    spec = _overhead_spec()
    return Block(spec, pre_norm=True), torch.randn(batch, seq, spec.hidden, requires_grad=True)


def overhead_block_kernels() -> int:
    """The kernels the cost model counts (``cost.compute.op_kernels``) for a forward and backward
    of the calibration's overhead block: a GPT layer with fused attention, as the runtime runs it."""
    from paratrain.cost.compute import layer_ops, op_kernels

    *_, batch = OVERHEAD_BLOCK
    return sum(sum(op_kernels(o)) for o in layer_ops(_overhead_spec(), microbatch=batch, dtype="fp32",
                                                        attention="flash"))


def training_gemm_shapes() -> list[tuple[int, int, int]]:
    """The ``(m, n, k)`` GEMMs of the calibration's training GEMMs (``VARIATION_SHAPE``'s two Linear
    layers, forward and backward with the input's gradient), as ``cost.compute.op_time_split`` times
    a weight GEMM: the forward ``(m, n, k)``, the input gradient ``(m, k, n)``, the weight gradient
    ``(k, n, m)``."""
    tokens, hidden, ffn = VARIATION_SHAPE
    out = []
    for m, n, k in ((tokens, ffn, hidden), (tokens, hidden, ffn)):
        out += [(m, n, k), (m, k, n), (k, n, m)]
    return out


def training_gemm_efficiency(device: DeviceSpec, seconds: float) -> float:
    """The GEMM efficiency at which the cost model times the calibration's training GEMMs in
    ``seconds`` (per core) on ``device``: their FLOPs at the peak and the shape model's efficiency
    (``cost.gemm``), over the measured time less one kernel overhead per GEMM; at most 1."""
    from paratrain.cost.gemm import gemm_tile_choice

    shapes = training_gemm_shapes()
    ideal = sum(2 * m * n * k / (device.peak_fp32_flops * gemm_tile_choice(m, n, k, device, 1, "fp32")[0])
                for m, n, k in shapes)
    busy = seconds - len(shapes) * device.kernel_overhead_s
    return min(1.0, ideal / busy) if busy > 0 else 1.0


def reference_attention_op() -> Op:
    """The fused attention operator the cost model charges for ``ATTENTION_SHAPE`` (a causal GPT
    layer's attention on one rank, ``cost.compute``'s flash operator)."""
    from paratrain.cost.compute import layer_ops
    from paratrain.spec.model import resolve_model

    b, heads, seq, head_dim = ATTENTION_SHAPE
    model = dataclasses.replace(resolve_model("gpt-tiny"), hidden=heads * head_dim, heads=heads, seq=seq,
                                ffn=4 * heads * head_dim, dtype="fp32")
    (op,) = [o for o in layer_ops(model, microbatch=b, attention="flash") if o.attention_shape is not None]
    return op


def training_attention_efficiency(device: DeviceSpec, seconds: float) -> float:
    """The attention efficiency at which the cost model times the calibration's attention
    (:func:`reference_attention_op`, forward and backward) in ``seconds`` (per core) on ``device``:
    with efficiency 1 its kernels' compute time, over the measured time less their overheads (one
    per kernel ``cost.compute.op_kernels`` counts); at most 1. CPU attention at these sizes is
    compute-bound, so the time is inversely proportional to it."""
    from paratrain.cost.compute import op_kernels, op_time_split

    op = reference_attention_op()
    ideal = dataclasses.replace(device, attention_efficiency=1.0)
    overhead = sum(op_kernels(op)) * device.kernel_overhead_s
    fwd, bwd, _ = op_time_split(op, ideal, "fp32")
    busy = seconds - overhead
    return min(1.0, (fwd + bwd - overhead) / busy) if busy > 0 else 1.0

"""Layouts on this machine: predicted (after ``paratrain calibrate`` alone) vs measured step time.

One script, the workflow a user follows: ``paratrain calibrate --procs 4 --threads 1`` (or
``--calibration DIR``, a ``PARATRAIN_CACHE`` directory holding a calibration), then one launch of
4 processes of one thread each, started as ``paratrain train`` starts its workers
(:func:`launch_workers`), that trains every layout for ``--steps`` steps with paratrain's step loop,
spread over ``--rounds`` rounds that each give every layout its share in turn (a host whose speed
drifts during the run then slows every layout alike, not only those that ran last), then
``paratrain calibrate`` again (``--no-calibrate-after`` skips it), then
``paratrain.sim.simulate_config`` on each calibrated ``cpu`` cluster (PyTorch's AdamW, the
calibration's duration variation) for each layout: the prediction is the mean of the two (the
runs sit between them; the host's speed moves by several per cent within minutes), and each
calibration's own verdict is printed beside it.
Measured: the median step time over the steps after the first. No fit to the runs predicted.

Model: GPT, 8 layers, hidden 256, 4 heads, sequence 128, vocabulary 256, fp32; global batch 32 in
micro-batches of 2 (``--global-batch``, ``--microbatch``): 16 micro-batches keep the pipelines'
bubbles small. On a machine with fewer cores than processes a process idle in a bubble or a
communication wait gives its core to the others: the calibration records the cores it ran on and
stores per-core rates, and the simulator shares the cores among the processes computing at each
instant (:mod:`paratrain.sim.sharing`). Layouts mix data, tensor (with and without sequence
parallelism) and pipeline parallelism and pipeline schedules (``--layouts`` picks some).

    .venv/bin/python bench/bench_layouts.py                       # calibrate, run, predict (~5 min)
    .venv/bin/python bench/bench_layouts.py --calibration DIR --steps 3 --layouts dp4,tp4
    .venv/bin/python bench/bench_layouts.py --save-calibration DIR   # keep the calibration it made
    .venv/bin/python bench/bench_layouts.py --calibration DIR --predict-only   # the predictions alone

Prints one row per layout (predicted s, measured s, error %, predicted and measured rank, the range
of its measured step times) and a verdict against the issue's targets (every layout within 15 %,
the same ranking). Then the ranking up to ties: two layouts are ordered by the measurement only when
every measured step of one was faster than every step of the other (:func:`ordered_pairs`); the
line counts how many of those pairs the prediction orders the same way. The strict verdict is the
target; the second line says whether the predicted ranking errs only between layouts that the
measurement itself cannot order.
Meaningful only on an otherwise idle machine: four processes share its cores. The last line says
whether it was (:class:`LoadWatch`: the core-seconds other jobs and the hypervisor took meanwhile).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

# name: (dp, tp, pp, schedule, virtual stages, sequence parallel)
LAYOUTS: dict[str, tuple[int, int, int, str, int, bool]] = {
    "dp4": (4, 1, 1, "1f1b", 1, False),
    "tp4": (1, 4, 1, "1f1b", 1, False),
    "tp4-sp": (1, 4, 1, "1f1b", 1, True),
    "dp2-tp2": (2, 2, 1, "1f1b", 1, False),
    "pp4-1f1b": (1, 1, 4, "1f1b", 1, False),
    "pp4-interleaved": (1, 1, 4, "interleaved", 2, False),
    "pp2-dp2-gpipe": (2, 1, 2, "gpipe", 1, False),
    "pp2-dp2-zb-h1": (2, 1, 2, "zb-h1", 1, False),
    "pp2-tp2-1f1b": (1, 2, 2, "1f1b", 1, False),
}
# context parallelism (ring attention), on request only (--layouts): name -> (dp, tp, pp, cp)
CP_LAYOUTS: dict[str, tuple[int, int, int, int]] = {"dp2-cp2": (2, 1, 1, 2), "cp4": (1, 1, 1, 4),
                                                    "tp2-cp2": (1, 2, 1, 2)}
TOLERANCE = 0.15  # the target: every layout within 15 %


def _spec(a: argparse.Namespace):
    from paratrain.spec.model import preset

    return dataclasses.replace(preset("gpt-tiny"), name="bench-gpt", layers=a.layers, hidden=a.hidden, heads=a.heads,
                               seq=a.seq, vocab=a.vocab)


def _config(a: argparse.Namespace, name: str):
    from paratrain.parallel.config import ParallelConfig

    if name in CP_LAYOUTS:
        dp, tp, pp, cp = CP_LAYOUTS[name]
        return ParallelConfig(dp=dp, tp=tp, pp=pp, cp=cp, microbatch=a.microbatch, global_batch=a.global_batch,
                              dtype="fp32")
    dp, tp, pp, schedule, v, sp = LAYOUTS[name]
    return ParallelConfig(dp=dp, tp=tp, pp=pp, schedule=schedule, virtual_stages=v, sequence_parallel=sp,
                          microbatch=a.microbatch, global_batch=a.global_batch, dtype="fp32")


def worker(a: argparse.Namespace) -> None:
    """One of the four processes: every layout on its own mesh of the launch's group, trained in
    ``--rounds`` rounds (each round gives every layout its share of ``--steps`` in turn), so that a
    host whose speed drifts during the run slows every layout alike instead of the ones that ran
    last. Rank 0 writes each layout's step times (``step_time_s`` rows, as ``paratrain train``'s
    metrics), in the order they ran."""
    import torch

    from paratrain.runtime.mesh import init_runtime
    from paratrain.runtime.train import TrainConfig, Trainer

    torch.set_num_threads(1)
    out = Path(a.out)
    rates = [_gemm_rate()]
    names = a.layouts.split(",")
    trainers = {}
    for name in names:  # every layout built first: a round then only trains
        train = TrainConfig(steps=a.steps, data="synthetic", progress=False, log_every=a.steps)
        ctx = init_runtime(_config(a, name))
        torch.manual_seed(train.seed)
        trainers[name] = Trainer(ctx, _spec(a), train)
    rows: dict[str, list[dict[str, float]]] = {n: [] for n in names}
    for r, share in enumerate(round_steps(a.steps, a.rounds)):
        for name in names:
            for _ in range(share):
                step = len(rows[name])
                row = trainers[name].train_step(step)
                rows[name].append({"step": step, "round": r, "step_time_s": row["step_time_s"]})
            torch.distributed.barrier()
    rates.append(_gemm_rate())
    rank = torch.distributed.get_rank()
    if rank == 0:
        for name in names:
            (out / f"{name}.jsonl").write_text("".join(json.dumps(x) + "\n" for x in rows[name]))
    (out / f"gemm-{rank}.json").write_text(json.dumps(rates))
    torch.distributed.destroy_process_group()


def _worker_entry(argv: list[str]) -> None:
    """This bench's worker, given the arguments ``main`` passes to :func:`launch_workers`."""
    p = argparse.ArgumentParser()
    p.add_argument("--layouts")
    p.add_argument("--steps", type=int)
    p.add_argument("--rounds", type=int)
    p.add_argument("--out")
    add_model_flags(p)
    worker(p.parse_args(argv))


def _forked(entry: Any, argv: list[str]) -> None:
    """What each forked worker runs first (it dies with the fork server), then ``entry(argv)``."""
    from paratrain.runtime.forkserver import worker_started

    worker_started()
    entry(argv)


def launch_workers(argv: list[str], env: dict[str, str], entry: Any = None) -> None:
    """Four workers started as ``paratrain train`` starts its own (``runtime/launch.py``): torch's
    elastic agent in this process, the workers forked from a server that imported the runtime once.
    Not ``torchrun``'s freshly spawned interpreters: on this 2-core machine they ran the tensor-
    parallel layouts 7-11 % slower than forked workers (two interleaved pairs of launches, the same
    worker code; dp 4 3-5 %), and ``paratrain train`` and ``paratrain calibrate`` fork theirs.
    ``entry(argv)`` runs in each worker (default: this bench's worker); it must be a module-level
    function, which the workers import by name."""
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    from paratrain.runtime.forkserver import forked_workers
    from paratrain.runtime.launch import free_port

    os.environ.update(env)  # the fork server starts with this environment (OMP_NUM_THREADS=1)
    lc = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=4, run_id="bench-layouts", rdzv_backend="c10d",
                      rdzv_endpoint=f"127.0.0.1:{free_port()}", max_restarts=0, monitor_interval=0.1,
                      start_method="forkserver", local_addr="127.0.0.1")
    with forked_workers(["paratrain.runtime.train"]):
        elastic_launch(lc, _forked)(entry or _worker_entry, argv)


def round_steps(steps: int, rounds: int) -> list[int]:
    """Steps per round for ``steps`` spread over ``rounds`` as evenly as possible (the earlier
    rounds take the remainder); rounds that would get none are dropped."""
    base, extra = divmod(steps, rounds)
    return [n for n in (base + (i < extra) for i in range(rounds)) if n]


def _gemm_rate(seconds: float = 1.0) -> float:
    """FLOP/s per core of CPU of back-to-back fp32 512x512x512 GEMMs on this process for
    ``seconds`` of wall time: the host's speed at that moment. On the thread's CPU clock, so the
    figure does not depend on how the four processes overlap (they start and stop at different
    moments; by the wall, a process alone on a core for part of the window looked up to 67 %
    faster than its share)."""
    import torch

    x, y = torch.randn(512, 512), torch.randn(512, 512)
    x @ y
    n, t0, c0 = 0, time.perf_counter(), time.thread_time()
    while time.perf_counter() - t0 < seconds:
        x @ y
        n += 1
    return 2 * 512**3 * n / (time.thread_time() - c0)


def host_drift(calibrated_per_core: float, rates: list[list[float]]) -> str:
    """How fast the host ran GEMMs before and after training, per core (:func:`_gemm_rate`),
    against the calibration's per-core rate: a host whose speed moved between the calibration and
    the runs (another virtual machine on the same cores, frequency scaling: neither shows inside
    this one) makes the comparison meaningless however good the model is."""
    before = statistics.fmean(r[0] for r in rates)
    after = statistics.fmean(r[-1] for r in rates)
    return (f"host speed (fp32 GEMM per core of CPU, every process at once): calibration (its best size) "
            f"{calibrated_per_core / 1e9:.1f}, before the runs {before / 1e9:.1f}, after them {after / 1e9:.1f} "
            f"GFLOP/s "
            f"({before / calibrated_per_core - 1:+.0%} and {after / calibrated_per_core - 1:+.0%})")


def _step_times(path: Path) -> list[float]:
    """Step times after the first (rank 0's rows; the first step when there is only one)."""
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    times = [r["step_time_s"] for r in rows if r.get("rank", 0) == 0]
    return times[1:] if len(times) > 1 else times


def ordered_pairs(times: list[list[float]]) -> list[tuple[int, int]]:
    """Pairs ``(i, j)`` the measurement orders, layout ``i`` faster than ``j``: every step of ``i``
    took less than every step of ``j`` (their ranges of step times do not overlap). Layouts whose
    ranges overlap differ by less than the run's step-to-step variation: no measurement here ranks
    them, so a ranking of them is not compared."""
    return [(i, j) for i, a in enumerate(times) for j, b in enumerate(times) if i != j and max(a) < min(b)]


def ranking_up_to_ties(predicted: list[float], times: list[list[float]]) -> tuple[int, int]:
    """``(pairs predicted in the measured order, pairs the measurement orders)``
    (:func:`ordered_pairs`); the predicted ranking equals the measured one up to ties when the two
    are equal."""
    pairs = ordered_pairs(times)
    return sum(predicted[i] < predicted[j] for i, j in pairs), len(pairs)


def _ranks(values: list[float]) -> list[int]:
    order = sorted(range(len(values)), key=lambda i: values[i])
    rank = [0] * len(values)
    for r, i in enumerate(order):
        rank[i] = r + 1
    return rank


def _predicted(a: argparse.Namespace, cluster, names: list[str]) -> list[float]:
    from paratrain.sim import simulate_config

    return [simulate_config(_spec(a), cluster, _config(a, n), optimizer="torch").iteration_time_s for n in names]


def _describe(cluster) -> str:
    dev = cluster.device
    cores = (f"{cluster.cores_per_node} cores shared by 4 processes of {cluster.threads_per_process} thread(s), "
             f"per-core " if cluster.cores_per_node else "cores not recorded (no sharing modelled), ")
    return (f"calibration: {cores}GEMM {dev.peak_fp32_flops / 1e9:.1f} GFLOP/s, kernel "
            f"{dev.kernel_overhead_s * 1e6:.1f} us, DTensor dispatch {dev.tp_dispatch_forward_s * 1e6:.0f} + "
            f"{dev.tp_dispatch_backward_s * 1e6:.0f} us per module, {len(cluster.measured_collectives)} "
            f"tensor-parallel collectives measured")


def _predict_only(a: argparse.Namespace) -> None:
    """The predictions of an existing calibration, without training: for iterating on the model."""
    os.environ["PARATRAIN_CACHE"] = str(a.calibration)
    from paratrain.spec.cluster import resolve_cluster

    cluster = resolve_cluster("cpu", "--cluster", gpus=4)
    names = a.layouts.split(",")
    predicted = _predicted(a, cluster, names)
    print(_describe(cluster))
    print(f"{'layout':<18}{'predicted s':>12}{'rank pred':>11}")
    for n, ps, rp in zip(names, predicted, _ranks(predicted), strict=True):
        print(f"{n:<18}{ps:>12.3f}{rp:>11}")


# The model and batch every layout trains (flag, default); bench_layout_cpu.py takes the same.
MODEL_FLAGS = (("layers", 8), ("hidden", 256), ("heads", 4), ("seq", 128), ("vocab", 256), ("microbatch", 2),
               ("global-batch", 32))


def add_model_flags(p: argparse.ArgumentParser) -> None:
    """The model flags (the bench's and its workers')."""
    for name, default in MODEL_FLAGS:
        p.add_argument(f"--{name}", type=int, default=default)


def model_argv(a: argparse.Namespace) -> list[str]:
    """The model flags as parsed, to pass on to the workers."""
    return [f"--{name}={getattr(a, name.replace('-', '_'))}" for name, _ in MODEL_FLAGS]


def _cpu_seconds() -> tuple[float, float, float]:
    """``(busy, stolen, elapsed)`` core-seconds of the whole machine so far (``/proc/stat``'s first
    line: user, nice, system, irq, softirq busy; steal: time the hypervisor ran something else on
    our virtual cores); zeros where there is no ``/proc/stat``."""
    try:
        fields = [float(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    except (OSError, ValueError):
        return 0.0, 0.0, 0.0
    tick = os.sysconf("SC_CLK_TCK")
    user, nice, system, idle, iowait, irq, softirq, steal = (fields + [0.0] * 8)[:8]
    busy = user + nice + system + irq + softirq
    return busy / tick, steal / tick, (busy + idle + iowait + steal) / tick


class LoadWatch:
    """Who used the machine's cores while the bench ran: the machine's busy core-seconds
    (``/proc/stat``) less those of the bench's own processes (``os.times`` of its children, every
    thread) are other jobs'; ``steal`` is the hypervisor's. More than ``OTHERS`` of the available
    core-seconds taken by either means the figures describe a shared machine."""

    OTHERS = 0.05

    def __enter__(self) -> LoadWatch:
        self._cpu0, self._own0 = _cpu_seconds(), os.times()
        return self

    def __exit__(self, *exc: object) -> None:
        busy1, steal1, total1 = _cpu_seconds()
        busy0, steal0, total0 = self._cpu0
        t = os.times()
        own = (t.children_user + t.children_system + t.user + t.system
               - self._own0.children_user - self._own0.children_system - self._own0.user - self._own0.system)
        self.total_s = total1 - total0
        self.own_s, self.stolen_s = own, steal1 - steal0
        self.others_s = max(0.0, busy1 - busy0 - own)

    def verdict(self) -> str:
        if not self.total_s:
            return "machine use: not known (no /proc/stat)"
        share = max(self.others_s, self.stolen_s) / self.total_s
        return (f"machine use: {self.total_s:.0f} core-s available, the bench's processes {self.own_s:.0f}, other jobs "
                f"{self.others_s:.0f}, stolen by the hypervisor {self.stolen_s:.0f}"
                + ("; THE MACHINE WAS SHARED: the figures describe a loaded machine" if share > self.OTHERS
                   else "; otherwise idle"))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--calibration", help="PARATRAIN_CACHE directory with cpu.json and cpu-cluster.json "
                   "(default: run paratrain calibrate --procs 4 --threads 1 into a fresh one)")
    p.add_argument("--save-calibration", help="copy the calibration made here to this directory (a PARATRAIN_CACHE "
                   "for --calibration)")
    p.add_argument("--layouts", default=",".join(LAYOUTS),
                   help="comma-separated, of: " + ", ".join([*LAYOUTS, *CP_LAYOUTS]) + " (the cp ones on request)")
    p.add_argument("--predict-only", action="store_true", help="print the predictions of --calibration's "
                   "calibration without training (no measured column, no verdict)")
    p.add_argument("--steps", type=int, default=4, help="steps per layout (the first is a warm-up)")
    p.add_argument("--calibrate-after", action=argparse.BooleanOptionalAction, default=True,
                   help="without --calibration: calibrate again after the runs and predict with the mean of the "
                   "two calibrations' predictions (the host's speed drifts by several per cent in minutes)")
    p.add_argument("--rounds", type=int, default=2, help="rounds the steps are spread over (every layout in "
                   "turn in each round)")
    add_model_flags(p)
    a = p.parse_args()
    unknown = [n for n in a.layouts.split(",") if n not in LAYOUTS and n not in CP_LAYOUTS]
    if a.steps < 1 or a.rounds < 1:
        p.error("--steps and --rounds must be at least 1")
    if unknown:
        p.error(f"unknown layouts {unknown}; choose from {', '.join([*LAYOUTS, *CP_LAYOUTS])}")
    if a.predict_only:
        if not a.calibration:
            p.error("--predict-only needs --calibration DIR")
        _predict_only(a)
        return
    bin_dir = Path(sys.executable).parent
    env = {**os.environ, "OMP_NUM_THREADS": "1"}

    def calibrate(into: Path, when: str) -> None:
        print(f"paratrain calibrate --procs 4 --threads 1 ({when}) ...", flush=True)
        subprocess.run([str(bin_dir / "paratrain"), "calibrate", "--procs", "4", "--threads", "1"],
                       env={**env, "PARATRAIN_CACHE": str(into)}, check=True)

    with tempfile.TemporaryDirectory(prefix="bench-layouts-") as tmp_name, LoadWatch() as load:
        tmp = Path(tmp_name)
        caches = [Path(a.calibration) if a.calibration else tmp / "cache"]
        t0 = time.perf_counter()
        if not a.calibration:
            calibrate(caches[0], "before the runs")
        t1 = time.perf_counter()
        args = [f"--layouts={a.layouts}", f"--steps={a.steps}", f"--rounds={a.rounds}", *model_argv(a),
                f"--out={tmp}"]
        launch_workers(args, env)
        t2 = time.perf_counter()
        if not a.calibration and a.calibrate_after:
            caches.append(tmp / "cache-after")
            calibrate(caches[1], "after the runs")
        if a.save_calibration:
            for c, sub in zip(caches, ("", "after"), strict=False):
                (Path(a.save_calibration) / sub).mkdir(parents=True, exist_ok=True)
                for f in ("cpu.json", "cpu-cluster.json"):
                    shutil.copyfile(c / f, Path(a.save_calibration) / sub / f)
        names = a.layouts.split(",")
        step_times = [_step_times(tmp / f"{n}.jsonl") for n in names]
        measured = [statistics.median(ts) for ts in step_times]
        from paratrain.spec.cluster import resolve_cluster

        clusters = []
        for c in caches:  # each read while its calibration exists
            os.environ["PARATRAIN_CACHE"] = str(c)
            clusters.append(resolve_cluster("cpu", "--cluster", gpus=4))
        gemm = [json.loads(f.read_text()) for f in sorted(tmp.glob("gemm-*.json"))]
    each = [_predicted(a, c, names) for c in clusters]
    # the runs sit between the two calibrations: the mean of their predictions
    predicted = [statistics.fmean(ps) for ps in zip(*each, strict=True)]
    for c, when in zip(clusters, ("before the runs", "after the runs"), strict=False):
        print(f"{_describe(c)} ({when})")
    print(f"calibration {t1 - t0:.0f} s; runs {t2 - t1:.0f} s")
    if len(each) > 1:
        print("predicted: the mean of the two calibrations' predictions")
    pr, mr = _ranks(predicted), _ranks(measured)
    print(f"{'layout':<18}{'predicted s':>12}{'measured s':>12}{'error':>9}{'rank pred':>11}{'rank meas':>11}"
          f"{'steps min-max s':>18}")
    errors = []
    for n, ps, ms, rp, rm, ts in zip(names, predicted, measured, pr, mr, step_times, strict=True):
        err = ps / ms - 1
        errors.append(err)
        print(f"{n:<18}{ps:>12.3f}{ms:>12.3f}{err * 100:>8.1f}%{rp:>11}{rm:>11}{min(ts):>11.3f}-{max(ts):.3f}")
    worst = max(errors, key=abs)
    within = sum(abs(e) <= TOLERANCE for e in errors)
    same = pr == mr
    agree, pairs = ranking_up_to_ties(predicted, step_times)
    print(f"within {TOLERANCE:.0%}: {within} of {len(names)} layouts (worst {worst * 100:+.1f} %, mean |error| "
          f"{statistics.fmean(abs(e) for e in errors) * 100:.1f} %); predicted ranking "
          f"{'equals' if same else 'differs from'} the measured one; target "
          f"{'met' if same and within == len(names) else 'not met'}")
    print(f"up to ties within the measured noise (two layouts are ranked only when every step of one was faster "
          f"than every step of the other): {agree} of the {pairs} pairs the measurement orders are predicted in "
          f"that order; ranking {'equals' if agree == pairs else 'differs from'} the measured one up to ties")
    if len(each) > 1:
        for ps, when in zip(each, ("before", "after"), strict=True):
            errs = [x / m - 1 for x, m in zip(ps, measured, strict=True)]
            print(f"  with the calibration {when} the runs alone: within {TOLERANCE:.0%}: "
                  f"{sum(abs(e) <= TOLERANCE for e in errs)} of {len(names)} (worst {max(errs, key=abs) * 100:+.1f} %, "
                  f"mean |error| {statistics.fmean(abs(e) for e in errs) * 100:.1f} %)")
    print(load.verdict())
    print(host_drift(clusters[0].device.peak_fp32_flops, gemm))
    if len(clusters) > 1:
        print(f"  the calibration after the runs: {clusters[1].device.peak_fp32_flops / 1e9:.1f} GFLOP/s per core "
              f"({clusters[1].device.peak_fp32_flops / clusters[0].device.peak_fp32_flops - 1:+.0%} against before)")

if __name__ == "__main__":
    main()

"""Pipeline engine benchmark: paratrain's engine against torch.distributed.pipelining, and measured
timelines against the calibrated simulator.

    .venv/bin/python bench/bench_pipeline.py                # ~4 minutes on a 2-core machine
    .venv/bin/python bench/bench_pipeline.py --steps 8 --schedules gpipe,1f1b

Two processes (pp=2), one thread each (``OMP_NUM_THREADS=1``, ``torch.set_num_threads(1)``): on a
2-core machine more processes share cores and distort every timing. One torchrun launch runs, for
each schedule, paratrain's engine and (GPipe, 1F1B, interleaved 1F1B) torch's own
``ScheduleGPipe`` / ``Schedule1F1B`` / ``ScheduleInterleaved1F1B`` on the same model (an untied
GPT: torch's stages cannot share the embedding with the head), the same micro-batches and the same
processes, each step followed by the same global-norm clipping and AdamW step, plus paratrain's
engine with every receive posted at its own action (``prefetch_receives=0``); they alternate step
by step so that all see the same background load. Reported: median step time after the first
step, the minimum, and the median of the per-step paired ratios with a 95 % bootstrap interval.

Right before the launch it runs ``paratrain calibrate --threads 1 --procs 2`` into a temporary
cache (two gloo processes of one thread measuring at once, sustained rates, the link) and
simulates every schedule with it (``paratrain.sim.simulate_config``, cluster ``cpu``, PyTorch's
AdamW as the optimizer step, durations drawn with a variation, mean of 32 draws), the compute
speed and the variation fitted as ``paratrain calibrate --from-trace`` fits them to the traces of
the *other six* schedules' runs (held out: a schedule's own trace never feeds its prediction).
Compared with the engine's measured trace (both as ``paratrain compare`` computes them;
measured: mean bubble and median iteration over the steps after the first). For reference: the
same with only the variation fitted, with the variation ``paratrain calibrate`` measures on a
loop of identical kernels, with variation 0, and an exact replay (every action its measured
duration, communication as calibrated), which isolates the schedule and communication model.
Targets: ratio ours/torch ≤ 1.0; bubble within 5 points; simulated iteration time
within 15 %.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SYNC_PEERS = {"gpipe": "ScheduleGPipe", "1f1b": "Schedule1F1B", "interleaved": "ScheduleInterleaved1F1B"}
SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb-h1", "chimera", "pipedream", "2bw")


def _spec(a: argparse.Namespace):
    from paratrain.spec.model import preset

    return dataclasses.replace(preset("gpt-tiny"), name="bench-gpt", layers=a.layers, hidden=a.hidden, heads=a.heads,
                               seq=a.seq, vocab=a.vocab, tied_embeddings=False)


def _config(a: argparse.Namespace, name: str):
    from paratrain.parallel.config import ParallelConfig

    return ParallelConfig(pp=2, microbatch=a.microbatch, global_batch=a.microbatch * a.microbatches, schedule=name,
                          virtual_stages=2 if name == "interleaved" else 1, dtype="fp32")


# ----- worker (one of the two processes) -----------------------------------------------------------

def _torch_pipelining(a: argparse.Namespace, ctx, name: str):
    """A function running one step of torch's schedule (plus clipping and AdamW); returns seconds."""
    import torch
    import torch.distributed as dist
    from torch.distributed import pipelining

    from paratrain.runtime.data import DataSource, load_corpus
    from paratrain.runtime.models import TransformerLM, build_model

    spec, cfg = _spec(a), _config(a, name)
    model = build_model(spec, a.seed)
    v, n_chunks = cfg.virtual_stages, cfg.num_chunks
    per = spec.layers // n_chunks
    rank = ctx.pp_rank
    indices = [rank + k * 2 for k in range(v)]  # looped placement, as the interleaved schedule's
    stages = [pipelining.PipelineStage(model.chunk(i * per, (i + 1) * per), i, n_chunks, ctx.device)
              for i in indices]
    params = [p for s in stages for p in s.submod.parameters()]
    opt = torch.optim.AdamW(params, lr=1e-4, foreach=False)
    cls = getattr(pipelining, SYNC_PEERS[name])
    sched = cls(stages if v > 1 else stages[0], n_microbatches=a.microbatches, loss_fn=TransformerLM.loss)
    data = DataSource(load_corpus("synthetic"), spec, seed=a.seed, global_batch=cfg.global_batch,
                      microbatch=cfg.global_batch)

    def step(k: int) -> float:
        x, y = data.local_batch(k, 0, 1).microbatch(0)
        t0 = time.perf_counter()
        if rank == 0:
            sched.step(x)
        else:
            sched.step(target=y, losses=[])
        sq = sum(p.grad.pow(2).sum() for p in params if p.grad is not None)
        dist.all_reduce(sq)
        coef = torch.clamp(1.0 / (sq.sqrt() + 1e-6), max=1.0)
        for p in params:
            if p.grad is not None:
                p.grad.mul_(coef)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return time.perf_counter() - t0

    return step


def _ours(a: argparse.Namespace, ctx, name: str, out: Path, prefetch: int | None = None):
    """paratrain's trainer for ``name`` and a function running one step of it; the trace is
    recorded with the default receive prefetch (``prefetch=None``)."""
    import torch

    from paratrain.runtime.train import TrainConfig, Trainer

    cfg = _config(a, name)
    train = TrainConfig(steps=a.steps, seed=a.seed, lr=1e-4, data="synthetic", progress=False,
                        trace=str(out / f"{name}.trace.json") if prefetch is None else None,
                        prefetch_receives=prefetch)
    torch.manual_seed(a.seed)
    trainer = Trainer(dataclasses.replace(ctx, config=cfg), _spec(a), train)
    return trainer, lambda k: trainer.train_step(k)["step_time_s"]


def worker(a: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    from paratrain.runtime.mesh import init_runtime

    torch.set_num_threads(1)
    out = Path(a.out)
    ctx = init_runtime(_config(a, "1f1b"), timeout_s=600)
    results: dict[str, dict[str, list[float]]] = {}
    for name in a.schedules.split(","):
        trainer, ours = _ours(a, ctx, name, out)
        theirs = _torch_pipelining(a, ctx, name) if name in SYNC_PEERS else None
        plain = _ours(a, ctx, name, out, prefetch=0) if name in SYNC_PEERS else None
        results[name] = {"ours": [], "torch": [], "ours_at_action": []}
        runners = [("ours", ours)] + ([("torch", theirs)] if theirs is not None else []) \
            + ([("ours_at_action", plain[1])] if plain is not None else [])
        for k in range(a.steps):
            # alternate, so that all see the same background load, and rotate the order, so that
            # none holds one position (e.g. right after the other engine) throughout
            for key, run in runners[k % len(runners):] + runners[:k % len(runners)]:
                results[name][key].append(run(k))
        trainer.finish()
    if ctx.rank == 0:
        (out / "times.json").write_text(json.dumps(results))
    dist.barrier()  # no rank tears its sockets down while a peer still talks to it
    dist.destroy_process_group()


# ----- driver ----------------------------------------------------------------------------------------

def _median_after_first(xs: list[float]) -> float:
    return statistics.median(xs[1:] if len(xs) > 1 else xs)


def _paired(ours: list[float], theirs: list[float]) -> tuple[float, float, float, int]:
    """(median ratio, 95 % bootstrap interval of the median, steps where ours was faster) of the
    per-step ratios of the steps given (callers leave out each run's first step)."""
    import numpy as np

    r = np.array(ours) / np.array(theirs)
    rng = np.random.default_rng(0)
    boots = np.median(rng.choice(r, size=(4000, len(r)), replace=True), axis=1)
    return float(np.median(r)), float(np.quantile(boots, 0.025)), float(np.quantile(boots, 0.975)), int((r < 1).sum())


def _measured(path: Path, steps: int) -> tuple[float, float]:
    """(bubble fraction, iteration time) of a measured trace, as ``paratrain compare`` computes them."""
    from paratrain.trace import read_trace as load_trace
    from paratrain.trace import timeline_stats

    spans, meta = load_trace(str(path), "trace")
    m, its = int(meta["microbatches"]), int(meta["iterations"])
    if its > 1:  # asynchronous: one timeline over all steps
        s = timeline_stats(spans, microbatches=m, iterations=its)
        return s.bubble_fraction, s.iteration_time_s
    stats = []
    for k in range(1, steps):
        sel = [sp for sp in spans if sp.step == k]
        t0 = min(sp.start_s for sp in sel)
        sel = [dataclasses.replace(sp, start_s=sp.start_s - t0) for sp in sel]
        stats.append(timeline_stats(sel, microbatches=m, iterations=1))
    return (statistics.mean(s.bubble_fraction for s in stats), statistics.median(s.iteration_time_s for s in stats))


def _fold_u_parts(spans: list) -> list:
    """Compute spans with each optimizer step's parts (``U.norm``, ``U.stash``: compute before its
    wait) added to the duration of the ``U`` that follows them on the rank: one span per action."""
    out, carry = [], {}
    for sp in sorted(spans, key=lambda sp: (sp.rank, sp.start_s)):
        if sp.name.startswith("U."):
            carry[sp.rank] = carry.get(sp.rank, 0.0) + sp.duration_s
            continue
        if sp.name == "U" and carry.get(sp.rank):
            sp = dataclasses.replace(sp, duration_s=sp.duration_s + carry.pop(sp.rank))
        out.append(sp)
    return out


def _simulate_exact(a: argparse.Namespace, name: str, trace: Path, steps: int,
                    cluster) -> tuple[float, float] | None:
    """(bubble, iteration time) of the schedule simulated with every compute action and optimizer
    step taking exactly its own measured duration (the i-th compute span of a rank is its i-th
    compute action) and the cost model's communication on ``cluster`` (p2p, reductions, the
    gradient-norm all-reduce): what is left is idle time that neither the schedule's order nor the
    modelled communication produces. Synchronous schedules: per step after the first, mean bubble,
    median iteration (as measured); asynchronous ones: the whole run."""
    from paratrain.cost.stage import chunk_costs
    from paratrain.runtime.pipeline import schedule_for
    from paratrain.schedule.ir import ActionKind as K
    from paratrain.sim import simulate, timing_for_config
    from paratrain.trace import read_trace as load_trace

    timed = (K.FORWARD, K.BACKWARD, K.BACKWARD_INPUT, K.BACKWARD_WEIGHT, K.OPTIMIZER_STEP)
    cfg = _config(a, name)
    sched = schedule_for(cfg, a.steps)
    comm = timing_for_config(sched, chunk_costs(_spec(a), cluster, cfg), cluster, cfg, optimizer="torch")
    spans, _ = load_trace(str(trace), "trace")
    spans = _fold_u_parts(spans)
    idx = [[i for i, x in enumerate(row) if x.kind in timed] for row in sched.actions]
    out = []
    for k in range(1, steps) if sched.iterations == 1 else [None]:
        per_rank = []
        for r in range(sched.stages):
            sel = sorted((sp for sp in spans if sp.rank == r and sp.stream == "compute"
                          and (k is None or sp.step == k)), key=lambda sp: sp.start_s)
            if len(sel) != len(idx[r]):
                return None
            per_rank.append(dict(zip(idx[r], (sp.duration_s for sp in sel), strict=True)))
        # every timed action takes its measured duration; communication stays modelled
        res = simulate(sched, dataclasses.replace(comm, action_s=lambda r, i, per_rank=per_rank: per_rank[r].get(i)))
        out.append((res.bubble_fraction, res.iteration_time_s))
    return statistics.mean(b for b, _ in out), statistics.median(t for _, t in out)


def _table(title: str, rows: list[tuple[str, float, float, float, float]]) -> None:
    print(f"\n{title}")
    print(f"{'schedule':<13}{'bubble meas':>12}{'bubble sim':>11}{'diff pts':>9}{'iter meas s':>12}"
          f"{'iter sim s':>11}{'error':>8}")
    for name, b_meas, b_sim, it_meas, it_sim in rows:
        print(f"{name:<13}{100 * b_meas:>11.1f}%{100 * b_sim:>10.1f}%{100 * (b_sim - b_meas):>+9.1f}"
              f"{it_meas:>12.4f}{it_sim:>11.4f}{100 * (it_sim - it_meas) / it_meas:>+7.1f}%")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--out", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--schedules", default=",".join(SCHEDULES))
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--vocab", type=int, default=256)
    ap.add_argument("--microbatch", type=int, default=4)
    ap.add_argument("--microbatches", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    if a.worker:
        worker(a)
        return
    tmp = Path(tempfile.mkdtemp(prefix="bench-pipeline-"))
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_PORT", "LOCAL_RANK")}
    env["OMP_NUM_THREADS"] = "1"
    env["PARATRAIN_CACHE"] = str(tmp / "cache")
    args = [f"--{k.replace('_', '-')}={v}" for k, v in vars(a).items() if k not in ("worker", "out")]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--rdzv-backend", "c10d",
           "--rdzv-endpoint", "127.0.0.1:0", __file__, "--worker", f"--out={tmp}", *args]
    before = tmp / "cal-before"
    subprocess.run([sys.executable, "-m", "paratrain", "calibrate", "--threads", "1", "--procs", "2"], check=True,
                       env={**env, "PARATRAIN_CACHE": str(before)}, capture_output=True, text=True)
    load_before = os.getloadavg()[0]
    t0 = time.perf_counter()
    subprocess.run(cmd, check=True, env=env)
    load_run = os.getloadavg()[0]
    print(f"launch: {time.perf_counter() - t0:.0f} s wall; model {a.layers} layers, hidden {a.hidden}, seq {a.seq}, "
          f"vocab {a.vocab}; {a.microbatches} micro-batches of {a.microbatch}; pp=2, 1 thread per process; load "
          f"average {load_before:.1f} before, {load_run:.1f} after")
    times = json.loads((tmp / "times.json").read_text())
    print("\niteration time of steps 2..N, paratrain engine vs torch.distributed.pipelining (s; ratio = ours/torch)")
    print(f"{'schedule':<13}{'ours median':>12}{'torch median':>13}{'ratio':>7}{'ours min':>10}{'torch min':>10}"
          f"{'ratio':>7}")
    for name, t in times.items():
        if t["torch"]:
            ours, theirs = _median_after_first(t["ours"]), _median_after_first(t["torch"])
            o_min, t_min = min(t["ours"][1:]), min(t["torch"][1:])
            print(f"{name:<13}{ours:>12.4f}{theirs:>13.4f}{ours / theirs:>7.3f}{o_min:>10.4f}{t_min:>10.4f}"
                  f"{o_min / t_min:>7.3f}")
    print(f"(load average at the end of the run: {load_run:.1f} on {os.cpu_count()} cores; the minimum is the "
          "figure least disturbed by other processes)")
    print("\npaired per step (the two ran back to back): median of ours/torch over steps 2..N, 95 % bootstrap "
          "interval of that median, steps where ours was faster; and the same for ours without receive prefetch")
    print(f"{'schedule':<13}{'ours/torch':>11}{'95% interval':>16}{'faster':>8}{'no-prefetch/torch':>19}"
          f"{'95% interval':>16}")
    for name, t in times.items():
        if t["torch"]:
            r, lo, hi, wins = _paired(t["ours"][1:], t["torch"][1:])
            r0, lo0, hi0, _ = _paired(t["ours_at_action"][1:], t["torch"][1:])
            interval, interval0, faster = f"{lo:.3f}-{hi:.3f}", f"{lo0:.3f}-{hi0:.3f}", f"{wins}/{len(t['ours']) - 1}"
            print(f"{name:<13}{r:>11.3f}{interval:>16}{faster:>8}{r0:>19.3f}{interval0:>16}")
    peers = [t for t in times.values() if t["torch"]]
    if len(peers) > 1:  # every schedule's steps together
        ours_, torch_, plain_ = ([x for t in peers for x in t[k][1:]] for k in ("ours", "torch", "ours_at_action"))
        r, lo, hi, wins = _paired(ours_, torch_)
        r0, lo0, hi0, _ = _paired(plain_, torch_)
        interval, interval0, faster = f"{lo:.3f}-{hi:.3f}", f"{lo0:.3f}-{hi0:.3f}", f"{wins}/{len(ours_)}"
        print(f"{'all':<13}{r:>11.3f}{interval:>16}{faster:>8}{r0:>19.3f}{interval0:>16}")
    measured = {name: _measured(tmp / f"{name}.trace.json", a.steps) for name in times}
    from paratrain.sim import simulate_config
    from paratrain.spec.cluster import resolve_cluster

    def cluster_of(cache: Path):
        os.environ["PARATRAIN_CACHE"] = str(cache)
        return resolve_cluster("cpu", "--cluster", gpus=2)

    def describe(cluster) -> str:
        dev, link = cluster.device, cluster.intra_link
        return (f"GEMM {dev.peak_fp32_flops / 1e9:.1f} GFLOP/s, copy {dev.memory_bandwidth_Bps / 1e9:.2f} GB/s, "
                f"kernel {dev.kernel_overhead_s * 1e6:.1f} us, link {link.latency_s * 1e6:.0f} us + n / "
                f"{link.bandwidth_Bps / 1e9:.2f} GB/s, duration variation {dev.duration_cv:.3f}")

    def cost_model_rows(cluster_for, cv_for=lambda name: None):
        rows = []
        for name, (b_meas, it_meas) in measured.items():
            sim = simulate_config(_spec(a), cluster_for(name), _config(a, name), optimizer="torch",
                                  duration_cv=cv_for(name))
            rows.append((name, b_meas, sim.bubble_fraction, it_meas, sim.iteration_time_s))
        return rows

    whole = cluster_of(before)
    print(f"\ncalibrated before the launch (paratrain calibrate --threads 1 --procs 2): {describe(whole)}")
    from paratrain.sim.fit import fit_trace, pooled_speed_factor, scaled_device

    fits = {name: fit_trace(tmp / f"{name}.trace.json", whole.device) for name in measured}
    print("each run against that calibration (paratrain calibrate --from-trace): measured / modelled compute "
          + ", ".join(f"{n} x{f.speed_factor:.3f}" for n, f in fits.items()) + "; variation "
          + ", ".join(f"{n} {f.duration_cv:.3f}" for n, f in fits.items()))

    def held_out(name: str):
        others = [f for n, f in fits.items() if n != name]
        cv = statistics.fmean(f.duration_cv for f in others)
        return dataclasses.replace(whole, device=scaled_device(whole.device, pooled_speed_factor(others), cv))

    _table("measured vs simulated from the cost model: that calibration fitted to the other six schedules' runs "
           "(paratrain calibrate --from-trace OTHERS: compute speed and variation; the prediction)",
           cost_model_rows(held_out))
    _table("the same with only the variation taken from the other six runs (compute speed as calibrated)",
           cost_model_rows(lambda name: whole,
                           lambda name: statistics.fmean(f.duration_cv for n, f in fits.items() if n != name)))
    _table(f"the same with the variation paratrain calibrate measured on a loop of identical kernels "
           f"({whole.device.duration_cv:.3f})", cost_model_rows(lambda name: whole))
    _table("the same with every action at its mean duration (variation 0)",
           cost_model_rows(lambda name: whole, lambda name: 0.0))
    rows = []
    for name, (b_meas, it_meas) in measured.items():
        exact = _simulate_exact(a, name, tmp / f"{name}.trace.json", a.steps, whole)
        if exact is not None:
            rows.append((name, b_meas, exact[0], it_meas, exact[1]))
    _table("diagnostic: every action its own measured duration, communication as calibrated (exact replay)", rows)
    print(f"\ntraces: {tmp}/<schedule>.trace.json (paratrain compare MEASURED SIMULATED)")


if __name__ == "__main__":
    main()

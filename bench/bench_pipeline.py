"""Pipeline engine benchmark: paratrain's engine against torch.distributed.pipelining, and measured
timelines against the calibrated simulator.

    .venv/bin/python bench/bench_pipeline.py                # ~3 minutes on a 2-core machine
    .venv/bin/python bench/bench_pipeline.py --steps 8 --layers 8 --hidden 128 --seq 128

Two processes (pp=2), one thread each (``OMP_NUM_THREADS=1``, ``torch.set_num_threads(1)``): on a
2-core machine more processes share cores and distort every timing. One torchrun launch runs, for
each schedule, paratrain's engine and (GPipe, 1F1B, interleaved 1F1B) torch's own
``ScheduleGPipe`` / ``Schedule1F1B`` / ``ScheduleInterleaved1F1B`` on the same model (an untied
GPT: torch's stages cannot share the embedding with the head), the same micro-batches and the same
processes, each step followed by the same global-norm clipping and AdamW step; the two
alternate step by step so that both see the same background load. Iteration time = median step
time after the first step, and the minimum (least disturbed by other processes on a shared machine).

Right before and right after that launch it calibrates the ``cpu`` device and links as the run
uses them (``paratrain calibrate --threads 1 --procs 2`` into a temporary cache: two gloo processes
of one thread measuring at once, sustained rates) and simulates every schedule with each
calibration (``paratrain.sim.simulate_config``, cluster ``cpu``, PyTorch's AdamW as the optimizer
step, action durations drawn around the cost model's with the calibrated variation, mean of 32
draws), comparing bubble fraction and iteration time with the engine's measured trace (both
computed as in ``paratrain compare``; measured: mean bubble and median iteration over the steps
after the first). For reference it also simulates with the earlier calibration (one process, best
of repeats, ``--procs 1``). Targets (issue 6): ratio ours/torch ≤ 1.0; bubble within 5 points;
simulated iteration time within 15 %.
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


def _profile(a: argparse.Namespace, ctx) -> dict[str, object]:
    """Per-chunk durations measured in isolation on this machine (both ranks measure at once, one
    thread each, as during the pipeline runs): forward, backward, its input and weight halves and
    the optimizer step of every chunk of the 2- and 4-chunk partitions; one p2p transfer; one
    gradient all-reduce per chunk between the two ranks (Chimera's replica reduction)."""
    import torch
    import torch.distributed as dist
    from torch.distributed.pipelining._backward import stage_backward_input, stage_backward_weight

    from paratrain.runtime.data import DataSource, load_corpus
    from paratrain.runtime.models import TransformerLM, build_model

    spec = _spec(a)
    model = build_model(spec, a.seed)
    data = DataSource(load_corpus("synthetic"), spec, seed=a.seed, global_batch=a.microbatch, microbatch=a.microbatch)
    x_tok, y = data.local_batch(0, 0, 1).microbatch(0)
    shape = (a.microbatch, spec.seq, spec.hidden)
    reps = 5

    def median_time(fn) -> float:
        fn()
        ts = []
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - t0)
        return statistics.median(ts)

    out: dict[str, object] = {}
    for n_chunks in (2, 4):
        per = spec.layers // n_chunks
        rows = []
        for c in range(n_chunks):
            ch = model.chunk(c * per, (c + 1) * per)
            weights = [p for p in ch.parameters()]
            first, last = c == 0, c == n_chunks - 1

            def fwd(ch=ch, first=first, last=last):
                x = x_tok if first else torch.randn(shape, requires_grad=True)
                o = ch(x)
                if last:
                    o = TransformerLM.loss(o, y)
                return x, o

            def grad_of(o, last=last):
                return None if last else [torch.randn_like(o)]

            t_f = median_time(lambda fwd=fwd: fwd())

            def full(fwd=fwd, weights=weights, first=first, grad_of=grad_of):
                x, o = fwd()
                g = grad_of(o)
                torch.autograd.grad([o], ([] if first else [x]) + weights, grad_outputs=g)

            t_fb = median_time(full)

            def split(fwd=fwd, weights=weights, first=first, grad_of=grad_of):
                x, o = fwd()
                g = grad_of(o)
                if first:
                    return 0.0, 0.0
                t0 = time.perf_counter()
                _, groups = stage_backward_input([o], g, [x], iter(weights))
                t1 = time.perf_counter()
                stage_backward_weight(iter(weights), groups)
                t2 = time.perf_counter()
                for w in weights:
                    w.grad = None
                return t1 - t0, t2 - t1

            halves = [split() for _ in range(reps)]
            t_b = t_fb - t_f
            t_i = statistics.median(h[0] for h in halves) if not first else 0.0
            t_w = statistics.median(h[1] for h in halves) if not first else t_b
            opt = torch.optim.AdamW(weights, lr=1e-4, foreach=False)
            for w in weights:
                w.grad = torch.zeros_like(w)
            t_opt = median_time(opt.step)
            flat = torch.zeros(sum(w.numel() for w in weights))
            t_red = median_time(lambda flat=flat: dist.all_reduce(flat))
            rows.append({"forward_s": t_f, "backward_s": t_b, "input_s": t_i, "weight_s": t_w, "optimizer_s": t_opt,
                         "reduce_s": t_red})
        out[str(n_chunks)] = rows
    buf = torch.randn(shape)

    def ping_pong() -> None:
        if ctx.rank == 0:
            dist.send(buf, 1)
            dist.recv(buf, 1)
        else:
            dist.recv(buf, 0)
            dist.send(buf, 0)

    out["p2p_s"] = median_time(ping_pong) / 2
    return out


def worker(a: argparse.Namespace) -> None:
    import torch

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
        for k in range(a.steps):  # alternate, so all see the same background load
            results[name]["ours"].append(ours(k))
            if theirs is not None:
                results[name]["torch"].append(theirs(k))
            if plain is not None:
                results[name]["ours_at_action"].append(plain[1](k))
        trainer.executor.finish()
    profile = _profile(a, ctx)
    if ctx.rank == 0:
        (out / "times.json").write_text(json.dumps(results))
        (out / "profile.json").write_text(json.dumps(profile))
    torch.distributed.destroy_process_group()


# ----- driver ----------------------------------------------------------------------------------------

def _median_after_first(xs: list[float]) -> float:
    return statistics.median(xs[1:] if len(xs) > 1 else xs)


def _paired(ours: list[float], theirs: list[float]) -> tuple[float, float, float, int]:
    """(median ratio, 95 % bootstrap interval of the median, steps where ours was faster) of the
    per-step ratios after the first step."""
    import numpy as np

    r = np.array(ours[1:]) / np.array(theirs[1:])
    rng = np.random.default_rng(0)
    boots = np.median(rng.choice(r, size=(4000, len(r)), replace=True), axis=1)
    return float(np.median(r)), float(np.quantile(boots, 0.025)), float(np.quantile(boots, 0.975)), int((r < 1).sum())


def _measured(path: Path, steps: int) -> tuple[float, float]:
    """(bubble fraction, iteration time) of a measured trace, as ``paratrain compare`` computes them."""
    from paratrain.cli.compare import load_trace, timeline_stats

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


def _simulate_profiled(a: argparse.Namespace, name: str, profile: dict):
    """The schedule simulated with the profiled durations (the optimizer step of a rank is the sum
    over its chunks; p2p one measured transfer; reductions only where a chunk has two copies)."""
    from paratrain.runtime.pipeline import schedule_for
    from paratrain.sim import Timing, simulate

    cfg = _config(a, name)
    sched = schedule_for(cfg, a.steps)
    rows = profile[str(sched.num_chunks)]
    hosts = [len({row[c] for row in sched.placement}) for c in range(sched.num_chunks)]
    p2p = float(profile["p2p_s"])
    timing = Timing(
        forward_s=tuple(r["forward_s"] for r in rows), backward_s=tuple(r["backward_s"] for r in rows),
        input_s=tuple(r["input_s"] for r in rows), weight_s=tuple(r["weight_s"] for r in rows),
        p2p_s=lambda src, dst, c: p2p,
        reduce_s=tuple(r["reduce_s"] if hosts[c] > 1 else 0.0 for c, r in enumerate(rows)),
        optimizer_s=tuple(sum(rows[c]["optimizer_s"] for c, _ in sched.chunks_of(r)) for r in range(sched.stages)),
    )
    return simulate(sched, timing)


def _simulate_replay(a: argparse.Namespace, name: str, trace: Path):
    """The schedule simulated with the run's own mean compute durations (per chunk and kind, from
    the measured trace, step 0 left out) and free communication: what is left of the difference
    is the schedule and communication model, not the per-operator cost model."""
    import re

    from paratrain.cli.compare import load_trace
    from paratrain.runtime.pipeline import schedule_for
    from paratrain.sim import Timing, simulate

    cfg = _config(a, name)
    sched = schedule_for(cfg, a.steps)
    spans, _ = load_trace(str(trace), "trace")
    spans = _fold_u_parts(spans)
    sums: dict[tuple[str, int], list[float]] = {}
    for sp in spans:
        if sp.stream != "compute" or (sp.step == 0 and sched.iterations == 1):
            continue
        m = re.search(r"@c(\d+)", sp.name)
        key = (sp.category, int(m.group(1)) if m else sp.rank)
        sums.setdefault(key, []).append(sp.duration_s)

    def mean(cat: str, i: int) -> float:
        xs = sums.get((cat, i), [])
        return sum(xs) / len(xs) if xs else 0.0

    n = sched.num_chunks
    timing = Timing(
        forward_s=tuple(mean("forward", c) for c in range(n)), backward_s=tuple(mean("backward", c) for c in range(n)),
        input_s=tuple(mean("input", c) for c in range(n)), weight_s=tuple(mean("weight", c) for c in range(n)),
        p2p_s=lambda src, dst, c: 0.0, reduce_s=(0.0,) * n,
        optimizer_s=tuple(mean("optimizer", r) for r in range(sched.stages)),
    )
    return simulate(sched, timing)


def _simulate_exact(a: argparse.Namespace, name: str, trace: Path, steps: int,
                    cluster=None) -> tuple[float, float] | None:
    """(bubble, iteration time) of the schedule simulated with every compute action and optimizer
    step taking exactly its own measured duration (the i-th compute span of a rank is its i-th
    compute action) and free communication, or with ``cluster``, the communication of the cost
    model on it (p2p, reductions, the gradient-norm all-reduce): what is left is idle time that
    neither the schedule's order nor the modelled communication produces. Synchronous schedules:
    per step after the first, mean bubble, median iteration (as measured); asynchronous ones: the
    whole run."""
    from paratrain.cli.compare import load_trace
    from paratrain.runtime.pipeline import schedule_for
    from paratrain.schedule.ir import ActionKind as K
    from paratrain.sim import Timing, simulate, timing_for_config

    timed = (K.FORWARD, K.BACKWARD, K.BACKWARD_INPUT, K.BACKWARD_WEIGHT, K.OPTIMIZER_STEP)
    sched = schedule_for(_config(a, name), a.steps)
    spans, _ = load_trace(str(trace), "trace")
    spans = _fold_u_parts(spans)
    n = sched.num_chunks
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
        timing = Timing(forward_s=(0.0,) * n, backward_s=(0.0,) * n, input_s=(0.0,) * n, weight_s=(0.0,) * n,
                        p2p_s=lambda src, dst, c: 0.0, reduce_s=(0.0,) * n, optimizer_s=(0.0,) * sched.stages,
                        action_s=lambda r, i, per_rank=per_rank: per_rank[r].get(i))
        if cluster is not None:
            from paratrain.cost.stage import chunk_costs

            cfg = _config(a, name)
            comm = timing_for_config(sched, chunk_costs(_spec(a), cluster, cfg), cluster, cfg, optimizer="torch")
            timing = dataclasses.replace(timing, p2p_s=comm.p2p_s, reduce_s=comm.reduce_s,
                                         step_allreduce_s=comm.step_allreduce_s)
        res = simulate(sched, timing)
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
    cal = {"before": str(tmp / "cal-before"), "after": str(tmp / "cal-after"), "1proc": str(tmp / "cal-1proc")}

    def calibrate(which: str, *flags: str) -> str:
        r = subprocess.run([sys.executable, "-m", "paratrain", "calibrate", *flags], check=True,
                           env={**env, "PARATRAIN_CACHE": cal[which]}, capture_output=True, text=True)
        return f"load {os.getloadavg()[0]:.1f}\n" + r.stdout

    cal_log = {"before": calibrate("before", "--threads", "1", "--procs", "2")}
    t0 = time.perf_counter()
    subprocess.run(cmd, check=True, env=env)
    load_run = os.getloadavg()[0]
    cal_log["after"] = calibrate("after", "--threads", "1", "--procs", "2")
    cal_log["1proc"] = calibrate("1proc", "--threads", "1", "--procs", "1")
    print(f"launch: {time.perf_counter() - t0:.0f} s wall; model {a.layers} layers, hidden {a.hidden}, seq {a.seq}, "
          f"vocab {a.vocab}; {a.microbatches} micro-batches of {a.microbatch}; pp=2, 1 thread per process")
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
            r, lo, hi, wins = _paired(t["ours"], t["torch"])
            r0, lo0, hi0, _ = _paired(t["ours_at_action"], t["torch"])
            interval, interval0, faster = f"{lo:.3f}-{hi:.3f}", f"{lo0:.3f}-{hi0:.3f}", f"{wins}/{len(t['ours']) - 1}"
            print(f"{name:<13}{r:>11.3f}{interval:>16}{faster:>8}{r0:>19.3f}{interval0:>16}")
    profile = json.loads((tmp / "profile.json").read_text())
    measured = {name: _measured(tmp / f"{name}.trace.json", a.steps) for name in times}
    rows = []
    for name, (b_meas, it_meas) in measured.items():
        sim = _simulate_profiled(a, name, profile)
        rows.append((name, b_meas, sim.bubble_fraction, it_meas, sim.iteration_time_s))
    _table("measured vs simulated, per-chunk durations profiled in isolation (paratrain.sim.simulate)", rows)
    rows = []
    for name, (b_meas, it_meas) in measured.items():
        sim = _simulate_replay(a, name, tmp / f"{name}.trace.json")
        rows.append((name, b_meas, sim.bubble_fraction, it_meas, sim.iteration_time_s))
    _table("measured vs simulated, the run's own mean compute durations, free communication (replay)", rows)
    rows = []
    for name, (b_meas, it_meas) in measured.items():
        exact = _simulate_exact(a, name, tmp / f"{name}.trace.json", a.steps)
        if exact is not None:
            rows.append((name, b_meas, exact[0], it_meas, exact[1]))
    _table("measured vs simulated, every action its own measured duration, free communication (exact replay)", rows)
    os.environ["PARATRAIN_CACHE"] = cal["after"]
    from paratrain.spec.cluster import resolve_cluster

    cluster = resolve_cluster("cpu", "--cluster", gpus=2)
    rows = []
    for name, (b_meas, it_meas) in measured.items():
        exact = _simulate_exact(a, name, tmp / f"{name}.trace.json", a.steps, cluster)
        if exact is not None:
            rows.append((name, b_meas, exact[0], it_meas, exact[1]))
    _table("measured vs simulated, every action its own measured duration, communication calibrated just after "
           "the run (exact replay)", rows)
    from paratrain.sim import simulate_config

    titles = {
        "1proc": "calibrated the earlier way: 1 process, best of repeats (paratrain calibrate --threads 1 --procs 1)",
        "before": "calibrated just before the run: 2 processes at once, sustained rates (--threads 1 --procs 2)",
        "after": "calibrated just after the run: 2 processes at once, sustained rates (--threads 1 --procs 2)",
    }
    from paratrain.cli.compare import duration_variation, load_trace

    def run_cv(name: str) -> float:
        spans, meta = load_trace(str(tmp / f"{name}.trace.json"), "trace")
        return duration_variation([sp for sp in spans if sp.step != 0] if int(meta["iterations"]) == 1 else spans)

    cvs = {name: run_cv(name) for name in measured}
    print("\nmeasured variation of action durations (pooled std / mean, paratrain compare): "
          + ", ".join(f"{n} {v:.3f}" for n, v in cvs.items()))
    for which in ("1proc", "before", "after"):
        os.environ["PARATRAIN_CACHE"] = cal[which]
        cluster = resolve_cluster("cpu", "--cluster", gpus=2)
        dev = cluster.device
        link = cluster.intra_link
        print(f"\ncalibration {which} ({cal_log[which].splitlines()[0]}): GEMM {dev.peak_fp32_flops / 1e9:.1f} GFLOP/s,"
              f" copy {dev.memory_bandwidth_Bps / 1e9:.2f} GB/s, kernel {dev.kernel_overhead_s * 1e6:.1f} us, "
              f"link {link.latency_s * 1e6:.0f} us + n / {link.bandwidth_Bps / 1e9:.2f} GB/s, "
              f"duration variation {dev.duration_cv:.3f}")
        variants = [(None, "")] if which != "before" else [(0.0, ", every action at its mean duration (variation "
                                                            "0)"), (None, "")]
        for cv, note in variants:
            rows = []
            for name, (b_meas, it_meas) in measured.items():
                sim = simulate_config(_spec(a), cluster, _config(a, name), record=True, optimizer="torch",
                                      duration_cv=cv)
                rows.append((name, b_meas, sim.bubble_fraction, it_meas, sim.iteration_time_s))
            _table(f"measured vs simulated from the cost model, {titles[which]}{note}", rows)
        if which == "before":
            rows = []
            for name, (b_meas, it_meas) in measured.items():
                held_out = statistics.fmean(v for n, v in cvs.items() if n != name)
                sim = simulate_config(_spec(a), cluster, _config(a, name), record=True, optimizer="torch",
                                      duration_cv=held_out)
                rows.append((name, b_meas, sim.bubble_fraction, it_meas, sim.iteration_time_s))
            _table(f"measured vs simulated from the cost model, {titles[which]}, variation measured in the "
                   "other six runs (mean of their pooled values)", rows)
    print(f"\ntraces: {tmp}/<schedule>.trace.json (paratrain compare MEASURED SIMULATED)")


if __name__ == "__main__":
    main()

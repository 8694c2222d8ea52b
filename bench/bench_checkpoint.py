"""Step-time overhead of checkpointing: CheckFreq (``--checkpoint-every auto``) against no checkpoints,
measured so that it can decide a 3.5 % bound; then, in the same run, a synchronous ``torch.save`` of
the whole training state every step, DCP ``async_save`` every ``--period`` steps, and the recovery
time (newest checkpoint found, verified and loaded, to the end of the first resumed step).

    .venv/bin/python bench/bench_checkpoint.py        # gpt-tiny: 3 pairs of 1000 steps, then sync, dcp, recovery
    .venv/bin/python bench/bench_checkpoint.py --layers 10 --hidden 768 --vocab 32768 --seq 64 \
        --global-batch 1 --steps 80 --only auto,recovery                                # ~100M parameters

One process on CPU (gloo, world 1); every run trains the same model from the same seed.

Method. ``--pairs`` pairs of runs, one without checkpoints (A) and one with ``auto`` (B),
interleaved A B B A A B … (the order alternates, so a machine that drifts steadily slows both
equally). A step's time is the wall time of ``train_step`` plus the checkpointer's work after it
(stalls, the start of a snapshot): what the training loop pays. Each run's figure is the mean of
its steady steps (the first ``--warmup`` steps, allocation and warm-up, excluded; auto's profiling
checkpoint and every checkpoint after it included). Each pair gives a ratio B/A - 1; the verdict is
the median of the pairs' ratios, with their spread (min-max), against ``--bound``: a pair that
something else on the machine disturbed moves the spread, not the median. The verdict counts as
decided only when every pair falls on the same side of the bound; otherwise the line says so. The same is printed for
the medians of the per-step times, which leave out the steps a checkpoint stalls and so show the
steps *beside* a write; the verdict uses the means, which count everything.

Work, not only wall: the CPU seconds of the training process (``getrusage``, all its threads) in
each run, and those of the writer process (the persist phase, :mod:`paratrain.runtime.checkpoint.writer`),
so the report says what a checkpoint costs in CPU.

``--only`` picks modes (auto, sync, dcp, recovery, write, persist). ``write`` (not in the default) times the
phases of one checkpoint write on the training thread (copy, DCP save with and without fsync,
marker with checksums, pruning) and the step time while a writer *thread* writes back to back.
``persist`` (not in the default) measures the writer process's CPU for one checkpoint under each
``--writer`` setting, without training.
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from paratrain.parallel.config import ParallelConfig
from paratrain.runtime.checkpoint import state, store, writer
from paratrain.runtime.checkpoint.persist import Checkpointer
from paratrain.runtime.mesh import init_runtime
from paratrain.runtime.train import TrainConfig, Trainer
from paratrain.spec.model import preset


def _trainer(ctx, spec, args, steps: int | None = None, **train) -> Trainer:
    torch.manual_seed(0)
    cfg = TrainConfig(steps=steps or args.steps, data="synthetic", progress=False, log_every=10**9, seed=0, **train)
    return Trainer(ctx, spec, cfg)


def _loop(trainer: Trainer, after=None, start: int = 0) -> list[float]:
    """Each step's wall time, the ``after`` hook (the checkpointer's work) included."""
    times = []
    for step in range(start, trainer.train.steps):
        t0 = time.perf_counter()
        row = trainer.train_step(step)
        if after is not None:
            after(step, row)
        times.append(time.perf_counter() - t0)
    return times


def _cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _persist_cpu(ctx, spec, args, root: Path) -> None:
    """The writer process's CPU seconds for one checkpoint under each ``--writer`` setting: the same
    snapshot (a trained state) persisted 4 times by one writer per setting, the first (imports,
    first touch of the shared memory) left out, no training beside it. CPU time, unlike the wall
    time of training beside a write, hardly depends on the machine's load."""
    from paratrain.runtime.checkpoint.writer import WriterProcess

    tr = _trainer(ctx, spec, args)
    for step in range(2):
        tr.train_step(step)
    cap = state.capture(tr)
    print("  writer process CPU a checkpoint (median of persists 2-4 of one writer per setting):")
    for i, v in enumerate(args.writer.split(",")):
        _variant(v)
        w = WriterProcess(0, 1, None, 600)
        w.wait_ready()
        dest = w.arena(*state.layout(cap))
        state.snapshot_into(cap, dest)
        xs, before = [], w.cpu_s
        for rep in range(4):
            path = store.step_dir(root / f"persist{i}", rep)
            answer = w.persist({"path": str(path), "step": rep, "manifest": {"step": rep}, "keep": 1,
                                "rank_pid": os.getpid()})
            xs.append(answer["cpu_s"] - before)
            before = answer["cpu_s"]
        w.close()
        print(f"    {v:<22} {statistics.median(xs[1:]):.3f} s  ({', '.join(f'{x:.3f}' for x in xs)}; "
              f"{answer['size_bytes'] / 2**20:.1f} MiB)")


def _write_phases(ctx, spec, args, root: Path) -> None:
    """Median phase times of 5 writes, then steps beside a writer that never pauses."""
    tr = _trainer(ctx, spec, args)
    for step in range(3):
        tr.train_step(step)
    group = dist.new_group(backend="gloo")
    phases: dict[str, list[float]] = {}

    def write(i: int, sync: bool = True) -> None:
        t0 = time.perf_counter()
        copies = state.snapshot(state.capture(tr))
        t1 = time.perf_counter()
        path = store.step_dir(root / "write", i)
        writer = dcp.FileSystemWriter(str(path), sync_files=sync, single_file_per_rank=True, thread_count=1)
        dcp.save(copies, storage_writer=writer, process_group=group)
        t2 = time.perf_counter()
        store.write_marker(path, {"step": i})
        t3 = time.perf_counter()
        store.prune(root / "write", 1)
        t4 = time.perf_counter()
        for name, secs in (("copy", t1 - t0), ("DCP save" if sync else "DCP save, no fsync", t2 - t1),
                           ("marker (checksums)", t3 - t2), ("prune", t4 - t3)):
            phases.setdefault(name, []).append(secs)

    for i in range(5):
        write(i)
        write(100 + i, sync=False)
    print("  one checkpoint write on the training thread (median of 5): " +
          ", ".join(f"{k} {1e3 * statistics.median(v):.1f} ms" for k, v in phases.items()))
    clean, beside = [], []
    for step in range(3, 23):
        clean.append(tr.train_step(step)["step_time_s"])
    stop = threading.Event()

    def writer_loop() -> None:
        i = 200
        while not stop.is_set():
            write(i)
            i += 1

    th = threading.Thread(target=writer_loop)
    th.start()
    for step in range(23, 43):
        beside.append(tr.train_step(step)["step_time_s"])
    stop.set()
    th.join()
    c, b = statistics.mean(clean), statistics.mean(beside)
    print(f"  steps beside a writer: {1e3 * b:.1f} ms against {1e3 * c:.1f} ms clean ({100 * (b - c) / c:+.0f}%): "
          "what a background write costs the steps it overlaps")


def _baseline_run(ctx, spec, args) -> dict:
    c0 = _cpu_s()
    times = _loop(_trainer(ctx, spec, args))
    return {"times": times, "cpu_s": _cpu_s() - c0}


def _variant(name: str) -> None:
    """Set the writer's priority, the marker's checksum and the snapshot thread's OpenMP team for
    the next run: ``nice10`` (the default), ``nice0``, ``nice19``, ``idle`` (SCHED_IDLE), each
    optionally with ``+sha256`` (SHA-256 checksums in the marker, as before CRC-32), ``+zipcrc``
    (torch.save's own CRC-32 of each zip record, as before the writer turned it off) and ``+team``
    (the snapshot copies with an OpenMP team of their own, as before :func:`state.one_thread_here`)."""
    prio, *extra = name.split("+")
    writer.WRITER_PRIORITY = "idle" if prio == "idle" else int(prio.removeprefix("nice"))
    store.DIGEST = "sha256" if "sha256" in extra else "crc32"
    state.ONE_THREAD_SNAPSHOT = "team" not in extra
    writer.ZIP_CRC32 = "zipcrc" in extra


def _auto_run(ctx, spec, args, ck_dir: Path, variant: str = "nice10") -> dict:
    """CheckFreq as ``paratrain train`` runs it: the loop's own Checkpointer (snapshot overlapped,
    persist in the writer process, ``k`` tuned, or every ``--every`` steps); the last checkpoint is
    awaited outside the loop."""
    shutil.rmtree(ck_dir, ignore_errors=True)
    _variant(variant)
    tr = _trainer(ctx, spec, args, checkpoint_dir=str(ck_dir), checkpoint_every=args.every, keep=1,
                  checkpoint_overhead=args.bound)
    lines: list[str] = []
    ck = Checkpointer(tr, lines.append)
    ck.begin()  # waits for the writer process to have started: outside the timed loop
    stalls: list[float] = []

    def after(step: int, row: dict) -> None:
        stalls.append(ck.after_step(step, row).get("checkpoint_stall_s", 0.0))

    c0 = _cpu_s()
    times = _loop(tr, after)
    cpu = _cpu_s() - c0
    ck.finish(args.steps)
    taken = [s for s in ck.saved if s < args.steps]
    files = [f for f in ck_dir.rglob("*") if f.is_file()]
    return {"times": times, "cpu_s": cpu, "writer_cpu_s": ck.writer_cpu_s, "taken": taken, "k": ck.interval,
            "size_bytes": sum(f.stat().st_size for f in files) / max(1, len(list(ck_dir.iterdir()))),
            "stall_s": sum(stalls), "lines": [x for x in lines if x.startswith("checkpoint interval")],
            "measured_s": ck._ledger.spent_s}


def _excess(a: dict, b: dict, warmup: int) -> float:
    """Seconds the checkpointing run ``b`` took over the run without checkpoints ``a`` (steps after
    ``warmup``): the whole loss, to compare with the tuner's measured cost."""
    return sum(b["times"][warmup:]) - sum(a["times"][warmup:])


def _ratios(pairs: list[tuple[dict, dict]], stat, warmup: int) -> list[float]:
    return [stat(b["times"][warmup:]) / stat(a["times"][warmup:]) - 1 for a, b in pairs]


def _pct(xs: list[float]) -> str:
    return f"{100 * statistics.median(xs):+.1f}% (pairs {', '.join(f'{100 * x:+.1f}%' for x in xs)}; " \
           f"spread {100 * min(xs):+.1f}% to {100 * max(xs):+.1f}%)"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="gpt-tiny")
    ap.add_argument("--layers", type=int)
    ap.add_argument("--hidden", type=int)
    ap.add_argument("--vocab", type=int)
    ap.add_argument("--seq", type=int)
    ap.add_argument("--global-batch", type=int, default=4)
    ap.add_argument("--steps", type=int, default=1000, help="steps of every run")
    ap.add_argument("--pairs", type=int, default=3, help="pairs of runs without and with auto checkpoints")
    ap.add_argument("--warmup", type=int, default=2, help="first steps of each run left out of its figure")
    ap.add_argument("--period", type=int, default=50, help="steps between DCP async_save checkpoints")
    ap.add_argument("--dir", default=None, help="where checkpoints go (default: a temporary directory)")
    ap.add_argument("--only", default="auto,sync,dcp,recovery", help="modes, comma-separated (write: phase times)")
    ap.add_argument("--bound", type=float, default=0.035, help="auto's bound, and the PASS/MISS line's")
    ap.add_argument("--every", default="auto", help="--checkpoint-every of the checkpointing runs (auto, or N "
                    "steps to compare --writer settings at the same checkpoints)")
    ap.add_argument("--writer", default="nice10", help="writer settings to compare, comma-separated: nice10 "
                    "(default), nice0, nice19, idle (SCHED_IDLE), each optionally +sha256 (the marker's checksum), "
                    "+zipcrc (torch.save's record CRC-32) and +team (the snapshot thread's own OpenMP team): the "
                    "earlier behaviours")
    args = ap.parse_args()
    sys.stdout.reconfigure(line_buffering=True)  # type: ignore[union-attr]  # figures as they come
    os.environ.setdefault("OMP_NUM_THREADS", str(torch.get_num_threads()))
    spec = preset(args.model).with_overrides(layers=args.layers, hidden=args.hidden, vocab=args.vocab, seq=args.seq)
    ctx = init_runtime(ParallelConfig(global_batch=args.global_batch, microbatch=1), timeout_s=600)
    root = Path(args.dir or tempfile.mkdtemp(prefix="bench_ckpt_"))
    w = args.warmup
    print(f"{spec.name} ({spec.layers} layers, hidden {spec.hidden}, vocab {spec.vocab}): "
          f"{spec.param_count():,} parameters, {args.steps} steps a run, global batch {args.global_batch}, "
          f"seq {spec.seq}, {torch.get_num_threads()} threads; checkpoints in {root}")

    modes = set(args.only.split(","))
    if "persist" in modes:
        _persist_cpu(ctx, spec, args, root)
    if "write" in modes:
        _write_phases(ctx, spec, args, root)
    if modes <= {"write", "persist"}:
        if args.dir is None:
            shutil.rmtree(root, ignore_errors=True)
        dist.destroy_process_group()
        return
    load_before = os.getloadavg()[0]
    bases: list[dict] = []
    pairs: list[tuple[dict, dict]] = []
    ck_dir = root / "auto"

    def show(name: str, r: dict, note: str = "") -> None:
        t = r["times"][w:]
        print(f"  {name:<22} mean {1e3 * statistics.mean(t):7.2f} ms/step  median {1e3 * statistics.median(t):7.2f}"
              f"  training process CPU {r['cpu_s']:6.2f} s{note}")

    variants = args.writer.split(",")
    by_variant: dict[str, list[tuple[dict, dict]]] = {v: [] for v in variants}
    for i in range(args.pairs if "auto" in modes else 0):
        order = ["base", *variants] if i % 2 == 0 else [*variants[::-1], "base"]
        got: dict[str, dict] = {}
        for which in order:
            if which == "base":
                got["base"] = _baseline_run(ctx, spec, args)
                show(f"pair {i + 1} no checkpoints", got["base"])
            else:
                r = got[which] = _auto_run(ctx, spec, args, ck_dir, which)
                name = args.every if len(variants) == 1 and which == "nice10" else f"{args.every} {which}"
                show(f"pair {i + 1} {name}", r, f", writer CPU {r['writer_cpu_s']:.2f} s; checkpoints at {r['taken']}, "
                     f"k={r['k']}, {r['size_bytes'] / 2**20:.1f} MiB each, loop on checkpoints {r['stall_s']:.2f} s")
        bases.append(got["base"])
        for v in variants:
            by_variant[v].append((got["base"], got[v]))
            print(f"  pair {i + 1} {v}: cost measured by the tuner {got[v]['measured_s']:.2f} s, "
                  f"the run's excess over no checkpoints {_excess(got['base'], got[v], w):.2f} s")
    pairs = by_variant[variants[0]]
    if len(variants) > 1 and pairs:
        for v in variants:
            ps = by_variant[v]
            per = [_excess(a, b, w) / max(1, len(b["taken"])) for a, b in ps]
            print(f"  {v:<14} vs none, mean step: {_pct(_ratios(ps, statistics.mean, w))}; "
                  f"{statistics.median(per):.2f} s of training a checkpoint ({len(ps[0][1]['taken'])} in the loop), "
                  f"writer CPU {statistics.median([b['writer_cpu_s'] / (len(b['taken']) + 1) for _, b in ps]):.2f} "
                  "s a checkpoint")

    if pairs and len(variants) == 1:
        means = _ratios(pairs, statistics.mean, w)
        print(f"  auto vs none, mean step (everything counted):   {_pct(means)}")
        print(f"  auto vs none, median step (steps beside writes): {_pct(_ratios(pairs, statistics.median, w))}")
        steps = args.steps
        n_ck = [len(b["taken"]) + 1 for _, b in pairs]  # the final checkpoint is written by the writer too
        extra_cpu = [(b["cpu_s"] - a["cpu_s"]) for a, b in pairs]
        writer = [b["writer_cpu_s"] for _, b in pairs]
        print(f"  CPU: training process {1e3 * statistics.median([a['cpu_s'] for a, _ in pairs]) / steps:.2f} ms/step "
              f"without checkpoints, {1e3 * statistics.median(extra_cpu) / steps:+.2f} ms/step with auto "
              f"(median over pairs); writer process {statistics.median(writer):.2f} s a run, "
              f"{statistics.median([wc / n for wc, n in zip(writer, n_ck, strict=True)]):.3f} s a checkpoint")
        over = statistics.median(means)
        verdict = "PASS" if over <= args.bound else "MISS"
        # decided only when every pair is on the same side of the bound: otherwise the machine's
        # noise is larger than the difference the verdict is about
        same_side = max(means) <= args.bound or min(means) > args.bound
        decided = (f"decided: all {len(means)} pairs on the same side" if same_side else
                   "NOT decided: pairs on both sides of the bound (noise larger than the effect; run again on an "
                   "idle machine or with more --pairs)")
        print(f"  auto overhead {100 * over:+.1f}% (median of {len(means)} paired ratios of mean step time, spread "
              f"{100 * min(means):+.1f}% to {100 * max(means):+.1f}%) against the bound {100 * args.bound:g}%: "
              f"{verdict}, {decided} (load average {load_before:.2f} before, {os.getloadavg()[0]:.2f} after, "
              f"{os.cpu_count()} cores)")

    base_step = statistics.median([statistics.mean(b["times"][w:]) for b in bases]) if bases else None

    def report(name: str, times: list[float], note: str) -> None:
        m = statistics.mean(times[w:])
        rel = f"  overhead {100 * (m / base_step - 1):+7.1f}%" if base_step else ""
        print(f"  {name:<25} mean {1e3 * m:8.2f} ms/step{rel}  {note}")

    # synchronous torch.save of the whole state every step (fsynced)
    tr = _trainer(ctx, spec, args) if "sync" in modes else None
    path = root / "sync.pt"

    def save_sync(step: int, row: dict) -> None:
        cap = state.capture(tr)
        with open(path, "wb") as fh:
            torch.save(dict(cap.tensors), fh)
            fh.flush()
            os.fsync(fh.fileno())

    if tr is not None:
        report("torch.save every step", _loop(tr, save_sync), "synchronous, fsynced")

    # DCP async_save every --period steps (staging on the training thread, upload in a background thread)
    tr = _trainer(ctx, spec, args) if "dcp" in modes else None
    group = dist.new_group(backend="gloo")
    pending: list = []
    blocked: list[float] = []  # per save: waiting for the previous one, then async_save's own call

    def save_async(step: int, row: dict) -> None:
        if (step + 1) % args.period:
            return
        t0 = time.perf_counter()
        if pending:
            pending.pop().result()
        sd = dict(state.capture(tr).tensors)
        pending.append(dcp.async_save(sd, checkpoint_id=str(root / "dcp" / f"step_{step + 1}"), process_group=group))
        blocked.append(time.perf_counter() - t0)

    if tr is not None:
        times = _loop(tr, save_async)
        if pending:
            pending.pop().result()
        report(f"DCP async_save every {args.period}", times,
               f"one in flight (defaults); training thread blocked {sum(blocked):.2f} s in {len(blocked)} saves")

    if "recovery" not in modes or not pairs:
        if args.dir is None:
            shutil.rmtree(root, ignore_errors=True)
        dist.destroy_process_group()
        return
    # recovery: newest checkpoint found, verified and loaded, then the first resumed step (one more
    # step than the run had, so there is one to resume)
    tr = _trainer(ctx, spec, args, steps=args.steps + 1, checkpoint_dir=str(ck_dir), resume=True, keep=1)
    ts = time.perf_counter()
    ck = Checkpointer(tr, lambda s: None)
    ck.writer.wait_ready()  # its start overlaps the load in a real resume; timed apart here
    t0 = time.perf_counter()
    first = ck.restore()
    t1 = time.perf_counter()
    tr.train_step(first)
    t2 = time.perf_counter()
    ck.close()
    print(f"  recovery: load {t1 - t0:.3f} s (find, verify checksums, load), first resumed step {t2 - t1:.3f} s, "
          f"total {t2 - t0:.3f} s; the writer process's start {t0 - ts:.2f} s")
    if args.dir is None:
        shutil.rmtree(root, ignore_errors=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

"""Step-time overhead of checkpointing: CheckFreq (``--checkpoint-every auto``) against a synchronous
``torch.save`` of the whole training state every step and DCP ``async_save`` every ``--period``
steps, on the same trainer, data and process, in one run; then the recovery time (newest
checkpoint found, verified and loaded, to the end of the first resumed step).

    .venv/bin/python bench/bench_checkpoint.py                          # gpt-tiny, 40 steps
    .venv/bin/python bench/bench_checkpoint.py --layers 12 --hidden 768 --vocab 32768 --steps 24   # ~100M

One process on CPU (gloo, world 1). Each mode trains from the same seed for ``--steps`` steps;
the figure is the wall time of the step loop (the checkpoint work on the training thread
included: stalls, the profiling checkpoint of ``auto``, staging of ``async_save``) against the
loop without checkpoints, in percent; the loop without checkpoints runs again at the end, so a
drift of the machine shows. The last checkpoint's completion is awaited outside the loop in every
mode. Target of issue 13: auto <= 3.5 %; the last line says PASS or MISS against it, with the
load average, since the figure means something only on an otherwise idle machine.

    .venv/bin/python bench/bench_checkpoint.py --steps 400 --only auto --repeat 2   # auto only, twice

``--repeat R`` alternates R loops without checkpoints and R with auto (the verdict compares the
fastest of each, the loops least disturbed by anything else on the machine); ``--only`` picks
modes (write, auto, sync, dcp, recovery).
``write`` (not in the default) times the phases of one checkpoint write on the training thread
(copy, DCP save with and without fsync, marker with checksums, pruning) and the step time while a
writer thread writes checkpoints back to back, against clean steps: where ``auto``'s cost comes from.
"""

from __future__ import annotations

import argparse
import os
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
from paratrain.runtime.checkpoint import state, store
from paratrain.runtime.checkpoint.persist import Checkpointer
from paratrain.runtime.mesh import init_runtime
from paratrain.runtime.train import TrainConfig, Trainer
from paratrain.spec.model import preset


def _trainer(ctx, spec, args, steps: int | None = None, **train) -> Trainer:
    torch.manual_seed(0)
    cfg = TrainConfig(steps=steps or args.steps, data="synthetic", progress=False, log_every=10**9, seed=0, **train)
    return Trainer(ctx, spec, cfg)


def _loop(trainer: Trainer, after=None, start: int = 0) -> float:
    t0 = time.perf_counter()
    for step in range(start, trainer.train.steps):
        row = trainer.train_step(step)
        if after is not None:
            after(step, row)
    return time.perf_counter() - t0


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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="gpt-tiny")
    ap.add_argument("--layers", type=int)
    ap.add_argument("--hidden", type=int)
    ap.add_argument("--vocab", type=int)
    ap.add_argument("--seq", type=int)
    ap.add_argument("--global-batch", type=int, default=4)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--period", type=int, default=10, help="steps between DCP async_save checkpoints")
    ap.add_argument("--dir", default=None, help="where checkpoints go (default: a temporary directory)")
    ap.add_argument("--only", default="auto,sync,dcp,recovery", help="modes, comma-separated (write: phase times)")
    ap.add_argument("--repeat", type=int, default=1, help="alternate this many baseline and auto loops")
    ap.add_argument("--bound", type=float, default=0.035, help="auto's bound, and the PASS/MISS line's")
    args = ap.parse_args()
    sys.stdout.reconfigure(line_buffering=True)  # type: ignore[union-attr]  # figures as they come
    os.environ.setdefault("OMP_NUM_THREADS", str(torch.get_num_threads()))
    spec = preset(args.model).with_overrides(layers=args.layers, hidden=args.hidden, vocab=args.vocab, seq=args.seq)
    ctx = init_runtime(ParallelConfig(global_batch=args.global_batch, microbatch=1), timeout_s=600)
    root = Path(args.dir or tempfile.mkdtemp(prefix="bench_ckpt_"))
    print(f"{spec.name} ({spec.layers} layers, hidden {spec.hidden}, vocab {spec.vocab}): "
          f"{spec.param_count():,} parameters, {args.steps} steps, global batch {args.global_batch}, "
          f"seq {spec.seq}, {torch.get_num_threads()} threads; checkpoints in {root}")

    modes = set(args.only.split(","))
    if "write" in modes:
        _write_phases(ctx, spec, args, root)
        if modes == {"write"}:
            if args.dir is None:
                shutil.rmtree(root, ignore_errors=True)
            dist.destroy_process_group()
            return
    load_before = os.getloadavg()[0]
    bases: list[float] = []
    autos: list[float] = []
    base_s = _loop(_trainer(ctx, spec, args))
    bases.append(base_s)
    print(f"  no checkpoints            {base_s:8.2f} s  ({base_s / args.steps:.3f} s/step)")

    def report(name: str, secs: float, note: str) -> None:
        print(f"  {name:<25} {secs:8.2f} s  overhead {100 * (secs - base_s) / base_s:+6.1f}%  {note}")

    ck_dir = root / "auto"
    for r in range(args.repeat if "auto" in modes else 0):
        if r:
            again = _loop(_trainer(ctx, spec, args))
            bases.append(again)
            print(f"  no checkpoints            {again:8.2f} s  (repeat {r + 1})")
        # CheckFreq: the loop's own Checkpointer (snapshot overlapped, persist in the background, auto k)
        shutil.rmtree(ck_dir, ignore_errors=True)
        tr = _trainer(ctx, spec, args, checkpoint_dir=str(ck_dir), checkpoint_every="auto", keep=1,
                      checkpoint_overhead=args.bound)
        lines: list[str] = []
        ck = Checkpointer(tr, lines.append)
        ck.begin()
        stalls: list[float] = []
        def after(step: int, row: dict, ck: Checkpointer = ck, stalls: list[float] = stalls) -> None:
            stalls.append(ck.after_step(step, row).get("checkpoint_stall_s", 0.0))

        secs = _loop(tr, after)
        ck.finish(args.steps)  # the last step's checkpoint, awaited outside the timed loop
        autos.append(secs)
        size = sum(f.stat().st_size for f in ck_dir.rglob("*") if f.is_file()) / max(1, len(list(ck_dir.iterdir())))
        taken = [s for s in ck.saved if s < args.steps]
        report("auto (CheckFreq)", secs, f"checkpoints at {taken}, k={ck.interval}, {size / 2**20:.1f} MiB each; "
               f"training thread on checkpoints {sum(stalls):.2f} s")
        for line in lines:
            if line.startswith("checkpoint interval"):
                print(f"      {line}")

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

    # DCP async_save every --period steps (staging on the training thread, upload in the background)
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
        secs = _loop(tr, save_async)
        if pending:
            pending.pop().result()
        report(f"DCP async_save every {args.period}", secs,
               f"one in flight (defaults); training thread blocked {sum(blocked):.2f} s in {len(blocked)} saves")

    # the baseline again: a drift of the machine over the run shows as a difference between the two
    again_s = _loop(_trainer(ctx, spec, args))
    bases.append(again_s)
    report("no checkpoints, again", again_s, "(same as the first line on a steady machine)")
    if autos:
        # the fastest auto loop against the fastest baseline loop: on a machine that others load
        # now and then, the fastest of several loops is the one least disturbed
        over = (min(autos) - min(bases)) / min(bases)
        verdict = "PASS" if over <= args.bound else "MISS"
        paired = ", ".join(f"{100 * (a - b) / b:+.1f}%" for a, b in zip(autos, bases, strict=False))
        print(f"  auto overhead {100 * over:+.1f}% of step time (best of {len(autos)} auto and {len(bases)} baseline "
              f"loops; each auto loop against the baseline loop before it: {paired}) against the bound "
              f"{100 * args.bound:g}%: {verdict} (load average {load_before:.2f} before, "
              f"{os.getloadavg()[0]:.2f} after, {os.cpu_count()} cores: meaningful on an idle machine only)")

    if "recovery" not in modes or not autos:
        if args.dir is None:
            shutil.rmtree(root, ignore_errors=True)
        dist.destroy_process_group()
        return
    # recovery: newest checkpoint found, verified and loaded, then the first resumed step (one more
    # step than the run had, so there is one to resume)
    tr = _trainer(ctx, spec, args, steps=args.steps + 1, checkpoint_dir=str(ck_dir), resume=True, keep=1)
    ck = Checkpointer(tr, lambda s: None)
    t0 = time.perf_counter()
    first = ck.restore()
    t1 = time.perf_counter()
    tr.train_step(first)
    t2 = time.perf_counter()
    print(f"  recovery: load {t1 - t0:.3f} s (find, verify checksums, load), first resumed step {t2 - t1:.3f} s, "
          f"total {t2 - t0:.3f} s")
    if args.dir is None:
        shutil.rmtree(root, ignore_errors=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

"""Cost of draining an asynchronous pipeline (PipeDream-2BW, PipeDream) at a checkpoint step.

    .venv/bin/python bench/bench_drain.py                                  # 2BW, pp=2, gpt-tiny, 48 steps
    .venv/bin/python bench/bench_drain.py --schedule pipedream --every 1,4,16 --steps 64

With ``--checkpoint-dir`` an asynchronous schedule drains at each checkpoint step: the steps up to
it run as one action list, which fills the pipeline at its start and empties it at its end
(runtime/pipeline.py). This measures the drains alone, without checkpoints: the same run (same
trainer, data, process group) trains ``--steps`` steps without a drain, then draining every K
steps for each K of ``--every``, then without again (a drifting machine shows as a difference of
the two). The cost of one drain is the extra time over the number of drains, printed against a
step's time. Launches itself on ``--pp`` processes (torchrun, gloo, CPU).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

import torch
import torch.distributed as dist

from paratrain.parallel.config import ParallelConfig, ScheduleName
from paratrain.runtime.mesh import init_runtime
from paratrain.runtime.train import TrainConfig, Trainer
from paratrain.spec.model import preset


def _run(ctx, spec, args, every: int | None) -> float:
    torch.manual_seed(0)
    tr = Trainer(ctx, spec, TrainConfig(steps=args.steps, data="synthetic", progress=False, log_every=10**9))
    if every is not None:
        tr.executor.drain_at = lambda step: (step // every + 1) * every  # type: ignore[attr-defined]
    dist.barrier()
    t0 = time.perf_counter()
    for step in range(args.steps):
        tr.train_step(step)
    dist.barrier()
    return time.perf_counter() - t0


def worker(args: argparse.Namespace) -> None:
    spec = preset(args.model)
    config = ParallelConfig(pp=args.pp, microbatch=1, global_batch=args.global_batch,
                            schedule=ScheduleName(args.schedule))
    ctx = init_runtime(config, timeout_s=600)
    say = print if ctx.rank == 0 else (lambda *a, **k: None)
    say(f"{spec.name}: {args.schedule}, pp={args.pp}, {config.num_microbatches} micro-batches a step, "
        f"{args.steps} steps, {torch.get_num_threads()} thread(s) a process")
    _run(ctx, spec, args, None)  # warm-up: allocation, first schedule generation
    base = _run(ctx, spec, args, None)
    step_s = base / args.steps
    say(f"  no drain            {base:7.2f} s  ({step_s * 1e3:.1f} ms/step)")
    for every in (int(e) for e in args.every.split(",")):
        secs = _run(ctx, spec, args, every)
        drains = (args.steps - 1) // every  # the end of the run is a drain in every case
        per = (secs - base) / max(1, drains)
        say(f"  drain every {every:<4}    {secs:7.2f} s  {drains} drains: {per * 1e3:+.1f} ms a drain "
            f"= {per / step_s:+.2f} steps")
    again = _run(ctx, spec, args, None)
    say(f"  no drain, again     {again:7.2f} s  (same as the first on a steady machine; load average "
        f"{os.getloadavg()[0]:.2f}, {os.cpu_count()} cores)")
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="gpt-tiny")
    ap.add_argument("--schedule", default="2bw", choices=["2bw", "pipedream"])
    ap.add_argument("--pp", type=int, default=2)
    ap.add_argument("--global-batch", type=int, default=4)
    ap.add_argument("--steps", type=int, default=48)
    ap.add_argument("--every", default="1,4,16", help="drain periods to measure, comma-separated")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(args)
        return
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(args.pp), "--master-port", "0",
           "--rdzv-backend", "c10d", "--rdzv-endpoint", "127.0.0.1:0", __file__, "--worker", *sys.argv[1:]]
    sys.exit(subprocess.run(cmd, env=env).returncode)


if __name__ == "__main__":
    main()

"""Gavel's mechanism driving real ``paratrain train`` jobs through Ray, with preemption.

A local Ray cluster on this machine declares two accelerator types as custom resources
(``acc_a``: 2 units, ``acc_b``: 1). Six tiny GPT jobs (``gpt-tiny`` on synthetic data, different
seeds and lengths) share them under ``max_min_fairness_perf`` with short rounds, so jobs are
preempted (SIGTERM at the round's end) and resumed from their newest checkpoint, on either type.
Each job is also run once uninterrupted; the script prints every job's final loss both ways, the
number of slices and preemptions, and whether all losses match exactly.

Run: ``.venv/bin/python bench/bench_cluster_ray.py [--round-s 20] [--steps 80] [--workdir DIR]``
(needs ``pip install -e '.[cluster]'`` for Ray).
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from paratrain.cluster.policies import get_policy
from paratrain.cluster.ray_driver import TrainJobSpec, drive, final_loss, ray_executor, run_slice
from paratrain.spec.hetero import parse_accelerators


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--round-s", type=float, default=20.0)
    ap.add_argument("--steps", type=int, default=80)
    ap.add_argument("--workdir", type=Path, default=None)
    args = ap.parse_args()
    work = args.workdir or Path(tempfile.mkdtemp(prefix="paratrain-ray-"))
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    jobs = [TrainJobSpec(name=f"gpt-tiny-seed{s}", steps=args.steps + 2 * (s % 3),
                         train_args=("--model", "gpt-tiny", "--data", "synthetic", "--seed", str(s)),
                         throughputs={"acc_a": 1.0, "acc_b": 0.5}) for s in range(6)]
    cluster = parse_accelerators("acc_a=2,acc_b=1")

    t0 = time.monotonic()
    with ThreadPoolExecutor(max_workers=3) as pool:  # the uninterrupted reference runs
        refs = list(pool.map(lambda ij: run_slice(str(work / f"ref{ij[0]}"), list(ij[1].train_args),
                                                  ij[1].steps, None), enumerate(jobs)))
    ref_losses = [final_loss(work / f"ref{i}" / "metrics-0.jsonl") for i in range(len(jobs))]
    t_ref = time.monotonic() - t0

    t0 = time.monotonic()
    execute = ray_executor(resources=cluster.counts)
    outcomes = drive(jobs, cluster, get_policy("max_min_fairness_perf"), round_s=args.round_s,
                     workdir=work / "sched", execute=execute)
    t_sched = time.monotonic() - t0

    print(f"6 jobs on acc_a=2, acc_b=1 (Ray custom resources), rounds of {args.round_s:g} s; work dir {work}")
    print(f"{'job':18s} {'steps':>5s} {'slices':>6s} {'preempted':>9s} {'types':14s} {'loss (scheduled)':>18s} "
          f"{'loss (uninterrupted)':>21s}")
    same = True
    for spec, o, ref, r in zip(jobs, outcomes, ref_losses, refs, strict=True):
        types = ",".join(sorted(set(o.types_used)))
        print(f"{spec.name:18s} {spec.steps:5d} {o.slices:6d} {o.preemptions:9d} {types:14s} "
              f"{o.final_loss!s:>18s} {ref!s:>21s}")
        same &= o.final_loss is not None and o.final_loss == ref and r.finished
    print(f"uninterrupted runs {t_ref:.0f} s; scheduled runs {t_sched:.0f} s; "
          f"preemptions {sum(o.preemptions for o in outcomes)}, resumes {sum(o.slices - 1 for o in outcomes)}")
    print("every final loss equals its uninterrupted run: " + ("yes" if same else "NO"))


if __name__ == "__main__":
    main()

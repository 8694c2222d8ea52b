"""Speed of the discrete-event simulator.

Prints, for each schedule at 64 stages × 512 micro-batches (interleaved: 2 chunks per rank),
the CPU time to generate the schedule, to simulate one iteration (``run_schedule`` with uniform
durations, no trace recording) and the simulated actions per second; then the cost of one
``simulate_config`` call (cost model + generation + simulation) for a planner-sized config.
The issue's target: one iteration of 64 stages × 512 micro-batches × 2 chunks per rank in under
2 s on one core.

Run: ``.venv/bin/python bench/bench_sim.py [--stages 64] [--microbatches 512] [--repeat 3]``.
"""

from __future__ import annotations

import argparse
import time

from paratrain.parallel.config import ParallelConfig
from paratrain.schedule import generate
from paratrain.sim import run_schedule, simulate_config, uniform_timing
from paratrain.spec.cluster import resolve_cluster
from paratrain.spec.model import resolve_model


def _best(fn, repeat: int) -> tuple[float, object]:
    """Best CPU time of ``repeat`` runs: on a shared machine the process's own CPU time is the
    figure that does not depend on what else runs (wall time is printed by the caller too)."""
    best, out = float("inf"), None
    for _ in range(repeat):
        t0 = time.process_time()
        out = fn()
        best = min(best, time.process_time() - t0)
    return best, out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--stages", type=int, default=64)
    ap.add_argument("--microbatches", type=int, default=512)
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    p, m = args.stages, args.microbatches
    print(
        f"{'schedule':<12} {'chunks/rank':>11} {'actions':>9} {'generate s':>11} {'simulate s':>11} {'actions/s':>11}"
    )
    for name in ("interleaved", "1f1b", "gpipe", "zb-h1", "chimera", "2bw"):
        v = 2 if name == "interleaved" else 1
        its = {"iterations": 3} if name == "2bw" else {}
        gen_s, s = _best(
            lambda name=name, v=v, its=its: generate(name, stages=p, microbatches=m, virtual_stages=v, **its), 1
        )
        timing = uniform_timing(s)
        sim_s, run = _best(lambda s=s, timing=timing: run_schedule(s, timing, record=False), args.repeat)
        print(f"{name:<12} {v:>11} {run.actions:>9,} {gen_s:>11.3f} {sim_s:>11.3f} {run.actions / sim_s:>11,.0f}")
    model = resolve_model("gpt3-175b")
    cluster = resolve_cluster("dgx-a100", gpus=1024)
    cfg = ParallelConfig(dp=16, tp=8, pp=8, microbatch=1, global_batch=1536, schedule="interleaved", virtual_stages=2)
    simulate_config(model, cluster, cfg)  # warm the cost model's per-layer cache, as in a planner sweep
    t, res = _best(lambda: simulate_config(model, cluster, cfg), args.repeat)
    print(
        f"simulate_config gpt3-175b on 1024 A100 (dp16 tp8 pp8 v2, {cfg.num_microbatches} micro-batches): "
        f"{t * 1e3:.1f} ms per call, iteration {res.iteration_time_s:.2f} s, MFU {res.mfu:.1%}"
    )


if __name__ == "__main__":
    main()

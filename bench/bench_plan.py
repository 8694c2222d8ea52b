"""Planner search time on its two reference problems.

    .venv/bin/python bench/bench_plan.py

Prints, for GPT-3 175B on 1024 A100-80GB (dgx-a100, global batch 1536, sequence 2048) and for a
1T-parameter GPT (128 layers, hidden 25600, 160 heads) on 3072 A100-80GB (global batch 3072),
the wall-clock search time (targets: 10 s and 30 s), the candidates considered and evaluated,
and the winner with its simulated throughput. The cluster carries the A100's fitted calibration, as
``paratrain plan`` applies it by default.
"""

from __future__ import annotations

import time

from paratrain.plan.calibrated import FITTED_BY_DEVICE
from paratrain.plan.search import plan
from paratrain.plan.validate import with_calibration
from paratrain.spec.cluster import resolve_cluster
from paratrain.spec.model import preset

PROBLEMS = (
    ("gpt3-175b", 1024, 1536, 10.0),
    ("gpt-1t", 3072, 3072, 30.0),
)


def main() -> None:
    for name, gpus, batch, target_s in PROBLEMS:
        model = preset(name)
        cluster = resolve_cluster("dgx-a100", gpus=gpus)
        cluster = with_calibration(cluster, FITTED_BY_DEVICE[cluster.device.name])
        start = time.perf_counter()
        res = plan(model, cluster, batch)
        wall = time.perf_counter() - start
        w = res.winner
        cfg, m = w.config, w.metrics
        sched = cfg.schedule.value + (f" v={cfg.virtual_stages}" if cfg.virtual_stages > 1 else "")
        print(
            f"{name} on {gpus} GPUs, batch {batch}: search {wall:.2f} s (target {target_s:.0f} s, "
            f"{'OK' if wall <= target_s else 'OVER'}); {res.considered} candidates, "
            f"{res.memory_checked} memory-checked, "
            f"{res.evaluated} timed by the closed forms, "
            f"{sum(1 for c in res.ranked if c.simulated is not None)} simulated"
        )
        print(
            f"  winner dp={cfg.dp} tp={cfg.tp} pp={cfg.pp} mb={cfg.microbatch} {sched} recompute={cfg.recompute.value}"
            f" sp={cfg.sequence_parallel} zero1={cfg.optimizer_sharding}: {m.iteration_time_s:.3f} s/iteration, "
            f"{m.tokens_per_s:,.0f} tokens/s, {m.tflops_per_gpu:.1f} TFLOP/s/GPU, MFU {100 * m.mfu:.1f}%, "
            f"peak {m.peak_memory_bytes / 2**30:.1f} GiB"
        )


if __name__ == "__main__":
    main()
